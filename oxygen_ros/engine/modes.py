"""One policy per engine mode: where prefixes come from and how a cycle spends its language work.

Modes for A/B comparison (same code path, different sharing and batching):
    ``isolated`` (:class:`IsolatedMode`): every task runs its own vision encoding, its own prefill
    into a private cache and decodes to completion, one task after the other (openpi-style);
    ``shared_prefix`` (:class:`SharedPrefixMode`): one encoding per frame and one prefill per
    distinct prompt; each language request then decodes to completion, one after the other;
    ``unified`` (:class:`UnifiedMode`): sharing plus cross-frame continuous batching under the
    scheduler (``fixed_k`` steps per cycle or the ``deadline`` scheduling).
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

import numpy as np
import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.language import LanguageWork
from oxygen_ros.engine.prefix_cache import PrefixJob, PrefixPlanner
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.scheduler import AdmissionPlan
from oxygen_ros.engine.types import Observation, RequestStatus


class ModePolicy:
    """A mode's decisions; the defaults are the shared-prefix behaviour, which the modes refine.

    Args:
        config: the engine configuration.
        planner: the cycle's prefix planner.
        robot: the robot id of a fleet's lane (its prefix keys), None for a single-robot engine.
    """

    def __init__(self, config: EngineConfig, planner: PrefixPlanner, robot: Hashable = None):
        self.config = config
        self.planner = planner
        self.robot = robot

    def action_job(self, obs: Observation, mask: tuple[bool, ...], action_ids: tuple[int, ...],
                   features: torch.Tensor, requests: list[Request]) -> PrefixJob:
        """The action prefix's job; it keeps what this cycle's ``requests`` that share it need."""
        path = self.planner.path(obs.seq, mask, action_ids, self.robot)
        logits, pooled = self.planner.needs(path, requests)
        return PrefixJob(path, features, action_ids, logits, pooled)

    def action_done(self) -> None:
        """After the action chunk: nothing to drop (the tree serves the cycle's requests)."""

    def keep_inputs(self, request: Request, images: list[np.ndarray], features: torch.Tensor) -> None:
        """What a new request keeps until it is prefilled: the frame's shared vision encoding."""
        request.image_features = features

    def prefill_cost(self, request: Request) -> int:
        """Tokens to prefill before ``request`` can start."""
        return self.planner.cost(request)

    def request_job(self, request: Request, work: LanguageWork) -> PrefixJob:
        """The prefix job that starts ``request``."""
        return self.planner.job(request, work.scheduler.active)

    def language(self, work: LanguageWork, obs: Observation, deadline: float) -> bool:
        """The cycle's language work after the action chunk; True when the cycle was overloaded.

        Here: each admitted request decodes to its end, one at a time.
        """
        while True:
            plan = work.admit(obs.stamp, float("inf"))
            if not plan.admitted:
                return False
            for admission in plan.admitted:
                request = admission.request
                work.start(AdmissionPlan([admission]))
                while request.status == RequestStatus.RUNNING:
                    work.apply_cancels()
                    if request.status != RequestStatus.RUNNING:
                        break
                    work.step([request])
                self.request_done()

    def request_done(self) -> None:
        """After a request decoded to its end (run-to-completion modes)."""


class SharedPrefixMode(ModePolicy):
    """One encoding per frame, one prefill per distinct prompt, each request decoded to its end."""


class IsolatedMode(ModePolicy):
    """Nothing shared: private prefixes, one vision call per task, the tree dropped after each."""

    def action_job(self, obs, mask, action_ids, features, requests) -> PrefixJob:
        return PrefixJob((("isolated-action", self.robot, obs.seq),), features, action_ids, False, False)

    def action_done(self) -> None:
        self.planner.tree.clear()

    def keep_inputs(self, request, images, features) -> None:
        request.images = images       # each request runs its own vision encoding

    def prefill_cost(self, request: Request) -> int:
        return request.prefix_len

    def request_job(self, request: Request, work: LanguageWork) -> PrefixJob:
        return PrefixJob((("isolated", self.robot, request.request_id),), work.encode(request.images),
                         tuple(request.prompt_ids), True, request.task.kind == "memory")

    def request_done(self) -> None:
        self.planner.tree.clear()


class UnifiedMode(ModePolicy):
    """Sharing plus cross-frame continuous batching in the slack before the deadline."""

    def language(self, work: LanguageWork, obs: Observation, deadline: float) -> bool:
        """Admit and decode language requests in the slack before ``deadline``.

        ``fixed_k`` runs ``decode_steps_per_cycle`` steps of the whole batch. ``deadline`` admits
        what the slack pays for by the online prefill estimate and runs steps while the estimated
        step cost fits the slack, shrinking the batch to its highest-priority requests when the
        whole batch would not fit. It guarantees language a minimum every cycle, slack or not:
        ``min_admissions_per_cycle`` admissions (with their prefills) and
        ``min_decode_steps_per_cycle`` steps of the whole batch; language therefore slows down under
        overload but never stops, and a request ends only by its own task's rules.

        Returns:
            True when the slack could not pay for the guaranteed minimum, which ran anyway (the
            cycle overruns its deadline by that work).
        """
        config, estimator = self.config, work.meter.estimator
        deadline_mode = config.scheduling == "deadline"
        plan = work.admit(obs.stamp, admission_budget(config, estimator, deadline),
                          config.min_admissions_per_cycle if deadline_mode else 0)
        work.start(plan)
        overloaded = decode_within_budget(config, estimator, deadline, work.apply_cancels,
                                          work.scheduler.decode_batch, work.step)
        return overloaded or plan.forced > 0


def admission_budget(config: EngineConfig, estimator, deadline: float) -> float:
    """Prefill tokens the slack before ``deadline`` pays for by the online prefill estimate
    (``deadline`` scheduling; unbounded for ``fixed_k`` or before the first measurement)."""
    if config.scheduling != "deadline":
        return float("inf")
    per_token = estimator.estimate_prefill(1)
    if per_token is None:
        return float("inf")
    slack = deadline - time.perf_counter() - config.slack_margin_s
    return max(0.0, slack) / per_token if per_token > 0 else float("inf")


def decode_within_budget(config: EngineConfig, estimator, deadline: float, apply_cancels: Callable[[], None],
                         decode_batch: Callable[[], list], step: Callable[[list], None]) -> bool:
    """Batched decode steps until the batch is empty or the budget is spent (one engine's requests or
    a fleet's, through the three callables).

    ``fixed_k`` runs ``decode_steps_per_cycle`` steps of the whole batch. ``deadline`` runs steps while
    the estimated step cost fits the slack, shrinking the batch to its largest highest-priority prefix
    that fits (stepping it also measures that batch size for the estimate); without slack the first
    ``min_decode_steps_per_cycle`` steps still run with the whole batch.

    Returns:
        True when the guaranteed minimum ran without slack to pay for it.
    """
    deadline_mode = config.scheduling == "deadline"
    margin = config.slack_margin_s
    overloaded = False
    steps = 0
    while True:
        apply_cancels()
        batch = decode_batch()
        if not batch:
            break
        if not deadline_mode:
            if steps >= config.decode_steps_per_cycle:
                break
        else:
            size = estimator.fitting_batch(len(batch), deadline - time.perf_counter() - margin)
            if size == 0:
                if steps >= config.min_decode_steps_per_cycle:
                    break
                size = len(batch)
                overloaded = True
            batch = batch[:size]
        step(batch)
        steps += 1
    return overloaded


MODES: dict[str, type[ModePolicy]] = {"isolated": IsolatedMode, "shared_prefix": SharedPrefixMode,
                                      "unified": UnifiedMode}


def mode_policy(config: EngineConfig, planner: PrefixPlanner, robot: Hashable = None) -> ModePolicy:
    """The policy of ``config.mode`` (for ``robot``'s lane of a fleet, or a single robot: None)."""
    return MODES[config.mode](config, planner, robot)
