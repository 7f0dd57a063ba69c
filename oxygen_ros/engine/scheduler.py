"""Admission, preemption, cancellation and continuous batching of language requests.

Like nano-vllm's scheduler, it holds a waiting and a running queue and decides; the engine runs the
model. Memory policy (vLLM-style reservation, simplified to a worst case per request):

* the action task's pages are reserved up front (``action_reserve_blocks``): language requests can
  never take them, so every control cycle can prefill its prefix;
* a language request is admitted only when the pool can hold its worst case
  (``charge = pages(prefix_len + max_new_tokens - 1) + 1`` copy-on-write page) on top of every running
  request's charge. Running requests therefore never run out of pages mid-decode, and the sum of
  charges bounds pool use (sharing only makes real use smaller);
* the request's pages are owned here from admission to its end: :meth:`Scheduler.bind` forks its
  sequence from its prefix, and :meth:`Scheduler.finish` (every end goes through it) frees them;
* when a request does not fit, running requests of lower priority are preempted (status
  ``preempted``) if that makes room; otherwise it waits (``admission: wait``, up to ``max_wait_s`` of
  observation time) or ends as ``dropped`` (``admission: drop``, or a charge above the whole pool).

The step-cost estimate is a high quantile (by default the maximum) of the recent measured decode steps per
batch size (and per prefilled token for prefills); the deadline-aware engine starts a step, or
admits a prefill, only when its estimate fits the slack left before the deadline.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.kv_cache_manager import KVCacheManager, KVSequence
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.types import RequestStatus


def _quantile(samples: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``samples`` with linear interpolation (numpy's default method),
    in plain Python: a step-cost window is a few dozen numbers, observed once per step."""
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


class StepCostEstimator:
    """Online, conservative cost estimates in seconds: decode steps per batch size, prefill per token.

    Each estimate is a high quantile (e.g. p90) of the most recent ``window`` measurements, so a
    few slow steps (another process on the cores, a page fault) make the scheduler more careful
    at once instead of being averaged away. ``estimate_decode(b)`` uses batch size ``b``'s own
    samples when measured, else the estimate of the nearest larger measured batch (decode cost
    grows with the batch), else the largest smaller measured batch scaled linearly by
    ``b / b_known`` (conservative), else None (nothing measured yet).

    Args:
        quantile: the quantile of recent samples used, in (0, 1].
        window: recent samples kept per batch size (and for prefill), >= 1.
    """

    def __init__(self, quantile: float, window: int):
        self._quantile = quantile
        self._window = window
        self._decode_samples: dict[int, deque[float]] = {}
        self._decode: dict[int, float] = {}
        self._prefill_samples: deque[float] = deque(maxlen=window)

    def observe_decode(self, batch: int, seconds: float) -> None:
        samples = self._decode_samples.setdefault(batch, deque(maxlen=self._window))
        samples.append(seconds)
        self._decode[batch] = _quantile(samples, self._quantile)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        # Only kept here: the quantile is taken when an estimate is asked for, after the action chunk.
        if tokens > 0:
            self._prefill_samples.append(seconds / tokens)

    def estimate_decode(self, batch: int) -> float | None:
        if batch in self._decode:
            return self._decode[batch]
        larger = [b for b in self._decode if b > batch]
        if larger:
            return self._decode[min(larger)]
        if self._decode:
            known = max(self._decode)
            return self._decode[known] * batch / known
        return None

    def fitting_batch(self, batch: int, seconds: float) -> int:
        """The largest batch size ``<= batch`` whose estimated step fits in ``seconds`` (0 if none);
        1 while nothing is measured, so the first step taken is the cheapest one."""
        if not self._decode:
            return min(batch, 1) if seconds > 0 else 0
        for size in range(batch, 0, -1):
            if self.estimate_decode(size) <= seconds:
                return size
        return 0

    def estimate_prefill(self, tokens: int) -> float | None:
        if not self._prefill_samples:
            return None
        return _quantile(self._prefill_samples, self._quantile) * tokens


@dataclass
class Admission:
    """One admitted request and the pages reserved for it (its charge, the worst case of the
    whole request); its KV sequence (``request.kv``) exists once :meth:`Scheduler.bind` forked it."""

    request: Request
    reserved_blocks: int

    @property
    def seq(self) -> KVSequence | None:
        """The request's own KV sequence, None until bound."""
        return self.request.kv


@dataclass
class AdmissionPlan:
    """What one :meth:`Scheduler.admit` decided (in the spirit of vLLM's ``KVCacheBlocks``).

    Attributes:
        admitted: the admitted requests with their reserved pages, in admission order.
        forced: admissions over the prefill budget (the guaranteed minimum).
    """

    admitted: list[Admission] = field(default_factory=list)
    forced: int = 0

    @property
    def requests(self) -> list[Request]:
        """The admitted requests, in admission order."""
        return [admission.request for admission in self.admitted]


def action_reserve_blocks(manager: KVCacheManager, cameras: int, image_tokens_per_camera: int,
                          max_prompt_tokens: int | None) -> int:
    """The action task's page reserve: its largest prefix (``cameras`` images of
    ``image_tokens_per_camera`` tokens and a prompt of ``max_prompt_tokens``; None: no prompt
    budget, counted as 0) plus one copy-on-write page for a fork. Language admission never charges
    these pages, so every cycle can prefill its action prefix."""
    return manager.blocks_for(cameras * image_tokens_per_camera + (max_prompt_tokens or 0)) + 1


class Scheduler:
    """Waiting and running language requests over one KV pool.

    Args:
        config: the engine configuration (max batch size, queue bound).
        manager: the KV-cache manager whose pages requests hold.
        action_reserve_blocks: pages kept for the action task's prefix.
        share_blocks: the pages this scheduler may use (its action reserve included): the whole pool
            (None, a single-robot engine) or one robot's share of a fleet's pool.

    Raises:
        ValueError: the pool (or share) is smaller than the action reserve.
    """

    def __init__(self, config: EngineConfig, manager: KVCacheManager, action_reserve_blocks: int,
                 share_blocks: int | None = None):
        share = manager.pool.num_blocks if share_blocks is None else share_blocks
        if action_reserve_blocks > share:
            raise ValueError(f"KV pool of {share} pages cannot reserve "
                             f"{action_reserve_blocks} pages for the action task; raise "
                             "engine.kv_budget_mb")
        self._config = config
        self._manager = manager
        self.language_capacity = share - action_reserve_blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.committed_blocks = 0
        self.forced_admissions = 0      # admissions over the prefill budget in the last admit()
        self._ended: list[Request] = []

    def charge(self, request: Request) -> int:
        """Worst-case pages of ``request``: prefix plus generated tokens plus one copy-on-write."""
        return self._manager.blocks_for(request.prefix_len + request.task.max_new_tokens - 1) + 1

    def add(self, request: Request) -> None:
        """Queue a new request; past ``max_waiting`` the lowest-priority, oldest one is dropped."""
        self.waiting.append(request)
        if len(self.waiting) > self._config.max_waiting:
            victim = min(self.waiting, key=lambda r: (r.task.priority, -r.t_arrival))
            self.waiting.remove(victim)
            self._end(victim, RequestStatus.DROPPED)

    def admit(self, now_stamp: float, prefill_cost: Callable[[Request], int],
              prefill_budget: float, min_admitted: int = 0) -> AdmissionPlan:
        """Admit waiting requests by priority, then age, as far as pool and prefill budget allow.

        Args:
            now_stamp: stamp of the newest observation (s); waiting requests older than their
                task's ``max_wait_s`` are dropped.
            prefill_cost: tokens the engine must prefill to start a request (0 when its prefix is
                already cached this cycle).
            prefill_budget: tokens that may still be prefilled this cycle (``inf`` = no limit).
            min_admitted: the guaranteed minimum: until this many requests are admitted in this
                call, a request whose prefill exceeds the budget is admitted anyway (the pool
                must still hold it). Such admissions are counted in :attr:`forced_admissions`.

        Returns:
            The plan: the admitted requests, now RUNNING with their charge committed (their pages
            come with :meth:`bind`). Requests that end here (dropped, preempted) are reported by
            :meth:`drain_ended`.
        """
        plan = AdmissionPlan()
        admitted = plan.admitted
        self.forced_admissions = 0
        for request in sorted(self.waiting, key=lambda r: (-r.task.priority, r.t_arrival)):
            charge = self.charge(request)
            if charge > self.language_capacity:
                self._remove_waiting(request, RequestStatus.DROPPED)
                continue
            if now_stamp - request.stamp > request.task.max_wait_s:
                self._remove_waiting(request, RequestStatus.DROPPED)
                continue
            cost = prefill_cost(request)
            fits = self.committed_blocks + charge <= self.language_capacity or \
                self._preempt_for(request, charge)
            within_budget = cost <= prefill_budget
            if fits and (within_budget or len(admitted) < min_admitted):
                if within_budget:
                    prefill_budget -= cost
                else:   # the guaranteed minimum: the budget is spent, later ones must fit in 0
                    prefill_budget = 0.0
                    self.forced_admissions += 1
                    plan.forced += 1
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                request.charged_blocks = charge
                self.committed_blocks += charge
                self.running.append(request)
                admitted.append(Admission(request, charge))
            elif not fits and request.task.admission == "drop":
                self._remove_waiting(request, RequestStatus.DROPPED)
        return plan

    def bind(self, admission: Admission, prefix: KVSequence) -> None:
        """Give an admitted request its own sequence: a fork of its prefix ``prefix`` (shared pages;
        its first append copies the shared tail page, which its charge covers)."""
        admission.request.kv = self._manager.fork(prefix)

    def decode_batch(self) -> list[Request]:
        """The running requests one decode step advances: all of them up to ``max_batch_size``,
        highest priority first, then oldest."""
        ready = [r for r in self.running if r.kv is not None and r.output_ids]
        ready.sort(key=lambda r: (-r.task.priority, r.t_arrival))
        return ready[:self._config.max_batch_size]

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a running or waiting request with ``status``; its pages are released at once."""
        if request in self.waiting:
            self._remove_waiting(request, status)
            return
        if request not in self.running:
            raise ValueError(f"request {request.request_id} is not active")
        self.running.remove(request)
        self.committed_blocks -= request.charged_blocks
        request.charged_blocks = 0
        self._end(request, status)

    def find(self, request_id: int) -> Request | None:
        """The active (waiting or running) request with this id, or None."""
        for request in self.waiting + self.running:
            if request.request_id == request_id:
                return request
        return None

    def drain_ended(self) -> list[Request]:
        """Requests that reached a terminal status since the last call, in order."""
        ended, self._ended = self._ended, []
        return ended

    @property
    def active(self) -> list[Request]:
        return self.waiting + self.running

    def _preempt_for(self, request: Request, charge: int) -> bool:
        """Preempt lower-priority running requests if that makes room for ``charge`` pages."""
        victims = sorted((r for r in self.running if r.task.priority < request.task.priority),
                         key=lambda r: (r.task.priority, -r.t_arrival))
        free = self.language_capacity - self.committed_blocks
        chosen = []
        for victim in victims:
            if free >= charge:
                break
            chosen.append(victim)
            free += victim.charged_blocks
        if free < charge:
            return False
        for victim in chosen:
            self.finish(victim, RequestStatus.PREEMPTED)
        return True

    def _remove_waiting(self, request: Request, status: RequestStatus) -> None:
        self.waiting.remove(request)
        self._end(request, status)

    def _end(self, request: Request, status: RequestStatus) -> None:
        # Every end of a request passes here: its pages are freed in this one place.
        if request.kv is not None:
            self._manager.free(request.kv)
            request.kv = None
        request.image_features = None
        request.images = None
        request.status = status
        request.t_finish = time.perf_counter()
        self._ended.append(request)
