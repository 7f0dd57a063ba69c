"""Intra-op CPU threads that follow what the machine has free (the engine's ``intra_op_threads``).

On a shared CPU (a robot computer runs its drivers, controllers and recorder beside the policy; the demo
its simulator) every 2-thread op ends at an OpenMP barrier that waits for a descheduled thread, so a
phase costs a scheduler time slice per op instead of its arithmetic (docs/benchmarks.md, "Roofline").
With ``intra_op_threads: 0`` the engine sets torch's intra-op thread count to the cores the *other*
processes leave free:

* measured from ``/proc/stat`` (the machine's busy CPU time) minus this process's own CPU time
  (``os.times``), over a window: from the engine's construction to its end when that took at least
  :data:`MIN_WINDOW_S` (a node's configure loads a model), then over every control cycle (the window
  from one cycle's start to the next);
* ``free = cpus − others' busy cores``; threads = ``floor(free + 1 − ``:data:`REQUIRED_FREE_SHARE```)``
  clamped to ``[1, usable cpus]``: a core counts when at least 75 % of it is free;
* a new count is applied (``torch.set_num_threads``, process-wide) only after :data:`AGREEING_SAMPLES`
  consecutive windows agree on it, so one burst of load does not flip it back and forth.

``intra_op_threads: n >= 1`` fixes the count at ``n``. On a machine without ``/proc/stat`` (not Linux)
the automatic setting keeps torch's count. Inductor writes the thread count in force at compile time into
the compiled denoising step's loops (``models/cpu_compile.py``); its products and attention follow the
current count.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

_LOG = logging.getLogger(__name__)

# Shortest window (s) a measurement is taken over; shorter ones are left to the next.
MIN_WINDOW_S = 0.1
# Share of a core that must be free for it to count as a thread's.
REQUIRED_FREE_SHARE = 0.75
# Consecutive windows that must agree on a new count before it is applied.
AGREEING_SAMPLES = 2
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

    Args:
        setting: ``intra_op_threads``: 0 = follow the machine, n >= 1 = exactly n.
        enabled: False (a model off the CPU) leaves torch's count alone.
        stat_path, clock, own_cpu: where the machine's CPU time, the wall clock (s) and this process's CPU
            seconds come from (tests give a file of their own).

    Attributes:
        threads: the count in force (torch's, as set by this object).
        others: the other processes' busy cores in the last window (None before one).
        changes: how often the count was changed.

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
        self.changes = 0
        self._candidate: tuple[int, int] | None = None   # (count, windows that agreed)
        try:
            self.usable = len(os.sched_getaffinity(0))
        except AttributeError:   # not Linux
            self.usable = os.cpu_count() or 1
        if enabled and setting > 0:
            torch.set_num_threads(setting)
        self.threads = torch.get_num_threads()
        self._last = self._sample()

    @property
    def automatic(self) -> bool:
        """Whether the count follows the machine (``setting`` 0 on the CPU)."""
        return self.enabled and self.setting == 0

    def _sample(self) -> tuple[float, float, float, int] | None:
        stat = read_cpu_stat(self._stat_path)
        return None if stat is None else (self._clock(), stat[0], self._own_cpu(), stat[1])

    def update(self) -> int:
        """Close the window since the last sample (when at least :data:`MIN_WINDOW_S` long), measure the
        others' load over it and apply a new count once :data:`AGREEING_SAMPLES` windows agree. Call it at
        a cycle's start (and at the end of the engine's construction); it also sets torch's count back
        to this engine's when something else in the process changed it. Returns the count in force."""
        if not self.enabled:
            return self.threads
        if torch.get_num_threads() != self.threads:   # another engine of the process set its own
            torch.set_num_threads(self.threads)
        if not self.automatic:
            return self.threads
        now = self._sample()
        if now is None or self._last is None:
            self._last = now
            return self.threads
        wall = now[0] - self._last[0]
        if wall < MIN_WINDOW_S:
            return self.threads
        others = max(0.0, ((now[1] - self._last[1]) - (now[2] - self._last[2])) / wall)
        self.others, self._last = others, now
        target = threads_for_free_cores(now[3] - others, self.usable)
        if target == self.threads:
            self._candidate = None
            return self.threads
        agreed = self._candidate[1] + 1 if self._candidate and self._candidate[0] == target else 1
        self._candidate = (target, agreed)
        if agreed >= AGREEING_SAMPLES:
            _LOG.info("intra-op threads %d -> %d (other processes busy on %.2f of %d CPUs)", self.threads, target,
                      others, now[3])
            torch.set_num_threads(target)
            self.threads, self._candidate = target, None
            self.changes += 1
        return self.threads
