"""The demo's control rate, chosen from the cycle cost measured at start (``make demo``, docs/demo.md).

On a shared 2-core CPU the node's cycle (encode, prefill, denoise, the language prefills due, the
scheduler's guaranteed decode steps) can cost more than the configured period, and every cycle then ends
past its deadline. So the demo first runs ``--calibration-cycles`` cycles at the configured rate with the
simulator rendering beside the node, takes a high quantile of their cost, and runs at the highest rate on a
``step_hz`` grid whose period is at least that cost times a headroom, never above the configured rate.

Pure functions of the engine's per-cycle records (``CycleRecord`` as dicts), no ROS: tested without
timing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

CALIBRATION_CYCLES = 16    # measured cycles (at 4 Hz about 4-6 s: several speech and memory requests among them)
SKIPPED_CYCLES = 2         # the first cycles after activation (first prefills, page faults) are not measured
HEADROOM = 1.5             # period >= cost x headroom: renders landing on a cycle, the machine's other load
QUANTILE = 0.9             # of the measured cycle costs
STEP_HZ = 0.5              # rates are multiples of this (0.5, 1, 1.5, ... Hz)


def cycle_cost_s(record: Mapping, min_decode_steps: int = 1) -> float:
    """What one control cycle costs without the decode steps it took only because there was slack [s].

    The deadline scheduler fills a cycle's slack with decode steps, so a cycle's wall time grows with the
    period; the cost that sets the period is the rest (``frame_latency_s - decode_s``: observation,
    encode, prefills, denoise, bookkeeping) plus the ``min_decode_steps`` steps it takes even without slack
    (``min_decode_steps_per_cycle``), at this cycle's mean step cost.

    Args:
        record: a ``CycleRecord`` as a dict (``frame_latency_s``, ``decode_s``, ``decode_steps`` in s / steps).
        min_decode_steps: the engine's ``min_decode_steps_per_cycle`` (>= 0).

    Raises:
        ValueError: a negative or non-finite time, or ``min_decode_steps`` < 0.
    """
    if min_decode_steps < 0:
        raise ValueError(f"min_decode_steps must be >= 0, got {min_decode_steps}")
    frame, decode, steps = float(record["frame_latency_s"]), float(record["decode_s"]), int(record["decode_steps"])
    if not (math.isfinite(frame) and math.isfinite(decode)) or frame < 0 or decode < 0:
        raise ValueError(f"cycle times must be finite and >= 0, got frame {frame}, decode {decode}")
    step = decode / steps if steps > 0 else 0.0
    return max(0.0, frame - decode) + min(min_decode_steps, steps) * step


@dataclass(frozen=True)
class RateChoice:
    """The control rate the demo runs at and how it was chosen (``control_rate.json`` in the run directory).

    Attributes:
        configured_hz: the rate asked for (``--control-rate``).
        chosen_hz: the rate run.
        calibrated: False when calibration was off or did not finish (then ``chosen_hz == configured_hz``).
        cycles: cycles measured.
        cost_s: the ``quantile`` of their cost [s] (None when not calibrated).
        quantile, headroom, step_hz: the rule's settings.
    """

    configured_hz: float
    chosen_hz: float
    calibrated: bool
    cycles: int = 0
    cost_s: float | None = None
    quantile: float = QUANTILE
    headroom: float = HEADROOM
    step_hz: float = STEP_HZ

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the summary, e.g. ``2.5 Hz (chosen from 16 calibration cycles: p90 cost 250 ms x 1.5
        headroom; asked 4 Hz)``."""
        if not self.calibrated:
            return f"{self.chosen_hz:g} Hz (as configured; no calibration)"
        return (f"{self.chosen_hz:g} Hz (chosen from {self.cycles} calibration cycles: p{100 * self.quantile:g} "
                f"cost {1e3 * self.cost_s:.0f} ms x {self.headroom:g} headroom; asked {self.configured_hz:g} Hz)")


def choose_rate(costs_s: Sequence[float], configured_hz: float, quantile: float = QUANTILE,
                headroom: float = HEADROOM, step_hz: float = STEP_HZ) -> RateChoice:
    """The highest multiple of ``step_hz`` whose period is at least ``headroom`` x the ``quantile`` of
    ``costs_s``, capped at ``configured_hz``; at least ``step_hz`` (or ``configured_hz`` if lower) when
    even that period is too short (the demo then runs overloaded, and says so through its misses).

    Raises:
        ValueError: no cost, a negative or non-finite cost, ``configured_hz`` or ``step_hz`` not > 0,
            ``headroom`` < 1, ``quantile`` outside (0, 1].
    """
    if not costs_s:
        raise ValueError("no cycle cost measured")
    costs = np.asarray(costs_s, dtype=np.float64)
    if not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(f"cycle costs must be finite and >= 0, got {list(costs_s)}")
    if not (configured_hz > 0 and step_hz > 0):
        raise ValueError(f"configured_hz and step_hz must be > 0, got {configured_hz}, {step_hz}")
    if not headroom >= 1.0:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    cost = float(np.quantile(costs, quantile))
    fits_hz = math.inf if cost == 0 else 1.0 / (cost * headroom)
    # A small tolerance so that a rate exactly on the grid is not lost to floating point.
    on_grid = math.floor(fits_hz / step_hz + 1e-9) * step_hz if math.isfinite(fits_hz) else math.inf
    chosen = min(configured_hz, max(on_grid, step_hz))
    return RateChoice(configured_hz=configured_hz, chosen_hz=chosen, calibrated=True, cycles=len(costs),
                      cost_s=cost, quantile=quantile, headroom=headroom, step_hz=step_hz)


def measured_costs(records: Iterable[Mapping], min_decode_steps: int = 1,
                   skip: int = SKIPPED_CYCLES) -> list[float]:
    """:func:`cycle_cost_s` of ``records`` in seq order, the first ``skip`` left out."""
    ordered = sorted(records, key=lambda r: r["seq"])
    return [cycle_cost_s(r, min_decode_steps) for r in ordered[skip:]]


def deadline_misses(records: Iterable[Mapping]) -> tuple[int, int]:
    """``(cycles past their deadline, cycles)`` of the records."""
    records = list(records)
    return sum(bool(r["deadline_missed"]) for r in records), len(records)
