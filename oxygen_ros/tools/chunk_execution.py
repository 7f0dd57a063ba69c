"""Robot-side execution of action chunks: the action due at a time, from the chunks received so far.

A robot that receives overlapping action chunks (each: a stamp, a step ``dt`` and ``H`` actions, action
``i`` due at ``stamp + i·dt``) must decide which action to apply at its control time ``t``. Two ways:

* **newest chunk wins** (the default; what ``sim_robot.py`` and ``evaluate/`` have always done): the
  chunk with the latest stamp gives its action at the index of ``t``, clamped to its first and last
  action (so its last action is held once it runs out);
* **temporal ensembling** (ACT's, Zhao et al. 2023, "Learning Fine-Grained Bimanual Manipulation with
  Low-Cost Hardware", Algorithm 2): the weighted average of the predictions for ``t`` of every kept chunk
  that covers ``t``. ACT queries its policy every control step and weights the ``n`` predictions for the
  current step by ``w_i = exp(−m·i)``, ``i = 0`` the *oldest*, normalised to sum 1, with ``m = 0.01``:
  ``m > 0`` weighs older predictions more (smoother), ``m → 0`` averages uniformly, ``m < 0`` weighs
  newer ones more (LeRobot's ``ACTTemporalEnsembler`` documents the same convention).

Our chunks arrive every few control steps, with arbitrary stamps, not every step. ``i`` is therefore a
chunk's *age in control steps* relative to the oldest covering chunk: ``i = (stamp − stamp_oldest) / dt``
(``dt`` of the newest covering chunk; all chunks of one policy share it), not its rank. With a chunk every
step on the step grid this is exactly ACT's weighting; with a chunk every ``k`` steps, consecutive chunks'
weights differ by ``exp(−m·k)``, so ``m`` keeps its meaning (a time constant of ``1/m`` control steps)
whatever the query rate, and a chunk that arrived late weighs by when its observation was taken.

The index rule picks a chunk's prediction for ``t``: ``floor`` — ``floor((t − stamp) / dt)``, the action
whose slot ``[stamp + i·dt, stamp + (i+1)·dt)`` contains ``t`` (``sim_robot``: a real-time clock between
the steps); ``round`` — ``round((t − stamp) / dt)`` (``evaluate``'s lockstep: the clock stands on the step
grid, and round absorbs the nanosecond rounding of message stamps). A chunk *covers* ``t`` when that
index lies in ``0 .. H−1``: with ``floor``, ``stamp ≤ t < stamp + H·dt``.

No ROS here (numpy only); not thread-safe (callers hold their own lock).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

INDEX_RULES = ("floor", "round")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One received action chunk: ``actions[i]`` is due at ``stamp + i·dt``."""

    stamp: float            # [s], the clock of the observation the chunk was computed from
    dt: float               # [s] between actions, > 0
    actions: np.ndarray     # float64 [H, D], read-only


class ChunkExecutor:
    """The action due at time ``t`` from the action chunks received so far.

    Args:
        ensemble_m: ACT's temporal-ensembling coefficient ``m`` [1 / control step]; 0 (the default) turns
            ensembling off: the newest chunk wins, bit for bit the old behaviour. Any other finite value
            turns it on (ACT's 0.01 weighs older predictions a little more; negative weighs newer ones more).
        max_chunks: with ensembling on, how many chunks (the latest stamps) are kept, ≥ 1; it should be at
            least the number that overlap, ``ceil(H / steps between chunks)``. Ignored when off (one kept).
        index_rule: ``"floor"`` (default) or ``"round"``: how ``(t − stamp) / dt`` becomes an action index
            (module docstring).

    Raises:
        ValueError: ``ensemble_m`` not finite, ``max_chunks`` < 1, or an unknown ``index_rule``.
    """

    def __init__(self, ensemble_m: float = 0.0, max_chunks: int = 16, index_rule: str = "floor"):
        ensemble_m = float(ensemble_m)
        if not math.isfinite(ensemble_m):
            raise ValueError(f"ensemble_m must be finite, got {ensemble_m}")
        if int(max_chunks) != max_chunks or max_chunks < 1:
            raise ValueError(f"max_chunks must be an integer >= 1, got {max_chunks}")
        if index_rule not in INDEX_RULES:
            raise ValueError(f"index_rule must be one of {INDEX_RULES}, got {index_rule!r}")
        self.ensemble_m = ensemble_m
        self.max_chunks = int(max_chunks) if ensemble_m != 0.0 else 1
        self.index_rule = index_rule
        self._chunks: list[Chunk] = []      # ascending stamp; equal stamps in order of arrival

    @property
    def ensembling(self) -> bool:
        """True when temporal ensembling is on (``ensemble_m`` ≠ 0)."""
        return self.ensemble_m != 0.0

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The kept chunks, oldest stamp first."""
        return tuple(self._chunks)

    def clear(self) -> None:
        """Forget every chunk (e.g. after the robot was reset: do not drive back into the same state)."""
        self._chunks.clear()

    def add(self, stamp: float, dt: float, actions) -> bool:
        """Take in a chunk; returns whether it is kept.

        Off: it replaces the kept chunk when its stamp is ≥ the kept one's (the newest chunk wins; an
        older one arriving late is not kept). On: it is inserted by stamp and the oldest beyond
        ``max_chunks`` are dropped (a late chunk older than all ``max_chunks`` kept ones is not kept).

        Args:
            stamp: [s], finite. dt: [s] between actions, finite and > 0.
            actions: array-like of float, shape ``[H, D]`` with H ≥ 1 and D ≥ 1, finite; copied as float64.

        Raises:
            ValueError: a non-finite stamp or action, dt ≤ 0 or non-finite, actions not 2-D or empty, or
                (ensembling on) an action dimension D other than the kept chunks'.
        """
        stamp, dt = float(stamp), float(dt)
        if not math.isfinite(stamp):
            raise ValueError(f"chunk stamp must be finite, got {stamp}")
        if not (math.isfinite(dt) and dt > 0.0):
            raise ValueError(f"chunk dt must be finite and > 0, got {dt}")
        try:
            array = np.array(actions, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"chunk actions are not a float array: {err}") from None
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
            raise ValueError(f"chunk actions must have shape [H >= 1, D >= 1], got {array.shape}")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"chunk actions hold {int(np.sum(~np.isfinite(array)))} non-finite values")
        array.setflags(write=False)
        chunk = Chunk(stamp, dt, array)
        if not self.ensembling:
            if self._chunks and stamp < self._chunks[-1].stamp:
                return False
            self._chunks[:] = [chunk]
            return True
        if self._chunks and array.shape[1] != self._chunks[-1].actions.shape[1]:
            raise ValueError(f"chunk action dimension {array.shape[1]} differs from the kept chunks' "
                             f"{self._chunks[-1].actions.shape[1]}")
        position = bisect.bisect_right([c.stamp for c in self._chunks], stamp)
        self._chunks.insert(position, chunk)
        dropped = max(0, len(self._chunks) - self.max_chunks)
        del self._chunks[:dropped]
        return position >= dropped

    def seam(self, t: float, stamp: float, dt: float, actions) -> tuple[np.ndarray, np.ndarray] | None:
        """The seam a chunk would make if it were taken in just before control time ``t`` [s]: how the
        command at ``t`` and its velocity change, compared with the chunks kept now (the chunk is not kept).

        Position: ``E'(t) − E(t)``; velocity: ``(E'(t + dt) − E'(t)) / dt − (E(t + dt) − E(t)) / dt``,
        with ``E`` / ``E'`` :meth:`action_at` without / with the chunk and ``dt`` the chunk's step. For the
        newest chunk wins this is the new chunk's action at ``t`` against the old one's (the jump at the
        switch); with ensembling, the change the new chunk makes to the average.

        Returns:
            ``(position [D], velocity [D / s])`` float64, or None when no chunk is kept (nothing to switch from)
            or the chunk would not be kept.

        Raises:
            ValueError: as :meth:`add`, or ``t`` not finite.
        """
        if not self._chunks:
            return None
        before = (self.action_at(t), self.action_at(t + float(dt)))
        kept = list(self._chunks)
        try:
            if not self.add(stamp, dt, actions):
                return None
            after = (self.action_at(t), self.action_at(t + float(dt)))
        finally:
            self._chunks[:] = kept
        return after[0] - before[0], ((after[1] - after[0]) - (before[1] - before[0])) / float(dt)

    def _index(self, chunk: Chunk, t: float) -> int:
        """The unclamped action index of ``t`` in ``chunk`` by the index rule."""
        if self.index_rule == "floor":
            return int((t - chunk.stamp) // chunk.dt)
        return int(round((t - chunk.stamp) / chunk.dt))

    def weights_at(self, t: float) -> list[tuple[Chunk, int, float]]:
        """The chunks that contribute to the action at ``t``: ``(chunk, action index, weight)``, oldest
        first, weights summing to 1. Off, or when no kept chunk covers ``t``: the newest chunk alone with
        its clamped index and weight 1 (its first action before its stamp, its last once it ran out);
        no chunk: ``[]``.

        Raises:
            ValueError: ``t`` not finite.
        """
        t = float(t)
        if not math.isfinite(t):
            raise ValueError(f"time must be finite, got {t}")
        if not self._chunks:
            return []
        if self.ensembling:
            covering = [(c, i) for c in self._chunks for i in (self._index(c, t),) if 0 <= i < len(c.actions)]
            if covering:
                step = covering[-1][0].dt
                # ACT: w_i = exp(−m·i), i = age in control steps from the oldest covering chunk; shifted by the
                # largest exponent before exp (the normalised weights are unchanged, nothing overflows).
                exponents = np.array([-self.ensemble_m * (c.stamp - covering[0][0].stamp) / step for c, _ in covering])
                weights = np.exp(exponents - exponents.max())
                weights /= weights.sum()
                return [(c, i, float(w)) for (c, i), w in zip(covering, weights)]
        newest = self._chunks[-1]
        # np.clip of the float-derived index, exactly as sim_robot / evaluate computed it before this module.
        return [(newest, int(np.clip(self._index(newest, t), 0, len(newest.actions) - 1)), 1.0)]

    def action_at(self, t: float) -> np.ndarray | None:
        """The action due at ``t`` [s]: float64 ``[D]`` (a new array), or None before any chunk arrived.

        Off: the newest chunk's action at the clamped index. On: ``Σ w_k · actions_k[i_k]`` over the kept
        chunks covering ``t`` (:meth:`weights_at`); the newest chunk's clamped action when none covers it.

        Raises:
            ValueError: ``t`` not finite.
        """
        contributions = self.weights_at(t)
        if not contributions:
            return None
        if len(contributions) == 1:
            chunk, index, _ = contributions[0]
            return chunk.actions[index].copy()
        return sum(weight * chunk.actions[index] for chunk, index, weight in contributions)
