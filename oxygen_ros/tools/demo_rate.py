"""The demo's control rate in its summary (``make demo``, docs/demo.md): which rates the recorded cycles ran at.

The demo runs the node with ``control_rate_mode: adaptive`` (``oxygen_ros/engine/rate.py``): the rate starts at
``--control-rate`` and follows the measured cycle cost during the run. At its end the demo writes the node's
rate changes to ``control_rate.json`` (:func:`rate_log`); the summary (``tools/report.py``) joins them with the
recorded cycles' ``seq`` (:func:`cycle_rates`) and prints one line (:func:`describe_rates`): the rates run,
the cycles at each and how many of them missed their deadline.

Pure functions of plain dicts (what the JSON files hold), no ROS: tested without timing.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

from oxygen_ros.engine.rate import ControlRate


def rate_log(rate: ControlRate) -> dict:
    """``control_rate.json`` of a node's :class:`ControlRate`: ``mode`` (fixed / adaptive), ``max_hz``,
    ``min_hz``, ``step_hz``, ``headroom``, ``window`` and ``changes`` (each :class:`~oxygen_ros.engine.rate.RateChange` as a
    dict, oldest first; the newest :data:`~oxygen_ros.engine.rate.CHANGES_KEPT`)."""
    return {"mode": "adaptive" if rate.adaptive else "fixed", "max_hz": rate.max_hz, "min_hz": rate.min_hz,
            "step_hz": rate.step_hz, "headroom": rate.headroom, "window": rate.window,
            "changes": [change.as_dict() for change in rate.changes]}


def cycle_rates(log: Mapping, seqs: Sequence[int]) -> list[float]:
    """The rate [Hz] each cycle of ``seqs`` ran at: the ``to_hz`` of the last change decided by an earlier
    cycle (a change applies from the cycle after the one whose measurement decided it), else ``max_hz`` (the
    rate at the start). Raises KeyError for a log without ``max_hz``."""
    changes = sorted(log.get("changes", []), key=lambda c: c["seq"])
    rates = []
    for seq in seqs:
        hz = log["max_hz"]
        for change in changes:
            if change["seq"] >= seq:
                break
            hz = change["to_hz"]
        rates.append(float(hz))
    return rates


def describe_rates(log: Mapping, cycles: Iterable[Mapping]) -> str:
    """The summary's control-rate line for the recorded ``cycles`` (``CycleRecord`` dicts: ``seq``,
    ``deadline_missed``), e.g. ``adaptive 1.5-4 Hz: 3 Hz in 120 of 180 cycles (2 late), 3.5 Hz in 60 (0 late);
    2 changes (1 down, 1 up)`` (the changes that applied to recorded cycles; ``control_rate.json`` lists every one,
    the settling cycles' included); ``4 Hz (fixed): 180 cycles (0 late)``; the rate alone for a log written by
    another version."""
    cycles = sorted(cycles, key=lambda c: c["seq"])
    if log.get("mode") == "fixed":
        late = sum(bool(c["deadline_missed"]) for c in cycles)
        return f"{log['max_hz']:g} Hz (fixed): {len(cycles)} cycles ({late} late)"
    if "max_hz" not in log:
        return f"{log.get('chosen_hz', 'n/a')} Hz"
    head = f"adaptive {log['min_hz']:g}-{log['max_hz']:g} Hz"
    if not cycles:
        return f"{head}: no cycle recorded"
    first, last = cycles[0]["seq"], cycles[-1]["seq"]
    changes = [c for c in log.get("changes", []) if first <= c["seq"] + 1 <= last]
    rates = cycle_rates(log, [c["seq"] for c in cycles])
    counts, late = Counter(rates), Counter(hz for hz, c in zip(rates, cycles) if c["deadline_missed"])
    ranked = sorted(counts, key=lambda hz: (-counts[hz], -hz))
    parts = [f"{hz:g} Hz in {counts[hz]}" + (f" of {len(cycles)} cycles" if i == 0 else "") + f" ({late[hz]} late)"
             for i, hz in enumerate(ranked)]
    down = sum(c["to_hz"] < c["from_hz"] for c in changes)
    return f"{head}: {', '.join(parts)}; {len(changes)} changes ({down} down, {len(changes) - down} up)"
