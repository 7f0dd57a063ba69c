"""``oxygen_node``: the managed (lifecycle) ROS 2 node that runs a π0.5 / π0 VLA with the unified
KV-cache engine.

Lifecycle:
    configure   reads the parameters, loads the model, builds the engine (allocates the KV pool),
                creates publishers and subscriptions; any failure returns FAILURE with the reason logged
                and leaves nothing loaded.
    activate    enables the lifecycle publishers and starts the control-cycle thread.
    deactivate  stops the thread, cancels every language request in flight and publishes its final
                Speech (STATUS_CANCELLED); no KV page stays held.
    cleanup     frees the engine, the model and every ROS entity created by configure.
    shutdown    from any state: what deactivate and cleanup do.
With ``autostart`` (default true) the node drives configure → activate itself.

Threads: subscription callbacks (executor) only convert and store the latest inputs; one control-cycle
thread runs the engine at ``control_rate_hz`` (wall clock), and publishes the action chunk as soon as it
is ready, then the speech and memory outputs of the language work done in the cycle's slack. The
executor never waits for inference. Lifecycle state queries and parameter reads are in a callback group of
their own, and so are the ask / command services (oxygen_ros/node/commands.py): the ``oxygen_node``
executable spins a multi-threaded executor, so they answer while configure loads the model.

Topics (relative names resolve in the node's namespace; ``~`` is the node's private namespace):
    in   camera_topics[i]          sensor_msgs/Image or CompressedImage, sensor-data QoS (best effort,
                                   depth 1; reliability per camera_reliability)
    in   instruction_topic         std_msgs/String, reliable + transient local, depth 1
    in   joint_states_topic        sensor_msgs/JointState, sensor-data QoS
    out  ~/action_chunk            oxygen_ros/ActionChunk, reliable, depth 10, once per control cycle
    out  ~/joint_trajectory        trajectory_msgs/JointTrajectory (publish_trajectory), reliable, depth 1
    out  ~/speech                  oxygen_ros/Speech partials and finals, reliable, depth 100
    out  ~/speech_text             std_msgs/String: the final text of completed utterances, reliable, depth 10
    out  ~/memory                  oxygen_ros/MemoryEntry, reliable, depth 10
    out  ~/status                  oxygen_ros/EngineStatus, reliable, depth 10, at status_rate_hz
    out  /diagnostics              diagnostic_msgs/DiagnosticArray, reliable, depth 10, at status_rate_hz

Services and actions (oxygen_ros/node/commands.py):
    ~/ask                          oxygen_ros/action/Ask: one language output on request (feedback, cancel)
    ~/pause_actions, ~/resume_actions  oxygen_ros/srv/SwitchActions: withhold / restore the action outputs
    ~/set_instruction              oxygen_ros/srv/SetInstruction: set the instruction, with an answer
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import EngineStatus, MemoryEntry, Speech
from rclpy.event_handler import QoSRequestedIncompatibleQoSInfo, SubscriptionEventCallbacks
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.engine import ActionChunk, Engine, RequestStatus
from oxygen_ros.node import conversions
from oxygen_ros.node.commands import Commands
from oxygen_ros.node.diagnostics import StatusTracker, diagnostic_array, engine_status_msg
from oxygen_ros.node.image_conversion import ImageConversionError, compressed_to_rgb, image_to_rgb
from oxygen_ros.node.inputs import DropCounter, Frame, InputError, InputStore, is_zero
from oxygen_ros.node.model_loading import build_engine, warm_up
from oxygen_ros.node.parameters import CameraSettings, NodeSettings, declare_parameters, read_settings

_INSTRUCTION_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                              durability=DurabilityPolicy.TRANSIENT_LOCAL)
# Services that only read state: with a multi-threaded executor they answer while a transition runs (configure
# loads the model). Transitions, parameter changes, timers and subscriptions stay in the default group, one at a
# time, as with a single-threaded executor.
_QUERY_SERVICES = ("get_state", "get_available_states", "get_available_transitions", "get_transition_graph",
                   "describe_parameters", "get_parameters", "get_parameter_types", "list_parameters")
_OBSERVATIONS_KEPT = 4096   # stamps/instructions of recent observations, for outputs of long language requests


@dataclass(frozen=True)
class _ObservationInfo:
    """What the outputs of one observation copy: its stamp, instruction and cameras used."""

    stamp: Time
    instruction: str
    camera_slots: tuple[str, ...]


def _node_terms(message: str) -> str:
    """An engine / model error message in the node's terms: the engine's ``kv_budget_bytes`` is the node's
    ``engine.kv_budget_mb`` parameter."""
    if "kv_budget_bytes" in message:
        return message.replace("kv_budget_bytes", "the parameter engine.kv_budget_mb")
    if "KV budget" in message or "KV pool" in message:
        return f"{message} (raise the parameter engine.kv_budget_mb)"
    return message


class OxygenNode(LifecycleNode):
    """The oxygen_ros lifecycle node (see the module docstring for lifecycle, threads and topics).

    Args:
        node_name: the node's name (default ``oxygen_node``).
        **kwargs: forwarded to :class:`rclpy.lifecycle.LifecycleNode` (``context``, ``namespace``,
            ``parameter_overrides``, ...), so several nodes can share one process and executor.

    Drive transitions through the lifecycle services (``<node>/change_state``) or from the thread that
    spins the node's executor: transitions and the status timer must not run concurrently.
    """

    def __init__(self, node_name: str = "oxygen_node", **kwargs):
        super().__init__(node_name, **kwargs)
        self._query_group = MutuallyExclusiveCallbackGroup()
        for service in self.services:
            if service.srv_name.rsplit("/", 1)[-1] in _QUERY_SERVICES:
                service.callback_group = self._query_group
                self._query_group.add_entity(service)
        self._lifecycle_state = "unconfigured"
        self._settings: NodeSettings | None = None
        self._engine: Engine | None = None
        self._inputs: InputStore | None = None
        self._drops = DropCounter(self.get_logger().warning)
        self._skips = DropCounter(self.get_logger().warning)
        self._status = StatusTracker()
        # ROS entities made by configure, destroyed by cleanup
        self._owned_publishers: list = []
        self._owned_subscriptions: list = []
        self._owned_timers: list = []
        self._memory_tasks: frozenset[str] = frozenset()
        self._cycle_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._active = False
        self._seq = 0
        self._session = ""
        self._observations: OrderedDict[int, _ObservationInfo] = OrderedDict()
        self._utterance_sequence: dict[int, int] = {}
        self._cycle_error_warner = DropCounter(self.get_logger().error)
        self._configure_error: str | None = None
        self._autostart_failed: str | None = None
        # Raises InvalidParameterTypeException / InvalidParameterValueException for a value of the wrong
        # type or out of range (overrides, a params file): rclpy checks them at declaration.
        # ~/ask, ~/pause_actions, ~/resume_actions, ~/set_instruction (oxygen_ros/node/commands.py); before
        # the parameters, so that a node whose declaration fails can still be destroyed
        self._commands = Commands(self)
        declare_parameters(self)
        if self.get_parameter("autostart").value:
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def lifecycle_state(self) -> str:
        """``unconfigured``, ``inactive``, ``active`` or ``finalized``."""
        return self._lifecycle_state

    @property
    def engine(self) -> Engine | None:
        """The engine while configured (tests read its pool occupancy), else None."""
        return self._engine

    def input_drops(self) -> dict[str, int]:
        """Dropped inputs by reason since activation (``unsupported_encoding``, ``joint_state_nan`` ...)."""
        return self._drops.counts()

    def skipped_cycles(self) -> int:
        """Control cycles since activation that had no usable observation (no chunk published)."""
        return self._skips.total()

    @property
    def commands(self) -> Commands:
        """The ask / command interface (``~/ask``, ``~/pause_actions``, ``~/resume_actions``,
        ``~/set_instruction``)."""
        return self._commands

    def utterance_id(self, request_id: int) -> str:
        """The id that the Speech messages (or MemoryEntry) of engine request ``request_id`` carry."""
        return f"{self._session}-{request_id}"

    def observation_stamp(self, seq: int, stamp_s: float) -> Time:
        """The stamp the outputs of observation ``seq`` carry (``stamp_s``: its stamp in seconds)."""
        return self._info(seq, stamp_s).stamp

    @property
    def configure_error(self) -> str | None:
        """Why the last configure failed (as logged), or None after a successful one."""
        return self._configure_error

    @property
    def autostart_failed(self) -> str | None:
        """``configure`` or ``activate`` when autostart's transition failed (the node stays usable, e.g. by
        a lifecycle manager; the ``oxygen_node`` executable exits non-zero), else None."""
        return self._autostart_failed

    def _autostart(self) -> None:
        self.destroy_timer(self._autostart_timer)
        for transition, trigger in (("configure", self.trigger_configure), ("activate", self.trigger_activate)):
            if trigger() != TransitionCallbackReturn.SUCCESS:
                self._autostart_failed = transition
                self.get_logger().error(f"autostart: {transition} failed (reason above); the node stays "
                                        f"{self._lifecycle_state}")
                return

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Load the model and the engine, create the ROS entities; FAILURE (reason logged) on any error."""
        start = time.perf_counter()
        try:
            settings = read_settings(self)
            engine = build_engine(settings)
            warm_s = warm_up(engine, settings)
        except Exception as error:  # any load failure: report it, keep nothing
            self._configure_error = _node_terms(f"{type(error).__name__}: {error}")
            self.get_logger().error(f"configure failed: {self._configure_error}")
            return TransitionCallbackReturn.FAILURE
        self._configure_error = None
        self._settings, self._engine = settings, engine
        self._inputs = InputStore(settings.cameras, settings.joint_names, settings.default_instruction)
        self._seq = 0
        self._session = f"{int(time.time() * 1e3):x}"
        self._observations.clear()
        self._utterance_sequence.clear()
        self._memory_tasks = frozenset(t.name for t in engine.config.language_tasks if t.kind == "memory")
        self._create_entities(settings)
        self._lifecycle_state = "inactive"
        pool = engine.pool
        self.get_logger().info(
            f"configured {settings.model_id} in {time.perf_counter() - start:.1f} s (warm-up cycle "
            f"{warm_s:.2f} s): KV pool "
            f"{pool.num_blocks} pages x {pool.bytes_per_block} B, cameras "
            f"{[c.slot for c in settings.cameras]}, control rate {settings.control_rate_hz:g} Hz")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Enable the publishers and start the control-cycle thread."""
        result = super().on_activate(state)
        if result != TransitionCallbackReturn.SUCCESS:
            return result
        self._inputs.clear()
        self._drops.reset()
        self._skips.reset()
        self._status.reset()
        self._stop.clear()
        self._active = True
        self._cycle_thread = threading.Thread(target=self._run_cycles, name="oxygen_control_cycle", daemon=True)
        self._cycle_thread.start()
        self._lifecycle_state = "active"
        self.get_logger().info("active")
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Stop the cycle thread, cancel the language requests in flight (final Speech published)."""
        self._stop_cycles()
        self._end_language_requests(publish=True)
        self._lifecycle_state = "inactive"
        self.get_logger().info("inactive")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Free the engine, the model and the ROS entities created by configure."""
        self._release()
        self._lifecycle_state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """From any state: stop, cancel what is in flight (published while still active), free all."""
        if self._active:
            self._stop_cycles()
            self._end_language_requests(publish=True)
        self._release()
        self._lifecycle_state = "finalized"
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised: free everything and return to unconfigured."""
        self.get_logger().error(f"error in transition from {state.label}: releasing the engine")
        self._release()
        self._lifecycle_state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def release(self) -> None:
        """Stop the cycle thread and free the engine without publishing (process exit after a signal,
        when the context may already be shut down). Idempotent."""
        self._release()

    def destroy_node(self) -> None:
        """Stop the control-cycle thread and free the engine first: a cycle thread left running would
        still be inside torch when the interpreter tears down (``terminate called without an active
        exception``)."""
        self._release()
        self._commands.destroy()
        super().destroy_node()

    def _release(self) -> None:
        self._stop_cycles()
        self._commands.end_goals("the node released its engine (cleanup, shutdown or exit)")
        for timer in self._owned_timers:
            self.destroy_timer(timer)
        for subscription in self._owned_subscriptions:
            self.destroy_subscription(subscription)
        for publisher in self._owned_publishers:
            self.destroy_lifecycle_publisher(publisher)
        if self._owned_publishers:
            self.destroy_publisher(self._diagnostics_pub)
        self._owned_timers.clear()
        self._owned_subscriptions.clear()
        self._owned_publishers.clear()
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        self._settings = None
        self._inputs = None

    def _stop_cycles(self) -> None:
        """Stop the control-cycle thread and wait until it has ended.

        The cycle in progress finishes first (its decode steps end early: the language requests are
        cancelled), so nothing it uses — publishers, engine — is destroyed under it. A cycle is
        bounded (one engine cycle), so this waits without a deadline and logs every 5 s while it does.
        """
        self._active = False
        thread = self._cycle_thread
        if thread is None:
            return
        self._stop.set()
        self._cancel_language_requests()   # ends the decode steps of the cycle in progress early
        thread.join(timeout=5.0)
        while thread.is_alive():
            self.get_logger().warning("waiting for the control cycle in progress to end")
            thread.join(timeout=5.0)
        self._cycle_thread = None

    def _cancel_language_requests(self) -> None:
        if self._engine is None:
            return
        for task in self._engine.config.language_tasks:
            self._engine.cancel_task(task.name)

    def _end_language_requests(self, publish: bool) -> None:
        """Cancel every language request and publish their final events; the KV pool ends empty."""
        self._cancel_language_requests()
        events, memories = self._engine.flush()
        if publish:
            self._publish_language(events, memories)
        used = self._engine.pool.num_used
        if used:
            self.get_logger().error(f"{used} KV pages still held after cancelling every language request")

    # ---- ROS entities -----------------------------------------------------------------------

    def _create_entities(self, settings: NodeSettings) -> None:
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self._chunk_pub = self.create_lifecycle_publisher(ActionChunkMsg, "~/action_chunk", reliable)
        self._trajectory_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", 1) \
            if settings.publish_trajectory else None
        self._speech_pub = self.create_lifecycle_publisher(Speech, "~/speech", 100)
        self._speech_text_pub = self.create_lifecycle_publisher(String, "~/speech_text", reliable)
        self._memory_pub = self.create_lifecycle_publisher(MemoryEntry, "~/memory", reliable)
        self._status_pub = self.create_lifecycle_publisher(EngineStatus, "~/status", reliable)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", reliable)
        self._owned_publishers += [p for p in (self._chunk_pub, self._trajectory_pub, self._speech_pub,
                                               self._speech_text_pub, self._memory_pub, self._status_pub)
                                   if p is not None]
        for camera in settings.cameras:
            qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                             reliability=ReliabilityPolicy.RELIABLE if camera.reliability == "reliable"
                             else ReliabilityPolicy.BEST_EFFORT,
                             durability=DurabilityPolicy.VOLATILE)
            msg_type = Image if camera.transport == "raw" else CompressedImage
            events = SubscriptionEventCallbacks(
                incompatible_qos=lambda info, camera=camera: self._on_incompatible_qos(info, camera.topic))
            self._owned_subscriptions.append(self.create_subscription(
                msg_type, camera.topic, lambda msg, camera=camera: self._on_image(msg, camera), qos,
                event_callbacks=events))
        self._owned_subscriptions.append(self.create_subscription(
            String, settings.instruction_topic, self._on_instruction, _INSTRUCTION_QOS))
        self._owned_subscriptions.append(self.create_subscription(
            JointState, settings.joint_states_topic, self._on_joint_state, qos_profile_sensor_data))
        self._owned_timers.append(self.create_timer(1.0 / settings.status_rate_hz, self._publish_status))

    # ---- input callbacks (executor thread: convert and store only) ----------------------------

    def _now(self) -> tuple[Time, float]:
        now = self.get_clock().now()
        return now.to_msg(), now.nanoseconds * 1e-9

    def _on_image(self, msg, camera: CameraSettings) -> None:
        if not self._active:
            return
        try:
            image = image_to_rgb(msg) if camera.transport == "raw" else compressed_to_rgb(msg)
        except ImageConversionError as error:
            self._drops.drop(error.reason, f"{camera.topic}: {error}")
            return
        now_msg, now_s = self._now()
        stamp = now_msg if is_zero(msg.header.stamp) else msg.header.stamp
        self._inputs.store_frame(camera.slot, Frame(image, stamp, now_s))

    def _on_incompatible_qos(self, info: QoSRequestedIncompatibleQoSInfo, topic: str) -> None:
        self._drops.drop("incompatible_qos", f"{topic}: a publisher's QoS is incompatible with this subscription "
                         f"(policy id {info.last_policy_kind}); check camera_reliability")

    def _on_instruction(self, msg: String) -> None:
        self.take_instruction(msg.data)

    def take_instruction(self, text: str) -> tuple[bool, str]:
        """Validate and store an instruction (from the instruction topic or ``~/set_instruction``).

        Returns:
            (taken, what happened): refused when the node is not configured, the text is empty or longer
            than ``max_instruction_chars`` (counted as a dropped input).
        """
        inputs, settings, engine = self._inputs, self._settings, self._engine
        if inputs is None or settings is None or engine is None:
            return False, f"the node is {self._lifecycle_state}: configure it first"
        limit = self.get_parameter("max_instruction_chars").value
        if len(text) > limit:
            reason = f"instruction of {len(text)} characters exceeds max_instruction_chars {limit}"
            self._drops.drop("instruction_too_long", f"{reason}; keeping {inputs.instruction!r}")
            return False, reason
        if not text.strip():
            self._drops.drop("instruction_empty", "empty instruction ignored")
            return False, "empty instruction ignored"
        if not inputs.store_instruction(text):
            return True, "instruction unchanged"
        self.get_logger().info(f"instruction: {text[:200]!r}")
        if self._active and settings.speech_enabled and settings.speech_cancel_on_new_instruction:
            engine.cancel_task("speech")
        return True, "instruction set: the next control cycle uses it"

    def _on_joint_state(self, msg: JointState) -> None:
        if not self._active:
            return
        try:
            state = self._inputs.map_joint_state(msg.name, msg.position)
        except InputError as error:
            self._drops.drop(error.reason, f"{self._settings.joint_states_topic}: {error}")
            return
        self._inputs.store_joint_state(state, self._now()[1])

    # ---- the control cycle (its own thread) ---------------------------------------------------

    def _run_cycles(self) -> None:
        settings, engine, inputs = self._settings, self._engine, self._inputs
        period = settings.control_period_s
        next_start = time.perf_counter()
        while not self._stop.is_set():
            deadline = next_start + period
            try:
                self._run_one_cycle(settings, engine, inputs, deadline)
            except Exception as error:  # one failed cycle must not end the node; it is counted and logged
                if not rclpy.ok(context=self.context):
                    return
                self._status.record_error(f"{type(error).__name__}: {error}")
                self._cycle_error_warner.drop("cycle_failed", f"{type(error).__name__}: {error}")
            next_start = deadline
            now = time.perf_counter()
            if next_start < now:    # overran: start the next cycle now, do not try to catch up
                next_start = now
            self._stop.wait(next_start - now)

    def _run_one_cycle(self, settings: NodeSettings, engine: Engine, inputs: InputStore, deadline: float) -> None:
        _, now_s = self._now()
        staleness = self.get_parameter("staleness_limit_s").value
        ready = inputs.observation(now_s, staleness, self._seq)
        if isinstance(ready, str):
            self._status.record_skip(ready)
            self._skips.drop("no_observation", f"no action chunk this cycle: {ready}")
            self._publish_language(*engine.take_events())    # requests cancelled meanwhile still end
            return
        self._seq += 1
        info = _ObservationInfo(ready.stamp, ready.observation.instruction, ready.camera_slots)
        self._observations[ready.observation.seq] = info
        while len(self._observations) > _OBSERVATIONS_KEPT:
            self._observations.popitem(last=False)
        result = engine.run_cycle(ready.observation, deadline, on_action=lambda chunk: self._commands.gate_action(
            lambda: self._publish_action(chunk, info, settings)))    # withheld while ~/pause_actions
        dropped = sum(1 for e in result.text_events if e.final and e.status == RequestStatus.DROPPED)
        self._publish_language(result.text_events, result.memory_entries)
        active = engine.active_requests
        self._status.record_cycle(result.record, dropped, engine.pool.used_bytes,
                                  sum(r.status == RequestStatus.RUNNING for r in active),
                                  sum(r.status == RequestStatus.WAITING for r in active))

    def _publish_action(self, chunk: ActionChunk, info: _ObservationInfo, settings: NodeSettings) -> None:
        self._chunk_pub.publish(conversions.action_chunk_msg(
            chunk, info.stamp, settings.frame_id, settings.action_names, settings.action_dt_s, settings.model_id))
        if self._trajectory_pub is not None:
            stamp = info.stamp if settings.trajectory_stamp_policy == "observation" else Time()
            self._trajectory_pub.publish(conversions.joint_trajectory_msg(
                chunk, stamp, settings.frame_id, settings.action_names, settings.trajectory_joint_names,
                settings.action_dt_s))

    def _info(self, seq: int, stamp_s: float) -> _ObservationInfo:
        info = self._observations.get(seq)
        if info is None:    # evicted (a very old request): rebuild the stamp from seconds
            nanoseconds = round(stamp_s * 1e9)
            info = _ObservationInfo(Time(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9), "", ())
        return info

    def _publish_language(self, events, memories) -> None:
        for event in events:
            if event.task in self._memory_tasks:
                continue    # memory captions are published as MemoryEntry only
            info = self._info(event.seq, event.stamp)
            sequence = self._utterance_sequence.pop(event.request_id, 0) if event.final else \
                self._utterance_sequence.get(event.request_id, 0)
            if not event.final:
                self._utterance_sequence[event.request_id] = sequence + 1
            self._speech_pub.publish(conversions.speech_msg(
                event, info.stamp, self.utterance_id(event.request_id), sequence,
                self._commands.instruction_for(event.request_id, info.instruction)))
            if event.final and event.status == RequestStatus.COMPLETED and event.text:
                self._speech_text_pub.publish(String(data=event.text))
        for entry in memories:
            info = self._info(entry.seq, entry.stamp)
            self._memory_pub.publish(conversions.memory_entry_msg(
                entry, info.stamp, self.utterance_id(entry.request_id), info.camera_slots,
                self._commands.instruction_for(entry.request_id, info.instruction)))
        self._commands.on_language(events)    # ~/ask goals: feedback and results

    # ---- status (executor thread) -------------------------------------------------------------

    def _publish_status(self) -> None:
        settings, engine, inputs = self._settings, self._engine, self._inputs
        if engine is None:
            return
        now_msg, now_s = self._now()
        status = window = None
        if self._active:
            window = self._status.window()
            pool = engine.pool
            status = engine_status_msg(window, now_msg, engine.metrics_records.action_horizon, self._drops.total(),
                                       pool.used_bytes, pool.num_blocks * pool.bytes_per_block)
            self._status_pub.publish(status)
        self._diagnostics_pub.publish(diagnostic_array(
            self.get_fully_qualified_name(), settings.model_id, self._lifecycle_state, status, window,
            self._drops.counts(), inputs.frame_ages(now_s), settings.control_rate_hz))


def _error_line(error: BaseException) -> str:
    """One line of an rclpy / rcl error: without rcl's ``, at /path/file.c:123`` source locations."""
    import re

    text = " ".join(str(error).split())
    return re.sub(r",? at \S+\.c(pp)?:\d+", "", text)


def main(args=None) -> int:
    """Run ``oxygen_node`` until SIGINT / SIGTERM or a lifecycle shutdown; returns the exit code.

    Exit codes: 0 after a signal or a lifecycle shutdown; 1 when autostart's configure or activate failed
    (reason logged; without autostart a failed configure leaves the node waiting for a lifecycle manager);
    2 when the command line, the params file or a parameter value is rejected before the node exists (a
    missing or malformed params file, a wrong type, a value out of range): one line on stderr.
    """
    try:
        rclpy.init(args=args)
    except Exception as error:  # rcl's argument / params-file parsing
        print(f"oxygen_node: {_error_line(error)}", file=sys.stderr)
        return 2
    try:
        node = OxygenNode()
    except (InvalidParameterTypeException, InvalidParameterValueException) as error:
        print(f"oxygen_node: invalid parameter: {_error_line(error)}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    # Three threads: the default group (transitions, parameter changes, timers, subscriptions), the query
    # services (lifecycle state, parameter reads) and the ask / command interface, so that these answer while
    # configure loads the model. Inference runs on the node's own control-cycle thread.
    executor = MultiThreadedExecutor(num_threads=3)
    executor.add_node(node)
    status = 0
    try:
        while rclpy.ok() and node.lifecycle_state != "finalized":
            executor.spin_once(timeout_sec=0.1)
            if node.autostart_failed:
                node.get_logger().fatal(f"autostart: {node.autostart_failed} failed; exiting (code 1)")
                status = 1
                break
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown(timeout_sec=5.0)
        node.release()
        node.destroy_node()
        rclpy.try_shutdown()
    return status
