"""Language work: start admitted requests from their prefixes, advance them by batched decode steps.

The engine's mode policy (``oxygen_ros/engine/modes.py``) decides how much of this work a cycle does
and in which order; :class:`LanguageWork` does it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from oxygen_ros.engine.kv_cache_manager import KVCacheManager
from oxygen_ros.engine.meter import CycleMeter
from oxygen_ros.engine.model_runner import ModelRunner
from oxygen_ros.engine.outputs import OutputAssembler
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.prefix_cache import PrefixJob, PrefixNode, PrefixPlanner
from oxygen_ros.engine.request import Request, sample_tokens
from oxygen_ros.engine.scheduler import AdmissionPlan, Scheduler
from oxygen_ros.engine.types import RequestStatus

if TYPE_CHECKING:
    from oxygen_ros.engine.modes import ModePolicy


class LanguageWork:
    """Admission, prefix, first token and decode steps of language requests.

    Args:
        scheduler: admission and the requests' pages.
        planner: the cycle's prefix tree and its prefills.
        manager: the KV pages (a decode step's page for its token).
        runner: the model calls.
        outputs: streaming text and final events.
        apply_cancels: applies cancellations asked for from other threads (called at every decode
            step boundary).
        io: the robot's pre/post-processing for its camera images (None: the runner's).

    Attributes:
        mode: the engine's mode policy (set by the engine; it decides how requests get prefixes).
        meter: the measurement of the current stretch of work (set by the engine per stretch).
    """

    def __init__(self, scheduler: Scheduler, planner: PrefixPlanner, manager: KVCacheManager,
                 runner: ModelRunner, outputs: OutputAssembler, apply_cancels: Callable[[], None],
                 io: ModelIO | None = None):
        self.scheduler = scheduler
        self.io = io
        self.planner = planner
        self._manager = manager
        self._runner = runner
        self._outputs = outputs
        self.apply_cancels = apply_cancels
        self.mode: ModePolicy | None = None
        self.meter: CycleMeter | None = None

    def encode(self, images: list[np.ndarray]) -> torch.Tensor:
        """One vision call for ``images`` (timed as ``encode_s``)."""
        with self.meter.phase("encode_s"):
            return self._runner.encode(images, self.io)

    def admit(self, now_stamp: float, prefill_budget: float, minimum: int = 0) -> AdmissionPlan:
        """:meth:`Scheduler.admit` with the mode's prefill costs."""
        return self.scheduler.admit(now_stamp, self.mode.prefill_cost, prefill_budget, minimum)

    def start(self, plan: AdmissionPlan) -> None:
        """Prefill (or find) the admitted requests' prefixes, bind their sequences, sample their
        first tokens."""
        if not plan.requests:
            return
        self.begin(plan, self.planner.nodes(self.jobs(plan), self.meter))

    def jobs(self, plan: AdmissionPlan) -> list[PrefixJob]:
        """The prefix jobs of the admitted requests of ``plan`` (a fleet prefills the jobs of every
        robot in one batched call per tree level)."""
        return [self.mode.request_job(request, self) for request in plan.requests]

    def begin(self, plan: AdmissionPlan, nodes: list[PrefixNode]) -> None:
        """Bind the admitted requests of ``plan`` to forks of their prefix ``nodes`` (in order) and
        sample their first tokens."""
        requests = plan.requests
        if not requests:
            return
        now = time.perf_counter()
        for admission, node in zip(plan.admitted, nodes):
            self.scheduler.bind(admission, node.seq)
            request = admission.request
            request.image_features = None
            request.images = None
            request.pooled = node.pooled
            request.next_logits = node.logits
        tokens = sample_tokens(torch.stack([r.next_logits for r in requests]), requests)
        for request, token in zip(requests, tokens):
            request.t_first_token = now
            self.add_token(request, token)

    def step(self, batch: list[Request]) -> None:
        """One batched decode step of ``batch`` (one token each)."""
        t = time.perf_counter()
        for request in batch:   # within the request's admission charge: cannot fail
            self._manager.prepare_append(request.kv, 1)
        logits = self._runner.decode_step([r.kv for r in batch], [r.output_ids[-1] for r in batch])
        tokens = sample_tokens(logits, batch)
        self.meter.decode_step(len(batch), time.perf_counter() - t)
        for request, token in zip(batch, tokens):
            self.add_token(request, token)

    def drain(self) -> None:
        """Run every waiting and running request to its end, with no deadline (a flush)."""
        while self.scheduler.active:
            # now_stamp = -inf: no waiting request is too old while draining.
            self.start(self.admit(-float("inf"), float("inf")))
            if not self.scheduler.running and self.scheduler.waiting:
                # Nothing running and nothing admissible: the rest can never be served.
                for request in list(self.scheduler.waiting):
                    self.scheduler.finish(request, RequestStatus.DROPPED)
            while self.scheduler.decode_batch():
                self.step(self.scheduler.decode_batch())
            self.planner.tree.clear()
            self._outputs.ended(self.scheduler.drain_ended())

    def add_token(self, request: Request, token: int) -> None:
        """Count, stream and (on a stop token or the last allowed one) complete ``request``'s new ``token``."""
        self.meter.tokens += 1
        if self._outputs.add_token(request, token):
            self.scheduler.finish(request, RequestStatus.COMPLETED)
