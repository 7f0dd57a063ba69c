"""The memory entries' place and store in ``oxygen_node`` (docs/memory.md): configure creates one
:class:`MemoryService` (with the topic bridge, oxygen_ros/node/topics.py), cleanup destroys it.

* Place: with ``memory.pose.topic``, a subscription (best effort, depth 50) keeps the recent
  ``geometry_msgs/PoseStamped`` samples (:class:`PoseBuffer`); each MemoryEntry gets the sample nearest its
  observation's stamp when one lies within ``memory.pose.max_age_s`` of it (``has_pose`` true, ``pose`` that
  sample, its own stamp in ``pose.header``), else ``has_pose`` false and a default pose — never a guessed one.
  ``robot`` is ``memory.robot`` (default: the node's namespace).
* Store: with ``memory.store.path``, every published entry is queued (never waiting: a full queue drops the
  entry, counted and warned) for a writer thread that inserts it into the store (SQLite,
  :class:`~oxygen_ros.memory.sqlite_store.SqliteMemoryStore`, or Milvus with ``memory.store.collection``,
  :class:`~oxygen_ros.memory.milvus_store.MilvusMemoryStore`) and applies the retention rules every
  ``memory.store.prune_every_s``; ``~/query_memory`` (``oxygen_ros/srv/QueryMemory``) answers from the store, in
  a callback group of its own; ``~/ask`` fills a prompt's ``{memory}`` field from it (:meth:`MemoryService.recall`).

Threads: the pose callback and the service run on the executor; :meth:`MemoryService.complete` and
:meth:`MemoryService.record` on the control-cycle thread (both only take a lock or put on a queue).
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
import time
from typing import Callable

import numpy as np
from diagnostic_msgs.msg import KeyValue
from geometry_msgs.msg import PoseStamped
from oxygen_ros.msg import MemoryEntry
from oxygen_ros.srv import QueryMemory
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from oxygen_ros.memory import MemoryQuery, MemoryRecord, MemoryStore, Pose, RetentionPolicy, open_store
from oxygen_ros.memory.prompt import memory_text, recall
from oxygen_ros.node.inputs import DropCounter, is_zero, stamp_seconds, time_msg
from oxygen_ros.node.parameters import MemorySettings

POSE_BUFFER_SIZE = 400       # pose samples kept (20 s of a 20 Hz localisation)
MAX_QUERY_K = 1000           # most entries one ~/query_memory answer carries
_WRITE_BATCH = 64            # most queued entries one store transaction takes
_CLOSE_TIMEOUT_S = 10.0      # how long cleanup waits for the writer to store what is queued [s]
_WAKE = object()             # put on the writer's queue by close: stop waiting
_POSE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=50, reliability=ReliabilityPolicy.BEST_EFFORT)


class PoseBuffer:
    """The recent pose samples, sorted by stamp (thread-safe).

    Args:
        capacity: samples kept; the oldest go first.
    """

    def __init__(self, capacity: int = POSE_BUFFER_SIZE):
        self._capacity = capacity
        self._stamps: list[float] = []
        self._poses: list[Pose] = []
        self._latest_received = -math.inf
        self._lock = threading.Lock()

    def add(self, pose: Pose) -> bool:
        """Keep ``pose`` (its ``stamp_s`` [s]). A sample more than 1 s older than the one received before it
        (a replayed bag starting over, a clock reset) empties the buffer first: samples of the old time base
        must not be matched to new observations. Returns False when it emptied the buffer."""
        with self._lock:
            went_back = pose.stamp_s < self._latest_received - 1.0
            if went_back:
                self._stamps.clear()
                self._poses.clear()
            self._latest_received = pose.stamp_s
            i = bisect.bisect_right(self._stamps, pose.stamp_s)
            self._stamps.insert(i, pose.stamp_s)
            self._poses.insert(i, pose)
            if len(self._stamps) > self._capacity:
                del self._stamps[0], self._poses[0]
            return not went_back

    def nearest(self, stamp_s: float, max_age_s: float) -> Pose | None:
        """The sample whose stamp is nearest ``stamp_s`` [s] if it is at most ``max_age_s`` [s] away, else None."""
        with self._lock:
            i = bisect.bisect_left(self._stamps, stamp_s)
            candidates = [j for j in (i - 1, i) if 0 <= j < len(self._stamps)]
            if not candidates:
                return None
            best = min(candidates, key=lambda j: abs(self._stamps[j] - stamp_s))
            return self._poses[best] if abs(self._stamps[best] - stamp_s) <= max_age_s else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._stamps)


class MemoryWriter:
    """A thread that inserts queued records into a store and applies a retention policy.

    Args:
        store: where records go (closed by :meth:`close`).
        queue_size: records that may wait; :meth:`put` drops one beyond (counted in ``drops``).
        policy: the retention rules, applied at start and every ``prune_every_s`` [s] (wall clock).
        now_s: the present for the age rule [s] (the node clock, the observation stamps' clock).
        drops: counts ``memory_queue_full`` and ``memory_store_failed`` (a write that raised: its records are
            lost, the writer goes on).
        log: INFO logging function (what pruning removed).
    """

    def __init__(self, store: MemoryStore, queue_size: int, policy: RetentionPolicy, prune_every_s: float,
                 now_s: Callable[[], float], drops: DropCounter, log: Callable[[str], object]):
        self.store = store
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._policy, self._prune_every_s, self._now_s = policy, prune_every_s, now_s
        self._drops, self._log = drops, log
        self.written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory_store_writer", daemon=True)
        self._thread.start()

    def put(self, record: MemoryRecord) -> bool:
        """Queue ``record`` without waiting; False (counted, warned) when the queue is full or closed."""
        if self._stop.is_set():
            return False
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._drops.drop("memory_queue_full", f"memory entry {record.entry_id} not stored: "
                             f"{self._queue.maxsize} entries already wait for the store (a slow disk?)")
            return False

    def _run(self) -> None:
        self._prune()
        next_prune = time.monotonic() + self._prune_every_s
        while True:
            try:
                first = self._queue.get(timeout=min(1.0, max(0.0, next_prune - time.monotonic())))
            except queue.Empty:
                first = None
            if first is not None and first is not _WAKE:
                batch = [first]
                while len(batch) < _WRITE_BATCH:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not _WAKE:
                        batch.append(item)
                self._write(batch)
            if time.monotonic() >= next_prune:
                self._prune()
                next_prune = time.monotonic() + self._prune_every_s
            if self._stop.is_set() and self._queue.empty():
                return

    def _write(self, batch: list[MemoryRecord]) -> None:
        try:
            self.written += self.store.insert(batch)
        except Exception as err:    # a full disk must not end the thread: counted, the next batch is tried
            self._drops.drop("memory_store_failed", f"{len(batch)} memory entries not stored: {err}")

    def _prune(self) -> None:
        if not self._policy.active:
            return
        try:
            removed = self.store.prune(self._policy, self._now_s())
        except Exception as err:
            self._drops.drop("memory_prune_failed", f"memory store retention not applied: {err}")
            return
        if any(removed.values()):
            self._log(f"memory store retention removed {', '.join(f'{n} by {k}' for k, n in removed.items() if n)}")

    def close(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (up to ``timeout_s`` [s]), stop the thread and close the store. Idempotent."""
        self._stop.set()
        try:
            self._queue.put_nowait(_WAKE)    # ends the wait for the next entry now
        except queue.Full:
            pass                             # a full queue wakes it anyway
        self._thread.join(timeout_s)
        self.store.close()


def check_store(settings: MemorySettings) -> None:
    """Open and close the store of ``settings`` (none without ``store_path``): configure calls this before
    loading the model, so that a store that cannot be opened fails configure with the reason.

    Raises:
        ValueError, sqlite3.Error, RuntimeError, OSError: as :func:`oxygen_ros.memory.open_store` (RuntimeError:
            a Milvus server that cannot be reached or refuses).
    """
    if settings.store_path:
        open_store(settings.store_path, synchronous=settings.synchronous, collection=settings.collection).close()


def record_of(msg: MemoryEntry) -> MemoryRecord:
    """The store's record of a published ``oxygen_ros/MemoryEntry`` (pose only when ``has_pose``)."""
    pose = None
    if msg.has_pose:
        p, q = msg.pose.pose.position, msg.pose.pose.orientation
        pose = Pose(msg.pose.header.frame_id, (p.x, p.y, p.z), (q.x, q.y, q.z, q.w),
                    stamp_seconds(msg.pose.header.stamp))
    embedding = np.array(msg.embedding, dtype=np.float32) if len(msg.embedding) else None
    return MemoryRecord(msg.entry_id, stamp_seconds(msg.header.stamp), msg.text, msg.robot, msg.instruction,
                        tuple(msg.camera_names), pose, embedding)


def entry_msg(record: MemoryRecord) -> MemoryEntry:
    """The ``oxygen_ros/MemoryEntry`` of a stored record (the inverse of :func:`record_of`)."""
    msg = MemoryEntry()
    msg.header.stamp = time_msg(record.stamp_s)
    msg.entry_id, msg.text, msg.robot, msg.instruction = record.entry_id, record.text, record.robot, record.instruction
    msg.camera_names = list(record.camera_names)
    if record.embedding is not None:
        msg.embedding = record.embedding.astype(np.float32).tolist()
    if record.pose is not None:
        _fill_pose(msg, record.pose)
    return msg


def _fill_pose(msg: MemoryEntry, pose: Pose) -> None:
    msg.has_pose = True
    msg.pose.header.frame_id = pose.frame_id
    msg.pose.header.stamp = time_msg(pose.stamp_s)
    p, q = msg.pose.pose.position, msg.pose.pose.orientation
    p.x, p.y, p.z = pose.position
    q.x, q.y, q.z, q.w = pose.orientation


class MemoryService:
    """Place, store and ``~/query_memory`` of one configuration (see the module docstring).

    Args:
        node: the node the subscription and the service belong to.
        settings: the ``memory.*`` settings of this configure.
        now_s: the node clock [s] (the present of the retention's age rule).

    Raises:
        ValueError, sqlite3.Error, RuntimeError: the store cannot be opened (configure fails with the reason).
    """

    def __init__(self, node, settings: MemorySettings, now_s: Callable[[], float]):
        self._node = node
        self._settings = settings
        self._now_s = now_s
        self.robot = settings.robot or node.get_namespace().strip("/")
        self.drops = DropCounter(node.get_logger().warning, what="memory")
        self.poses = PoseBuffer()
        self.writer: MemoryWriter | None = None
        self._subscription = self._service = None
        if settings.store_path:
            policy = RetentionPolicy(settings.max_age_s, settings.max_count, settings.duplicate_radius_m,
                                     settings.duplicate_text_similarity)
            store = open_store(settings.store_path, synchronous=settings.synchronous, collection=settings.collection)
            node.get_logger().info(f"memory store {settings.store_path}: {store.count()} entries")
            self.writer = MemoryWriter(store, settings.queue_size, policy, settings.prune_every_s, now_s, self.drops,
                                       node.get_logger().info)
            self._service = node.create_service(QueryMemory, "~/query_memory", self._on_query,
                                                callback_group=MutuallyExclusiveCallbackGroup())
            node.commands.attach_memory(self)     # ~/ask's {memory} field
        if settings.pose_topic:
            self._subscription = node.create_subscription(PoseStamped, settings.pose_topic, self._on_pose, _POSE_QOS)

    def key_values(self) -> list[KeyValue]:
        """The figures for ``/diagnostics`` (the node's engine status): ``memory_stored`` (entries written since
        configure, with a store) and ``memory <reason>`` per counted drop (``memory_queue_full``,
        ``memory_store_failed``, ``memory_prune_failed``, ``pose_wrong_frame``, ``pose_unstamped``,
        ``pose_not_finite``, ``pose_went_back``)."""
        values = [] if self.writer is None else [KeyValue(key="memory_stored", value=str(self.writer.written))]
        drops = sorted(self.drops.counts().items())
        return values + [KeyValue(key=f"memory {reason}", value=str(n)) for reason, n in drops]

    # ---- place ------------------------------------------------------------------------------------

    def _on_pose(self, msg: PoseStamped) -> None:
        frame = self._settings.fixed_frame
        if frame and msg.header.frame_id != frame:
            self.drops.drop("pose_wrong_frame", f"pose in frame {msg.header.frame_id!r} dropped: "
                            f"memory.pose.fixed_frame is {frame!r}")
            return
        if is_zero(msg.header.stamp):
            self.drops.drop("pose_unstamped", "pose with stamp 0 dropped: it cannot be matched to an observation")
            return
        p, q = msg.pose.position, msg.pose.orientation
        values = (p.x, p.y, p.z, q.x, q.y, q.z, q.w)
        if not all(math.isfinite(v) for v in values):
            self.drops.drop("pose_not_finite", "pose with a NaN or infinite value dropped")
            return
        if not self.poses.add(Pose(msg.header.frame_id, values[:3], values[3:], stamp_seconds(msg.header.stamp))):
            self.drops.drop("pose_went_back", "pose stamps went back more than 1 s: older samples forgotten")

    def complete(self, msg: MemoryEntry) -> None:
        """Fill ``robot``, ``has_pose`` and ``pose`` of an entry about to be published."""
        msg.robot = self.robot
        if not self._settings.pose_topic:
            return
        pose = self.poses.nearest(stamp_seconds(msg.header.stamp), self._settings.pose_max_age_s)
        if pose is not None:
            _fill_pose(msg, pose)

    # ---- store ------------------------------------------------------------------------------------

    def record(self, msg: MemoryEntry) -> None:
        """Queue a published entry for the store (nothing without ``memory.store.path``); never waits."""
        if self.writer is not None:
            self.writer.put(record_of(msg))

    def recall(self, question: str, k: int) -> tuple[str, list[str], float]:
        """The ``{memory}`` text of an ``~/ask`` goal, the ids of its entries (this robot's entries:
        :func:`oxygen_ros.memory.prompt.recall`, :func:`~oxygen_ros.memory.prompt.memory_text`) and the time of
        asking [s, node clock] that the lines' ages (``<N> s ago``) and a question's age count from. Raises
        RuntimeError without a store, and the store's errors."""
        writer = self.writer
        if writer is None:
            raise RuntimeError("no memory store (set memory.store.path)")
        now_s = self._now_s()
        text, ids = memory_text(recall(writer.store, question, k, self.robot, now_s), now_s)
        return text, ids, now_s

    def _on_query(self, request, response):
        response.success = False
        writer = self.writer
        if writer is None:
            response.message = "no memory store"
            return response
        try:
            query = MemoryQuery(
                text=request.text, since_s=None if is_zero(request.since) else stamp_seconds(request.since),
                until_s=None if is_zero(request.until) else stamp_seconds(request.until),
                near=(request.position.x, request.position.y, request.position.z) if request.use_place else None,
                radius_m=request.radius_m, robot=request.robot or None, k=min(request.k or 10, MAX_QUERY_K),
                oldest_first=request.oldest_first)
            hits = writer.store.query(query)
        except Exception as err:     # a refused query or a failing store: the answer says why
            response.message = f"query refused: {err}" if isinstance(err, ValueError) else f"store failed: {err}"
            return response
        response.entries = [entry_msg(hit.record) for hit in hits]
        response.scores = [hit.score for hit in hits]
        response.success = True
        response.message = f"{len(hits)} entries"
        return response

    def destroy(self) -> None:
        """Destroy the subscription and the service, store what is queued and close the store. Idempotent."""
        if self._service is not None:
            self._node.commands.attach_memory(None)
        if self._subscription is not None:
            self._node.destroy_subscription(self._subscription)
        if self._service is not None:
            self._node.destroy_service(self._service)
        self._subscription = self._service = None
        if self.writer is not None:
            self.writer.close()
        self.writer = None
