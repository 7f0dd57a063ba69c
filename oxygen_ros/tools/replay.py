"""Replay a rosbag2 recording (MCAP or sqlite3) into a running ROS graph at the recorded rate.

``ros2 bag play`` does this on a robot with a full ROS 2 install; this player needs only rclpy and
``rosbags``, so users can run the oxygen node on their own robot logs anywhere the node runs::

    oxygen_ros replay <bag> --remap /cam_high/image_raw:=/camera/image_raw [--remap ...]
        [--topics /a /b ...] [--rate 1.0] [--loop] [--restamp] [--duration S]
        [--node [--params-file config/pi05_tiny.yaml] [--param name:=value ...]]

(also ``python -m oxygen_ros.tools.replay ...``). Messages are published exactly as recorded — the
serialized CDR bytes, without a round trip through Python objects — unless ``--restamp`` rewrites every
``header.stamp`` to the time of publication (for nodes that judge freshness by stamps). Each message is
published at ``start + (recorded time - bag start) / rate`` on a monotonic clock.

QoS: every topic is published reliable (compatible with reliable and best-effort subscribers alike);
``std_msgs/String`` topics (instructions) also transient local with depth 1, so a node that subscribes
late still gets the last instruction, as the oxygen node's instruction subscription expects.

Like ``ros2 bag play``, topics whose message type is not installed here (a vendor's messages) are skipped
with a warning and the rest is replayed. Messages of this package recorded before a field was added to their
type (e.g. an ``ActionChunk`` without ``rtc_*``) are re-encoded to the installed type, the new fields at their
"not set" values (``bag_reader.Upgrade``). A recording whose recorder was killed (no ``metadata.yaml``, an
MCAP without its footer) is replayed up to its last complete chunk, with a warning that says how many
messages were recovered and how much of the file's end was skipped (``bag_reader``). Errors (a missing or
unreadable bag, nothing to replay) end the program with one line ``oxygen_ros replay: error: ...`` and exit
status 1; bad arguments (``--rate 0``) with the usage and status 2.

With ``--node`` the oxygen node (``OxygenNode``) runs in the same process and executor (the ``oxygen_node``
executable's, :class:`~oxygen_ros.node.executor.TransitionExecutor`), with the given
parameter file and ``--param`` overrides, and the player prints how many action chunks it published.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Iterable

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message, serialize_message

from oxygen_ros.node.executor import TransitionExecutor
from oxygen_ros.tools.bag_reader import BagError, Upgrade, open_bag
from oxygen_ros.tools.bag_recorder import message_class, project_typestore

_LATCHED_TYPES = {"std_msgs/msg/String"}


def parse_remaps(remaps: Iterable[str]) -> dict[str, str]:
    """``["/from:=/to", ...]`` → ``{"/from": "/to"}``.

    Raises:
        ValueError: an entry is not of the form ``/from:=/to``.
    """
    mapping = {}
    for remap in remaps:
        source, sep, target = remap.partition(":=")
        if not sep or not source or not target:
            raise ValueError(f"remap {remap!r} is not of the form /from:=/to")
        mapping[source] = target
    return mapping


class BagPlayer(Node):
    """Publishes the messages of a rosbag2 at the recorded rate (see the module docstring).

    A recording its recorder never closed (killed: no ``metadata.yaml``, an MCAP without footer) is read up
    to its last complete record (``bag_reader.open_bag``); :attr:`recovery` then says what was recovered.
    Topics whose message type is not installed here are skipped, with a warning, and listed in
    :attr:`skipped`; the others are replayed.

    Args:
        bag: rosbag2 directory (MCAP or sqlite3 storage), or a single ``.mcap`` file.
        remap: recorded topic → published topic.
        topics: replay only these recorded topics; None replays all.
        rate: playback speed factor (2.0 = twice as fast).
        loop: start over at the end, until :meth:`stop`.
        restamp: rewrite ``header.stamp`` to the publication time (messages with a ``header`` field).
        node_name: the node's name.
        **node_kwargs: forwarded to ``rclpy.node.Node`` (``context=``, ...).

    Raises:
        FileNotFoundError: ``bag`` does not exist.
        oxygen_ros.tools.bag_reader.BagError: ``bag`` is not a readable bag.
        ValueError: ``rate`` is not positive, or no topic is left to replay (none of ``topics`` is in the
            bag, or no type of them is installed).
    """

    def __init__(self, bag: Path | str, *, remap: dict[str, str] | None = None,
                 topics: Iterable[str] | None = None, rate: float = 1.0, loop: bool = False,
                 restamp: bool = False, node_name: str = "bag_player", **node_kwargs):
        # Everything that can fail comes before the node exists: a half-built node would still be destroyed
        # by rclpy's shutdown.
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate:g}")
        self.bag = Path(bag)
        installed = project_typestore()
        reader = open_bag(self.bag, installed)
        try:
            wanted = set(topics) if topics is not None else None
            chosen = [c for c in reader.connections if wanted is None or c.topic in wanted]
            self._classes, self.skipped = {}, {}
            # Messages of this package recorded with an earlier definition of their type are re-encoded.
            recorded = getattr(reader, "typestore", None)
            self.upgrades: dict[int, Upgrade] = {}
            for connection in chosen:
                try:
                    cls = message_class(connection.msgtype)
                    if Upgrade.needed(connection.msgtype, recorded, installed):
                        self.upgrades[connection.id] = Upgrade(connection.msgtype, recorded, installed)
                    self._classes[connection.id] = cls
                except (ImportError, AttributeError, ValueError) as err:
                    self.skipped[connection.topic] = f"{connection.msgtype or 'no type'} ({err})"
            self._connections = [c for c in chosen if c.id in self._classes]
            if not self._connections:
                if not reader.connections:
                    raise ValueError(f"{self.bag} holds no topic at all (an empty recording, or one killed before "
                                     "its first flush)")
                what = f"none of the topics {sorted(wanted)} is" if wanted is not None and not chosen else \
                    "no topic with an installed message type is"
                raise ValueError(f"{what} in {self.bag}")
        except BaseException:
            reader.close()
            raise
        self._reader = reader
        self.recovery = getattr(reader, "recovery", None)
        self.rate, self.loop, self.restamp = rate, loop, restamp
        self.remap = dict(remap or {})
        self.published: dict[str, int] = {self.remap.get(c.topic, c.topic): 0 for c in self._connections}
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(node_name, **node_kwargs)
        for topic, reason in self.skipped.items():
            self.get_logger().warning(f"skipping {topic}: message type {reason} is not installed here, or was "
                                    "recorded with an incompatible definition")
        if self.recovery is not None and not self.recovery.finished:
            self.get_logger().warning(self.recovery.describe())
        self._replay_publishers = {}
        for connection in self._connections:
            topic = self.remap.get(connection.topic, connection.topic)
            if connection.msgtype in _LATCHED_TYPES:
                qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                 durability=DurabilityPolicy.TRANSIENT_LOCAL)
            else:
                qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
            self._replay_publishers[connection.id] = self.create_publisher(
                self._classes[connection.id], topic, qos)

    @property
    def duration_s(self) -> float:
        """Recorded duration of the bag [s]."""
        return self._reader.duration * 1e-9

    def start(self) -> None:
        """Start publishing on a thread of its own; :attr:`finished` is set at the end."""
        self._thread = threading.Thread(target=self._play, name="bag_player", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing (waits for the thread) and close the bag; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._reader.close()

    def destroy_node(self) -> None:
        self.stop()
        super().destroy_node()

    def _serialized(self, connection, raw: bytes) -> bytes:
        if connection.id in self.upgrades:
            raw = self.upgrades[connection.id](raw)
        if not self.restamp:
            return bytes(raw)
        msg = deserialize_message(bytes(raw), self._classes[connection.id])
        if not hasattr(msg, "header"):
            return bytes(raw)
        now = self.get_clock().now().nanoseconds
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        return serialize_message(msg)

    def _play(self) -> None:
        start_ns = self._reader.start_time
        loop_ns = max(self._reader.duration, 1)
        t0 = time.monotonic()
        iteration = 0
        try:
            while not self._stop.is_set():
                for connection, stamp_ns, raw in self._reader.messages(connections=self._connections):
                    offset_s = ((stamp_ns - start_ns) + iteration * loop_ns) * 1e-9 / self.rate
                    if self._stop.wait(max(0.0, t0 + offset_s - time.monotonic())):
                        return
                    self._replay_publishers[connection.id].publish(self._serialized(connection, raw))
                    self.published[self.remap.get(connection.topic, connection.topic)] += 1
                iteration += 1
                if not self.loop:
                    return
        finally:
            self.finished.set()


def _parameter_overrides(items: Iterable[str]):
    """``["name:=value", ...]`` → rclpy Parameters, each checked against the oxygen node's declaration
    (:func:`oxygen_ros.node.parameters.parse_override`; ValueError with a one-line message)."""
    from rclpy.parameter import Parameter

    from oxygen_ros.node.parameters import parse_override

    overrides = []
    for item in items:
        name, value = parse_override(item)
        overrides.append(Parameter(name, value=value))
    return overrides


def _positive(text: str) -> float:
    """An argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``oxygen_ros replay``: publish a bag's topics at the recorded rate (see the module docstring).

    Returns 0 when the bag was played; a bag that cannot be played ends the program with one line on stderr
    (``oxygen_ros replay: error: ...``) and exit status 1, a bad argument with the usage and status 2.
    """
    parser = argparse.ArgumentParser(prog="oxygen_ros replay", description=__doc__.split("\n")[0])
    parser.add_argument("bag", type=Path, help="rosbag2 directory (MCAP or sqlite3)")
    parser.add_argument("--remap", action="append", default=[], metavar="/FROM:=/TO",
                        help="publish the recorded topic /FROM on /TO (repeatable)")
    parser.add_argument("--topics", nargs="+", default=None, help="replay only these recorded topics")
    parser.add_argument("--rate", type=_positive, default=1.0, help="playback speed factor (default 1.0)")
    parser.add_argument("--loop", action="store_true", help="start over at the end")
    parser.add_argument("--restamp", action="store_true", help="rewrite header.stamp to now")
    parser.add_argument("--duration", type=float, default=None,
                        help="stop after this many seconds [s] (default: the end of the bag)")
    parser.add_argument("--node", action="store_true", help="also run the oxygen node in this process")
    parser.add_argument("--params-file", type=Path, default=None, help="the oxygen node's parameter file")
    parser.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="an oxygen node parameter override (repeatable)")
    args = parser.parse_args(argv)
    try:
        remap = parse_remaps(args.remap)
        overrides = _parameter_overrides(args.param) if args.node else []
    except ValueError as err:
        parser.error(str(err))
    if not args.bag.exists():
        parser.exit(1, f"{parser.prog}: error: {args.bag} does not exist\n")

    # Only the parameter file goes to rclpy: the player's own arguments (e.g. --remap a:=b) are not ROS's.
    rclpy_args = ["--ros-args", "--params-file", str(args.params_file)] if args.params_file else []
    rclpy.init(args=rclpy_args)
    executor = None
    nodes = []
    error = None
    try:
        player = BagPlayer(args.bag, remap=remap, topics=args.topics, rate=args.rate, loop=args.loop,
                           restamp=args.restamp)
        nodes.append(player)
        chunks = []
        if args.node:
            from oxygen_ros.msg import ActionChunk
            from oxygen_ros.node.oxygen_node import OxygenNode

            node = OxygenNode(parameter_overrides=overrides)
            nodes.append(node)
            player.create_subscription(ActionChunk, f"{node.get_fully_qualified_name()}/action_chunk",
                                       chunks.append, 10)
        # The oxygen_node executable's executor with the node (its transitions on a worker, every other callback
        # on this thread: a multi-threaded executor's pool threads take the control cycle's interpreter lock,
        # docs/demo.md); the player publishes from its own thread.
        executor = TransitionExecutor(node.runs_long) if args.node else SingleThreadedExecutor()
        for node in nodes:
            executor.add_node(node)
        player.get_logger().info(f"replaying {args.bag} ({player.duration_s:.2f} s recorded) at "
                                 f"{args.rate:g}x{' in a loop' if args.loop else ''}")
        player.start()
        deadline = time.monotonic() + args.duration if args.duration else None
        while not player.finished.is_set() and (deadline is None or time.monotonic() < deadline):
            executor.spin_once(timeout_sec=0.1)
        for topic, count in player.published.items():
            print(f"{topic}: {count} messages")
        for topic, reason in player.skipped.items():
            print(f"{topic}: skipped, message type {reason} is not installed here")
        if player.recovery is not None and not player.recovery.finished:
            print(player.recovery.describe())
        if args.node:
            print(f"action chunks published by the oxygen node: {len(chunks)}")
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except (FileNotFoundError, BagError, ValueError) as err:
        error = err
    finally:
        if executor is not None:
            executor.shutdown()
        for node in nodes:
            node.destroy_node()
        rclpy.try_shutdown()
    if error is not None:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
