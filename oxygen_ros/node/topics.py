"""The topic bridge of ``oxygen_node``: the ROS entities that configure creates and cleanup destroys — the
publishers, the subscriptions with their QoS and callbacks, and the node's timers — and the inputs' first
steps (convert, check, store in the :class:`~oxygen_ros.node.inputs.InputStore`). Subscription callbacks run
on the executor thread and never wait for inference.

Topics (relative names resolve in the node's namespace; ``~`` is the node's private namespace):
    in   camera_topics[i]          sensor_msgs/Image or CompressedImage, sensor-data QoS (best effort,
                                   depth 1; reliability per camera_reliability)
    in   instruction_topic         std_msgs/String, reliable + volatile, depth 10 (every publisher's live
                                   messages); plus reliable + transient local, depth 1, only while no
                                   instruction has arrived and a transient-local publisher offers one
    in   joint_states_topic        sensor_msgs/JointState, sensor-data QoS
    in   robot_description         std_msgs/String (URDF), reliable + transient local, depth 1; only with
                                   joint_limits.from_robot_description
    out  ~/action_chunk            oxygen_ros/ActionChunk, reliable, depth 10, once per control cycle
    out  ~/joint_trajectory        trajectory_msgs/JointTrajectory (publish_trajectory), reliable, depth 1
    out  ~/speech                  oxygen_ros/Speech partials and finals, reliable, depth 100
    out  ~/speech_text             std_msgs/String: the final text of completed utterances that have something
                                   to say (the others are withheld and counted; with speech.publish_on_change
                                   only a text that differs from the last one sent), reliable + transient
                                   local, depth 10 (a late transient-local subscriber gets the last texts)
    out  ~/memory                  oxygen_ros/MemoryEntry, reliable, depth 10
    in   memory.pose.topic         geometry_msgs/PoseStamped, best effort, depth 50 (only when set; memory_service.py)
    srv  ~/query_memory            oxygen_ros/QueryMemory (only with memory.store.path; memory_service.py)
    out  ~/status                  oxygen_ros/EngineStatus, reliable, depth 10, at status_rate_hz
    out  /diagnostics              diagnostic_msgs/DiagnosticArray, reliable, depth 10, at status_rate_hz

Every subscription and publisher counts incompatible-QoS events (reported in ~/status and /diagnostics).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Protocol

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import EngineStatus, MemoryEntry, Speech
from rclpy.clock import Clock, ClockType
from rclpy.duration import Duration
from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSPolicyKind, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.node.command_conflicts import GRAPH_POLL_S, CommandConflicts
from oxygen_ros.node.diagnostics import FrequencyStatus
from oxygen_ros.node.image_conversion import ImageConversionError, compressed_to_rgb, image_to_rgb
from oxygen_ros.node.inputs import DropCounter, Frame, InputError, InputStore, is_zero, stamp_seconds
from oxygen_ros.node.memory_service import MemoryService
from oxygen_ros.node.output_checks import limits_from_urdf
from oxygen_ros.node.parameters import CameraSettings, NodeSettings
from oxygen_ros.node.time_checks import StampWatch, clock_started

# Instruction: every publisher's live messages arrive on a volatile subscription (compatible with volatile
# and transient-local publishers alike). A transient-local one is added only while no instruction has
# arrived and a transient-local publisher is on the graph, to get its latched message (a volatile
# publisher would see it as incompatible, so it does not stay).
_INSTRUCTION_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
                              durability=DurabilityPolicy.VOLATILE)
_LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.TRANSIENT_LOCAL)
_GRAPH_POLL_S = 1.0   # how often the graph is checked for a latched instruction on offer [s]


class InputSink(Protocol):
    """What the bridge hands its inputs to (the node: :class:`~oxygen_ros.node.oxygen_node.OxygenNode`)."""

    def receiving(self) -> bool:
        """Whether camera frames and joint states are taken now (the node is active)."""

    def clock_now(self) -> tuple[Time, float]:
        """The node clock (``Time``, seconds), checked for a backwards jump."""

    def drop_input(self, kind: str, reason: str, message: str) -> None:
        """Count and log one dropped input of ``kind`` (``frames``, ``joint_states``, ``instructions``)."""

    def stamp_went_back(self, topic: str, previous_s: float, stamp_s: float) -> None:
        """A camera's header stamps went back from ``previous_s`` to ``stamp_s`` [s]."""

    def take_instruction(self, text: str) -> tuple[bool, str]:
        """Validate and store an instruction: (taken, what happened)."""


class TopicBridge:
    """The node's topics for one configuration (see the module docstring): created by configure, destroyed
    by :meth:`destroy` (cleanup, shutdown).

    Args:
        node: the lifecycle node the entities belong to.
        settings: the configure step's settings (topics, cameras, reliability, rates).
        inputs: where the inputs are stored; sink: what the inputs are handed to (the node).
        stamps: the camera stamp watch; qos_events: the counter of incompatible-QoS events; withheld: the
            error-level counter of withheld outputs (no joint limits).
        on_status: the status timer's callback (at ``status_rate_hz``).
        conflicts: the command-conflict watch, polled every ``GRAPH_POLL_S`` with ``conflict_policy()``.

    Attributes:
        action_chunk, trajectory, speech, speech_text, memory, status, diagnostics: the publishers
            (``trajectory`` is None without ``publish_trajectory``).
        memory_service: the memory entries' pose, store and ``~/query_memory`` (memory_service.py).
        joint_limits: the joint position limits in force (parameters, or the last valid robot_description).
        robot_description_error: why the last robot_description gave no limits, or None.
        joint_positions: the latest JointState positions by joint name while active (for on_stop_command).
        frequencies: per input (cameras by slot, ``joint_states``): (message frequency, topic, required).
    """

    def __init__(self, node, settings: NodeSettings, inputs: InputStore, sink: InputSink, stamps: StampWatch,
                 qos_events: DropCounter, withheld: DropCounter, on_status: Callable[[], None],
                 conflicts: CommandConflicts, conflict_policy: Callable[[], str]):
        self._node = node
        self._settings = settings
        self._inputs = inputs
        self._sink = sink
        self._stamps = stamps
        self._qos_events = qos_events
        self._withheld = withheld
        self._publishers: list = []
        self._subscriptions: list = []
        self._timers: list = []
        self._latched_instruction = None
        self._instruction_received = False
        self.joint_limits = settings.joint_limits
        self.robot_description_error: str | None = None
        self.joint_positions: dict[str, float] | None = None
        self._input_counts: dict[str, int] = {}
        self._create(settings, on_status, conflicts, conflict_policy)

    def _create(self, settings: NodeSettings, on_status, conflicts: CommandConflicts, conflict_policy) -> None:
        node = self._node
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.memory_service = MemoryService(node, settings.memory, lambda: node.get_clock().now().nanoseconds * 1e-9)

        def publisher(msg_type, topic: str, qos, lifecycle: bool = True):
            events = PublisherEventCallbacks(
                incompatible_qos=lambda info: self._on_incompatible_qos(info, "publisher", topic))
            create = node.create_lifecycle_publisher if lifecycle else node.create_publisher
            return create(msg_type, topic, qos, event_callbacks=events)

        self.action_chunk = publisher(ActionChunkMsg, "~/action_chunk", reliable)
        self.trajectory = publisher(JointTrajectory, "~/joint_trajectory", 1) if settings.publish_trajectory else None
        self.speech = publisher(Speech, "~/speech", 100)
        # Latched: a subscriber that joins late and asks for transient local (a recorder, a TTS node
        # started after the robot) still gets the last texts - with publish_on_change, the current subtask,
        # which may be said once for a whole task phase. Volatile subscribers are served as before.
        self.speech_text = publisher(String, "~/speech_text", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self.memory = publisher(MemoryEntry, "~/memory", reliable)
        self.status = publisher(EngineStatus, "~/status", reliable)
        self.diagnostics = publisher(DiagnosticArray, "/diagnostics", reliable, lifecycle=False)
        self._publishers += [p for p in (self.action_chunk, self.trajectory, self.speech, self.speech_text,
                                         self.memory, self.status) if p is not None]
        for camera in settings.cameras:
            qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                             reliability=ReliabilityPolicy.RELIABLE if camera.reliability == "reliable"
                             else ReliabilityPolicy.BEST_EFFORT,
                             durability=DurabilityPolicy.VOLATILE)
            msg_type = Image if camera.transport == "raw" else CompressedImage
            self._subscribe(msg_type, camera.topic, lambda msg, camera=camera: self._on_image(msg, camera), qos)
        self.frequencies = {camera.slot: (FrequencyStatus(), node.resolve_topic_name(camera.topic), camera.required)
                            for camera in settings.cameras}
        self.frequencies["joint_states"] = (FrequencyStatus(), node.resolve_topic_name(settings.joint_states_topic),
                                            True)
        self._subscribe(String, settings.instruction_topic, self._on_instruction, _INSTRUCTION_QOS)
        joint_qos = qos_profile_sensor_data if settings.joint_states_reliability == "best_effort" else \
            QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=5, reliability=ReliabilityPolicy.RELIABLE)
        self._subscribe(JointState, settings.joint_states_topic, self._on_joint_state, joint_qos)
        if settings.joint_limits_from_robot_description:
            self._subscribe(String, "robot_description", self._on_robot_description, _LATCHED_QOS)
        self._timers.append(node.create_timer(1.0 / settings.status_rate_hz, on_status))
        conflicts.watch([node.resolve_topic_name(p.topic_name) for p in (self.action_chunk, self.trajectory)
                         if p is not None])
        self._timers.append(node.create_timer(GRAPH_POLL_S, lambda: conflicts.check(conflict_policy()),
                                              clock=Clock(clock_type=ClockType.STEADY_TIME)))
        # On the steady clock: the graph is polled even while a simulated /clock is paused or absent.
        self._timers.append(node.create_timer(_GRAPH_POLL_S, self._update_latched_instruction,
                                              clock=Clock(clock_type=ClockType.STEADY_TIME)))
        self._update_latched_instruction()

    def destroy(self) -> None:
        """Destroy every entity the bridge created (the memory store gets what is queued first). Idempotent."""
        node = self._node
        self.memory_service.destroy()
        for timer in self._timers:
            node.destroy_timer(timer)
        for subscription in self._subscriptions:
            node.destroy_subscription(subscription)
        for publisher in self._publishers:
            node.destroy_lifecycle_publisher(publisher)
        if self._publishers:
            node.destroy_publisher(self.diagnostics)
        self._timers.clear()
        self._subscriptions.clear()
        self._publishers.clear()
        self.frequencies = {}
        self._latched_instruction = None
        self.trajectory = None

    def clear(self) -> None:
        """A new activation: no input counted or held from before."""
        self.joint_positions = None
        self._input_counts = {}
        for frequency, _, _ in self.frequencies.values():
            frequency.clear()

    def wait_for_final_messages(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` [s] until every reliable subscriber acknowledged what ``~/speech`` and
        ``~/joint_trajectory`` published; False on timeout."""
        publishers = [p for p in (self.speech, self.trajectory) if p is not None]
        deadline = time.monotonic() + timeout_s
        acked = True
        for publisher in publishers:
            left = max(0.0, deadline - time.monotonic())
            try:
                acked = publisher.wait_for_all_acked(Duration(nanoseconds=int(left * 1e9))) and acked
            except Exception:  # noqa: BLE001 - a destroyed publisher or an RMW without the call
                acked = False
        return acked

    def take_input_counts(self) -> dict[str, int]:
        """Inputs stored per input (``camera <slot>``, ``joint_states``) since the last call."""
        counts, self._input_counts = self._input_counts, {}
        return counts

    def _subscribe(self, msg_type, topic: str, callback, qos: QoSProfile, ignored_policy: QoSPolicyKind | None = None):
        """A subscription owned by the bridge whose incompatible-QoS events are counted (except those of
        ``ignored_policy``)."""
        events = SubscriptionEventCallbacks(
            incompatible_qos=lambda info: self._on_incompatible_qos(info, "subscription", topic, ignored_policy))
        subscription = self._node.create_subscription(msg_type, topic, callback, qos, event_callbacks=events)
        self._subscriptions.append(subscription)
        return subscription

    def _update_latched_instruction(self) -> None:
        """Subscribe transient-local to the instruction while none has arrived and a transient-local
        publisher offers one (its latched message then arrives); unsubscribe once one has arrived."""
        node, settings, latched = self._node, self._settings, self._latched_instruction
        if self._instruction_received:
            if latched is not None:
                self._subscriptions.remove(latched)
                node.destroy_subscription(latched)
                self._latched_instruction = None
            return
        if latched is None and any(info.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL
                                   for info in node.get_publishers_info_by_topic(
                                       node.resolve_topic_name(settings.instruction_topic))):
            # A volatile publisher is incompatible with this one by design (the volatile subscription
            # serves it and counts every other incompatibility on the topic), so it has no QoS event
            # handler: rclpy's executor can still hold a destroyed subscription's event handler in its
            # wait set and raise InvalidHandle ("cannot use Destroyable") when the subscription goes.
            self._latched_instruction = node.create_subscription(
                String, settings.instruction_topic, self._on_latched_instruction, _LATCHED_QOS)
            self._subscriptions.append(self._latched_instruction)

    def _on_incompatible_qos(self, info, direction: str, topic: str,
                             ignored_policy: QoSPolicyKind | None = None) -> None:
        """Count an incompatible-QoS event of a ``subscription`` or ``publisher`` of ``topic``."""
        try:
            policy = QoSPolicyKind(info.last_policy_kind)
        except ValueError:
            policy = None
        if ignored_policy is not None and policy == ignored_policy:
            return
        other = "publisher" if direction == "subscription" else "subscription"
        name = f"policy id {info.last_policy_kind}" if policy is None else policy.name
        self._qos_events.drop(f"{direction} {self._node.resolve_topic_name(topic)}",
                              f"a {other} with incompatible QoS ({name}) cannot connect to this {direction}: "
                              "no messages pass between them (see the QoS column of the topic table in docs/node.md)")

    # ---- input callbacks (executor thread: convert and store only) ----------------------------

    def _tick(self, name: str) -> None:
        """Count one message of input ``name`` (a camera slot or ``joint_states``) for its topic status."""
        entry = self.frequencies.get(name)
        if entry is not None:
            entry[0].tick()

    def _on_image(self, msg, camera: CameraSettings) -> None:
        sink = self._sink
        if not sink.receiving():
            return
        self._tick(camera.slot)
        try:
            image = image_to_rgb(msg, camera.accept_mono16) if camera.transport == "raw" else compressed_to_rgb(msg)
        except ImageConversionError as error:
            sink.drop_input("frames", error.reason, f"{camera.topic}: {error}")
            return
        now_msg, now_s = sink.clock_now()
        if not clock_started(now_s):
            sink.drop_input("frames", "clock_not_started", f"{camera.topic}: frame received before the node clock "
                            "started (use_sim_time and no /clock yet): its age cannot be measured")
            return
        if is_zero(msg.header.stamp):
            stamp = now_msg
        else:
            stamp = msg.header.stamp
            previous = self._stamps.observe(camera.slot, stamp_seconds(stamp), now_s)
            if previous is not None:
                sink.stamp_went_back(camera.topic, previous, stamp_seconds(stamp))
        self._inputs.store_frame(camera.slot, Frame(image, stamp, now_s))
        key = f"camera {camera.slot}"
        self._input_counts[key] = self._input_counts.get(key, 0) + 1

    def _on_joint_state(self, msg: JointState) -> None:
        sink, topic = self._sink, self._settings.joint_states_topic
        if not sink.receiving():
            return
        self._tick("joint_states")
        try:
            state = self._inputs.map_joint_state(msg.name, msg.position)
        except InputError as error:
            sink.drop_input("joint_states", error.reason, f"{topic}: {error}")
            return
        now_s = sink.clock_now()[1]
        if not clock_started(now_s):
            sink.drop_input("joint_states", "clock_not_started", f"{topic}: joint state "
                            "received before the node clock started (use_sim_time and no /clock yet)")
            return
        self._inputs.store_joint_state(state, now_s)
        self._input_counts["joint_states"] = self._input_counts.get("joint_states", 0) + 1
        # what on_stop_command hold holds (the trajectory joints may differ from joint_names)
        self.joint_positions = {name: float(p) for name, p in zip(msg.name, msg.position) if math.isfinite(p)}

    def _on_instruction(self, msg: String) -> None:
        self._instruction_received = True
        self._sink.take_instruction(msg.data)

    def _on_latched_instruction(self, msg: String) -> None:
        """The transient-local subscription: only the latched instruction, while none has arrived (live
        messages of the same publisher also arrive on the volatile subscription)."""
        if not self._instruction_received:
            self._on_instruction(msg)

    def _on_robot_description(self, msg: String) -> None:
        action_names = self._settings.action_names
        try:
            limits, unlimited = limits_from_urdf(msg.data, action_names)
        except ValueError as error:
            self.robot_description_error = str(error)
            self._withheld.drop("no_joint_limits", f"{error}; action chunks are withheld until a valid "
                                "robot_description arrives")
            return
        self.joint_limits, self.robot_description_error = limits, None
        self._node.get_logger().info(f"joint limits from robot_description: {limits.limited} of "
                                     f"{len(action_names)} action dimensions limited"
                                     + (f" (no limit for {unlimited})" if unlimited else ""))
