"""The control-cycle thread of ``oxygen_node``: at the control rate (wall clock: ``control_rate_hz``, or in
``control_rate_mode`` adaptive the rate the measured cycle cost allows, ``oxygen_ros/engine/rate.py``) it
checks that a cycle can run (an instruction, the node clock started and not paused, joint limits, a fresh observation: else the
cycle is skipped with the reason), runs one engine cycle, hands the action chunk to the action output as
soon as it is ready and the language events of the cycle to the language output, and records the cycle for
~/status. A cycle that raises is counted and logged; the thread goes on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import rclpy
from builtin_interfaces.msg import Time

from oxygen_ros.engine import RequestStatus
from oxygen_ros.engine.engine import RobotEngine
from oxygen_ros.engine.rate import ControlRate, RateChange
from oxygen_ros.node.action_output import ActionOutput
from oxygen_ros.node.diagnostics import StatusTracker
from oxygen_ros.node.inputs import DropCounter, InputStore, is_blank
from oxygen_ros.node.language_output import LanguageOutput
from oxygen_ros.node.parameters import NodeSettings
from oxygen_ros.node.time_checks import clock_started
from oxygen_ros.node.topics import TopicBridge

# Skip reasons that are the expected wait before the first observation since configure (logged at INFO then).
_STARTUP_SKIPS = ("clock_not_started", "no_joint_limits", "no_observation")


@dataclass(frozen=True)
class ObservationTag:
    """The node's :attr:`Observation.tag`, handed back by the engine on every output of the observation:
    what those outputs copy (its header stamp, instruction and cameras used)."""

    stamp: Time
    instruction: str
    camera_slots: tuple[str, ...]


# The tag of outputs no observation started (an asked request cancelled before any cycle took it).
_NO_OBSERVATION = ObservationTag(Time(), "", ())


def output_tag(output) -> ObservationTag:
    """The node's tag on an engine output (ActionChunk, TextEvent, MemoryEntry): the tag of the observation
    it came from, as the engine handed it back."""
    return _NO_OBSERVATION if output.tag is None else output.tag


def log_rate_change(logger, change: RateChange, headroom: float) -> None:
    """Log a change of the adaptive control rate: a drop as a warning, a rise at INFO (``logger``: an rclpy
    logger; each severity has its own call site, which rclpy requires)."""
    text = change.describe(headroom)
    if change.to_hz < change.from_hz:
        logger.warning(text)
    else:
        logger.info(text)


class ControlCycle:
    """The control cycles of one configuration (see the module docstring): :meth:`start` at activate,
    :meth:`stop` at deactivate.

    Args:
        node: the node (its ``staleness_limit_s`` parameter, logger and context).
        settings, engine, inputs, topics: the configuration: its settings, engine, input store and topics
            (joint limits from robot_description).
        actions, language: where the cycle's outputs go.
        status: ~/status; skips, failures: the counters of skipped and failed cycles.
        now: the node clock (``Time``, seconds); time_restart: set when time went back (waiting requests
            restart at the next cycle).
        cancel_language: cancels every language request (ends the decode steps of a cycle in progress).
    """

    def __init__(self, node, settings: NodeSettings, engine: RobotEngine, inputs: InputStore, topics: TopicBridge,
                 actions: ActionOutput, language: LanguageOutput, status: StatusTracker, skips: DropCounter,
                 failures: DropCounter, now: Callable[[], tuple[Time, float]], time_restart: threading.Event,
                 cancel_language: Callable[[], None]):
        self._node = node
        self._settings, self._engine, self._inputs, self._topics = settings, engine, inputs, topics
        self._actions, self._language = actions, language
        self._status, self._skips, self._failures = status, skips, failures
        self._now = now
        self._time_restart = time_restart
        self._cancel_language = cancel_language
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_cycle_clock: tuple[float, int] | None = None
        self._seq = 0    # observations since configure
        self.rate = self._new_rate()

    def _new_rate(self) -> ControlRate:
        engine_config = self._settings.engine
        return ControlRate(engine_config.action, engine_config.min_decode_steps_per_cycle)

    def start(self) -> None:
        """Start the control-cycle thread (an adaptive control rate starts again at ``control_rate_hz``)."""
        self.rate = self._new_rate()
        self._last_cycle_clock = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_cycles, name="oxygen_control_cycle", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the control-cycle thread and wait until it has ended.

        The cycle in progress finishes first (its decode steps end early: the language requests are
        cancelled), so nothing it uses — publishers, engine — is destroyed under it. A cycle is
        bounded (one engine cycle), so this waits without a deadline and logs every 5 s while it does.
        """
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        self._cancel_language()   # ends the decode steps of the cycle in progress early
        thread.join(timeout=5.0)
        while thread.is_alive():
            self._node.get_logger().warning("waiting for the control cycle in progress to end")
            thread.join(timeout=5.0)
        self._thread = None

    def _run_cycles(self) -> None:
        next_start = time.perf_counter()
        while not self._stop.is_set():
            deadline = next_start + self.rate.period_s
            try:
                self._run_one_cycle(deadline)
            except Exception as error:  # one failed cycle must not end the node; it is counted and logged
                if not rclpy.ok(context=self._node.context):
                    return
                self._status.record_error(f"{type(error).__name__}: {error}")
                self._failures.drop("cycle_failed", f"{type(error).__name__}: {error}")
            next_start = deadline
            now = time.perf_counter()
            if next_start < now:    # overran: start the next cycle now, do not try to catch up
                next_start = now
            self._stop.wait(next_start - now)

    def _skip(self, reason: str, detail: str) -> None:
        self._status.record_skip(detail)
        info = self._node.get_logger().info
        if reason == "no_instruction":   # a node may wait long for its task: said once per activation, at INFO
            self._skips.drop(reason, detail, info, once=True)
            return
        if self._seq == 0 and reason in _STARTUP_SKIPS:
            # Before the first observation since configure, waiting for inputs (or the clock) is the expected
            # state, not a fault: logged at INFO (still counted, and on /diagnostics).
            self._skips.drop(reason, f"waiting for the first observation: {detail}", info)
            return
        self._skips.drop(reason, f"no action chunk this cycle: {detail}")
        self._language.publish(self._engine.take_events()[0])    # requests cancelled meanwhile still end

    def _run_one_cycle(self, deadline: float) -> None:
        settings, engine, inputs = self._settings, self._engine, self._inputs
        if is_blank(inputs.instruction):    # nothing moves without a task; every prompt has {instruction}
            self._skip("no_instruction", f"waiting for an instruction on {settings.instruction_topic} or "
                       "~/set_instruction (default_instruction is empty): no action chunk, trajectory or "
                       "language output until one arrives")
            return
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
        topics = self._topics
        if settings.joint_limits_from_robot_description and topics.joint_limits is None:
            error = topics.robot_description_error
            self._skip("no_joint_limits", "no joint limits yet: waiting for robot_description"
                       + (f" ({error})" if error else ""))
            return
        staleness = self._node.get_parameter("staleness_limit_s").value
        ready = inputs.observation(lambda: self._now()[1], staleness, self._seq)
        if isinstance(ready, str):
            self._skip("no_observation", ready)
            return
        self._last_cycle_clock = (now_s, receipts)
        if self._time_restart.is_set():
            self._time_restart.clear()
            self._restart_waiting_requests(ready.observation.stamp)
        self._seq += 1
        ready.observation.tag = ObservationTag(ready.stamp, ready.observation.instruction, ready.camera_slots)
        actions = self._actions

        def on_action(chunk) -> None:
            actions.publish(chunk, output_tag(chunk).stamp)
            # real-time chunking's inference delay: observation stamp -> chunk out, in the node's clock (simulated
            # time under use_sim_time)
            engine.observe_delay(max(0.0, self._now()[1] - chunk.stamp))

        result = engine.run_cycle(ready.observation, deadline, on_action=on_action)
        dropped = sum(1 for e in result.text_events if e.final and e.status == RequestStatus.DROPPED)
        self._language.publish(result.text_events)
        active = engine.active_requests
        self._status.record_cycle(result.record, dropped, engine.pool.used_bytes,
                                  sum(r.status == RequestStatus.RUNNING for r in active),
                                  sum(r.status == RequestStatus.WAITING for r in active))
        change = self.rate.observe(result.record)     # after the outputs: the next cycle's period
        if change is not None:
            log_rate_change(self._node.get_logger(), change, self.rate.headroom)

    def _restart_waiting_requests(self, stamp_s: float) -> None:
        """After a backwards jump of time: waiting language requests triggered by an observation stamped
        after ``stamp_s`` (on the old time base) are cancelled; their wait cannot be measured on the new
        one (``max_wait_s``), and their final Speech goes out with the next cycle."""
        engine = self._engine
        for request in engine.active_requests:
            if request.status == RequestStatus.WAITING and request.stamp > stamp_s:
                engine.cancel(request.request_id)
