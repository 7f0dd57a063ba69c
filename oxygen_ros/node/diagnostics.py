"""Engine and input health: ``~/status`` (oxygen_ros/EngineStatus) and ``/diagnostics``.

:class:`StatusTracker` is fed by the control-cycle thread (one :meth:`StatusTracker.record_cycle` per
cycle, one :meth:`StatusTracker.record_skip` per cycle without an observation) and read by the status
timer on the executor thread (:meth:`StatusTracker.window`). Rates are per wall-clock second over the
last status period (inference is compute-bound: wall time is what matters for throughput).

Output and time events (:data:`OUTPUT_EVENTS`, :meth:`StatusTracker.record_event`) are counted since
activation and per status period; the period's counts set the ``/diagnostics`` level.

Per input topic (each camera, the joint states) :class:`FrequencyStatus` gives one ``/diagnostics`` status
``<node>: <topic> topic status`` with the conventions of diagnostic_updater's FrequencyStatus (ros/diagnostics):
the same keys, a window of the last ``window_size`` status periods, the acceptable band widened by
``tolerance``. diagnostic_updater is not used because no Python distribution of it installs in this
environment (the ROS Kilted wheels on PyPI have no ``ros-diagnostic-updater``; ``pip download`` finds none),
and the node must run from its pinned wheels alone; the conventions are implemented here instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from oxygen_ros.msg import EngineStatus

from oxygen_ros.engine.metrics import CycleRecord


# Output and time events: EngineStatus field names. ERROR_EVENTS make the engine status ERROR in a period
# in which they happened (something non-finite was computed), the others WARN.
OUTPUT_EVENTS = ("non_finite_actions", "limited_actions", "expired_chunks", "expired_trajectories",
                 "non_finite_embeddings", "clock_jumps", "stamp_jumps")
ERROR_EVENTS = ("non_finite_actions", "non_finite_embeddings")


@dataclass
class StatusWindow:
    """Figures of one status period plus running totals since activation."""

    period_s: float = 0.0
    chunks: int = 0
    frame_latency_sum_s: float = 0.0
    action_latency_sum_s: float = 0.0
    tokens: int = 0
    skipped: int = 0
    last_skip_reason: str = ""
    errors: int = 0
    last_error: str = ""
    frames_total: int = 0
    deadline_misses_total: int = 0
    overloaded: int = 0
    overloaded_total: int = 0
    dropped_requests_total: int = 0
    pool_peak_bytes: int = 0
    active_requests: int = 0
    waiting_requests: int = 0
    events: dict[str, int] = field(default_factory=dict)         # OUTPUT_EVENTS in this period
    events_total: dict[str, int] = field(default_factory=dict)   # OUTPUT_EVENTS since activation
    last_event: str = ""


class StatusTracker:
    """Thread-safe aggregation of cycle records between two status publications."""

    def __init__(self):
        self._lock = threading.Lock()
        self._current = StatusWindow()
        self._window_start = time.perf_counter()

    def reset(self) -> None:
        """Start from zero (on activate)."""
        with self._lock:
            self._current = StatusWindow()
            self._window_start = time.perf_counter()

    def record_cycle(self, record: CycleRecord, dropped_requests: int, pool_used_bytes: int, active: int,
                     waiting: int) -> None:
        """Account one control cycle that published a chunk."""
        with self._lock:
            w = self._current
            w.chunks += 1
            w.frame_latency_sum_s += record.frame_latency_s
            w.action_latency_sum_s += record.action_latency_s
            w.tokens += record.generated_tokens
            w.frames_total += 1
            w.deadline_misses_total += int(record.deadline_missed)
            w.overloaded += int(record.overloaded)
            w.overloaded_total += int(record.overloaded)
            w.dropped_requests_total += dropped_requests
            w.pool_peak_bytes = max(w.pool_peak_bytes, record.pool_used_bytes, pool_used_bytes)
            w.active_requests, w.waiting_requests = active, waiting

    def record_skip(self, reason: str) -> None:
        """Account a cycle that had no usable observation."""
        with self._lock:
            self._current.skipped += 1
            self._current.last_skip_reason = reason

    def record_error(self, error: str) -> None:
        """Account a cycle that failed in the engine."""
        with self._lock:
            self._current.errors += 1
            self._current.last_error = error

    def record_event(self, event: str, detail: str) -> None:
        """Count one output or time event (one of :data:`OUTPUT_EVENTS`); ``detail`` says what happened."""
        if event not in OUTPUT_EVENTS:
            raise ValueError(f"unknown event {event!r}; one of {OUTPUT_EVENTS}")
        with self._lock:
            w = self._current
            w.events[event] = w.events.get(event, 0) + 1
            w.events_total[event] = w.events_total.get(event, 0) + 1
            w.last_event = f"{event}: {detail}"

    def totals(self) -> dict[str, int]:
        """:data:`OUTPUT_EVENTS` counted since activation (0 for those that never happened)."""
        with self._lock:
            return {event: self._current.events_total.get(event, 0) for event in OUTPUT_EVENTS}

    def window(self) -> StatusWindow:
        """The figures since the previous call; the running totals carry over."""
        now = time.perf_counter()
        with self._lock:
            done = self._current
            done.period_s = now - self._window_start
            self._current = StatusWindow(
                frames_total=done.frames_total, deadline_misses_total=done.deadline_misses_total,
                overloaded_total=done.overloaded_total,
                dropped_requests_total=done.dropped_requests_total, pool_peak_bytes=done.pool_peak_bytes,
                active_requests=done.active_requests, waiting_requests=done.waiting_requests,
                events_total=dict(done.events_total))
            self._window_start = now
        return done


class FrequencyStatus:
    """Message rate of one input topic over a sliding window, as diagnostic_updater's FrequencyStatus
    reports it (keys ``Events in window``, ``Events since startup``, ``Duration of window (s)``, ``Actual
    frequency (Hz)``, ``Minimum acceptable frequency (Hz)``, ``Maximum acceptable frequency (Hz)``).

    :meth:`tick` counts one message (any thread); :meth:`status` (once per status period) closes a period:
    the window spans the last ``window_size`` periods (fewer right after :meth:`clear`), measured on the
    steady clock (``clock``, seconds; a paused ``/clock`` must not stretch or stop the window).

    Levels: OK "Desired frequency met" inside ``[min_hz * (1 - tolerance), max_hz * (1 + tolerance)]``;
    WARN "Frequency too low." / "Frequency too high." outside it and WARN "No events recorded." when the
    window saw no message (diagnostic_updater makes the last one ERROR; here the engine status already
    reports the consequence, skipped cycles, and a stopped camera is a degraded input the node survives).
    An optional input (``required`` False) without messages is OK with a note (the model masks it).

    Args:
        window_size: status periods in the window (diagnostic_updater's default 5).
        tolerance: relative widening of the acceptable band (default 0.1).
        clock: seconds of a monotonic clock (default :func:`time.monotonic`).
    """

    def __init__(self, window_size: int = 5, tolerance: float = 0.1, clock=time.monotonic):
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self._window_size = window_size
        self._tolerance = tolerance
        self._clock = clock
        self._lock = threading.Lock()
        self._count = 0
        self._history: list[tuple[float, int]] = []
        self.clear()

    def clear(self) -> None:
        """Start a new window (on activation); the count since startup carries on."""
        with self._lock:
            self._history = [(self._clock(), self._count)]

    def tick(self) -> None:
        """Count one message."""
        with self._lock:
            self._count += 1

    def status(self, name: str, hardware_id: str, min_hz: float, max_hz: float = float("inf"),
               required: bool = True) -> DiagnosticStatus:
        """Close the current period and report the window (see the class docstring).

        Args:
            name: the status name (``<node>: <topic> topic status``).
            hardware_id: REP-107's hardware id.
            min_hz, max_hz: the acceptable frequency before the tolerance [Hz]; 0 / inf: no bound.
            required: False for an optional input (no message = OK with a note).
        """
        now = self._clock()
        with self._lock:
            count = self._count
            start, start_count = self._history[0]
            self._history.append((now, count))
            if len(self._history) > self._window_size:
                self._history.pop(0)
        events = count - start_count
        duration = now - start
        frequency = events / duration if duration > 0 else 0.0
        low = min_hz * (1.0 - self._tolerance)
        high = max_hz * (1.0 + self._tolerance)
        status = DiagnosticStatus(name=name, hardware_id=hardware_id)
        if events == 0:
            status.level = DiagnosticStatus.OK if not required else DiagnosticStatus.WARN
            status.message = "No events recorded." + ("" if required else " (optional input: masked)")
        elif frequency < low:
            status.level, status.message = DiagnosticStatus.WARN, "Frequency too low."
        elif frequency > high:
            status.level, status.message = DiagnosticStatus.WARN, "Frequency too high."
        else:
            status.level, status.message = DiagnosticStatus.OK, "Desired frequency met"
        values = [("Events in window", str(events)), ("Events since startup", str(count)),
                  ("Duration of window (s)", f"{duration:.6f}"), ("Actual frequency (Hz)", f"{frequency:.6f}")]
        if min_hz == max_hz:
            values.append(("Target frequency (Hz)", f"{min_hz:.6f}"))
        if min_hz > 0:
            values.append(("Minimum acceptable frequency (Hz)", f"{low:.6f}"))
        if high != float("inf"):
            values.append(("Maximum acceptable frequency (Hz)", f"{high:.6f}"))
        status.values = [KeyValue(key=key, value=value) for key, value in values]
        return status


def inactive_topic_status(name: str, hardware_id: str, lifecycle_state: str) -> DiagnosticStatus:
    """A topic status while the node is not active: OK, the state as message (nothing is measured)."""
    return DiagnosticStatus(name=name, hardware_id=hardware_id, level=DiagnosticStatus.OK,
                            message=f"{lifecycle_state}: not measured",
                            values=[KeyValue(key="lifecycle_state", value=lifecycle_state)])


def engine_status_msg(w: StatusWindow, stamp: Time, horizon: int, dropped_frames: int, pool_used_bytes: int,
                      pool_capacity_bytes: int, camera_clock_offset: float | None = None,
                      incompatible_qos: int = 0, dropped_joint_states: int = 0,
                      dropped_instructions: int = 0, control_rate_hz: float = 0.0,
                      control_rate_changes: int = 0) -> EngineStatus:
    """``oxygen_ros/EngineStatus`` of one status window (see msg/EngineStatus.msg for units).

    Args:
        camera_clock_offset: node clock minus header stamp at receipt, largest over the cameras [s];
            None (sent as 0) when no camera has sent a non-zero stamp.
        incompatible_qos: incompatible-QoS events on the node's endpoints since configure.
        dropped_frames, dropped_joint_states, dropped_instructions: drops since activation per input kind
            (camera frames only in ``dropped_frames``).
        control_rate_hz, control_rate_changes: the control rate now [Hz] and its changes since activation
            (``oxygen_ros/engine/rate.py``).
    """
    msg = EngineStatus()
    msg.header.stamp = stamp
    msg.chunk_rate = w.chunks / w.period_s if w.period_s > 0 else 0.0
    # Actions actually delivered per second over the period (H per published chunk), not the capacity
    # H / mean latency (which says how fast the engine could go, not what the robot received).
    msg.action_rate = msg.chunk_rate * horizon
    msg.cycle_latency_mean = w.action_latency_sum_s / w.chunks if w.chunks else 0.0
    msg.tokens_per_second = w.tokens / w.period_s if w.period_s > 0 else 0.0
    msg.frames = w.frames_total
    msg.deadline_misses = w.deadline_misses_total
    msg.overloaded = w.overloaded > 0
    msg.overloaded_cycles = w.overloaded_total
    msg.dropped_frames = dropped_frames
    msg.dropped_joint_states = dropped_joint_states
    msg.dropped_instructions = dropped_instructions
    msg.dropped_requests = w.dropped_requests_total
    msg.active_language_requests = w.active_requests
    msg.waiting_language_requests = w.waiting_requests
    msg.kv_pool_used_bytes = pool_used_bytes
    msg.kv_pool_peak_bytes = max(w.pool_peak_bytes, pool_used_bytes)
    msg.kv_pool_capacity_bytes = pool_capacity_bytes
    for event in OUTPUT_EVENTS:
        setattr(msg, event, w.events_total.get(event, 0))
    msg.camera_clock_offset = 0.0 if camera_clock_offset is None else float(camera_clock_offset)
    msg.incompatible_qos = incompatible_qos
    msg.control_rate = float(control_rate_hz)
    msg.control_rate_changes = control_rate_changes
    return msg


def diagnostic_array(node_name: str, hardware_id: str, lifecycle_state: str, status: EngineStatus | None,
                     w: StatusWindow | None, drops: dict[str, int], camera_ages: dict[str, float | None],
                     target_rate_hz: float, camera_offsets: dict[str, float] | None = None,
                     offset_warn_s: float = float("inf"), qos_events: dict[str, int] | None = None,
                     new_qos_events: int = 0, stamp: Time | None = None, new_drops: dict[str, int] | None = None,
                     camera_required: dict[str, bool] | None = None, input_rates: dict[str, float] | None = None,
                     actions_paused: bool = False, withheld_chunks: int = 0) -> DiagnosticArray:
    """``/diagnostics``: one status for the engine, one for the inputs (REP-107 style: ``hardware_id``, key
    values with units, the message naming every reason for a level above OK).

    Every level is judged on the last status period only, so it returns to OK once the cause stops.
    Engine: OK with message ``inactive`` while configured but not active (a deliberate state, not a
    fault); ERROR when a cycle failed, or a non-finite action chunk or memory embedding was withheld in
    the period; WARN when cycles were skipped (no usable observation), an output was clamped, withheld or
    expired, a clock or stamp jumped back, the chunk rate is below half the target, or the engine was
    overloaded (language ran on its guaranteed minimum). Paused actions (``~/pause_actions``) are noted
    in the message and the values (``actions_paused``, ``withheld_chunks``) without changing the level.
    Inputs: WARN when inputs were dropped in the period (``new_drops``; ``drops`` are the totals since
    activation, listed as values), a required camera has no frame yet, a camera's clock offset
    (``camera_offsets``: node clock minus header stamp at receipt [s]) exceeds ``offset_warn_s``, or new
    incompatible-QoS events (``qos_events``: counts per endpoint since configure; ``new_qos_events`` of
    them since the previous publication) were reported. An optional camera (``camera_required`` False)
    without frames is OK, with a note. ``input_rates`` [Hz] (messages received per second over the
    period, per input: ``camera <slot>``, ``joint_states``) are listed as ``<input> rate [Hz]``.

    Args:
        stamp: the header stamp (the node clock now); default the EngineStatus's, else zero.
        new_drops: drops by reason in the period; None = all of ``drops``.
        camera_required: per camera slot; default every camera required.
    """
    camera_offsets = camera_offsets or {}
    qos_events = qos_events or {}
    new_drops = drops if new_drops is None else {reason: n for reason, n in new_drops.items() if n}
    camera_required = camera_required or {}
    input_rates = input_rates or {}
    array = DiagnosticArray()
    if stamp is None:
        stamp = status.header.stamp if status is not None else Time()
    array.header.stamp = stamp

    engine = DiagnosticStatus(name=f"{node_name}: engine", hardware_id=hardware_id)
    paused = f"actions paused (~/pause_actions): {withheld_chunks} action chunks withheld" if actions_paused else ""
    if status is None or w is None:
        engine.level = DiagnosticStatus.OK
        engine.message = "inactive" if lifecycle_state == "inactive" else f"not active ({lifecycle_state})"
    else:
        errors = {event: w.events[event] for event in ERROR_EVENTS if w.events.get(event)}
        warnings = []
        if w.events:
            warnings.append(f"output / time events {w.events}: {w.last_event}")
        if w.skipped:
            warnings.append(f"{w.skipped} cycles skipped: {w.last_skip_reason}")
        if status.chunk_rate < 0.5 * target_rate_hz:
            warnings.append(f"chunk rate {status.chunk_rate:.2f} Hz below half the target "
                            f"{target_rate_hz:.2f} Hz")
        if w.overloaded:
            warnings.append(f"overloaded: {w.overloaded} of {w.chunks} cycles had no slack for "
                            "language, which runs on its guaranteed minimum (slower, not stopped)")
        if w.errors:
            engine.level, engine.message = DiagnosticStatus.ERROR, f"{w.errors} cycles failed: {w.last_error}"
        elif errors:
            engine.level, engine.message = DiagnosticStatus.ERROR, \
                f"withheld non-finite outputs {errors}: {w.last_event}"
        elif warnings:
            engine.level, engine.message = DiagnosticStatus.WARN, "; ".join(warnings)
        else:
            engine.level, engine.message = DiagnosticStatus.OK, "running"
        for slot in EngineStatus.get_fields_and_field_types():
            if slot != "header":
                engine.values.append(KeyValue(key=slot, value=f"{getattr(status, slot):.6g}"
                                              if isinstance(getattr(status, slot), float)
                                              else str(getattr(status, slot))))
        engine.values.append(KeyValue(key="skipped_cycles", value=str(w.skipped)))
    if paused:
        engine.message += f"; {paused}"
    engine.values.append(KeyValue(key="lifecycle_state", value=lifecycle_state))
    engine.values.append(KeyValue(key="actions_paused", value=str(actions_paused).lower()))
    engine.values.append(KeyValue(key="withheld_chunks", value=str(withheld_chunks)))

    inputs = DiagnosticStatus(name=f"{node_name}: inputs", hardware_id=hardware_id)
    missing = [slot for slot, age in camera_ages.items() if age is None]
    missing_required = [slot for slot in missing if camera_required.get(slot, True)]
    missing_optional = [slot for slot in missing if not camera_required.get(slot, True)]
    offset = {slot: value for slot, value in camera_offsets.items() if abs(value) > offset_warn_s}
    warnings = []    # every reason for WARN, in the message
    notes = []       # OK, but worth saying
    if new_drops:
        warnings.append(f"{sum(new_drops.values())} inputs dropped in the last period: "
                        + ", ".join(f"{reason} {n}" for reason, n in sorted(new_drops.items())))
    if new_qos_events:
        warnings.append(f"{new_qos_events} incompatible-QoS events: {sorted(qos_events)}")
    if offset:
        warnings.append("camera clock offset (node clock - header stamp) "
                        + ", ".join(f"{slot} {value:+.3f} s" for slot, value in offset.items())
                        + f" beyond {offset_warn_s:g} s: observation-stamped outputs expire; synchronise the clocks")
    if status is not None:
        if missing_required:
            warnings.append(f"no frame yet from required camera(s) {missing_required}")
        if missing_optional:
            notes.append(f"optional camera(s) {missing_optional} absent (masked)")
    elif lifecycle_state != "active":
        notes.append(f"{lifecycle_state}: inputs not used")
    inputs.level = DiagnosticStatus.WARN if warnings else DiagnosticStatus.OK
    inputs.message = "; ".join(warnings + notes) or "ok"
    for slot, age in camera_ages.items():
        inputs.values.append(KeyValue(key=f"camera {slot} age [s]", value="none" if age is None else f"{age:.3f}"))
    for name, rate in input_rates.items():
        inputs.values.append(KeyValue(key=f"{name} rate [Hz]", value=f"{rate:.3f}"))
    for slot, value in camera_offsets.items():
        inputs.values.append(KeyValue(key=f"camera {slot} clock offset [s]", value=f"{value:.3f}"))
    for reason, count in sorted(drops.items()):
        inputs.values.append(KeyValue(key=f"dropped {reason}", value=str(count)))
    for endpoint, count in sorted(qos_events.items()):
        inputs.values.append(KeyValue(key=f"incompatible QoS {endpoint}", value=str(count)))
    array.status = [engine, inputs]
    return array
