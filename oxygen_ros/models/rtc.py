"""Real-time chunking (RTC): inpainting guidance that makes a new action chunk continue the one in flight.

Black, Galliker, Levine 2025, "Real-Time Execution of Action Chunking Flow Policies" (arXiv 2506.07339),
Algorithm 1 and Eqs. 2-5. While a new chunk is computed from observation ``o``, the robot keeps executing
the previous chunk: its actions from the observation on are a target ``Y`` for the new chunk's first
actions. Each Euler step's velocity is corrected (ΠGDM guidance) so that the step's estimate of the clean
chunk moves toward ``Y`` where the prefix weights ``W`` say so:

* the first ``d`` actions (the inference delay: executed before the new chunk can arrive) have weight 1;
* from ``d`` to the execution horizon ``s`` the weight decays to 0, ``c_i = (s - i) / (s - d + 1)``
  (``linear``) or ``c_i · (e^{c_i} - 1) / (e - 1)`` (``exp``, the paper's Eq. 5);
* from ``s`` on, and where the previous chunk has no action, the weight is 0.

Two more schedules are LeRobot's (``RTCAttentionSchedule`` ZEROS and ONES, read from a checkpoint's
``rtc_config``): ``zeros`` (a hard prefix: 1 for ``i < d``, 0 from d on) and ``ones`` (1 for every ``i < s``).

Time convention. The paper integrates τ from 0 (noise) to 1 (data) with ``v = dA/dτ``; π0 / π0.5 (and this
package, docs/models.md "Flow matching") integrate ``t`` from 1 (noise) to 0 (data) with
``x ← x + dt · v``, ``dt = -1/S``, so ``τ = 1 - t`` and ``v_π0 = -v_paper``. In π0 time:

* the clean-chunk estimate is ``x̂ = x_t - t · v(x_t, t)`` (the paper's ``Â¹ = A^τ + (1 - τ) v``);
* the guided velocity is ``v - w_t · Jᵀ (W ⊙ (Y - x̂))`` with ``J = ∂x̂/∂x_t`` (a vector-Jacobian
  product through the action expert, the prefix KV held fixed), the paper's ``v + w Jᵀ(...)`` with the
  sign of ``v_π0``;
* the guidance weight is ``w_t = min(β, (1 - τ) / (τ r_τ²))`` with ``r_τ² = (1 - τ)² / (τ² + (1 - τ)²)``,
  i.e. ``w_t = min(β, (t² + (1 - t)²) / (t (1 - t)))``, and β where that is infinite (t = 0 or 1).
  LeRobot's RTC processor computes the same weight (``time / (1 - time)`` times
  ``(time² + (1 - time)²) / time²``, clipped at ``max_guidance_weight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("linear", "exp", "zeros", "ones")


def prefix_weights(delay: int, execution_horizon: int, horizon: int, schedule: str = "exp") -> torch.Tensor:
    """The RTC prefix weights ``W`` of a chunk of ``horizon`` actions (module docstring).

    Args:
        delay: d, the actions executed before the new chunk arrives (>= 0); clipped to the execution horizon.
        execution_horizon: s, where the weights reach 0 (>= 0); clipped to ``horizon``.
        horizon: H, actions per chunk (>= 1).
        schedule: ``linear`` or ``exp`` decay between d and s, ``zeros`` (0 between d and s) or ``ones`` (1).

    Returns:
        float32 ``[H]``: 1 for ``i < d``, the decay for ``d <= i < s``, 0 from s on.

    Raises:
        ValueError: a negative delay or horizon, or an unknown schedule.
    """
    if delay < 0 or execution_horizon < 0 or horizon < 1:
        raise ValueError(f"RTC needs delay >= 0, execution_horizon >= 0, horizon >= 1; got "
                         f"{delay}, {execution_horizon}, {horizon}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown RTC schedule {schedule!r}; one of {SCHEDULES}")
    end = min(execution_horizon, horizon)
    start = min(delay, end)
    weights = torch.zeros(horizon, dtype=torch.float32)
    weights[:start] = 1.0
    if schedule == "ones":
        weights[:end] = 1.0
    elif end > start and schedule != "zeros":
        c = (end - torch.arange(start, end, dtype=torch.float64)) / (end - start + 1)
        if schedule == "exp":
            c = c * torch.expm1(c) / (math.e - 1.0)
        weights[start:end] = c.float()
    return weights


def guidance_weight(t: float, max_guidance_weight: float) -> float:
    """The clipped ΠGDM guidance weight at π0 time ``t`` (1 = noise, 0 = data; module docstring):
    ``min(β, (t² + (1 - t)²) / (t (1 - t)))``, β at t = 0 or 1."""
    if t <= 0.0 or t >= 1.0:
        return float(max_guidance_weight)
    return min(float(max_guidance_weight), (t * t + (1.0 - t) ** 2) / (t * (1.0 - t)))


@dataclass
class RTCGuidance:
    """What guides one denoising call toward the chunks in flight (one row per chunk of the batch).

    Attributes:
        target: Y, fp32 ``[B, H, action_dim]``: per row the previous chunk's normalised model actions from
            the new observation on (any value where ``weights`` is 0).
        weights: W, fp32 ``[B, H]`` per row (:func:`prefix_weights`); a row of zeros is not guided.
        max_guidance_weight: β, the clip of the guidance weight (>= 0; 0 turns guidance off).
    """

    target: torch.Tensor
    weights: torch.Tensor
    max_guidance_weight: float

    def check(self, batch: int, horizon: int, action_dim: int) -> None:
        """Raise ValueError unless ``target`` is ``[batch, horizon, action_dim]``, ``weights``
        ``[batch, horizon]`` and β >= 0."""
        if tuple(self.target.shape) != (batch, horizon, action_dim) or tuple(self.weights.shape) != (batch, horizon):
            raise ValueError(f"RTC guidance must be target [B={batch}, H={horizon}, {action_dim}] and weights "
                             f"[{batch}, {horizon}], got {tuple(self.target.shape)} and {tuple(self.weights.shape)}")
        if not self.max_guidance_weight >= 0:
            raise ValueError(f"max_guidance_weight must be >= 0, got {self.max_guidance_weight}")

    @property
    def active(self) -> bool:
        """Whether any row is guided at all (β > 0 and some weight > 0)."""
        return self.max_guidance_weight > 0 and bool((self.weights > 0).any())


def guided_velocity(velocity_of, x: torch.Tensor, t, weight, target: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """One Euler step's RTC-guided velocity at π0 time ``t`` (module docstring).

    The vector-Jacobian product is taken with respect to ``x`` only. Eagerly by autograd (grad mode is turned on
    for the velocity, so a caller under ``torch.no_grad`` is served); while ``torch.compile`` traces it, by
    ``torch.func.vjp``, so that the whole guided step (velocity and product) is one graph. The function
    transform costs more per op in eager mode than autograd (measured: docs/benchmarks.md), hence the two.
    ``velocity_of`` must not write its result into tensors it captures (a function transform refuses that).

    Args:
        velocity_of: ``x [B, H, D] -> v [B, H, D]`` fp32, differentiable in x (the action expert over a fixed
            prefix).
        x: fp32 ``[B, H, D]`` noisy actions at time t.
        t: π0 time of the step (1 = noise), a float or a 0-dim fp32 tensor.
        weight: the guidance weight ``w_t`` (:func:`guidance_weight`), a float or a 0-dim fp32 tensor.
        target: Y, fp32 ``[B, H, D]`` (:class:`RTCGuidance`).
        weights: W, fp32 ``[B, H]``.

    Returns:
        fp32 ``[B, H, D]``: ``v - w_t · Jᵀ(W ⊙ (Y - x̂))`` with ``x̂ = x - t v`` and ``J = ∂x̂/∂x = I - t ∂v/∂x``,
        i.e. ``v - w_t · (e - t (∂v/∂x)ᵀ e)`` for the weighted error ``e = W ⊙ (Y - x̂)``.
    """
    if torch.compiler.is_compiling():
        velocity, pullback = torch.func.vjp(velocity_of, x)
    else:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            velocity = velocity_of(x)

        def pullback(error: torch.Tensor) -> tuple[torch.Tensor]:
            return torch.autograd.grad(velocity, x, error)
    error = weights[..., None] * (target - (x - t * velocity)).detach()
    (pulled,) = pullback(error)
    return velocity.detach() - weight * (error - t * pulled)
