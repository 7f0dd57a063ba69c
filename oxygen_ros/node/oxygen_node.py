"""``oxygen_node``: the managed (lifecycle) ROS 2 node that runs a π0.5 / π0 VLA with the unified
KV-cache engine (docs/node.md). One job per class:

    node/lifecycle.py        ManagedNode: the transitions and their hooks, autostart, the parameter lock
    node/topics.py           TopicBridge: publishers, subscriptions with their QoS and callbacks, timers
                             (the topic table is its module docstring)
    node/control_cycle.py    ControlCycle: the control-cycle thread
    node/action_output.py    ActionOutput: one decision per action chunk (publish, clamp, withhold, why)
    node/language_output.py  LanguageOutput: ~/speech, ~/speech_text, ~/memory
    node/memory_service.py   MemoryService: the memory entries' pose, their store, ~/query_memory
    this module              OxygenNode: configure (settings, engine, warm-up), activation, time, status

Lifecycle: configure reads the parameters, loads the model, builds the engine (allocates the KV pool) and
creates publishers and subscriptions; any failure returns FAILURE with the reason logged and leaves nothing
loaded. activate enables the lifecycle publishers and starts the control-cycle thread. deactivate stops the
thread, cancels every language request in flight and publishes its final Speech (STATUS_CANCELLED); no KV
page stays held. cleanup frees the engine, the model and every ROS entity created by configure; shutdown,
from any state, does what deactivate and cleanup do. With ``autostart`` (default true) the node drives
configure → activate itself.

Threads: subscription callbacks (executor) only convert and store the latest inputs; one control-cycle
thread runs the engine at the control rate (wall clock: ``control_rate_hz``, or what the cycle cost allows in
adaptive ``control_rate_mode``), and publishes the action chunk as soon as it
is ready, then the speech and memory outputs of the language work done in the cycle's slack. The
executor never waits for inference. Lifecycle state queries and the parameter services (reads and changes) are
in a callback group of their own, and so are the ask / command services (oxygen_ros/node/commands.py): the
``oxygen_node`` executable runs lifecycle transitions on a worker thread and every other callback on its
spinning thread (oxygen_ros/node/executor.py), so they answer while configure loads the model (a configure-time
parameter is then refused with the reason, a dynamic one accepted).

Also: duplicate publishers of the command topics (node/command_conflicts.py), time checks
(node/time_checks.py: backwards jumps counted; nothing runs before the clock starts), ~/ask and the
command services (node/commands.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

import numpy as np
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import KeyValue

from oxygen_ros.engine import ActionChunk
from oxygen_ros.engine.engine import RobotEngine
from oxygen_ros.node.action_output import ActionOutput
from oxygen_ros.node.command_conflicts import CommandConflicts
from oxygen_ros.node.control_cycle import ControlCycle, output_tag
from oxygen_ros.node.commands import Commands
from oxygen_ros.node.diagnostics import StatusTracker, diagnostic_array, engine_status_msg, inactive_topic_status
from oxygen_ros.node.inputs import DropCounter, InputStore, is_blank
from oxygen_ros.node.language_output import LanguageOutput
from oxygen_ros.node.lifecycle import ManagedNode
from oxygen_ros.node.memory_service import check_store
from oxygen_ros.node.model_loading import build_engine, warm_up
from oxygen_ros.node.output_checks import all_finite
from oxygen_ros.node.parameters import (NodeSettings, check_dynamic_change, declare_parameters, parameter_values,
                                        settings_from_values)
from oxygen_ros.node.time_checks import ClockWatch, StampWatch
from oxygen_ros.node.topics import TopicBridge

class OxygenNode(ManagedNode):
    """The oxygen_ros lifecycle node (see the module docstring for lifecycle, threads and topics).

    Args:
        node_name: the node's name (default ``oxygen_node``).
        engine_builder: builds the engine (a :class:`~oxygen_ros.engine.engine.RobotEngine`) from the
            configure step's settings (default :func:`oxygen_ros.node.model_loading.build_engine`: load the
            model, build an engine); the fleet node (``oxygen_ros/node/fleet_node.py``) gives each robot's
            node a client of its shared engine instead. Raises as that function.
        **kwargs: forwarded to :class:`rclpy.lifecycle.LifecycleNode` (``context``, ``namespace``,
            ``parameter_overrides``, ...), so several nodes can share one process and executor.

    Drive transitions through the lifecycle services (``<node>/change_state``) or from the thread that
    spins the node's executor: transitions and the status timer must not run concurrently.
    """

    def __init__(self, node_name: str = "oxygen_node", engine_builder=None, **kwargs):
        super().__init__(node_name, **kwargs)
        self._engine_builder = engine_builder
        self._settings: NodeSettings | None = None
        self._engine: RobotEngine | None = None
        self._inputs: InputStore | None = None
        self._topics: TopicBridge | None = None
        self._actions: ActionOutput | None = None
        self._language: LanguageOutput | None = None
        self._drops = DropCounter(self.get_logger().warning)
        # drops since activation per input kind (EngineStatus dropped_frames / _joint_states / _instructions)
        self._dropped_by_input = {"frames": 0, "joint_states": 0, "instructions": 0}
        self._dropped_lock = threading.Lock()
        self._skips = DropCounter(self.get_logger().warning, what="skipped cycle")
        self._status = StatusTracker()
        self._cycle: ControlCycle | None = None
        self._active = False
        self._session = ""
        self._cycle_error_warner = DropCounter(self._log_error)
        # output checks and time (see output_checks.py, time_checks.py)
        self._withheld = DropCounter(self._log_error, what="output withheld")
        self._output_warner = DropCounter(self.get_logger().warning, what="output changed")
        self._time_warner = DropCounter(self.get_logger().warning, what="time went backwards")
        self._qos_events = DropCounter(self.get_logger().warning, what="incompatible QoS")
        self._qos_reported = 0
        self._clock_watch = ClockWatch(self._read_clock, self._on_clock_jump)
        self._stamps = StampWatch()
        self._time_restart = threading.Event()
        # diagnostics' period figures: drops reported, when the status was last published
        self._drops_reported: dict[str, int] = {}
        self._status_published_at = time.perf_counter()
        # ~/ask and the command services (node/commands.py) come before the parameters, whose declaration raises
        # for a value of the wrong type or range: the node is then destroyed here, not left to the garbage
        # collector (as the context's last node it would take the DDS participant down inside a collection)
        self._commands = Commands(self)
        self._conflicts = CommandConflicts(self)    # other publishers of ~/action_chunk, ~/joint_trajectory
        try:
            declare_parameters(self)
        except BaseException:
            self.destroy_node()
            raise
        self._start_up(self.get_parameter("autostart").value)

    def _log_error(self, message: str) -> None:
        # Error-level counters log from this line: rclpy refuses two severities from one call site, and
        # DropCounter's warning-level counters log from its own.
        self.get_logger().error(message)

    # ---- what tests, tools and the fleet read -------------------------------------------------

    @property
    def engine(self) -> RobotEngine | None:
        """The engine while configured (tests read its pool occupancy), else None."""
        return self._engine

    def dropped_by_input(self) -> dict[str, int]:
        """Inputs dropped since activation per kind: ``frames`` (camera frames only), ``joint_states``,
        ``instructions`` (as in ~/status)."""
        with self._dropped_lock:
            return dict(self._dropped_by_input)

    def input_drops(self) -> dict[str, int]:
        """Dropped inputs by reason since activation (``unsupported_encoding``, ``joint_state_nan`` ...)."""
        return self._drops.counts()

    def speech_text_withheld(self) -> int:
        """Completed utterances since activation whose text was not published on ``~/speech_text``
        because it had nothing to say (empty, whitespace, control or replacement characters only)."""
        return 0 if self._language is None else self._language.speech_text_withheld

    def skipped_cycles(self) -> int:
        """Control cycles since activation that had no usable observation (no chunk published)."""
        return self._skips.total()

    def failed_cycles(self) -> int:
        """Control cycles that raised since the node started (counted and logged; the node goes on)."""
        return self._cycle_error_warner.total()

    def skip_reasons(self) -> dict[str, int]:
        """Skipped control cycles since activation by reason (``no_instruction``, ``no_observation``,
        ``clock_not_started``, ``clock_paused``, ``no_joint_limits``)."""
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
        topics = self._topics
        return None if topics is None else topics.joint_limits

    @property
    def command_conflicts(self) -> CommandConflicts:
        """Other publishers of the command topics as last seen on the graph (command_conflicts.py)."""
        return self._conflicts

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
        return output_tag(event).stamp

    # ---- lifecycle hooks (lifecycle.py runs the transitions) ----------------------------------

    def _read_parameters(self) -> Mapping[str, Any]:
        return parameter_values(self)

    def _refuse_change(self, parameters, lifecycle_state: str) -> str | None:
        return check_dynamic_change(parameters, lifecycle_state)

    def _load(self, parameters: Mapping[str, Any]):
        """Configure: the settings, the engine and its warm-up cycle; raises on any error, including a warm-up
        action chunk with a non-finite value (the engine is closed first)."""
        start = time.perf_counter()
        settings = settings_from_values(parameters, self.get_logger().info)
        check_store(settings.memory)     # before the model: a store that cannot be opened fails configure
        engine = (self._engine_builder or build_engine)(settings)
        try:
            warm_chunks: list[ActionChunk] = []
            warm_s = warm_up(engine, settings, warm_chunks.append)
            bad = [int(np.sum(~np.isfinite(chunk.actions))) for chunk in warm_chunks if not all_finite(chunk.actions)]
            if bad:
                raise ValueError(f"the warm-up action chunk has {bad[0]} non-finite values of "
                                 f"{warm_chunks[0].actions.size}: the checkpoint or the normalisation "
                                 "statistics produce NaN/inf actions")
        except Exception:
            engine.close()
            raise
        return settings, engine, start, warm_s

    def _setup(self, loaded) -> None:
        """Configure, once loaded: the input store, the topics and the outputs."""
        settings, engine, start, warm_s = loaded
        self._settings, self._engine = settings, engine
        self._inputs = InputStore(settings.cameras, settings.joint_names, settings.default_instruction)
        self._session = f"{int(time.time() * 1e3):x}"
        self._qos_events.reset()
        self._qos_reported = 0
        self._stamps.clear()
        self._topics = TopicBridge(self, settings, self._inputs, self, self._stamps, self._qos_events, self._withheld,
                                   self._publish_status, self._conflicts, self._conflict_policy)
        self._actions = ActionOutput(self, settings, self._topics, self._commands, self._conflicts,
                                     lambda: self._topics.joint_limits, self._now, self._status, self._withheld,
                                     self._output_warner, self._stamps)
        self._language = LanguageOutput(self, self._topics, self._commands, output_tag, self.utterance_id, self._status,
                                        self._withheld)
        self._cycle = ControlCycle(self, settings, engine, self._inputs, self._topics, self._actions, self._language,
                                   self._status, self._skips, self._cycle_error_warner, self._now, self._time_restart,
                                   self._cancel_language_requests)
        pool = engine.pool
        self.get_logger().info(
            f"configured {settings.model_id} in {time.perf_counter() - start:.1f} s (warm-up cycle "
            f"{warm_s:.2f} s): KV pool "
            f"{pool.num_blocks} pages x {pool.bytes_per_block} B, cameras "
            f"{[c.slot for c in settings.cameras]}, control rate {self._cycle.rate.describe()}")

    @property
    def control_rate(self):
        """The :class:`~oxygen_ros.engine.rate.ControlRate` of the current configuration's control cycles (its
        rate now, and in adaptive mode its changes), or None while unconfigured."""
        cycle = self._cycle
        return cycle.rate if cycle is not None else None

    def _conflict_policy(self) -> str:
        return self.get_parameter("command_conflict_policy").value

    def _may_activate(self) -> bool:
        policy = self._conflict_policy()
        conflict = self._conflicts.check(policy)
        if conflict is not None and policy == "refuse":
            self.get_logger().error(f"activate refused (command_conflict_policy refuse): another publisher of the "
                                    f"command topics: {conflict}")
            return False
        return True

    def _start(self) -> None:
        """Activate: counters from zero, then the control-cycle thread."""
        self._inputs.clear()
        self._drops.reset()
        with self._dropped_lock:
            self._dropped_by_input = dict.fromkeys(self._dropped_by_input, 0)
        self._skips.reset()
        self._language.reset()
        self._withheld.reset()
        self._output_warner.reset()
        self._time_warner.reset()
        self._status.reset()
        self._time_restart.clear()
        self._actions.reset()
        self._topics.clear()
        self._drops_reported = {}
        self._status_published_at = time.perf_counter()
        self._active = True
        self._cycle.start()

    def _stop(self) -> None:
        self.stop_acting()

    def _teardown(self) -> None:
        self._release()

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
        if self._actions is not None and self.get_parameter("on_stop_command").value == "hold":
            self._actions.send_hold()

    def wait_for_final_messages(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` [s] until every reliable subscriber acknowledged the final Speech and the
        last command (before the process exits and DDS drops what it has not delivered); False on timeout."""
        return True if self._topics is None else self._topics.wait_for_final_messages(timeout_s)

    def release(self) -> None:
        """Stop the cycle thread and free the engine without publishing (process exit after a signal,
        when the context may already be shut down). Idempotent."""
        self._release()

    def destroy_node(self) -> None:
        """Destroy the node now, with everything it created: stop the control-cycle thread and free the engine
        first (a cycle thread left running would still be inside torch when the interpreter tears down:
        ``terminate called without an active exception``), then the ``~/ask`` action server (a waitable, which
        ``Node.destroy_node`` leaves), the node's own entities, and last the lifecycle state machine
        (:meth:`ManagedNode.destroy_node`). Idempotent."""
        self._release()
        self._commands.destroy()
        super().destroy_node()

    def _release(self) -> None:
        self._stop_cycles()
        self._commands.end_goals("the node released its engine (cleanup, shutdown or exit)")
        if self._topics is not None:
            self._topics.destroy()
        self._topics = None
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        self._settings = None
        self._inputs = None
        self._cycle = None

    def _stop_cycles(self) -> None:
        """Stop the control-cycle thread and wait until it has ended (:meth:`ControlCycle.stop`)."""
        self._active = False
        if self._cycle is not None:
            self._cycle.stop()

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
            self._language.publish(events)
        used = self._engine.pool.num_used
        if used:
            self.get_logger().error(f"{used} KV pages still held after cancelling every language request")

    # ---- inputs and time (the topic bridge's InputSink) ---------------------------------------

    def receiving(self) -> bool:
        """Whether camera frames and joint states are taken now (while active)."""
        return self._active

    def clock_now(self) -> tuple[Time, float]:
        """The node clock now (``Time``, seconds); every read checks for a backwards jump."""
        return self._clock_watch.now()

    _now = clock_now

    def drop_input(self, kind: str, reason: str, message: str) -> None:
        """Count and log one dropped input of ``kind`` (a key of :meth:`dropped_by_input`) for ``reason``."""
        with self._dropped_lock:
            self._dropped_by_input[kind] += 1
        self._drops.drop(reason, message)

    def stamp_went_back(self, topic: str, previous_s: float, stamp_s: float) -> None:
        """A camera's header stamps went back: time triggers and waiting requests restart (next cycle)."""
        self._status.record_event("stamp_jumps", f"{topic}: {previous_s:.3f} s -> {stamp_s:.3f} s")
        self._time_warner.drop("stamp_jump", f"{topic}: header stamps went back from {previous_s:.3f} s to "
                               f"{stamp_s:.3f} s (a bag replayed in a loop?): time triggers and waiting requests "
                               "restart from the new time")
        self._time_restart.set()

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

    def take_instruction(self, text: str) -> tuple[bool, str]:
        """Validate and store an instruction (from the instruction topic or ``~/set_instruction``).

        Returns:
            (taken, what happened): refused when the node is not configured, the text is empty or blank
            (whitespace only) or longer than ``max_instruction_chars`` (counted as a dropped input).
        """
        inputs, settings, engine = self._inputs, self._settings, self._engine
        if inputs is None or settings is None or engine is None:
            return False, f"the node is {self._lifecycle_state}: configure it first"
        limit = self.get_parameter("max_instruction_chars").value
        if len(text) > limit:
            reason = f"instruction of {len(text)} characters exceeds max_instruction_chars {limit}"
            self.drop_input("instructions", "instruction_too_long", f"{reason}; keeping {inputs.instruction!r}")
            return False, reason
        if is_blank(text):
            reason = "empty or blank instruction refused: it gives no task"
            self.drop_input("instructions", "instruction_empty", f"{reason}; keeping {inputs.instruction!r}")
            return False, reason
        if not inputs.store_instruction(text):
            return True, "instruction unchanged"
        self.get_logger().info(f"instruction: {text[:200]!r}")
        # The engine cancels the requests of tasks with cancel_on_new_instruction when the next cycle's
        # observation carries the new instruction.
        return True, "instruction set: the next control cycle uses it"

    # ---- status (executor thread) -------------------------------------------------------------

    def _publish_status(self) -> None:
        settings, engine, inputs = self._settings, self._engine, self._inputs
        if engine is None:
            return
        now_msg, now_s = self._now()
        cycle = self._cycle      # read once: cleanup may clear it on the transition worker
        rate_hz = cycle.rate.hz if cycle is not None else settings.control_rate_hz
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
                                       dropped_instructions=dropped["instructions"],
                                       control_rate_hz=rate_hz,
                                       control_rate_changes=cycle.rate.change_count if cycle is not None else 0)
            self._topics.status.publish(status)
        # the period's figures: inputs received per second and drops since the previous publication
        wall = time.perf_counter()
        period_s = max(wall - self._status_published_at, 1e-9)
        self._status_published_at = wall
        counts = self._topics.take_input_counts()
        names = [f"camera {c.slot}" for c in settings.cameras] + ["joint_states"]
        rates = {name: counts.get(name, 0) / period_s for name in names} if self._active else {}
        drops = self._drops.counts()
        new_drops = {reason: n - self._drops_reported.get(reason, 0) for reason, n in drops.items()}
        self._drops_reported = dict(drops)
        diagnostics = diagnostic_array(
            self.get_fully_qualified_name(), settings.model_id, self._lifecycle_state, status, window,
            drops, inputs.frame_ages(now_s), rate_hz,
            camera_offsets=self._stamps.offsets(),
            offset_warn_s=self.get_parameter("camera_clock_offset_warn_s").value,
            qos_events=self._qos_events.counts(), new_qos_events=qos_total - self._qos_reported,
            stamp=now_msg, new_drops=new_drops, camera_required={c.slot: c.required for c in settings.cameras},
            input_rates=rates, actions_paused=self._commands.actions_paused,
            withheld_chunks=self._commands.withheld_chunks)
        self._qos_reported = qos_total
        diagnostics.status[0].values.append(KeyValue(key="speech_text_withheld",
                                                     value=str(self.speech_text_withheld())))
        diagnostics.status[0].values.extend(self._topics.memory_service.key_values())   # stored, dropped
        self._conflicts.annotate(diagnostics.status[0], self._conflict_policy())
        diagnostics.status.extend(self._topic_statuses(settings))
        self._topics.diagnostics.publish(diagnostics)

    def _topic_statuses(self, settings: NodeSettings) -> list:
        """One ``<node>: <topic> topic status`` per input topic (diagnostics.py's FrequencyStatus). The
        acceptable minimum is 1 / ``staleness_limit_s``: an input slower than that leaves cycles without a
        fresh one (skipped); there is no maximum (a faster input only replaces the stored one sooner)."""
        node_name = self.get_fully_qualified_name()
        statuses = []
        min_hz = 1.0 / self.get_parameter("staleness_limit_s").value
        for frequency, topic, required in self._topics.frequencies.values():
            name = f"{node_name}: {topic} topic status"
            statuses.append(frequency.status(name, settings.model_id, min_hz, required=required) if self._active
                            else inactive_topic_status(name, settings.model_id, self._lifecycle_state))
        return statuses

