"""Real-time chunking in the engine: where each robot is in the chunk it executes, how long inference takes
in control steps, and what guides the next chunk (the guidance itself: ``oxygen_ros/models/rtc.py``).

Per robot the engine keeps the chunk in flight (:class:`ChunkInFlight`: its normalised model actions, its
observation's stamp) and a :class:`DelayEstimator`. For a new observation at stamp ``t_o`` the plan
(:func:`plan_guidance`) is:

* ``k = floor((t_o − t_p) / dt)`` actions of the chunk in flight (stamp ``t_p``, one action per ``dt``) have
  started by the observation;
* ``d``: the inference delay in control steps — the robot executes ``d`` more actions of the old chunk
  before the new one can take over (the largest of the recent measured delays plus ``delivery_margin_s``,
  divided by ``dt`` and rounded up; or ``fixed_delay_steps``);
* the target of the new chunk's action ``i`` is the old chunk's action ``k + i``; the prefix weights are 1
  for ``i < d``, decay to 0 at the execution horizon ``s`` and are 0 where the old chunk has no action;
* the new chunk takes over at its own action ``d``, i.e. the old chunk's action ``k + d`` (the chunk's
  ``rtc_takeover_index``).

When there is nothing to guide toward, the chunk is denoised plainly and the reason is counted and carried by
the chunk (``rtc_fallback``): ``no_chunk`` (the first chunk, or the first after :meth:`Engine.flush` / a
reset), ``delay_unknown`` (``auto`` before enough delays were measured), ``expired`` (the old chunk was fully
executed by the observation: a pause or a stale observation), ``stale_stamp`` (an observation older than
the chunk in flight). ``delay_clipped`` (d beyond s: guided with the first s actions frozen) is counted but
still guided. A new instruction keeps the guidance: the robot executes the frozen actions either way.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from oxygen_ros.engine.config import RTCConfig
from oxygen_ros.models.rtc import prefix_weights

FALLBACKS = ("no_chunk", "delay_unknown", "expired", "stale_stamp")


@dataclass
class ChunkInFlight:
    """The chunk a robot executes: fp32 ``actions`` ``[H, action_dim]`` (normalised model actions, as the model
    produced them) of the observation at ``stamp`` (s, the robot's clock) with sequence number ``seq``."""

    actions: torch.Tensor
    stamp: float
    seq: int


class _RecentDelays:
    """One source's measured delays: the first ``warmup_cycles`` ignored, the last ``delay_window`` kept."""

    def __init__(self, config: RTCConfig):
        self._warmup = config.warmup_cycles
        self._kept: deque[float] = deque(maxlen=config.delay_window)
        self.seen = 0

    def add(self, delay_s: float) -> None:
        self.seen += 1
        if self.seen > self._warmup:
            self._kept.append(delay_s)

    @property
    def maximum(self) -> float | None:
        return max(self._kept) if self._kept else None


class DelayEstimator:
    """The inference delay ``d`` in control steps of one robot, from measured delays (observation stamp →
    chunk ready, seconds in the robot's clock).

    ``auto``: the largest of the last ``delay_window`` measurements after the first ``warmup_cycles`` ones,
    plus ``delivery_margin_s``, divided by ``action_dt_s`` and rounded up; None until one measurement past
    the warm-up exists. ``fixed``: ``fixed_delay_steps``. Measurements come from the caller with a clock
    (:meth:`observe`, e.g. the node: ROS time, so simulated time counts simulated steps); without any, the
    engine's own (the cycle's start to the chunk, wall clock) are used (:meth:`observe_own`).
    """

    def __init__(self, config: RTCConfig):
        self._config = config
        self._external = _RecentDelays(config)
        self._own = _RecentDelays(config)

    def observe(self, delay_s: float) -> None:
        """A measured delay (s) of one chunk from the caller's clock; from the first one on, only these count.
        Raises ValueError for a negative or non-finite delay."""
        if not (math.isfinite(delay_s) and delay_s >= 0):
            raise ValueError(f"an inference delay must be finite and >= 0 s, got {delay_s}")
        self._external.add(delay_s)

    def observe_own(self, delay_s: float) -> None:
        """The engine's own measurement of one chunk (s, wall clock from the cycle's start)."""
        self._own.add(delay_s)

    @property
    def delay_s(self) -> float | None:
        """The robust recent maximum (s) the estimate is built from, None while warming up."""
        return (self._external if self._external.seen else self._own).maximum

    def steps(self) -> int | None:
        """d in control steps (module docstring), or None while unknown."""
        config = self._config
        if config.delay_mode == "fixed":
            return config.fixed_delay_steps
        delay = self.delay_s
        if delay is None:
            return None
        return math.ceil((delay + config.delivery_margin_s) / config.action_dt_s - 1e-9)


@dataclass
class GuidancePlan:
    """How one chunk is denoised: ``target`` fp32 ``[H, D]`` and ``weights`` fp32 ``[H]`` (None: plain), the
    delay ``d`` used and the old chunk's action where the new one takes over (-1 when plain), and the
    fallback's reason ("" when guided); ``clipped``: d exceeded the execution horizon."""

    target: torch.Tensor | None
    weights: torch.Tensor | None
    delay_steps: int
    takeover_index: int
    fallback: str
    clipped: bool = False


def plan_guidance(config: RTCConfig, in_flight: ChunkInFlight | None, delays: DelayEstimator, stamp: float,
                  horizon: int, action_dim: int) -> GuidancePlan:
    """The plan of the chunk of an observation at ``stamp`` (s) for a robot executing ``in_flight`` (module
    docstring); ``horizon``, ``action_dim``: the model's chunk shape."""
    def plain(reason: str) -> GuidancePlan:
        return GuidancePlan(None, None, -1, -1, reason)

    if in_flight is None:
        return plain("no_chunk")
    if stamp < in_flight.stamp:
        return plain("stale_stamp")
    started = int(math.floor((stamp - in_flight.stamp) / config.action_dt_s + 1e-9))
    remaining = in_flight.actions.shape[0] - started
    if remaining <= 0:
        return plain("expired")
    delay = delays.steps()
    if delay is None:
        return plain("delay_unknown")
    target = torch.zeros(horizon, action_dim, dtype=torch.float32)
    target[:remaining] = in_flight.actions[started:started + horizon].float()
    weights = prefix_weights(delay, config.execution_horizon, horizon, config.schedule)
    weights[remaining:] = 0.0           # no action of the old chunk there: nothing to continue
    return GuidancePlan(target, weights, delay, started + delay, "", delay > config.execution_horizon)
