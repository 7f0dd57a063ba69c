"""Engine metrics: per-cycle latencies and work, per-request latencies, pool occupancy.

Definitions (the OxyGen paper's protocol, arXiv 2603.14371):
    * frame latency: seconds of one whole control cycle (encode, prefill, denoise, decode steps);
    * action latency: seconds from cycle start to the action chunk being ready;
    * action rate: ``H / frame latency`` actions per second;
    * time to first token (TTFT): request trigger (its cycle's start) to its first token, s;
    * completion latency: request trigger to its final status, s;
    * tokens/s: generated tokens over the summed frame latencies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


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


@dataclass
class EngineMetrics:
    """All records since the last :meth:`reset`, plus the pool's capacity and peak."""

    action_horizon: int
    pool_capacity_bytes: int
    cycles: list[CycleRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    peak_pool_bytes: int = 0

    def reset(self) -> None:
        """Forget all records (e.g. after warm-up)."""
        self.cycles.clear()
        self.requests.clear()
        self.peak_pool_bytes = 0

    def summary(self) -> dict:
        """Aggregates as a JSON-ready dict.

        Keys: ``frames``, ``frame_latency_s`` / ``action_latency_s`` (mean and percentiles),
        ``action_rate_hz`` (H / mean frame latency), ``tokens_per_s``, ``deadline_misses``,
        ``mean_batch_size``, ``max_batch_size``, ``ttft_s`` / ``completion_s`` (percentiles over
        requests that reached them), ``requests_by_status``, ``peak_pool_bytes``,
        ``pool_capacity_bytes``, per-phase mean times, and per-frame work counts.
        """
        frames = self.cycles
        frame_lat = [c.frame_latency_s for c in frames]
        action_lat = [c.action_latency_s for c in frames]
        batches = [b for c in frames for b in c.batch_sizes]
        total_time = sum(frame_lat)
        tokens = sum(c.generated_tokens for c in frames)
        statuses: dict[str, int] = {}
        for r in self.requests:
            statuses[r.status] = statuses.get(r.status, 0) + 1

        def mean(values: list[float]) -> float | None:
            return float(np.mean(values)) if values else None

        mean_frame = mean(frame_lat)
        return {
            "frames": len(frames),
            "frame_latency_s": {"mean": mean_frame, **percentiles(frame_lat)},
            "action_latency_s": {"mean": mean(action_lat), **percentiles(action_lat)},
            "action_rate_hz": self.action_horizon / mean_frame if mean_frame else None,
            "tokens_per_s": tokens / total_time if total_time > 0 else None,
            "deadline_misses": sum(c.deadline_missed for c in frames),
            "mean_batch_size": mean(batches),
            "max_batch_size": max(batches) if batches else 0,
            "mean_decode_steps_per_frame": mean([c.decode_steps for c in frames]),
            "phase_mean_s": {k: mean([getattr(c, k) for c in frames])
                             for k in ("encode_s", "prefill_s", "denoise_s", "decode_s")},
            "vision_calls_per_frame": mean([c.vision_calls for c in frames]),
            "prefilled_tokens_per_frame": mean([c.prefilled_tokens for c in frames]),
            "ttft_s": percentiles([r.ttft_s for r in self.requests if r.ttft_s is not None]),
            "completion_s": percentiles([r.completion_s for r in self.requests
                                         if r.status == "completed"]),
            "requests_by_status": statuses,
            "peak_pool_bytes": self.peak_pool_bytes,
            "pool_capacity_bytes": self.pool_capacity_bytes,
        }

    def as_dict(self) -> dict:
        """Summary plus every raw record."""
        return {"summary": self.summary(), "cycles": [asdict(c) for c in self.cycles],
                "requests": [asdict(r) for r in self.requests]}
