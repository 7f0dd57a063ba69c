"""Engine metrics: per-cycle latencies and work, per-request latencies, pool occupancy.

Definitions (the OxyGen paper's protocol, arXiv 2603.14371):
    * frame latency: seconds of one whole control cycle (encode, prefill, denoise, decode steps);
    * action latency: seconds from cycle start to the action chunk being ready;
    * action rate: ``H / frame latency`` actions per second;
    * time to first token (TTFT): request trigger (its cycle's start) to its first token, s;
    * completion latency: request trigger to its final status, s;
    * tokens/s: generated tokens over the summed frame latencies.

Records are bounded (:class:`EngineMetrics`): counters are running totals, percentiles cover a
window of the most recent cycles and requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np


# Per-cycle phase timings (seconds), the keys of CycleRecord's phase fields.
PHASES = ("encode_s", "prefill_s", "denoise_s", "decode_s")


@dataclass
class CycleRecord:
    """Measurements of one control cycle (times in s)."""

    seq: int
    frame_latency_s: float
    action_latency_s: float
    encode_s: float
    prefill_s: float
    denoise_s: float
    decode_s: float
    decode_steps: int
    batch_sizes: list[int]
    vision_calls: int
    images_encoded: int
    prefilled_tokens: int
    generated_tokens: int
    deadline_missed: bool
    pool_used_bytes: int
    overloaded: bool = False    # the slack could not pay for language's guaranteed minimum
    intra_op_threads: int = 0   # torch's intra-op CPU threads on the action path (engine/threads.py); 0 off the CPU


@dataclass
class RequestRecord:
    """Outcome of one language request (times in s; None when never reached)."""

    request_id: int
    task: str
    status: str
    tokens: int
    ttft_s: float | None
    completion_s: float


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p95 / p99 of ``values`` (numpy linear interpolation); None entries when empty."""
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return {"p50": float(p[0]), "p95": float(p[1]), "p99": float(p[2])}


class EngineMetrics:
    """Bounded engine records: running totals since the last :meth:`reset` and a window of the
    most recent cycles and requests.

    Memory stays flat on a long-running robot: only the newest ``window`` :class:`CycleRecord` and
    :class:`RequestRecord` objects are kept (for percentiles and raw export), while every counter
    (frames, busy time, tokens, decode steps, batch sizes, deadline misses, requests by status,
    work counts, per-phase time, peak pool bytes) is a running total over all records since the
    last reset, so means, rates and counts in :meth:`summary` stay exact however long the run.

    Args:
        action_horizon: H, actions per chunk (action rate = H / mean frame latency).
        pool_capacity_bytes: the KV pool's fixed budget in bytes.
        window: most recent cycles and requests kept for percentiles, >= 1.

    Raises:
        ValueError: window < 1.
    """

    def __init__(self, action_horizon: int, pool_capacity_bytes: int, window: int = 1000):
        if window < 1:
            raise ValueError(f"metrics window must be >= 1, got {window}")
        self.action_horizon = action_horizon
        self.pool_capacity_bytes = pool_capacity_bytes
        self.window = window
        self.cycles: deque[CycleRecord] = deque(maxlen=window)
        self.requests: deque[RequestRecord] = deque(maxlen=window)
        self.reset()

    def reset(self) -> None:
        """Forget all records and totals (e.g. after warm-up)."""
        self.cycles.clear()
        self.requests.clear()
        self.peak_pool_bytes = 0
        self._frames = 0
        self._busy_s = 0.0
        self._action_s = 0.0
        self._tokens = 0
        self._misses = 0
        self._overloaded = 0
        self._steps = 0
        self._batch_sum = 0
        self._max_batch = 0
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self._vision_calls = 0
        self._prefilled_tokens = 0
        self._statuses: dict[str, int] = {}

    def add_cycle(self, record: CycleRecord) -> None:
        """Count one control cycle and keep it in the window."""
        self.cycles.append(record)
        self._frames += 1
        self._busy_s += record.frame_latency_s
        self._action_s += record.action_latency_s
        self._tokens += record.generated_tokens
        self._misses += record.deadline_missed
        self._overloaded += record.overloaded
        self._steps += len(record.batch_sizes)
        self._batch_sum += sum(record.batch_sizes)
        self._max_batch = max(self._max_batch, max(record.batch_sizes, default=0))
        for phase in PHASES:
            self._phase_s[phase] += getattr(record, phase)
        self._vision_calls += record.vision_calls
        self._prefilled_tokens += record.prefilled_tokens
        self.peak_pool_bytes = max(self.peak_pool_bytes, record.pool_used_bytes)

    def note_pool_peak(self, peak_bytes: int) -> None:
        """Raise ``peak_pool_bytes`` to the pool's own peak ``peak_bytes`` [B] when that is higher."""
        self.peak_pool_bytes = max(self.peak_pool_bytes, peak_bytes)

    def add_request(self, record: RequestRecord) -> None:
        """Count one ended request and keep it in the window."""
        self.requests.append(record)
        self._statuses[record.status] = self._statuses.get(record.status, 0) + 1

    def summary(self) -> dict:
        """Aggregates as a JSON-ready dict.

        Totals since the last reset: ``frames``, ``frame_latency_s.mean`` /
        ``action_latency_s.mean``, ``action_rate_hz`` (H / mean frame latency), ``tokens_per_s``
        (tokens over summed frame latencies), ``deadline_misses``, ``overloaded_cycles`` (cycles
        whose slack could not pay for language's guaranteed minimum; also counted over the
        window as ``overloaded_cycles_in_window``), ``mean_batch_size``,
        ``max_batch_size``, ``mean_decode_steps_per_frame``, ``phase_mean_s`` (per-phase mean s),
        ``vision_calls_per_frame``, ``prefilled_tokens_per_frame``, ``requests_by_status``,
        ``peak_pool_bytes``, ``pool_capacity_bytes``. Over the window (``window`` says how many
        records): p50/p95/p99 of frame and action latency, ``phase_p50_s`` (per-phase median s),
        ``ttft_s`` and ``completion_s`` (requests that reached them).
        """
        frames = self._frames

        def per_frame(total: float) -> float | None:
            return total / frames if frames else None

        mean_frame = per_frame(self._busy_s)
        return {
            "frames": frames,
            "window": {"size": self.window, "cycles": len(self.cycles),
                       "requests": len(self.requests)},
            "frame_latency_s": {"mean": mean_frame,
                                **percentiles([c.frame_latency_s for c in self.cycles])},
            "action_latency_s": {"mean": per_frame(self._action_s),
                                 **percentiles([c.action_latency_s for c in self.cycles])},
            "action_rate_hz": self.action_horizon / mean_frame if mean_frame else None,
            "tokens_per_s": self._tokens / self._busy_s if self._busy_s > 0 else None,
            "deadline_misses": self._misses,
            "overloaded_cycles": self._overloaded,
            "overloaded_cycles_in_window": sum(c.overloaded for c in self.cycles),
            "mean_batch_size": self._batch_sum / self._steps if self._steps else None,
            "max_batch_size": self._max_batch,
            "mean_decode_steps_per_frame": per_frame(self._steps),
            "phase_mean_s": {k: per_frame(v) for k, v in self._phase_s.items()},
            "phase_p50_s": {k: percentiles([getattr(c, k) for c in self.cycles])["p50"]
                            for k in PHASES},
            "vision_calls_per_frame": per_frame(self._vision_calls),
            "prefilled_tokens_per_frame": per_frame(self._prefilled_tokens),
            "ttft_s": percentiles([r.ttft_s for r in self.requests if r.ttft_s is not None]),
            "completion_s": percentiles([r.completion_s for r in self.requests
                                         if r.status == "completed"]),
            "requests_by_status": dict(self._statuses),
            "peak_pool_bytes": self.peak_pool_bytes,
            "pool_capacity_bytes": self.pool_capacity_bytes,
        }

    def as_dict(self) -> dict:
        """Summary plus the windowed raw records."""
        return {"summary": self.summary(), "cycles": [asdict(c) for c in self.cycles],
                "requests": [asdict(r) for r in self.requests]}
