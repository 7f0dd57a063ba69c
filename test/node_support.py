"""Support of the node tests (no tests here): one OxygenNode and a robot-side test node in one rclpy context,
spun by an executor on a background thread, over real Fast DDS on loopback.

The robot side publishes camera frames, joint states and the instruction (at ``publish_hz``, each
stream switchable) and records everything the node publishes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]


def _install_prefix() -> Path:
    """Where oxygen_ros is installed: the ament index's prefix (a colcon workspace's ``install/oxygen_ros``, as
    ``colcon test`` and a sourced workspace see it), else this repository's own ``install/oxygen_ros``
    (``make setup``)."""
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_prefix
    except ImportError:
        return REPO_ROOT / "install" / "oxygen_ros"
    try:
        return Path(get_package_prefix("oxygen_ros"))
    except (PackageNotFoundError, ValueError):
        return REPO_ROOT / "install" / "oxygen_ros"


INSTALL_PREFIX = _install_prefix()
EXECUTABLE = INSTALL_PREFIX / "lib" / "oxygen_ros" / "oxygen_node"
FLEET_EXECUTABLE = INSTALL_PREFIX / "lib" / "oxygen_ros" / "oxygen_fleet_node"
OXYGEN_ROS = INSTALL_PREFIX / "lib" / "oxygen_ros" / "oxygen_ros"   # record, replay, demo, soak
JOINTS = ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper"]
_HARNESS_IDS = itertools.count(1)
# The tests' default_instruction (config/pi05_tiny.yaml ships none, and without an instruction the node publishes
# no action output): tests of that rule set default_instruction "" themselves.
TEST_INSTRUCTION = "pick up the cube"


# Keys of a params file's section for this node, most specific first: rcl applies "/**/oxygen_node" (any
# namespace, what the shipped files use), "oxygen_node" and "/oxygen_node" (the root namespace only).
NODE_KEYS = ("/**/oxygen_node", "oxygen_node", "/oxygen_node")


def executable_command(namespace: str | None = None, params_file=REPO_ROOT / "config" / "pi05_tiny.yaml",
                       overrides=(), executable=EXECUTABLE) -> list[str]:
    """The command line of an installed executable (``oxygen_node``, or ``oxygen_fleet_node`` with
    :data:`FLEET_EXECUTABLE`) with ``params_file``, optionally under ``namespace`` and with ``-p`` ``overrides``
    (``"name:=value"``), as ``ros2 run`` gives it. ``oxygen_node`` gets ``default_instruction``
    :data:`TEST_INSTRUCTION` first (an override of its own wins)."""
    args = [sys.executable, str(executable), "--ros-args"]
    if namespace is not None:
        args += ["-r", f"__ns:={namespace}"]
    if executable == EXECUTABLE:
        overrides = (f"default_instruction:={TEST_INSTRUCTION}", *overrides)
    return args + ["--params-file", str(params_file)] + [arg for override in overrides for arg in ("-p", override)]


def oxygen_ros_command(*args: str) -> list[str]:
    """The command line of the installed ``oxygen_ros`` program (``record``, ``replay`` ...) with ``args``."""
    return [sys.executable, str(OXYGEN_ROS), *args]


def start_executable(cwd, namespace: str | None = None, params_file=REPO_ROOT / "config" / "pi05_tiny.yaml",
                     overrides=(), executable=EXECUTABLE) -> subprocess.Popen:
    """Start the installed ``executable`` (:func:`executable_command`) in ``cwd``; stdout and stderr together,
    as text."""
    args = executable_command(namespace, params_file, overrides, executable)
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))


def stop_process(process: subprocess.Popen, timeout: float) -> int:
    """End a node process the way a user does: SIGINT if it still runs, then wait ``timeout`` s, then kill.

    Returns:
        The exit code (the kill's when the process ignored SIGINT for ``timeout`` s).
    """
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def node_section(data: dict) -> dict:
    """The oxygen node's section of a parsed params file (under any key of :data:`NODE_KEYS`).

    Raises:
        KeyError: the file has no section for the node.
    """
    for key in NODE_KEYS:
        if key in data:
            return data[key]
    raise KeyError(f"no section for oxygen_node (keys {list(data)}; expected one of {list(NODE_KEYS)})")


def flat_parameters(mapping: dict, prefix: str = ""):
    """``(dotted name, value)`` pairs of a params file's nested ``ros__parameters`` mapping."""
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from flat_parameters(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def file_parameters(path, **changes) -> list:
    """The node's parameters in the params file ``path`` as overrides, with ``changes`` (dotted names)
    applied."""
    from rclpy.parameter import Parameter

    values = dict(flat_parameters(node_section(yaml.safe_load(Path(path).read_text()))["ros__parameters"]))
    values.update(changes)
    return [Parameter(name, value=value) for name, value in values.items()]


def tiny_parameters(**changes) -> list:
    """``config/pi05_tiny.yaml`` as parameter overrides with ``default_instruction`` :data:`TEST_INSTRUCTION`,
    with ``changes`` (dotted names) applied."""
    return file_parameters(REPO_ROOT / "config" / "pi05_tiny.yaml",
                           **{"default_instruction": TEST_INSTRUCTION, **changes})


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``condition()`` until true or ``timeout`` [s]; return its last value."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(interval)
    return bool(condition())


def publish_until(publish, condition, timeout: float = 5.0, interval: float = 0.25) -> bool:
    """Call ``publish()`` every ``interval`` [s] until ``condition()`` or ``timeout`` [s].

    Camera and joint-state subscriptions are best effort with depth 1 while the harness streams good
    messages on the same topics, so one bad message may be replaced in the queue before the node
    reads it: resending until the node has counted it tests the drop, not the queue.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        publish()
        if wait_for(condition, interval):
            return True
    return bool(condition())


def raw_image(height=24, width=32, encoding="rgb8", step=None, stamp=None, data=None):
    """A ``sensor_msgs/Image`` of random pixels (``step`` defaults to the unpadded row size of a packed
    encoding of oxygen_ros/node/image_conversion.py, 3 bytes per pixel for unknown ones)."""
    from sensor_msgs.msg import Image

    from oxygen_ros.node.image_conversion import ENCODINGS

    known = ENCODINGS.get(encoding.lower())
    step = width * (3 if known is None else known.bytes_per_pixel) if step is None else step
    if data is None:
        data = np.random.default_rng(0).integers(0, 256, height * step, dtype=np.uint8).tobytes()
    msg = Image(height=height, width=width, encoding=encoding, step=step, data=data)
    if stamp is not None:
        msg.header.stamp = stamp
    return msg


def jpeg_image(height=24, width=32, stamp=None):
    """A ``sensor_msgs/CompressedImage`` holding a valid JPEG."""
    import cv2
    from sensor_msgs.msg import CompressedImage

    pixels = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    ok, encoded = cv2.imencode(".jpg", pixels)
    assert ok
    msg = CompressedImage(format="jpeg", data=encoded.tobytes())
    if stamp is not None:
        msg.header.stamp = stamp
    return msg


class Harness:
    """OxygenNode + robot side in one context; :meth:`close` shuts everything down.

    Each harness lives in a namespace of its own (``/harness_<pid>_<n>``: the node is
    ``/harness_<pid>_<n>/oxygen_node``, its topics and lifecycle services are under it), so a harness
    never talks to another one's node — one still alive (a module-scoped fixture) or one whose DDS
    entities are not yet unmatched. :attr:`namespace` and :meth:`topic` give the names.

    Args:
        parameter_overrides: the node's parameters (see :func:`tiny_parameters`).
        publish_hz: rate of the robot side's camera / joint-state streams [Hz].
        cam1_reliable: whether the robot side's wrist-camera publisher is reliable.
        joint_names: names of the published joint states (positions: :attr:`joint_positions`).
    """

    def __init__(self, parameter_overrides, publish_hz: float = 10.0, cam1_reliable: bool = True,
                 joint_names=tuple(JOINTS)):
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.node import Node
        from rclpy.qos import (DurabilityPolicy, QoSProfile, ReliabilityPolicy,
                               qos_profile_sensor_data)
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from std_msgs.msg import String
        from diagnostic_msgs.msg import DiagnosticArray
        from oxygen_ros.msg import ActionChunk, EngineStatus, MemoryEntry, Speech
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.node.oxygen_node import OxygenNode

        self.namespace = f"/harness_{os.getpid()}_{next(_HARNESS_IDS)}"
        self.context = Context()
        rclpy.init(context=self.context)
        self.node = OxygenNode(context=self.context, namespace=self.namespace,
                               parameter_overrides=parameter_overrides)
        self.robot = Node("robot_side", context=self.context, namespace=self.namespace)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.cam0 = self.robot.create_publisher(Image, "camera/image_raw", qos_profile_sensor_data)
        self.cam1 = self.robot.create_publisher(CompressedImage, "wrist_camera/image_raw/compressed",
                                                reliable if cam1_reliable else qos_profile_sensor_data)
        self.joints = self.robot.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self.instruction = self.robot.create_publisher(String, "instruction", QoSProfile(
            depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self.received: dict[str, list] = {name: [] for name in
                                          ("chunk", "trajectory", "speech", "speech_text", "memory", "status",
                                           "diagnostics")}
        self.received_times: dict[str, list[float]] = {name: [] for name in self.received}
        for name, msg_type, topic, depth in (
                ("chunk", ActionChunk, "oxygen_node/action_chunk", 10),
                ("trajectory", JointTrajectory, "oxygen_node/joint_trajectory", 10),
                ("speech", Speech, "oxygen_node/speech", 100),
                ("speech_text", String, "oxygen_node/speech_text", 10),
                ("memory", MemoryEntry, "oxygen_node/memory", 10),
                ("status", EngineStatus, "oxygen_node/status", 10),
                ("diagnostics", DiagnosticArray, "/diagnostics", 10)):
            qos = QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE)
            self.robot.create_subscription(msg_type, topic, lambda msg, name=name: self._record(name, msg), qos)
        self.publish_cam0 = True
        self.cam0_encoding = "rgb8"     # encoding of the scene camera's raw frames
        self.cam0_stamps: dict[str, set[tuple[int, int]]] = {}     # encoding -> stamps of frames sent
        self.publish_cam1 = True
        self.publish_joints = True
        self.zero_stamps = False
        self.joint_names = list(joint_names)
        self.stamp_seconds = None   # when set: a function of the frame index giving the header stamp [s]
        self.joint_positions = [0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.02]
        self.sent_stamps: set[tuple[int, int]] = set()
        self._frame_index = 0
        self._change_state = None
        self._publish_hz = publish_hz
        self.robot.create_timer(1.0 / publish_hz, self._publish_inputs)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.executor.add_node(self.robot)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        self._closed = False

    def topic(self, relative: str) -> str:
        """The absolute name of ``relative`` in this harness's namespace (``oxygen_node/action_chunk`` ->
        ``/harness_<pid>_<n>/oxygen_node/action_chunk``)."""
        return f"{self.namespace}/{relative}"

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException

        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def _record(self, name: str, msg) -> None:
        if name == "diagnostics" and not any(s.name.startswith(self.namespace + "/") for s in msg.status):
            return    # /diagnostics is global: keep only this harness's node
        self.received[name].append(msg)
        self.received_times[name].append(time.monotonic())

    def _publish_inputs(self) -> None:
        from builtin_interfaces.msg import Time
        from sensor_msgs.msg import JointState

        # Distinct stamps far from the wall clock (so output stamps can only come from these frames),
        # advancing like a real camera's.
        self._frame_index += 1
        nanoseconds = 1_000 * 10**9 + round(self._frame_index * 1e9 / self._publish_hz) + 123_456
        if self.stamp_seconds is not None:
            nanoseconds = round(self.stamp_seconds(self._frame_index) * 1e9)
        stamp = Time() if self.zero_stamps else Time(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)
        self.sent_stamps.add((stamp.sec, stamp.nanosec))
        if self.publish_cam0:
            self.cam0.publish(raw_image(encoding=self.cam0_encoding, stamp=stamp))
            self.cam0_stamps.setdefault(self.cam0_encoding, set()).add((stamp.sec, stamp.nanosec))
        if self.publish_cam1:
            self.cam1.publish(jpeg_image(stamp=stamp))
        if self.publish_joints:
            self.joints.publish(JointState(name=self.joint_names, position=self.joint_positions))

    def change_state(self, label: str, timeout: float = 120.0) -> bool:
        """Request lifecycle transition ``label`` (configure, activate, deactivate, cleanup, shutdown)
        through the node's ``change_state`` service, as a lifecycle manager does; True on success. ``timeout``
        [s] only bounds a hang: configure loads the model, which takes long on a loaded machine."""
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState

        if self._change_state is None:
            self._change_state = self.robot.create_client(ChangeState, "oxygen_node/change_state")
        assert self._change_state.wait_for_service(timeout_sec=10.0)
        future = self._change_state.call_async(ChangeState.Request(transition=Transition(label=label)))
        assert wait_for(future.done, timeout), f"no answer to {label}"
        return future.result().success

    def count(self, name: str) -> int:
        return len(self.received[name])

    def drops(self, reason: str) -> int:
        return self.node.input_drops().get(reason, 0)

    def chunks_flow(self, timeout: float = 10.0, n: int = 2) -> bool:
        """True when ``n`` more action chunks arrive within ``timeout`` [s]."""
        start = self.count("chunk")
        return wait_for(lambda: self.count("chunk") >= start + n, timeout)

    def close(self) -> None:
        """Shut everything down, in order: the executor (its spin thread ends, no callback in flight), the
        node's control-cycle thread and engine, both nodes, then the context — shut down *and* destroyed,
        so the DDS participant goes away with its services now rather than at garbage collection.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.executor.shutdown(timeout_sec=5.0)
        self._thread.join(timeout=5.0)
        self.node.release()
        self.node.destroy_node()
        self.robot.destroy_node()
        self.context.try_shutdown()
        self.context.destroy()


class RobotSide:
    """One simulated robot of a fleet: camera frames (raw scene, JPEG wrist), joint states and its instruction
    in its namespace, with header stamps of its own (``base_s`` seconds apart from other robots'), and the
    action chunks its ``oxygen_node`` publishes there (:attr:`chunks`; :meth:`records` as plain tuples).
    Its joint states name ``joint_names``, every position 0.1. Its node joins ``context``; spinning it is the
    caller's (any executor)."""

    def __init__(self, context, namespace: str, base_s: int, publish_hz: float = 10.0, joint_names=tuple(JOINTS)):
        from oxygen_ros.msg import ActionChunk
        from rclpy.node import Node
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from std_msgs.msg import String

        self.node = Node("robot_side", context=context, namespace=namespace)
        self.cam0 = self.node.create_publisher(Image, "camera/image_raw", qos_profile_sensor_data)
        self.cam1 = self.node.create_publisher(CompressedImage, "wrist_camera/image_raw/compressed",
                                               qos_profile_sensor_data)
        self.joints = self.node.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.instruction = self.node.create_publisher(String, "instruction", latched)
        self.instruction_text = f"robot {namespace} picks the cube"
        self.instruction.publish(String(data=self.instruction_text))
        self.chunks: list = []
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.node.create_subscription(ActionChunk, "oxygen_node/action_chunk", self.chunks.append, reliable)
        self.sent: set[tuple[int, int]] = set()
        self.publishing = True
        self._index = 0
        self._base_s = base_s
        self._hz = publish_hz
        self._joint_names = list(joint_names)
        self.node.create_timer(1.0 / publish_hz, self._publish)

    def _publish(self) -> None:
        from builtin_interfaces.msg import Time
        from sensor_msgs.msg import JointState

        if not self.publishing:
            return
        self._index += 1
        ns = self._base_s * 10**9 + round(self._index * 1e9 / self._hz)
        stamp = Time(sec=ns // 10**9, nanosec=ns % 10**9)
        self.sent.add((stamp.sec, stamp.nanosec))
        self.cam0.publish(raw_image(stamp=stamp))
        self.cam1.publish(jpeg_image(stamp=stamp))
        self.joints.publish(JointState(name=self._joint_names, position=[0.1] * len(self._joint_names)))

    def records(self, start: int = 0, end: int | None = None) -> list[tuple[int, int, int]]:
        """``(stamp sec, stamp nanosec, observation_seq)`` of the chunks received (``start:end``)."""
        return [(c.header.stamp.sec, c.header.stamp.nanosec, c.observation_seq) for c in self.chunks[start:end]]

    def chunks_after(self, count: int, n: int = 2, timeout: float = 300.0) -> bool:
        """Whether ``n`` chunks beyond the first ``count`` arrive within ``timeout`` [s] (bounds a hang only)."""
        return wait_for(lambda: len(self.chunks) >= count + n, timeout, 0.05)


@contextlib.contextmanager
def spinning_fleet(node, sides, context):
    """Spin one ``oxygen_fleet_node`` (``node``, or a list of them: several servers) and the robot sides' nodes
    (``sides``: a dict of :class:`RobotSide`) on one transition executor in a background thread until the block
    exits; then stop the thread, close and destroy the nodes, shut down and destroy ``context``."""
    import rclpy

    from oxygen_ros.node.executor import TransitionExecutor

    servers = list(node) if isinstance(node, (list, tuple)) else [node]
    executor = TransitionExecutor(lambda entity: any(s.runs_long(entity) for s in servers), context=context)
    for server in servers:
        executor.add_node(server)
    for side in sides.values():
        executor.add_node(side.node)
    stop = threading.Event()

    def spin():
        while not stop.is_set() and rclpy.ok(context=context):
            executor.spin_once(timeout_sec=0.05)

    for server in servers:
        server.attach(executor)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10.0)
        executor.shutdown(timeout_sec=5.0)
        for server in servers:
            server.close()
            server.destroy_node()
        for side in sides.values():
            side.node.destroy_node()
        context.try_shutdown()
        context.destroy()


def assert_own_chunks(records, sent, others_sent) -> None:
    """Chunks ``records`` (``(sec, nanosec, observation_seq)``, one life of a robot's node) were computed from
    that robot's own frames: each carries a stamp the robot sent (``sent``) and none another robot sent
    (``others_sent``: their stamp sets), and their observation_seq values strictly increase."""
    stamps = [(sec, nanosec) for sec, nanosec, _ in records]
    assert stamps and all(s in sent for s in stamps), (stamps[:5], sorted(sent)[:5])
    assert not any(s in other for other in others_sent for s in stamps)
    seqs = [seq for _, _, seq in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
