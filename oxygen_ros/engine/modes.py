"""One policy per engine mode: what the control loop shares and how much language work a cycle does.

A policy answers the loop's questions (``cycle.py``) and never runs model work itself:

* which prefix a task's request forks (the action prefix's job, a language request's job) and what it
  costs to prefill;
* what a new request keeps until it is prefilled (the frame's shared vision encoding, or its own images);
* whether admitted requests decode to completion one at a time, or in batches within a budget — and
  then how many prefill tokens the slack pays for and which batch size the next decode step may take.

Modes for A/B comparison (same loop, different sharing and batching):
    ``isolated`` (:class:`IsolatedMode`): every task runs its own vision encoding, its own prefill
    into a private cache and decodes to completion, one task after the other (openpi-style);
    ``shared_prefix`` (:class:`SharedPrefixMode`): one encoding per frame and one prefill per
    distinct prompt; each language request then decodes to completion, one after the other;
    ``unified`` (:class:`UnifiedMode`): sharing plus cross-frame continuous batching under the
    scheduler (``fixed_k`` steps per cycle or the ``deadline`` scheduling).
"""

from __future__ import annotations

import time
from typing import Hashable

import numpy as np
import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.prefix_cache import PrefixJob, PrefixPlanner
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.scheduler import StepCostEstimator


class ModePolicy:
    """A mode's answers; the defaults are the shared-prefix behaviour, which the modes refine.

    Args:
        config: the loop's configuration (scheduling, decode budget, slack margin).
        planner: the cycle's prefix planner (the tree its jobs are looked up in).
    """

    #: admitted requests decode to their end one at a time (True), or in batches within a budget
    decodes_to_completion = True
    #: prefixes stay in the cycle's tree for the cycle's other tasks (False: the tree is cleared after the action
    #: chunk and after each request, so nothing is shared)
    shares_prefixes = True

    def __init__(self, config: EngineConfig, planner: PrefixPlanner):
        self.config = config
        self.planner = planner

    def action_job(self, robot: Hashable, obs_seq: int, mask: tuple[bool, ...], action_ids: tuple[int, ...],
                   features: torch.Tensor, requests: list[Request]) -> PrefixJob:
        """The action prefix's job of ``robot``'s frame ``obs_seq`` (cameras ``mask``, vision ``features``
        ``[N, tokens, W]``); it keeps what that frame's new ``requests`` sharing it need."""
        path = self.planner.path(obs_seq, mask, action_ids, robot)
        logits, pooled = self.planner.needs(path, requests)
        return PrefixJob(path, features, action_ids, logits, pooled)

    def keep_inputs(self, request: Request, images: list[np.ndarray], features: torch.Tensor) -> None:
        """What a new request keeps until it is prefilled: the frame's shared vision encoding."""
        request.image_features = features

    def prefill_cost(self, request: Request) -> int:
        """Tokens to prefill before ``request`` can start."""
        return self.planner.cost(request)

    def request_job(self, request: Request, features: torch.Tensor | None, candidates: list[Request]) -> PrefixJob:
        """The prefix job that starts ``request``; ``features``: its own vision encoding when it kept its
        images (:meth:`keep_inputs`), else None; ``candidates``: the robot's active requests."""
        return self.planner.job(request, candidates)

    def admission_budget(self, estimator: StepCostEstimator, deadline: float) -> float:
        """Prefill tokens the slack before ``deadline`` (a ``time.perf_counter()`` instant) pays for."""
        return float("inf")

    def min_admissions(self) -> int:
        """Admissions per robot each cycle makes even without slack."""
        return 0

    def step_size(self, steps_done: int, batch: int, estimator: StepCostEstimator,
                  deadline: float) -> tuple[int, bool]:
        """How many of the ``batch`` running requests the next decode step takes after ``steps_done``
        steps this cycle: ``(size, forced)``, size 0 ends the cycle's decoding; ``forced`` when the
        step is a guaranteed minimum the slack does not pay for. Run-to-completion: the whole batch."""
        return batch, False


class SharedPrefixMode(ModePolicy):
    """One encoding per frame, one prefill per distinct prompt, each request decoded to its end."""


class IsolatedMode(ModePolicy):
    """Nothing shared: private prefixes, one vision call per task, the tree dropped after each."""

    shares_prefixes = False

    def action_job(self, robot, obs_seq, mask, action_ids, features, requests) -> PrefixJob:
        return PrefixJob((("isolated-action", robot, obs_seq),), features, action_ids, False, False)

    def keep_inputs(self, request, images, features) -> None:
        request.images = images       # each request runs its own vision encoding

    def prefill_cost(self, request: Request) -> int:
        return request.prefix_len

    def request_job(self, request, features, candidates) -> PrefixJob:
        return PrefixJob((("isolated", request.robot, request.request_id),), features,
                         tuple(request.prompt_ids), True, request.task.kind == "memory")



class UnifiedMode(ModePolicy):
    """Sharing plus cross-frame continuous batching in the slack before the deadline.

    ``fixed_k`` runs ``decode_steps_per_cycle`` steps of the whole batch. ``deadline`` admits what the
    slack pays for by the online prefill estimate and runs steps while the estimated step cost fits the
    slack, shrinking the batch to its highest-priority requests when the whole batch would not fit. It
    guarantees language a minimum every cycle, slack or not: ``min_admissions_per_cycle`` admissions
    (with their prefills) and ``min_decode_steps_per_cycle`` steps of the whole batch; language
    therefore slows down under overload but never stops, and a request ends only by its own task's rules.
    """

    decodes_to_completion = False

    def admission_budget(self, estimator: StepCostEstimator, deadline: float) -> float:
        """Prefill tokens the slack before ``deadline`` pays for by the online prefill estimate
        (``deadline`` scheduling; unbounded for ``fixed_k`` or before the first measurement)."""
        if self.config.scheduling != "deadline":
            return float("inf")
        per_token = estimator.estimate_prefill(1)
        if per_token is None:
            return float("inf")
        slack = deadline - time.perf_counter() - self.config.slack_margin_s
        return max(0.0, slack) / per_token if per_token > 0 else float("inf")

    def min_admissions(self) -> int:
        """Admissions per robot each cycle makes even without slack (``deadline`` scheduling)."""
        return self.config.min_admissions_per_cycle if self.config.scheduling == "deadline" else 0

    def step_size(self, steps_done, batch, estimator, deadline) -> tuple[int, bool]:
        """``fixed_k``: the whole batch for ``decode_steps_per_cycle`` steps. ``deadline``: the largest
        highest-priority prefix of the batch whose estimated step fits the slack (stepping it also
        measures that size for the estimate); without slack the first ``min_decode_steps_per_cycle``
        steps still take the whole batch (forced)."""
        config = self.config
        if config.scheduling != "deadline":
            return (batch if steps_done < config.decode_steps_per_cycle else 0), False
        size = estimator.fitting_batch(batch, deadline - time.perf_counter() - config.slack_margin_s)
        if size == 0 and steps_done < config.min_decode_steps_per_cycle:
            return batch, True
        return size, False


MODES: dict[str, type[ModePolicy]] = {"isolated": IsolatedMode, "shared_prefix": SharedPrefixMode,
                                      "unified": UnifiedMode}


def mode_policy(config: EngineConfig, planner: PrefixPlanner) -> ModePolicy:
    """The policy of ``config.mode``."""
    return MODES[config.mode](config, planner)
