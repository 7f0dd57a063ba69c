"""Record ROS 2 topics to a rosbag2 (MCAP by default) with `rosbags`, where rosbag2 is not installed.

On a robot with a full ROS 2 install, ``ros2 bag record`` does the same job; this recorder exists so the
demo and the tests can record on machines that only have rclpy (see ``docs/node.md``). Messages are taken
as serialized CDR straight from the middleware (``raw=True`` subscriptions), so nothing is converted and
what is written is byte for byte what was published.

Message definitions: rosbags ships the ROS 2 Kilted standard types; this package's own messages
(``msg/*.msg``) and any other type found in the ament index are registered from their ``.msg`` files, so
the bag's MCAP schemas are complete and ``rosbags``' ``AnyReader`` (and ``ros2 bag play``) can read it.

API:
    * :func:`project_typestore` — a typestore with the standard types plus ``oxygen_ros/msg/*``.
    * :class:`BagWriter` — a rosbag2 writer for serialized messages (no rclpy needed).
    * :class:`BagRecorder` — an rclpy node that discovers topics and records them into a :class:`BagWriter`.
    * :func:`default_run_dir` — ``runs/<YYYYmmdd-HHMMSS>/``, where the demo writes its runs.

Command line (records until Ctrl-C)::

    python -m oxygen_ros.tools.bag_recorder [-o BAG_DIR] [--topics /a /b ...] [--exclude REGEX]
        [--flush-period S]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import threading
from pathlib import Path
from typing import Iterable

import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rosbags.interfaces import (Nodetype, Qos, QosDurability, QosHistory, QosLiveliness,
                                QosReliability, QosTime)
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore, get_types_from_msg
from rosbags.typesys.store import Typestore

PACKAGE = "oxygen_ros"
STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
FLUSH_PERIOD_S = 1.0  # the recorder's default flush period [s]: what a killed recorder can lose


def default_run_dir(root: Path | str = "runs") -> Path:
    """``<root>/<YYYYmmdd-HHMMSS>`` for a new run (local time); not created here."""
    return Path(root) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def _msg_file(msgtype: str) -> Path | None:
    """The installed ``share/<pkg>/msg/<Name>.msg`` of ``pkg/msg/Name`` from the ament index, or None."""
    from ament_index_python.packages import PackageNotFoundError, get_package_share_directory

    pkg, kind, name = msgtype.split("/")
    try:
        path = Path(get_package_share_directory(pkg)) / kind / f"{name}.msg"
    except PackageNotFoundError:
        return None
    return path if path.is_file() else None


def register_msgtype(typestore: Typestore, msgtype: str) -> bool:
    """Register ``msgtype`` (``pkg/msg/Name``) and the types it uses into ``typestore``.

    Definitions are read from the ``.msg`` files in the ament index (the colcon install space and the
    ROS wheels' prefix). Returns True when the type is (now) known, False when no definition was found.
    """
    if msgtype in typestore.fielddefs:
        return True
    path = _msg_file(msgtype)
    if path is None:
        return False
    types = get_types_from_msg(path.read_text(), msgtype)
    for _, fields in types.values():
        for _, desc in fields:
            for dep in _referenced_types(desc):
                if dep not in typestore.fielddefs and dep not in types:
                    register_msgtype(typestore, dep)
    typestore.register(types)
    return True


def _referenced_types(desc) -> Iterable[str]:
    """Message type names in a rosbags field description ``(Nodetype, details)``; arrays and
    sequences nest a description in their details."""
    kind, details = desc
    if kind == Nodetype.NAME:
        yield details
    elif kind in (Nodetype.ARRAY, Nodetype.SEQUENCE):
        yield from _referenced_types(details[0])


def project_typestore() -> Typestore:
    """A rosbags typestore with the ROS 2 Kilted standard types and this package's ``msg/*.msg``.

    Raises:
        FileNotFoundError: the package's message files are not in the ament index (run ``make setup``
            and ``source scripts/env.sh``).
    """
    from ament_index_python.packages import get_package_share_directory

    typestore = get_typestore(Stores.ROS2_KILTED)
    msg_dir = Path(get_package_share_directory(PACKAGE)) / "msg"
    files = sorted(msg_dir.glob("*.msg"))
    if not files:
        raise FileNotFoundError(f"no .msg files in {msg_dir}")
    types = {}
    for path in files:
        types.update(get_types_from_msg(path.read_text(), f"{PACKAGE}/msg/{path.stem}"))
    typestore.register(types)
    return typestore


def _qos_to_bag(profile: QoSProfile) -> Qos:
    """rclpy QoS profile -> rosbags' Qos (stored as the connection's offered QoS in metadata.yaml)."""

    def duration(d) -> QosTime:
        ns = d.nanoseconds
        return QosTime(sec=ns // 1_000_000_000, nsec=ns % 1_000_000_000)

    return Qos(
        history=QosHistory(int(profile.history)),
        depth=profile.depth,
        reliability=QosReliability(int(profile.reliability)),
        durability=QosDurability(int(profile.durability)),
        deadline=duration(profile.deadline),
        lifespan=duration(profile.lifespan),
        liveliness=QosLiveliness(int(profile.liveliness)),
        liveliness_lease_duration=duration(profile.liveliness_lease_duration),
        avoid_ros_namespace_conventions=profile.avoid_ros_namespace_conventions,
    )


class BagWriter:
    """A rosbag2 (MCAP or sqlite3, format version 9) of serialized CDR messages; thread-safe.

    Connections are created on the first message of a topic. Use as a context manager or call
    :meth:`close`; the bag is only complete (``metadata.yaml`` written) after closing.

    Until :meth:`flush`, written messages may exist only in memory: rosbags' MCAP storage keeps the open
    chunk in memory until it reaches 1 MiB, its sqlite3 storage commits only at close. A process killed
    before closing keeps what was flushed: :class:`BagRecorder` flushes every ``flush_period_s``, and
    ``oxygen_ros replay`` (``bag_reader.open_bag``) reads an unclosed MCAP bag up to its last flush.

    Args:
        path: bag directory to create (must not exist; its parent is created).
        storage: ``"mcap"`` or ``"sqlite3"``.
        typestore: message definitions; default :func:`project_typestore`.

    Raises:
        ValueError: unknown storage.
        rosbags.rosbag2.WriterError: ``path`` exists.
    """

    def __init__(self, path: Path | str, storage: str = "mcap", typestore: Typestore | None = None):
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {sorted(STORAGES)}, got {storage!r}")
        self.path = Path(path)
        self.storage = storage
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.typestore = typestore if typestore is not None else project_typestore()
        self._writer = Writer(self.path, version=9, storage_plugin=STORAGES[storage])
        self._writer.open()
        self._connections: dict[str, object] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    def add_topic(self, topic: str, msgtype: str, qos: Iterable[Qos] = ()) -> None:
        """Declare ``topic`` of ``msgtype`` (``pkg/msg/Name``), with the publishers' offered QoS.

        Raises:
            KeyError: no definition of ``msgtype`` is known or installed.
        """
        with self._lock:
            if topic in self._connections or self._closed:
                return
            if not register_msgtype(self.typestore, msgtype):
                raise KeyError(f"no message definition for {msgtype}")
            self._connections[topic] = self._writer.add_connection(
                topic, msgtype, typestore=self.typestore, offered_qos_profiles=list(qos))
            self._counts[topic] = 0

    def write(self, topic: str, data: bytes | memoryview, stamp_ns: int) -> None:
        """Append one serialized CDR message of a declared ``topic`` received at ``stamp_ns`` [ns].

        Messages written after :meth:`close` are ignored (a callback may race the shutdown).
        """
        with self._lock:
            if self._closed:
                return
            self._writer.write(self._connections[topic], stamp_ns, data)
            self._counts[topic] += 1

    def flush(self) -> None:
        """Put every message written so far on disk, so that a crash (SIGKILL, OOM, power loss) keeps them.

        MCAP: ends the open chunk (a complete chunk record, readable without the file's summary), then
        flushes the file and syncs it to the disk (``os.fsync``). sqlite3: commits. Does nothing after
        :meth:`close`.
        """
        # rosbags' Writer has no flush of its own: this drives its storage plugin (rosbags pinned in
        # requirements/python.txt; test_demo_recorder's crash test covers it).
        with self._lock:
            if self._closed:
                return
            storage = self._writer.storage
            if self.storage == "mcap":
                if storage.chunk.msgs:  # definitions alone wait for their first message
                    storage.close_chunk()
                storage.bio.flush()
                os.fsync(storage.bio.fileno())
            else:
                storage.conn.commit()

    @property
    def message_counts(self) -> dict[str, int]:
        """Messages written per topic so far."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Finish the bag (writes ``metadata.yaml``); idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._writer.close()

    def __enter__(self) -> "BagWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def message_class(msgtype: str):
    """The rclpy message class of ``pkg/msg/Name``."""
    pkg, kind, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.{kind}"), name)


class BagRecorder(Node):
    """An rclpy node that records topics into a rosbag2, like ``ros2 bag record``.

    Every ``discovery_period_s`` it looks for new topics and subscribes to each one it should record
    (all topics by default; hidden topics never), with a QoS compatible with the publishers it found:
    best effort if any publisher is best effort, transient local if every publisher is (so a latched
    instruction is recorded), keep last ``depth``. Callbacks run in one mutually exclusive callback
    group, so they never block other nodes of a multi-threaded executor on each other.

    Every ``flush_period_s`` it flushes the bag to disk (:meth:`BagWriter.flush`): a recorder killed
    without closing (SIGKILL, OOM, power loss) loses at most the messages of the last flush period, and
    ``oxygen_ros replay`` reads the rest.

    Args:
        output: the bag directory to create, e.g. ``default_run_dir() / "bag"``.
        topics: record only these topics (exact names); None records all.
        exclude: regular expression of topic names not to record.
        storage: ``"mcap"`` (default) or ``"sqlite3"``.
        discovery_period_s: topic discovery period [s].
        depth: subscription queue depth [messages].
        flush_period_s: how often the bag is flushed to disk [s]; what a crash can lose.
        node_name: the node's name.
        **node_kwargs: forwarded to ``rclpy.node.Node`` (``context=``, ``namespace=`` ...).

    Call :meth:`close` (also done by ``destroy_node``) to finish the bag.
    """

    def __init__(self, output: Path | str, *, topics: Iterable[str] | None = None,
                 exclude: str | None = None, storage: str = "mcap",
                 discovery_period_s: float = 0.5, depth: int = 50, flush_period_s: float = FLUSH_PERIOD_S,
                 node_name: str = "bag_recorder", **node_kwargs):
        super().__init__(node_name, **node_kwargs)
        self.writer: BagWriter | None = None    # stays None when the writer cannot open (close() is then a no-op)
        self.writer = BagWriter(output, storage=storage)
        self._only = set(topics) if topics is not None else None
        self._exclude = re.compile(exclude) if exclude else None
        self._depth = depth
        self._group = MutuallyExclusiveCallbackGroup()
        self._recorded_subscriptions: dict[str, object] = {}
        self._skipped: set[str] = set()
        self._discover()
        self._timer = self.create_timer(discovery_period_s, self._discover, callback_group=self._group)
        self._flush_timer = self.create_timer(flush_period_s, self.writer.flush, callback_group=self._group)

    @property
    def path(self) -> Path:
        """The bag directory."""
        return self.writer.path

    @property
    def message_counts(self) -> dict[str, int]:
        """Messages recorded per topic so far."""
        return self.writer.message_counts

    @property
    def recorded_topics(self) -> list[str]:
        """Topics subscribed so far."""
        return sorted(self._recorded_subscriptions)

    def _wanted(self, topic: str) -> bool:
        if topic in self._recorded_subscriptions or topic in self._skipped:
            return False
        if any(part.startswith("_") for part in topic.split("/")):
            return False
        if self._only is not None and topic not in self._only:
            return False
        return not (self._exclude and self._exclude.search(topic))

    def _discover(self) -> None:
        for topic, types in self.get_topic_names_and_types():
            if not self._wanted(topic):
                continue
            publishers = self.get_publishers_info_by_topic(topic)
            if not publishers:
                continue
            msgtype = types[0]
            try:
                cls = message_class(msgtype)
                self.writer.add_topic(topic, msgtype, [_qos_to_bag(p.qos_profile) for p in publishers])
            except (ImportError, AttributeError, KeyError) as err:
                self._skipped.add(topic)
                self.get_logger().warning(f"not recording {topic} ({msgtype}): {err}")
                continue
            profiles = [p.qos_profile for p in publishers]
            qos = QoSProfile(
                history=HistoryPolicy.KEEP_LAST, depth=self._depth,
                reliability=ReliabilityPolicy.BEST_EFFORT
                if any(p.reliability == ReliabilityPolicy.BEST_EFFORT for p in profiles)
                else ReliabilityPolicy.RELIABLE,
                durability=DurabilityPolicy.TRANSIENT_LOCAL
                if all(p.durability == DurabilityPolicy.TRANSIENT_LOCAL for p in profiles)
                else DurabilityPolicy.VOLATILE)
            self._recorded_subscriptions[topic] = self.create_subscription(
                cls, topic, lambda data, t=topic: self._record(t, data), qos, raw=True,
                callback_group=self._group)
            self.get_logger().debug(f"recording {topic} ({msgtype})")

    def _record(self, topic: str, data: bytes) -> None:
        self.writer.write(topic, data, self.get_clock().now().nanoseconds)

    def close(self) -> None:
        """Stop recording and finish the bag; idempotent."""
        if self.writer is not None:
            self.writer.close()

    def destroy_node(self) -> None:
        self.close()
        super().destroy_node()


def main(argv: list[str] | None = None) -> int:
    """``python -m oxygen_ros.tools.bag_recorder``: record until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="bag directory to create (default runs/<timestamp>/bag)")
    parser.add_argument("--topics", nargs="+", default=None, help="record only these topics")
    parser.add_argument("--exclude", default=None, help="regular expression of topics not to record")
    parser.add_argument("--storage", choices=sorted(STORAGES), default="mcap")
    parser.add_argument("--flush-period", type=float, default=FLUSH_PERIOD_S, metavar="S",
                        help="flush the bag to disk every S seconds: a killed recorder's MCAP bag loses at most "
                             "the last S seconds (replay recovers the rest; an sqlite3 bag keeps its data but "
                             f"replay cannot open one its recorder never closed) (default {FLUSH_PERIOD_S:g})")
    args = parser.parse_args(argv)
    if args.flush_period <= 0:
        parser.error(f"argument --flush-period: must be positive, got {args.flush_period:g}")
    output = args.output or default_run_dir() / "bag"
    rclpy.init()
    recorder = BagRecorder(output, topics=args.topics, exclude=args.exclude, storage=args.storage,
                           flush_period_s=args.flush_period)
    recorder.get_logger().info(f"recording to {output}")
    try:
        rclpy.spin(recorder)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        recorder.destroy_node()
        rclpy.try_shutdown()
        print(f"{output}: {recorder.message_counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
