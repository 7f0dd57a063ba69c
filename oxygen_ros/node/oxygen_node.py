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
executor never waits for inference. Lifecycle state queries and the parameter services (reads and changes) are
in a callback group of their own, and so are the ask / command services (oxygen_ros/node/commands.py): the
``oxygen_node`` executable runs lifecycle transitions on a worker thread and every other callback on its
spinning thread (oxygen_ros/node/executor.py), so they answer while configure loads the model (a configure-time
parameter is then refused with the reason, a dynamic one accepted).

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
    out  ~/status                  oxygen_ros/EngineStatus, reliable, depth 10, at status_rate_hz
    out  /diagnostics              diagnostic_msgs/DiagnosticArray, reliable, depth 10, at status_rate_hz

Every subscription and publisher counts incompatible-QoS events (reported in ~/status and /diagnostics).
What leaves the node is checked first (oxygen_ros/node/output_checks.py): non-finite chunks and memory
embeddings are withheld, joint limits clamp or reject, expired outputs fall back or are withheld. Time
(oxygen_ros/node/time_checks.py): backwards jumps of the node clock or of camera stamps are counted and
restart staleness, time triggers and waiting requests; nothing runs before the node clock starts.

Services and actions (oxygen_ros/node/commands.py):
    ~/ask                          oxygen_ros/action/Ask: one language output on request (feedback, cancel)
    ~/pause_actions, ~/resume_actions  oxygen_ros/srv/SwitchActions: withhold / restore the action outputs
    ~/set_instruction              oxygen_ros/srv/SetInstruction: set the instruction, with an answer
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, KeyValue
from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import EngineStatus, MemoryEntry, Speech
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType
from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSPolicyKind, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.engine import ActionChunk, Engine, RequestStatus
from oxygen_ros.engine.detokenizer import is_speakable
from oxygen_ros.node import conversions
from oxygen_ros.node.commands import Commands
from oxygen_ros.node.diagnostics import (FrequencyStatus, StatusTracker, diagnostic_array, engine_status_msg,
                                         inactive_topic_status)
from oxygen_ros.node.image_conversion import ImageConversionError, compressed_to_rgb, image_to_rgb
from oxygen_ros.node.inputs import DropCounter, Frame, InputError, InputStore, is_zero, stamp_seconds
from oxygen_ros.node.model_loading import build_engine, warm_up
from oxygen_ros.node.output_checks import all_finite, expired_by, limits_from_urdf
from oxygen_ros.node.parameters import (CameraSettings, NodeSettings, check_dynamic_change, declare_parameters,
                                        read_settings)
from oxygen_ros.node.time_checks import ClockWatch, StampWatch, clock_started

# Instruction: every publisher's live messages arrive on a volatile subscription (compatible with volatile
# and transient-local publishers alike). A transient-local one is added only while no instruction has
# arrived and a transient-local publisher is on the graph, to get its latched message (a volatile
# publisher would see it as incompatible, so it does not stay).
_INSTRUCTION_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
                              durability=DurabilityPolicy.VOLATILE)
_LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.TRANSIENT_LOCAL)
_GRAPH_POLL_S = 1.0   # how often the graph is checked for a latched instruction on offer [s]
# Skip reasons that are the expected wait before the first observation since configure (logged at INFO then).
_STARTUP_SKIPS = ("clock_not_started", "no_joint_limits", "no_observation")
# Lifecycle state queries and the parameter services: with the executable's executor (transitions on a worker
# thread, oxygen_ros/node/executor.py) or a multi-threaded one they answer while a transition runs (configure
# loads the model). Transitions, timers and subscriptions stay in the default group,
# one at a time, as with a single-threaded executor. A parameter change and configure's reading of the
# parameters exclude each other through the node's parameter lock (OxygenNode.set_parameters_atomically), so a
# change is either read by that configure or judged in the state "configuring" (configure-time parameters
# refused with the reason, dynamic ones accepted).
_QUERY_SERVICES = ("get_state", "get_available_states", "get_available_transitions", "get_transition_graph",
                   "describe_parameters", "get_parameters", "get_parameter_types", "list_parameters",
                   "set_parameters", "set_parameters_atomically")


@dataclass(frozen=True)
class _ObservationTag:
    """The node's :attr:`Observation.tag`, handed back by the engine on every output of the observation:
    what those outputs copy (its header stamp, instruction and cameras used)."""

    stamp: Time
    instruction: str
    camera_slots: tuple[str, ...]


# The tag of outputs no observation started (an asked request cancelled before any cycle took it).
_NO_OBSERVATION = _ObservationTag(Time(), "", ())



class OxygenNode(LifecycleNode):
    """The oxygen_ros lifecycle node (see the module docstring for lifecycle, threads and topics).

    Args:
        node_name: the node's name (default ``oxygen_node``).
        engine_builder: builds the engine from the configure step's settings (default
            :func:`oxygen_ros.node.model_loading.build_engine`: load the model, build an engine); the
            fleet node (``oxygen_ros/node/fleet_node.py``) gives each robot's node a client of its shared
            engine instead. Raises as that function.
        **kwargs: forwarded to :class:`rclpy.lifecycle.LifecycleNode` (``context``, ``namespace``,
            ``parameter_overrides``, ...), so several nodes can share one process and executor.

    Drive transitions through the lifecycle services (``<node>/change_state``) or from the thread that
    spins the node's executor: transitions and the status timer must not run concurrently.
    """

    def __init__(self, node_name: str = "oxygen_node", engine_builder=None, **kwargs):
        super().__init__(node_name, **kwargs)
        self._engine_builder = engine_builder
        self._query_group = MutuallyExclusiveCallbackGroup()
        for service in self.services:
            if service.srv_name.rsplit("/", 1)[-1] in _QUERY_SERVICES:
                service.callback_group = self._query_group
                self._query_group.add_entity(service)
        self._lifecycle_state = "unconfigured"
        # held while a parameter change is judged and stored, and while configure enters "configuring" and
        # reads the parameters (see _QUERY_SERVICES)
        self._parameter_lock = threading.RLock()
        self._settings: NodeSettings | None = None
        self._engine: Engine | None = None
        self._inputs: InputStore | None = None
        self._drops = DropCounter(self.get_logger().warning)
        # drops since activation per input kind (EngineStatus dropped_frames / _joint_states / _instructions)
        self._dropped_by_input = {"frames": 0, "joint_states": 0, "instructions": 0}
        self._dropped_lock = threading.Lock()
        self._skips = DropCounter(self.get_logger().warning, what="skipped cycle")
        self._status = StatusTracker()
        # ROS entities made by configure, destroyed by cleanup
        self._owned_publishers: list = []
        self._owned_subscriptions: list = []
        self._owned_timers: list = []
        self._cycle_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._active = False
        self._seq = 0
        self._session = ""
        self._speech_text_withheld = 0      # completed utterances without speakable text, since activation
        self._speech_text_last: dict[str, str] = {}   # per task: the text last published on ~/speech_text
        self._cycle_error_warner = DropCounter(self._log_error)
        self._configure_error: str | None = None
        self._autostart_failed: str | None = None
        self._autostart_cancelled = threading.Event()   # set by a stop signal: no further autostart transition
        # output checks and time (see output_checks.py, time_checks.py)
        self._withheld = DropCounter(self._log_error, what="output withheld")
        self._output_warner = DropCounter(self.get_logger().warning, what="output changed")
        self._time_warner = DropCounter(self.get_logger().warning, what="time went backwards")
        self._qos_events = DropCounter(self.get_logger().warning, what="incompatible QoS")
        self._qos_reported = 0
        self._clock_watch = ClockWatch(self._read_clock, self._on_clock_jump)
        self._stamps = StampWatch()
        self._time_restart = threading.Event()
        self._last_cycle_clock: tuple[float, int] | None = None
        self._expiry_warned = False
        self._joint_limits = None
        self._robot_description_error: str | None = None
        self._instruction_received = False
        self._latched_instruction_sub = None
        self._trajectory_pub = None
        self._joint_positions: dict[str, float] | None = None   # latest JointState while active, by name
        # diagnostics' period figures: inputs stored per input since the last publication, drops reported
        self._input_counts: dict[str, int] = {}
        self._drops_reported: dict[str, int] = {}
        self._status_published_at = time.perf_counter()
        # per input topic (cameras by slot, "joint_states"): message frequency, its topic and whether required
        self._frequencies: dict[str, tuple[FrequencyStatus, str, bool]] = {}
        # Raises InvalidParameterTypeException / InvalidParameterValueException for a value of the wrong
        # type or out of range (overrides, a params file): rclpy checks them at declaration.
        # ~/ask, ~/pause_actions, ~/resume_actions, ~/set_instruction (oxygen_ros/node/commands.py); before
        # the parameters, so that a node whose declaration fails can still be destroyed: here, since the caller
        # never gets it (left to the garbage collector, the context's last node would take the DDS participant
        # down inside a collection)
        self._commands = Commands(self)
        try:
            declare_parameters(self)
        except BaseException:
            self.destroy_node()
            raise
        self.add_on_set_parameters_callback(self._check_parameter_change)
        if self.get_parameter("autostart").value:
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    def _log_error(self, message: str) -> None:
        # Error-level counters log from this line: rclpy refuses two severities from one call site, and
        # DropCounter's warning-level counters log from its own.
        self.get_logger().error(message)

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def lifecycle_state(self) -> str:
        """``unconfigured``, ``inactive``, ``active`` or ``finalized``."""
        return self._lifecycle_state

    @property
    def engine(self) -> Engine | None:
        """The engine while configured (tests read its pool occupancy), else None."""
        return self._engine

    def dropped_by_input(self) -> dict[str, int]:
        """Inputs dropped since activation per kind: ``frames`` (camera frames only), ``joint_states``,
        ``instructions`` (as in ~/status)."""
        with self._dropped_lock:
            return dict(self._dropped_by_input)

    def _drop_input(self, kind: str, reason: str, message: str) -> None:
        """Count and log one dropped input of ``kind`` (a key of :meth:`dropped_by_input`) for ``reason``."""
        with self._dropped_lock:
            self._dropped_by_input[kind] += 1
        self._drops.drop(reason, message)

    def input_drops(self) -> dict[str, int]:
        """Dropped inputs by reason since activation (``unsupported_encoding``, ``joint_state_nan`` ...)."""
        return self._drops.counts()

    def speech_text_withheld(self) -> int:
        """Completed utterances since activation whose text was not published on ``~/speech_text``
        because it had nothing to say (empty, whitespace, control or replacement characters only)."""
        return self._speech_text_withheld

    def skipped_cycles(self) -> int:
        """Control cycles since activation that had no usable observation (no chunk published)."""
        return self._skips.total()

    def skip_reasons(self) -> dict[str, int]:
        """Skipped control cycles since activation by reason (``no_observation``, ``clock_not_started``,
        ``clock_paused``, ``no_joint_limits``)."""
        return self._skips.counts()

    def output_events(self) -> dict[str, int]:
        """Output and time events since activation, by EngineStatus field name (``non_finite_actions``,
        ``limited_actions``, ``expired_chunks``, ``expired_trajectories``, ``non_finite_embeddings``,
        ``clock_jumps``, ``stamp_jumps``)."""
        return self._status.totals()

    def qos_events(self) -> dict[str, int]:
        """Incompatible-QoS events since configure by endpoint (``subscription <topic>``,
        ``publisher <topic>``)."""
        return self._qos_events.counts()

    @property
    def instruction(self) -> str | None:
        """The instruction in use (the default one until one arrives), or None while unconfigured."""
        inputs = self._inputs
        return None if inputs is None else inputs.instruction

    @property
    def joint_limits(self):
        """The joint position limits in force (:class:`oxygen_ros.node.output_checks.JointLimits`, from the
        parameters or robot_description), or None."""
        return self._joint_limits

    @property
    def commands(self) -> Commands:
        """The ask / command interface (``~/ask``, ``~/pause_actions``, ``~/resume_actions``,
        ``~/set_instruction``)."""
        return self._commands

    def utterance_id(self, request_id: int) -> str:
        """The id that the Speech messages (or MemoryEntry) of engine request ``request_id`` carry."""
        return f"{self._session}-{request_id}"

    @staticmethod
    def output_stamp(event) -> Time:
        """The header stamp an output of the engine carries: its observation's (zero when no observation
        started it)."""
        return _tag(event).stamp

    @property
    def configure_error(self) -> str | None:
        """Why the last configure failed (as logged), or None after a successful one."""
        return self._configure_error

    @property
    def autostart_failed(self) -> str | None:
        """``configure`` or ``activate`` when autostart's transition failed (the node stays usable, e.g. by
        a lifecycle manager; the ``oxygen_node`` executable exits non-zero), else None."""
        return self._autostart_failed

    def runs_long(self, entity) -> bool:
        """Whether ``entity``'s callback may run long: the ``change_state`` service and the autostart timer
        (lifecycle transitions: configure loads the model). The ``oxygen_node`` executable runs these on a
        worker thread (oxygen_ros/node/executor.py)."""
        if entity is getattr(self, "_autostart_timer", None):
            return True
        name = getattr(entity, "srv_name", None)
        return name is not None and name.rsplit("/", 1)[-1] == "change_state" and entity in self.services

    def cancel_autostart(self) -> None:
        """Take no further autostart transition (a stop signal arrived): a configure in progress ends, but
        the node is not activated after it, so nothing is published after the signal. Any thread."""
        self._autostart_cancelled.set()

    def _autostart(self) -> None:
        self.destroy_timer(self._autostart_timer)
        for transition, trigger in (("configure", self.trigger_configure), ("activate", self.trigger_activate)):
            if self._autostart_cancelled.is_set():
                self.get_logger().info(f"autostart: stopping before {transition}; the node stays "
                                       f"{self._lifecycle_state}")
                return
            if trigger() != TransitionCallbackReturn.SUCCESS:
                self._autostart_failed = transition
                self.get_logger().error(f"autostart: {transition} failed (reason above); the node stays "
                                        f"{self._lifecycle_state}")
                return

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Load the model and the engine, run the warm-up cycle, create the ROS entities; FAILURE (reason
        logged) on any error, including a warm-up action chunk with a non-finite value."""
        start = time.perf_counter()
        engine = None
        try:
            with self._parameter_lock:    # no parameter change between the state and the values read
                self._lifecycle_state = "configuring"     # configure-time parameters are refused from here on
                settings = read_settings(self)
            engine = (self._engine_builder or build_engine)(settings)
            warm_chunks: list[ActionChunk] = []
            warm_s = warm_up(engine, settings, warm_chunks.append)
            bad = [int(np.sum(~np.isfinite(chunk.actions))) for chunk in warm_chunks if not all_finite(chunk.actions)]
            if bad:
                raise ValueError(f"the warm-up action chunk has {bad[0]} non-finite values of "
                                 f"{warm_chunks[0].actions.size}: the checkpoint or the normalisation "
                                 "statistics produce NaN/inf actions")
        except Exception as error:  # any load failure: report it, keep nothing
            if engine is not None:
                engine.close()
            self._configure_error = f"{type(error).__name__}: {error}"
            self.get_logger().error(f"configure failed: {self._configure_error}")
            self._lifecycle_state = "unconfigured"
            return TransitionCallbackReturn.FAILURE
        self._configure_error = None
        self._settings, self._engine = settings, engine
        self._inputs = InputStore(settings.cameras, settings.joint_names, settings.default_instruction)
        self._seq = 0
        self._session = f"{int(time.time() * 1e3):x}"
        self._joint_limits = settings.joint_limits
        self._robot_description_error = None
        self._instruction_received = False
        self._qos_events.reset()
        self._qos_reported = 0
        self._stamps.clear()
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
        with self._dropped_lock:
            self._dropped_by_input = dict.fromkeys(self._dropped_by_input, 0)
        self._skips.reset()
        self._speech_text_withheld = 0
        self._speech_text_last.clear()
        self._withheld.reset()
        self._output_warner.reset()
        self._time_warner.reset()
        self._status.reset()
        self._time_restart.clear()
        self._last_cycle_clock = None
        self._expiry_warned = False
        self._joint_positions = None
        self._input_counts = {}
        self._drops_reported = {}
        self._status_published_at = time.perf_counter()
        for frequency, _, _ in self._frequencies.values():
            frequency.clear()
        self._stop.clear()
        self._active = True
        self._cycle_thread = threading.Thread(target=self._run_cycles, name="oxygen_control_cycle", daemon=True)
        self._cycle_thread.start()
        self._lifecycle_state = "active"
        self.get_logger().info("active")
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Stop the cycle thread, cancel the language requests in flight (final Speech published), send the
        controller's last command (``on_stop_command``)."""
        self.stop_acting()
        self._lifecycle_state = "inactive"
        self.get_logger().info("inactive")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Free the engine, the model and the ROS entities created by configure."""
        self._release()
        self._lifecycle_state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """From any state: stop, cancel what is in flight (published while still active), send the last
        command, free all."""
        self.stop_acting()
        self._release()
        self._lifecycle_state = "finalized"
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised: free everything and return to unconfigured."""
        self.get_logger().error(f"error in transition from {state.label}: releasing the engine")
        try:
            self.stop_acting()      # publishers still active: final Speech and last command go out
        except Exception as error:  # noqa: BLE001 - the release below must happen whatever failed here
            self.get_logger().error(f"ending the requests in flight failed: {type(error).__name__}: {error}")
        self._release()
        self._lifecycle_state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def stop_acting(self) -> bool:
        """When active: stop the control-cycle thread, end every language request in flight with exactly
        one final Speech (CANCELLED), and send the controller's last command (``on_stop_command``). The
        publishers must still be enabled (call before deactivating them or shutting the context down).
        Returns whether the node was active; does nothing otherwise (idempotent)."""
        if not self._active or self._engine is None:
            return False
        self._stop_cycles()
        self._end_language_requests(publish=True)
        self._send_stop_command()
        return True

    def _send_stop_command(self) -> None:
        """``on_stop_command: hold``: one JointTrajectory holding the latest JointState positions of the
        trajectory joints (stamp 0: executed on receipt). Logged and not sent when there is nothing to
        hold from (no JointState, or one without a trajectory joint)."""
        if self.get_parameter("on_stop_command").value != "hold" or self._trajectory_pub is None:
            return
        settings, positions = self._settings, self._joint_positions
        names = settings.trajectory_joint_names
        missing = list(names) if positions is None else [name for name in names if name not in positions]
        if missing:
            self.get_logger().warning(f"on_stop_command hold: no hold trajectory sent, no JointState position of "
                                      f"{missing} received while active")
            return
        self._trajectory_pub.publish(conversions.hold_trajectory_msg(
            names, [positions[name] for name in names], settings.frame_id, settings.action_dt_s))
        self.get_logger().info(f"on_stop_command hold: sent a JointTrajectory holding {list(names)}")

    def wait_for_final_messages(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` [s] until every reliable subscriber acknowledged the final Speech and the
        last command (before the process exits and DDS drops what it has not delivered); False on timeout."""
        from rclpy.duration import Duration

        publishers = [p for p in (getattr(self, "_speech_pub", None), self._trajectory_pub) if p is not None]
        deadline = time.monotonic() + timeout_s
        acked = True
        for publisher in publishers:
            left = max(0.0, deadline - time.monotonic())
            try:
                acked = publisher.wait_for_all_acked(Duration(nanoseconds=int(left * 1e9))) and acked
            except Exception:  # noqa: BLE001 - a destroyed publisher or an RMW without the call
                acked = False
        return acked

    def release(self) -> None:
        """Stop the cycle thread and free the engine without publishing (process exit after a signal,
        when the context may already be shut down). Idempotent."""
        self._release()

    def destroy_node(self) -> None:
        """Destroy the node now, with everything it created: stop the control-cycle thread and free the engine
        first (a cycle thread left running would still be inside torch when the interpreter tears down:
        ``terminate called without an active exception``), then the ``~/ask`` action server (a waitable, which
        ``Node.destroy_node`` leaves), the node's own entities, and last the lifecycle state machine.

        rclpy's ``LifecycleNode`` has no ``destroy_node`` of its own: its state machine keeps the rcl node
        (and, when it is the context's last node, Fast DDS's participant) alive until the garbage collector
        finalises it at an arbitrary moment, where destroying the participant can wait forever on a
        participant-listener callback in flight. Destroying it here finalises the rcl node deterministically,
        as soon as no executor wait still holds one of its entities. Idempotent."""
        self._release()
        self._commands.destroy()
        super().destroy_node()
        self._state_machine.destroy_when_not_in_use()

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
        self._frequencies = {}
        self._owned_publishers.clear()
        self._latched_instruction_sub = None
        self._trajectory_pub = None
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
        events, _ = self._engine.flush()
        if publish:
            self._publish_language(events)
        used = self._engine.pool.num_used
        if used:
            self.get_logger().error(f"{used} KV pages still held after cancelling every language request")

    # ---- ROS entities -----------------------------------------------------------------------

    def _create_entities(self, settings: NodeSettings) -> None:
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)

        def publisher(msg_type, topic: str, qos, lifecycle: bool = True):
            events = PublisherEventCallbacks(
                incompatible_qos=lambda info: self._on_incompatible_qos(info, "publisher", topic))
            create = self.create_lifecycle_publisher if lifecycle else self.create_publisher
            return create(msg_type, topic, qos, event_callbacks=events)

        self._chunk_pub = publisher(ActionChunkMsg, "~/action_chunk", reliable)
        self._trajectory_pub = publisher(JointTrajectory, "~/joint_trajectory", 1) \
            if settings.publish_trajectory else None
        self._speech_pub = publisher(Speech, "~/speech", 100)
        # Latched: a subscriber that joins late and asks for transient local (a recorder, a TTS node
        # started after the robot) still gets the last texts - with publish_on_change, the current subtask,
        # which may be said once for a whole task phase. Volatile subscribers are served as before.
        self._speech_text_pub = publisher(String, "~/speech_text", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self._memory_pub = publisher(MemoryEntry, "~/memory", reliable)
        self._status_pub = publisher(EngineStatus, "~/status", reliable)
        self._diagnostics_pub = publisher(DiagnosticArray, "/diagnostics", reliable, lifecycle=False)
        self._owned_publishers += [p for p in (self._chunk_pub, self._trajectory_pub, self._speech_pub,
                                               self._speech_text_pub, self._memory_pub, self._status_pub)
                                   if p is not None]
        for camera in settings.cameras:
            qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                             reliability=ReliabilityPolicy.RELIABLE if camera.reliability == "reliable"
                             else ReliabilityPolicy.BEST_EFFORT,
                             durability=DurabilityPolicy.VOLATILE)
            msg_type = Image if camera.transport == "raw" else CompressedImage
            self._subscribe(msg_type, camera.topic, lambda msg, camera=camera: self._on_image(msg, camera), qos)
        self._frequencies = {camera.slot: (FrequencyStatus(), self.resolve_topic_name(camera.topic), camera.required)
                             for camera in settings.cameras}
        self._frequencies["joint_states"] = (FrequencyStatus(), self.resolve_topic_name(settings.joint_states_topic),
                                             True)
        self._subscribe(String, settings.instruction_topic, self._on_instruction, _INSTRUCTION_QOS)
        joint_qos = qos_profile_sensor_data if settings.joint_states_reliability == "best_effort" else \
            QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=5, reliability=ReliabilityPolicy.RELIABLE)
        self._subscribe(JointState, settings.joint_states_topic, self._on_joint_state, joint_qos)
        if settings.joint_limits_from_robot_description:
            self._subscribe(String, "robot_description", self._on_robot_description, _LATCHED_QOS)
        self._owned_timers.append(self.create_timer(1.0 / settings.status_rate_hz, self._publish_status))
        # On the steady clock: the graph is polled even while a simulated /clock is paused or absent.
        self._owned_timers.append(self.create_timer(_GRAPH_POLL_S, self._update_latched_instruction,
                                                    clock=Clock(clock_type=ClockType.STEADY_TIME)))
        self._update_latched_instruction()

    def _subscribe(self, msg_type, topic: str, callback, qos: QoSProfile, ignored_policy: QoSPolicyKind | None = None):
        """A subscription owned by the node whose incompatible-QoS events are counted (except those of
        ``ignored_policy``)."""
        events = SubscriptionEventCallbacks(
            incompatible_qos=lambda info: self._on_incompatible_qos(info, "subscription", topic, ignored_policy))
        subscription = self.create_subscription(msg_type, topic, callback, qos, event_callbacks=events)
        self._owned_subscriptions.append(subscription)
        return subscription

    def _update_latched_instruction(self) -> None:
        """Subscribe transient-local to the instruction while none has arrived and a transient-local
        publisher offers one (its latched message then arrives); unsubscribe once one has arrived."""
        settings = self._settings
        if settings is None:
            return
        latched = self._latched_instruction_sub
        if self._instruction_received:
            if latched is not None:
                self._owned_subscriptions.remove(latched)
                self.destroy_subscription(latched)
                self._latched_instruction_sub = None
            return
        if latched is None and any(info.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL
                                   for info in self.get_publishers_info_by_topic(
                                       self.resolve_topic_name(settings.instruction_topic))):
            # A volatile publisher is incompatible with this one by design (the volatile subscription
            # serves it and counts every other incompatibility on the topic), so it has no QoS event
            # handler: rclpy's executor can still hold a destroyed subscription's event handler in its
            # wait set and raise InvalidHandle ("cannot use Destroyable") when the subscription goes.
            self._latched_instruction_sub = self.create_subscription(
                String, settings.instruction_topic, self._on_latched_instruction, _LATCHED_QOS)
            self._owned_subscriptions.append(self._latched_instruction_sub)

    # ---- input callbacks (executor thread: convert and store only) ----------------------------

    def _now(self) -> tuple[Time, float]:
        """The node clock now (``Time``, seconds); every read checks for a backwards jump."""
        return self._clock_watch.now()

    def _read_clock(self) -> tuple[Time, float]:
        now = self.get_clock().now()
        return now.to_msg(), now.nanoseconds * 1e-9

    def _on_clock_jump(self, from_s: float, to_s: float) -> None:
        """The node clock went back: inputs received before belong to the old time base (dropped), time
        triggers and waiting requests restart (next cycle)."""
        self._status.record_event("clock_jumps", f"{from_s:.3f} s -> {to_s:.3f} s")
        self._time_warner.drop("clock_jump", f"the node clock jumped back from {from_s:.3f} s to {to_s:.3f} s "
                               "(a /clock reset?): frames and joint states received before are not used, "
                               "staleness and time triggers restart from the new time")
        inputs = self._inputs
        if inputs is not None:
            inputs.clear()
        self._stamps.clear()
        self._time_restart.set()

    def _on_image(self, msg, camera: CameraSettings) -> None:
        if not self._active:
            return
        self._tick(camera.slot)
        try:
            image = image_to_rgb(msg, camera.accept_mono16) if camera.transport == "raw" else compressed_to_rgb(msg)
        except ImageConversionError as error:
            self._drop_input("frames", error.reason, f"{camera.topic}: {error}")
            return
        now_msg, now_s = self._now()
        if not clock_started(now_s):
            self._drop_input("frames", "clock_not_started", f"{camera.topic}: frame received before the node clock "
                             "started (use_sim_time and no /clock yet): its age cannot be measured")
            return
        if is_zero(msg.header.stamp):
            stamp = now_msg
        else:
            stamp = msg.header.stamp
            previous = self._stamps.observe(camera.slot, stamp_seconds(stamp), now_s)
            if previous is not None:
                self._status.record_event("stamp_jumps", f"{camera.topic}: {previous:.3f} s -> "
                                          f"{stamp_seconds(stamp):.3f} s")
                self._time_warner.drop("stamp_jump", f"{camera.topic}: header stamps went back from "
                                       f"{previous:.3f} s to {stamp_seconds(stamp):.3f} s (a bag replayed in a "
                                       "loop?): time triggers and waiting requests restart from the new time")
                self._time_restart.set()
        self._inputs.store_frame(camera.slot, Frame(image, stamp, now_s))
        key = f"camera {camera.slot}"
        self._input_counts[key] = self._input_counts.get(key, 0) + 1

    def _tick(self, name: str) -> None:
        """Count one message of input ``name`` (a camera slot or ``joint_states``) for its topic status."""
        entry = self._frequencies.get(name)
        if entry is not None:
            entry[0].tick()

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
        self._qos_events.drop(f"{direction} {self.resolve_topic_name(topic)}",
                              f"a {other} with incompatible QoS ({name}) cannot connect to this {direction}: "
                              "no messages pass between them (see the QoS column of the topic table in docs/node.md)")

    def set_parameters(self, parameter_list):
        """rclpy's :meth:`rclpy.node.Node.set_parameters`, one parameter at a time under the node's parameter
        lock (see :meth:`set_parameters_atomically`)."""
        return [self.set_parameters_atomically([parameter]) for parameter in parameter_list]

    def set_parameters_atomically(self, parameter_list):
        """rclpy's :meth:`rclpy.node.Node.set_parameters_atomically` (what the ``set_parameters`` and
        ``set_parameters_atomically`` services call) under the node's parameter lock: the change is judged
        against the lifecycle state and stored before configure can read the parameters, or after configure
        entered ``configuring`` (configure-time parameters are then refused with the reason)."""
        with self._parameter_lock:
            return super().set_parameters_atomically(parameter_list)

    def _check_parameter_change(self, parameters) -> SetParametersResult:
        reason = check_dynamic_change(parameters, self._lifecycle_state)
        return SetParametersResult(successful=reason is None, reason=reason or "")

    def _on_latched_instruction(self, msg: String) -> None:
        """The transient-local subscription: only the latched instruction, while none has arrived (live
        messages of the same publisher also arrive on the volatile subscription)."""
        if not self._instruction_received:
            self._on_instruction(msg)

    def _on_robot_description(self, msg: String) -> None:
        try:
            limits, unlimited = limits_from_urdf(msg.data, self._settings.action_names)
        except ValueError as error:
            self._robot_description_error = str(error)
            self._withheld.drop("no_joint_limits", f"{error}; action chunks are withheld until a valid "
                                "robot_description arrives")
            return
        self._joint_limits, self._robot_description_error = limits, None
        self.get_logger().info(f"joint limits from robot_description: {limits.limited} of "
                               f"{len(self._settings.action_names)} action dimensions limited"
                               + (f" (no limit for {unlimited})" if unlimited else ""))

    def _on_instruction(self, msg: String) -> None:
        self._instruction_received = True
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
            self._drop_input("instructions", "instruction_too_long", f"{reason}; keeping {inputs.instruction!r}")
            return False, reason
        if not text.strip():
            self._drop_input("instructions", "instruction_empty", "empty instruction ignored")
            return False, "empty instruction ignored"
        if not inputs.store_instruction(text):
            return True, "instruction unchanged"
        self.get_logger().info(f"instruction: {text[:200]!r}")
        # The engine cancels the requests of tasks with cancel_on_new_instruction when the next cycle's
        # observation carries the new instruction.
        return True, "instruction set: the next control cycle uses it"

    def _on_joint_state(self, msg: JointState) -> None:
        if not self._active:
            return
        self._tick("joint_states")
        try:
            state = self._inputs.map_joint_state(msg.name, msg.position)
        except InputError as error:
            self._drop_input("joint_states", error.reason, f"{self._settings.joint_states_topic}: {error}")
            return
        now_s = self._now()[1]
        if not clock_started(now_s):
            self._drop_input("joint_states", "clock_not_started", f"{self._settings.joint_states_topic}: joint state "
                             "received before the node clock started (use_sim_time and no /clock yet)")
            return
        self._inputs.store_joint_state(state, now_s)
        self._input_counts["joint_states"] = self._input_counts.get("joint_states", 0) + 1
        # what on_stop_command hold holds (the trajectory joints may differ from joint_names)
        self._joint_positions = {name: float(p) for name, p in zip(msg.name, msg.position) if math.isfinite(p)}

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

    def _skip(self, reason: str, detail: str) -> None:
        self._status.record_skip(detail)
        if self._seq == 0 and reason in _STARTUP_SKIPS:
            # Before the first observation since configure, waiting for inputs (or the clock) is the expected
            # state, not a fault: logged at INFO (still counted, and on /diagnostics).
            self._skips.drop(reason, f"waiting for the first observation: {detail}", self.get_logger().info)
            return
        self._skips.drop(reason, f"no action chunk this cycle: {detail}")
        self._publish_language(self._engine.take_events()[0])    # requests cancelled meanwhile still end

    def _run_one_cycle(self, settings: NodeSettings, engine: Engine, inputs: InputStore, deadline: float) -> None:
        _, now_s = self._now()
        if not clock_started(now_s):
            self._skip("clock_not_started", "the node clock has not started (use_sim_time: no /clock yet)")
            return
        receipts = inputs.receipts
        if self._last_cycle_clock == (now_s, receipts):
            # Staleness is judged on the node clock: a paused /clock ages nothing, so the same frozen
            # inputs would be used again and again.
            self._skip("clock_paused", f"the node clock stands at {now_s:.3f} s (paused /clock?) and no input "
                       "arrived since the last chunk")
            return
        if settings.joint_limits_from_robot_description and self._joint_limits is None:
            self._skip("no_joint_limits", "no joint limits yet: waiting for robot_description"
                       + (f" ({self._robot_description_error})" if self._robot_description_error else ""))
            return
        staleness = self.get_parameter("staleness_limit_s").value
        ready = inputs.observation(lambda: self._now()[1], staleness, self._seq)
        if isinstance(ready, str):
            self._skip("no_observation", ready)
            return
        self._last_cycle_clock = (now_s, receipts)
        if self._time_restart.is_set():
            self._time_restart.clear()
            self._restart_waiting_requests(engine, ready.observation.stamp)
        self._seq += 1
        ready.observation.tag = _ObservationTag(ready.stamp, ready.observation.instruction, ready.camera_slots)
        result = engine.run_cycle(ready.observation, deadline, on_action=lambda chunk: self._commands.gate_action(
            lambda: self._publish_action(chunk, settings)))    # withheld while ~/pause_actions
        dropped = sum(1 for e in result.text_events if e.final and e.status == RequestStatus.DROPPED)
        self._publish_language(result.text_events)
        active = engine.active_requests
        self._status.record_cycle(result.record, dropped, engine.pool.used_bytes,
                                  sum(r.status == RequestStatus.RUNNING for r in active),
                                  sum(r.status == RequestStatus.WAITING for r in active))

    def _restart_waiting_requests(self, engine: Engine, stamp_s: float) -> None:
        """After a backwards jump of time: waiting language requests triggered by an observation stamped
        after ``stamp_s`` (on the old time base) are cancelled; their wait cannot be measured on the new
        one (``max_wait_s``), and their final Speech goes out with the next cycle."""
        for request in engine.active_requests:
            if request.status == RequestStatus.WAITING and request.stamp > stamp_s:
                engine.cancel(request.request_id)

    def _publish_action(self, chunk: ActionChunk, settings: NodeSettings) -> None:
        """Check the chunk (finite, joint limits, expiry) and publish the ActionChunk and JointTrajectory
        the checks allow (module docstring of output_checks.py)."""
        info = _tag(chunk)
        actions = chunk.actions
        if not all_finite(actions):
            bad = int(np.sum(~np.isfinite(actions)))
            self._status.record_event("non_finite_actions", f"observation {chunk.seq}: {bad} of {actions.size} values")
            self._withheld.drop("non_finite_actions", f"action chunk of observation {chunk.seq} withheld (neither "
                                f"ActionChunk nor JointTrajectory sent): {bad} of {actions.size} values are NaN or "
                                "infinite")
            return
        limits = self._joint_limits
        if limits is not None and limits.violations(actions):
            outside = limits.violations(actions)
            policy = self.get_parameter("joint_limits.policy").value
            self._status.record_event("limited_actions", f"observation {chunk.seq}: {outside} values {policy}ed")
            (self._withheld if policy == "reject" else self._output_warner).drop(
                "limited_actions", f"action chunk of observation {chunk.seq}: {outside} of {actions.size} values "
                f"outside the joint limits ({limits.source}): "
                + ("chunk withheld" if policy == "reject" else "clamped into them"))
            if policy == "reject":
                return
            chunk = replace(chunk, actions=limits.clamp(actions))
        expiry = self.get_parameter("expired_output_policy").value
        margin = self.get_parameter("expired_output_margin_s").value   # delivery time to the controller
        _, now_s = self._now()
        stamp_s = stamp_seconds(info.stamp)
        horizon, dt = chunk.actions.shape[0], settings.action_dt_s
        late = expired_by(stamp_s, (horizon - 1) * dt - margin, now_s)
        if late is not None:
            self._status.record_event("expired_chunks", f"observation {chunk.seq}: {late:.3f} s past")
            self._warn_expired("ActionChunk", late, now_s - stamp_s, expiry)
        if late is None or expiry == "fallback":
            self._chunk_pub.publish(conversions.action_chunk_msg(
                chunk, info.stamp, settings.frame_id, settings.action_names, dt, settings.model_id))
        if self._trajectory_pub is None:
            return
        stamp = Time()
        if settings.trajectory_stamp_policy == "observation":
            late = expired_by(stamp_s, horizon * dt - margin, now_s)
            if late is None:
                stamp = info.stamp
            else:
                self._status.record_event("expired_trajectories", f"observation {chunk.seq}: {late:.3f} s past")
                self._warn_expired("JointTrajectory", late, now_s - stamp_s, expiry)
                if expiry == "withhold":
                    return
        self._trajectory_pub.publish(conversions.joint_trajectory_msg(
            chunk, stamp, settings.frame_id, settings.action_names, settings.trajectory_joint_names, dt))

    def _warn_expired(self, output: str, late_s: float, behind_s: float, policy: str) -> None:
        """One warning per activation for the first expired output, naming the clock offset."""
        if self._expiry_warned:
            return
        self._expiry_warned = True
        offset = self._stamps.largest_offset()
        action = {"fallback": "JointTrajectories go out with stamp 0 (start on receipt), ActionChunks as they are",
                  "withhold": "such outputs are withheld"}[policy]
        self.get_logger().warning(
            f"{output} already {late_s:.3f} s past its last point at publication: the observation stamp is "
            f"{behind_s:.3f} s behind the node clock"
            + ("" if offset is None else f" (camera header stamps vs node clock at receipt: {offset:+.3f} s)")
            + f". expired_output_policy {policy}: {action}; counted in ~/status (expired_chunks, "
            "expired_trajectories). If the camera offset is small the delay is inference time: the chunk spans "
            "less time (action_horizon x action_dt_s) than a cycle takes on this machine; otherwise synchronise "
            "the camera and node clocks, or use trajectory_stamp_policy: now. "
            "This warning is given once per activation.")

    def _publish_language(self, events) -> None:
        """Speech events on ``~/speech`` (and ``~/speech_text``); a memory request's entry, carried by its final
        event, on ``~/memory`` (its text events are not speech)."""
        for event in events:
            if event.kind == "memory":
                if event.memory is not None:
                    self._publish_memory(event.memory)
                continue
            info = _tag(event)
            self._speech_pub.publish(conversions.speech_msg(
                event, info.stamp, self.utterance_id(event.request_id), event.index,
                self._commands.instruction_for(event.request_id, info.instruction)))
            if event.final and event.status == RequestStatus.COMPLETED:
                self._publish_speech_text(event)
        self._commands.on_language(events)    # ~/ask goals: feedback and results

    def _publish_memory(self, entry) -> None:
        """A memory entry on ``~/memory``, unless its embedding is not finite (withheld, counted)."""
        if entry.embedding is not None and not all_finite(entry.embedding):
            bad = int(np.sum(~np.isfinite(entry.embedding)))
            self._status.record_event("non_finite_embeddings", f"memory request {entry.request_id}")
            self._withheld.drop("non_finite_embeddings", f"memory entry of observation {entry.seq} withheld: "
                                f"{bad} of {entry.embedding.size} embedding values are NaN or infinite")
            return
        info = _tag(entry)
        self._memory_pub.publish(conversions.memory_entry_msg(
            entry, info.stamp, self.utterance_id(entry.request_id), info.camera_slots,
            self._commands.instruction_for(entry.request_id, info.instruction)))

    def _publish_speech_text(self, event) -> None:
        """``~/speech_text`` gets a completed utterance's text only when a TTS can say it; with
        ``<task>.publish_on_change``, only when it differs from the task's text last published there.
        The text goes out without leading and trailing whitespace (a TTS reads it as is)."""
        if is_speakable(event.text):
            text = event.text.strip()
            name = f"{event.task}.publish_on_change"
            on_change = self.has_parameter(name) and self.get_parameter(name).value
            if on_change and self._speech_text_last.get(event.task) == text:
                return
            self._speech_text_last[event.task] = text
            self._speech_text_pub.publish(String(data=text))
            return
        self._speech_text_withheld += 1
        self.get_logger().warning(
            f"speech_text withheld: utterance {self._session}-{event.request_id} has nothing to say "
            f"({event.text[:40]!r}); {self._speech_text_withheld} withheld since activation",
            throttle_duration_sec=5.0)

    # ---- status (executor thread) -------------------------------------------------------------

    def _publish_status(self) -> None:
        settings, engine, inputs = self._settings, self._engine, self._inputs
        if engine is None:
            return
        now_msg, now_s = self._now()
        status = window = None
        qos_total = self._qos_events.total()
        if self._active:
            window = self._status.window()
            pool = engine.pool
            dropped = self.dropped_by_input()
            status = engine_status_msg(window, now_msg, engine.metrics_records.action_horizon, dropped["frames"],
                                       pool.used_bytes, pool.num_blocks * pool.bytes_per_block,
                                       self._stamps.largest_offset(), qos_total,
                                       dropped_joint_states=dropped["joint_states"],
                                       dropped_instructions=dropped["instructions"])
            self._status_pub.publish(status)
        # the period's figures: inputs received per second and drops since the previous publication
        wall = time.perf_counter()
        period_s = max(wall - self._status_published_at, 1e-9)
        self._status_published_at = wall
        counts, self._input_counts = self._input_counts, {}
        names = [f"camera {c.slot}" for c in settings.cameras] + ["joint_states"]
        rates = {name: counts.get(name, 0) / period_s for name in names} if self._active else {}
        drops = self._drops.counts()
        new_drops = {reason: n - self._drops_reported.get(reason, 0) for reason, n in drops.items()}
        self._drops_reported = dict(drops)
        diagnostics = diagnostic_array(
            self.get_fully_qualified_name(), settings.model_id, self._lifecycle_state, status, window,
            drops, inputs.frame_ages(now_s), settings.control_rate_hz,
            camera_offsets=self._stamps.offsets(),
            offset_warn_s=self.get_parameter("camera_clock_offset_warn_s").value,
            qos_events=self._qos_events.counts(), new_qos_events=qos_total - self._qos_reported,
            stamp=now_msg, new_drops=new_drops, camera_required={c.slot: c.required for c in settings.cameras},
            input_rates=rates, actions_paused=self._commands.actions_paused,
            withheld_chunks=self._commands.withheld_chunks)
        self._qos_reported = qos_total
        diagnostics.status[0].values.append(KeyValue(key="speech_text_withheld",
                                                     value=str(self._speech_text_withheld)))
        diagnostics.status.extend(self._topic_statuses(settings))
        self._diagnostics_pub.publish(diagnostics)


    def _topic_statuses(self, settings: NodeSettings) -> list:
        """One ``<node>: <topic> topic status`` per input topic (diagnostics.py's FrequencyStatus). The
        acceptable minimum is 1 / ``staleness_limit_s``: an input slower than that leaves cycles without a
        fresh one (skipped); there is no maximum (a faster input only replaces the stored one sooner)."""
        node_name = self.get_fully_qualified_name()
        statuses = []
        min_hz = 1.0 / self.get_parameter("staleness_limit_s").value
        for frequency, topic, required in self._frequencies.values():
            name = f"{node_name}: {topic} topic status"
            statuses.append(frequency.status(name, settings.model_id, min_hz, required=required) if self._active
                            else inactive_topic_status(name, settings.model_id, self._lifecycle_state))
        return statuses


def _tag(output) -> _ObservationTag:
    """The node's tag on an engine output (ActionChunk, TextEvent, MemoryEntry): the tag of the observation
    it came from, as the engine handed it back."""
    return _NO_OBSERVATION if output.tag is None else output.tag
