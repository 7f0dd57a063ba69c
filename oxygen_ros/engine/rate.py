"""The control rate of one robot's cycles: fixed, or adaptive to the measured cycle cost.

On a shared CPU a control cycle's cost follows what else runs (renders, drivers, other processes) and comes
in bursts, so a rate chosen once — fixed, or from a calibration at start — is either too slow for the quiet
stretches or misses its deadline in the busy ones. In ``adaptive`` mode (:class:`ControlRate`, the action
task's ``control_rate_mode``) the rate follows the cycles' cost while the robot runs:

* a cycle's **cost** (:func:`cycle_cost_s`) is its time without the decode steps it took only because there
  was slack (the deadline scheduler fills the slack, so that part grows with the period), plus the
  ``min_decode_steps_per_cycle`` steps it takes even without slack;
* the rates run are a grid: ``control_rate_min_hz``, then every ``control_rate_step_hz`` above it, and
  ``control_rate_hz`` (the most); a rate *fits* a cost ``c`` when its period is at least
  ``c x control_rate_headroom``;
* **down at once**: after each cycle, when the 90th percentile of the last ``control_rate_window`` costs
  (from :data:`MIN_ESTIMATE_CYCLES` costs on) no longer fits the rate, or the cycle missed its deadline and its
  own cost no longer fits, the rate drops to the fastest grid rate that fits (never below the minimum; there
  the cycles run overloaded and the misses say so);
* **up slowly**: after ``control_rate_window`` cycles at one rate with no deadline missed, when the 90th
  percentile of the window fits the next grid rate, the rate rises by one grid step. The gap between the two
  rules (the estimate must fit the *next* rate to go up, only the *current* one to stay) keeps the rate from
  flapping.

The first :data:`WARMUP_CYCLES` cycles (first prefills, page faults, lazy initialisation) are not measured.
``fixed`` mode always runs ``control_rate_hz``. Pure Python over the engine's :class:`CycleRecord`: no clock
is read here (the caller sleeps the period), so every rule is tested with hand-made records.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from oxygen_ros.engine.config import ActionTaskConfig
from oxygen_ros.engine.metrics import CycleRecord

WARMUP_CYCLES = 2          # first cycles not measured
QUANTILE = 0.9             # of the window's costs
MIN_ESTIMATE_CYCLES = 5    # costs before the quantile is used (before that only a deadline miss lowers the rate)
CHANGES_KEPT = 1000        # most recent rate changes kept (:attr:`ControlRate.changes`)
_TOLERANCE = 1e-9          # a period exactly equal to the needed time fits despite floating point


def _field(record: CycleRecord | Mapping[str, Any], name: str) -> Any:
    return record[name] if isinstance(record, Mapping) else getattr(record, name)


def cycle_cost_s(record: CycleRecord | Mapping[str, Any], min_decode_steps: int = 1) -> float:
    """What one control cycle costs without the decode steps it took only because there was slack [s]:
    ``frame_latency_s - decode_s`` (observation, encode, prefills, denoise, bookkeeping) plus
    ``min(min_decode_steps, decode_steps)`` steps at this cycle's mean step cost.

    Args:
        record: a :class:`CycleRecord` or its ``asdict`` (``frame_latency_s``, ``decode_s`` in s,
            ``decode_steps``).
        min_decode_steps: the engine's ``min_decode_steps_per_cycle`` (>= 0).

    Raises:
        ValueError: a negative or non-finite time, or ``min_decode_steps`` < 0.
    """
    if min_decode_steps < 0:
        raise ValueError(f"min_decode_steps must be >= 0, got {min_decode_steps}")
    frame, decode = float(_field(record, "frame_latency_s")), float(_field(record, "decode_s"))
    steps = int(_field(record, "decode_steps"))
    if not (math.isfinite(frame) and math.isfinite(decode)) or frame < 0 or decode < 0:
        raise ValueError(f"cycle times must be finite and >= 0, got frame {frame}, decode {decode}")
    step = decode / steps if steps > 0 else 0.0
    return max(0.0, frame - decode) + min(min_decode_steps, steps) * step


def rate_grid(low_hz: float, step_hz: float, high_hz: float) -> tuple[float, ...]:
    """The rates an adaptive control rate runs, ascending [Hz]: ``low_hz``, ``low_hz + step_hz``, ... below
    ``high_hz``, then ``high_hz``. Raises ValueError unless ``0 < low_hz <= high_hz`` and ``step_hz > 0``."""
    if not (0 < low_hz <= high_hz and step_hz > 0):
        raise ValueError(f"a rate grid needs 0 < low <= high and step > 0, got {low_hz}, {step_hz}, {high_hz}")
    count = math.floor((high_hz - low_hz) / step_hz + _TOLERANCE)
    rates = [round(low_hz + k * step_hz, 9) for k in range(count + 1)]
    return tuple(r for r in rates if r < high_hz - _TOLERANCE) + (high_hz,)


def automatic_floor_hz(max_hz: float, step_hz: float, chunk_span_s: float) -> float:
    """``control_rate_min_hz: 0``'s floor [Hz]: the lowest multiple of ``step_hz`` whose period is shorter than
    ``chunk_span_s`` (a chunk's H x action_dt_s: slower, the robot would run out of actions between chunks), at most
    ``max_hz``. Raises ValueError unless all three are > 0."""
    if not (max_hz > 0 and step_hz > 0 and chunk_span_s > 0):
        raise ValueError(f"max_hz, step_hz and chunk_span_s must be > 0, got {max_hz}, {step_hz}, {chunk_span_s}")
    k = math.floor(1.0 / (chunk_span_s * step_hz) + _TOLERANCE) + 1      # k x step > 1 / span
    return min(max_hz, round(k * step_hz, 9))


@dataclass(frozen=True)
class RateChange:
    """One change of the control rate.

    Attributes:
        seq: the engine's ``seq`` of the cycle whose measurement decided it (the new rate applies from the
            next cycle).
        from_hz, to_hz: the rates before and after [Hz].
        cost_s: the cost that decided [s]: the window's p90, or the missed cycle's own cost.
        reason: ``cost_over_period`` (the p90 no longer fits), ``deadline_missed`` (the cycle missed and its
            cost no longer fits) or ``cost_fits_faster`` (a window's p90 fits the next rate up).
    """

    seq: int
    from_hz: float
    to_hz: float
    cost_s: float
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self, headroom: float) -> str:
        """One log line, e.g. ``control rate 4 -> 3 Hz: p90 cycle cost 230 ms x 1.25 headroom is over the 250 ms
        period``."""
        cost = f"{1e3 * self.cost_s:.0f} ms x {headroom:g} headroom"
        head = f"control rate {self.from_hz:g} -> {self.to_hz:g} Hz"
        if self.reason == "deadline_missed":
            return f"{head}: cycle {self.seq} missed its deadline, its cost {cost} is over the " \
                   f"{1e3 / self.from_hz:.0f} ms period"
        if self.reason == "cost_over_period":
            return f"{head}: p{100 * QUANTILE:g} cycle cost {cost} is over the {1e3 / self.from_hz:.0f} ms period"
        return f"{head}: p{100 * QUANTILE:g} cycle cost {cost} fits the {1e3 / self.to_hz:.0f} ms period"


class ControlRate:
    """The control rate of one robot's cycles (module docstring): read :attr:`period_s` before each cycle,
    hand each cycle's record to :meth:`observe` after it.

    Args:
        action: the action task's settings (``control_rate_hz``, ``control_rate_mode`` and the adaptive
            mode's ``control_rate_min_hz``, ``control_rate_step_hz``, ``control_rate_headroom``,
            ``control_rate_window``); a ``control_rate_min_hz`` of 0 (automatic, resolved by the node with
            :func:`automatic_floor_hz`) that reaches here unresolved means one ``control_rate_step_hz``.
        min_decode_steps: the engine's ``min_decode_steps_per_cycle`` (what :func:`cycle_cost_s` counts).

    Not thread-safe for writers: one thread observes; others may read :attr:`hz`, :attr:`period_s` and
    :attr:`change_count` (plain attribute reads).
    """

    def __init__(self, action: ActionTaskConfig, min_decode_steps: int = 1):
        if min_decode_steps < 0:
            raise ValueError(f"min_decode_steps must be >= 0, got {min_decode_steps}")
        self.adaptive = action.control_rate_mode == "adaptive"
        self.max_hz = action.control_rate_hz
        # 0 (automatic) is resolved by the node from the chunk's span; without one the floor is one step
        floor = action.control_rate_min_hz or min(action.control_rate_step_hz, action.control_rate_hz)
        self.min_hz = floor if self.adaptive else action.control_rate_hz
        self.headroom = action.control_rate_headroom
        self.window = action.control_rate_window
        self.step_hz = action.control_rate_step_hz
        self.grid = rate_grid(self.min_hz, action.control_rate_step_hz, self.max_hz) if self.adaptive \
            else (self.max_hz,)
        self._min_decode_steps = min_decode_steps
        self._costs: deque[float] = deque(maxlen=self.window)
        self._seen = 0
        self._since_change = 0
        self.hz = self.max_hz
        self.change_count = 0
        self.changes: deque[RateChange] = deque(maxlen=CHANGES_KEPT)

    def describe(self) -> str:
        """The rate's range for a log line: ``adaptive 1.5-4 Hz`` or ``4 Hz``."""
        return f"adaptive {self.min_hz:g}-{self.max_hz:g} Hz" if self.adaptive else f"{self.max_hz:g} Hz"

    @property
    def period_s(self) -> float:
        """The current control period [s]: 1 / :attr:`hz`."""
        return 1.0 / self.hz

    def fitting_hz(self, needed_s: float) -> float:
        """The fastest grid rate whose period is at least ``needed_s`` [s]; the slowest when none is."""
        fits = [r for r in self.grid if 1.0 / r >= needed_s - _TOLERANCE]
        return fits[-1] if fits else self.grid[0]

    def estimate_s(self) -> float | None:
        """The p90 of the recent costs [s]; None before :data:`MIN_ESTIMATE_CYCLES` were measured."""
        if len(self._costs) < min(MIN_ESTIMATE_CYCLES, self.window):
            return None
        return float(np.quantile(np.asarray(self._costs, dtype=np.float64), QUANTILE))

    def observe(self, record: CycleRecord | Mapping[str, Any]) -> RateChange | None:
        """Take one cycle's record (a :class:`CycleRecord` or its dict); returns the change it caused (the new
        rate is :attr:`hz` from now on), or None. Fixed mode never changes. Raises ValueError for a record with
        a negative or non-finite time (:func:`cycle_cost_s`)."""
        if not self.adaptive:
            return None
        self._seen += 1
        if self._seen <= WARMUP_CYCLES:
            return None
        cost = cycle_cost_s(record, self._min_decode_steps)
        self._costs.append(cost)
        self._since_change += 1
        estimate = self.estimate_s()
        missed = bool(_field(record, "deadline_missed"))
        seq = int(_field(record, "seq"))
        if missed:
            self._since_change = 0       # no rise right after a miss, whatever its cause
            if cost * self.headroom > self.period_s + _TOLERANCE:
                # the larger of the cycle's own cost and the p90 decides, and is the one reported
                needed = max(cost, estimate or 0.0)
                lower = self.fitting_hz(needed * self.headroom)
                if lower < self.hz:
                    return self._change(seq, lower, needed,
                                        "deadline_missed" if needed == cost else "cost_over_period")
        if estimate is not None and estimate * self.headroom > self.period_s + _TOLERANCE:
            lower = self.fitting_hz(estimate * self.headroom)
            if lower < self.hz:
                return self._change(seq, lower, estimate, "cost_over_period")
        if estimate is not None and self._since_change >= self.window and len(self._costs) == self.window:
            faster = [r for r in self.grid if r > self.hz]
            if faster and estimate * self.headroom <= 1.0 / faster[0] + _TOLERANCE:
                return self._change(seq, faster[0], estimate, "cost_fits_faster")
        return None

    def _change(self, seq: int, hz: float, cost_s: float, reason: str) -> RateChange:
        change = RateChange(seq=seq, from_hz=self.hz, to_hz=hz, cost_s=cost_s, reason=reason)
        self.hz = hz
        self._since_change = 0
        self.change_count += 1
        self.changes.append(change)
        return change
