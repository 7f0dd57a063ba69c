"""Intra-op CPU threads that follow what the machine has free (the engine's ``intra_op_threads``).

On a shared CPU (a robot computer runs its drivers, controllers and recorder beside the policy; the demo
its simulator) every 2-thread op ends at an OpenMP barrier that waits for a descheduled thread, so a
phase costs a scheduler time slice per op instead of its arithmetic (docs/benchmarks.md, "Roofline").
With ``intra_op_threads: 0`` the engine sets torch's intra-op thread count to the cores the *other*
processes leave free:

* measured from ``/proc/stat`` (the machine's busy CPU time) minus this process's own CPU time
  (``os.times``), over a window: from the engine's construction to its end when that took at least
  :data:`MIN_WINDOW_S` (a node's configure loads a model), then over every control cycle (the window
  from the end of one cycle to the end of the next, where the next cycle's count is chosen);
* ``free = cpus − others' busy cores``; threads = ``floor(free + 1 − ``:data:`REQUIRED_FREE_SHARE```)``
  clamped to ``[1, usable cpus]``: a core counts when at least 75 % of it is free;
* a new count is applied (``torch.set_num_threads``, process-wide) only after :data:`AGREEING_SAMPLES`
  consecutive windows agree on it, so one burst of load does not flip it back and forth;
* re-checked by the cycles' own times: every :data:`PROBE_EVERY` cycles one cycle runs at a neighbouring
  count, and a count whose probes beat the recent cycles' action path by 10 % twice in a row becomes the
  count (so two threads that the free cores would allow but that run slower, e.g. beside a load that comes
  and goes faster than the windows, give way to one, and back);
* what the probes chose is remembered per target: when the free cores allow a target again, the count
  returns to the one the probes chose under it, not to the target (beside a bursty load the target flips
  between 1 and 2 every few seconds, and resetting the count at each flip undid every probe's finding).

``intra_op_threads: n >= 1`` fixes the count at ``n``. On a machine without ``/proc/stat`` (not Linux)
the automatic setting keeps torch's count. Inductor writes the thread count in force at compile time into
the compiled denoising step's loops (``models/cpu_compile.py``); its products and attention follow the
current count.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

_LOG = logging.getLogger(__name__)

# Shortest window (s) a measurement is taken over; shorter ones are left to the next.
MIN_WINDOW_S = 0.1
# Share of a core that must be free for it to count as a thread's.
REQUIRED_FREE_SHARE = 0.75
# Consecutive windows (or winning probes) that must agree on a new count before it is applied.
AGREEING_SAMPLES = 2
# Cycles between probes of a neighbouring count; a probe wins below this share of the recent median.
PROBE_EVERY = 20
PROBE_GAIN = 0.9
# Action-path times kept at the current count, and how many a probe needs to be compared with.
RECENT_CYCLES = 8
MIN_RECENT = 4
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user nice system irq softirq steal (guest time is inside user)


def read_cpu_stat(path: str | Path = "/proc/stat") -> tuple[float, int] | None:
    """``(busy CPU seconds of the whole machine since boot, number of CPUs)`` from a ``/proc/stat``
    file, or None when it cannot be read or parsed."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    total = next((line.split()[1:] for line in lines if line.startswith("cpu ")), None)
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    if total is None or len(total) < 8 or cpus < 1:
        return None
    try:
        busy = sum(int(total[i]) for i in _BUSY_FIELDS)
    except ValueError:
        return None
    return busy / os.sysconf("SC_CLK_TCK"), cpus


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads."""
    t = os.times()
    return t.user + t.system


def threads_for_free_cores(free: float, usable: int) -> int:
    """The thread count for ``free`` cores left by other processes, of ``usable`` this process may run
    on: cores at least :data:`REQUIRED_FREE_SHARE` free, at least 1, at most ``usable``."""
    return max(1, min(usable, math.floor(free + 1.0 - REQUIRED_FREE_SHARE)))


class IntraOpThreads:
    """The engine's intra-op thread count (see the module docstring).

    Two measurements set it when automatic: the free cores (``/proc/stat``, every window) bound it from
    above, the *target*; the cycles' own times choose within that bound: every :data:`PROBE_EVERY`
    cycles one cycle runs at a neighbouring count (one fewer, or one more when below the target), and
    when :data:`AGREEING_SAMPLES` probes in a row of the same count took less than :data:`PROBE_GAIN` of the
    median action-path time of the recent cycles at the current count, that count becomes the current one
    and the count chosen for that target. A new target sets the current count to the count the probes chose
    under it, or to the target itself when they chose none. The probes' wins count per (target, probed count)
    across changes of the target; a probe that loses resets its own.

    Args:
        setting: ``intra_op_threads``: 0 = follow the machine, n >= 1 = exactly n.
        enabled: False (a model off the CPU) leaves torch's count alone.
        stat_path, clock, own_cpu: where the machine's CPU time, the wall clock (s) and this process's CPU
            seconds come from (tests give a file of their own).

    Attributes:
        threads: the count of a normal cycle (a probe cycle runs at another for that cycle only).
        target: the count the free cores allow (the last applied measurement).
        others: the other processes' busy cores in the last window (None before one).
        changes, probes: how often the count was changed, how many probe cycles ran.

    Raises:
        ValueError: ``setting`` < 0.
    """

    def __init__(self, setting: int, enabled: bool = True, stat_path: str | Path = "/proc/stat",
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], float] = own_cpu_seconds):
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
            raise ValueError(f"intra_op_threads must be an int >= 0, got {setting!r}")
        self.setting, self.enabled = setting, enabled
        self._stat_path, self._clock, self._own_cpu = stat_path, clock, own_cpu
        self.others: float | None = None
        self.changes = self.probes = 0
        self._candidate: tuple[int, int] | None = None   # (target, windows that agreed)
        self._times: deque[float] = deque(maxlen=RECENT_CYCLES)
        self._probe: int | None = None                    # the count of the cycle running now, if a probe
        self._wins: dict[tuple[int, int], int] = {}         # (target, probed count) -> probes in a row it won
        self._chosen: dict[int, int] = {}                  # target -> the count the probes chose under it
        self._cycles = 0
        try:
            self.usable = len(os.sched_getaffinity(0))
        except AttributeError:   # not Linux
            self.usable = os.cpu_count() or 1
        if enabled and setting > 0:
            torch.set_num_threads(setting)
        self.threads = self.target = torch.get_num_threads()
        self._last = self._sample()

    @property
    def automatic(self) -> bool:
        """Whether the count follows the machine (``setting`` 0 on the CPU)."""
        return self.enabled and self.setting == 0

    def _sample(self) -> tuple[float, float, float, int] | None:
        stat = read_cpu_stat(self._stat_path)
        return None if stat is None else (self._clock(), stat[0], self._own_cpu(), stat[1])

    def update(self) -> int:
        """After a cycle (and at the end of the engine's construction), for the next one: close the window
        since the last sample (when at least :data:`MIN_WINDOW_S` long), measure the others' load over it and
        apply a new target once :data:`AGREEING_SAMPLES` windows agree; make the next cycle a probe when one
        is due. Returns the count the next cycle runs with (:meth:`apply` sets it at that cycle's start)."""
        if not self.enabled:
            return torch.get_num_threads()
        self._probe = None
        if self.automatic:
            self._measure()
            self._cycles += 1
            alternative = self._alternative()
            if alternative is not None and self._cycles % PROBE_EVERY == 0 and len(self._times) >= MIN_RECENT:
                self._probe = alternative
                self.probes += 1
        count = self.threads if self._probe is None else self._probe
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
        return count

    def apply(self) -> None:
        """At a cycle's start: torch's count set to the one :meth:`update` chose, in case something else in
        the process (another engine, user code) changed it since."""
        if self.enabled and torch.get_num_threads() != (count := self.threads if self._probe is None else self._probe):
            torch.set_num_threads(count)

    def observe(self, action_seconds: float) -> None:
        """At a cycle's end: the seconds its action path (encode, prefill, denoise) took, at the count
        :meth:`update` returned. A probe's time is compared with the recent cycles'; the others' are kept."""
        if not self.automatic:
            return
        if self._probe is None:
            self._times.append(action_seconds)
            return
        probe, self._probe = self._probe, None
        key = (self.target, probe)
        if action_seconds < PROBE_GAIN * statistics.median(self._times):
            self._wins[key] = self._wins.get(key, 0) + 1
        else:
            self._wins.pop(key, None)
        if self._wins.get(key, 0) >= AGREEING_SAMPLES:
            _LOG.info("intra-op threads %d -> %d (probe cycles %.1f ms against %.1f ms)", self.threads, probe,
                      1e3 * action_seconds, 1e3 * statistics.median(self._times))
            self._chosen[self.target] = probe
            self._wins = {k: v for k, v in self._wins.items() if k[0] != self.target}
            self._set(probe)
        torch.set_num_threads(self.threads)

    def _alternative(self) -> int | None:
        if self.threads > 1:
            return self.threads - 1
        return self.threads + 1 if self.threads < self.target else None

    def _set(self, count: int) -> None:
        if count != self.threads:
            self.threads = count
            self.changes += 1
            self._times.clear()

    def _measure(self) -> None:
        now = self._sample()
        if now is None or self._last is None:
            self._last = now
            return
        wall = now[0] - self._last[0]
        if wall < MIN_WINDOW_S:
            return
        others = max(0.0, ((now[1] - self._last[1]) - (now[2] - self._last[2])) / wall)
        self.others, self._last = others, now
        target = threads_for_free_cores(now[3] - others, self.usable)
        if target == self.target:
            self._candidate = None
            return
        agreed = self._candidate[1] + 1 if self._candidate and self._candidate[0] == target else 1
        self._candidate = (target, agreed)
        if agreed >= AGREEING_SAMPLES:
            _LOG.info("intra-op threads %d -> %d (other processes busy on %.2f of %d CPUs)", self.threads, target,
                      others, now[3])
            self.target, self._candidate = target, None
            self._set(self._chosen.get(target, target))   # a probe never goes above its target
