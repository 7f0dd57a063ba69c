"""Per-cycle measurement: phase timings, decode batch sizes, generated tokens, peak pages.

A :class:`CycleMeter` measures one stretch of engine work (a control cycle, a flush, a warm-up) and
feeds the scheduler's :class:`~oxygen_ros.engine.scheduler.StepCostEstimator` with what it
measured. The engine makes a fresh meter for each stretch; a warm-up gets a meter with a throw-away
estimator, so its one-time costs (CUDA graph capture, lazy initialisation) teach the scheduler nothing.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.metrics import PHASES, CycleRecord
from oxygen_ros.engine.model_runner import WorkCounters
from oxygen_ros.engine.scheduler import StepCostEstimator


class CycleMeter:
    """Measurements of one stretch of engine work.

    Args:
        pool: the KV pool whose occupancy is tracked (peak pages).
        estimator: the step-cost estimator that learns the measured prefill and decode costs.
        counters: the runner's cumulative work counters (the meter reports their increase).

    Attributes:
        timing: seconds per phase (``PHASES``).
        batch_sizes: the size of every decode step's batch, in order.
        tokens: tokens generated.
        peak_blocks: most pages in use at a measured point (start, after each prefill and step).
    """

    def __init__(self, pool: BlockPool, estimator: StepCostEstimator, counters: WorkCounters):
        self.estimator = estimator
        self.timing = dict.fromkeys(PHASES, 0.0)
        self.batch_sizes: list[int] = []
        self.tokens = 0
        self._pool = pool
        self._counters = counters
        self._before = WorkCounters(**vars(counters))
        self.peak_blocks = pool.num_used

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (``encode_s`` or ``denoise_s``; prefill and decode
        steps are reported with :meth:`prefill` and :meth:`decode_step`). A block that raises is not
        timed: its cycle ends without a record."""
        t = time.perf_counter()
        yield
        self.timing[name] += time.perf_counter() - t

    def prefill(self, tokens: int, seconds: float) -> None:
        """One batched prefill of ``tokens`` new tokens took ``seconds``."""
        self.timing["prefill_s"] += seconds
        self.estimator.observe_prefill(tokens, seconds)
        self.peak_blocks = max(self.peak_blocks, self._pool.num_used)

    def decode_step(self, batch: int, seconds: float) -> None:
        """One decode step of ``batch`` requests took ``seconds``."""
        self.estimator.observe_decode(batch, seconds)
        self.timing["decode_s"] += seconds
        self.batch_sizes.append(batch)
        self.peak_blocks = max(self.peak_blocks, self._pool.num_used)

    def record(self, seq: int, frame_latency_s: float, action_latency_s: float,
               deadline_missed: bool, overloaded: bool) -> CycleRecord:
        """The cycle's :class:`CycleRecord` (work counted since the meter was made)."""
        after, before = self._counters, self._before
        return CycleRecord(
            seq=seq, frame_latency_s=frame_latency_s, action_latency_s=action_latency_s,
            decode_steps=after.decode_steps - before.decode_steps, batch_sizes=self.batch_sizes,
            vision_calls=after.vision_calls - before.vision_calls,
            images_encoded=after.images_encoded - before.images_encoded,
            prefilled_tokens=after.prefilled_tokens - before.prefilled_tokens,
            generated_tokens=self.tokens, deadline_missed=deadline_missed, overloaded=overloaded,
            pool_used_bytes=self.peak_blocks * self._pool.bytes_per_block, **self.timing)
