"""The unified KV-cache engine: one control cycle per observation.

A cycle (:meth:`Engine.run_cycle`), after OxyGen (arXiv 2603.14371) with a deadline-aware scheduler:

1. the triggers of the language tasks fire (every N frames, every T seconds, on a new instruction);
   a new instruction cancels the running requests of tasks with ``cancel_on_new_instruction``;
2. the newest observation's cameras are encoded in one vision call, the action prompt's prefix is
   prefilled (or found in the cycle's prefix tree) and the action expert denoises from it; the
   :class:`ActionChunk` is handed out at once (``on_action`` callback and the return value);
3. waiting language requests are admitted (pool reservation, priority, preemption), the prefixes
   they need are prefilled in one batched call per tree level, and each request forks its prefix;
4. batched decode steps advance every running request of every frame: ``fixed_k`` runs k steps,
   ``deadline`` runs steps while the online step-cost estimate fits the slack before the deadline
   (shrinking the batch to its highest-priority requests when the whole batch would not fit).

Modes for A/B comparison (same code path, different sharing and batching):
    ``isolated``: every task runs its own vision encoding, its own prefill into a private cache and
    decodes to completion, one task after the other (openpi-style);
    ``shared_prefix``: one encoding per frame and one prefill per distinct prompt; each language
    request then decodes to completion, one after the other;
    ``unified``: sharing plus cross-frame continuous batching under the scheduler.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable

import numpy as np
import torch

from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.config import EngineConfig, TaskConfig
from oxygen_ros.engine.detokenizer import IncrementalDetokenizer
from oxygen_ros.engine.kv_cache_manager import KVCacheManager
from oxygen_ros.engine.metrics import PHASES, CycleRecord, EngineMetrics, RequestRecord
from oxygen_ros.engine.model_runner import ModelRunner, PrefillRow, Processor, WorkCounters
from oxygen_ros.engine.prefix_cache import PrefixCache, PrefixNode
from oxygen_ros.engine.request import Request, new_request_id, sample_tokens
from oxygen_ros.engine.scheduler import Scheduler, StepCostEstimator
from oxygen_ros.engine.types import (ActionChunk, MemoryEntry, Observation, RequestStatus,
                                     TextEvent)


@dataclass
class CycleResult:
    """What one control cycle produced.

    Attributes:
        action: the action chunk of the cycle's observation.
        text_events: partial and final text events of every language request, in order.
        memory_entries: memory-task requests completed during the cycle.
        record: the cycle's measurements.
    """

    action: ActionChunk
    text_events: list[TextEvent]
    memory_entries: list[MemoryEntry]
    record: CycleRecord


@dataclass(frozen=True)
class _Submission:
    """A request asked for with :meth:`Engine.submit`, waiting for the next cycle's observation."""

    request_id: int
    task: TaskConfig            # with the submitted prompt template, if one was given
    instruction: str | None     # replaces the observation's instruction in the prompt; None = keep it


@dataclass
class _PrefixJob:
    """A prefix to find in, or add to, the cycle's prefix tree."""

    path: tuple[Hashable, ...]
    features: torch.Tensor          # [n_cams, tokens, W]
    prompt_ids: tuple[int, ...]
    logits: bool
    pooled: bool


class Engine:
    """Runs the action task and the language tasks of :class:`EngineConfig` on one model.

    Args:
        model: a π0.5 / π0 model with the interface of ``oxygen_ros/engine/model_runner.py``.
        processor: its pre/post-processing (:class:`Processor`).
        config: the engine configuration.

    Raises:
        ValueError: the KV budget cannot hold the action task's reserve.

    Thread safety: :meth:`run_cycle`, :meth:`take_events`, :meth:`flush` and :meth:`close` must be
    called from one thread; :meth:`submit`, :meth:`cancel` and :meth:`cancel_task` may be called from
    any thread.
    """

    def __init__(self, model: Any, processor: Processor, config: EngineConfig):
        self.config = config
        cfg = model.config
        self._pool = BlockPool(cfg.vlm_num_layers, cfg.num_kv_heads, cfg.head_dim,
                               config.block_size, config.kv_budget_bytes, dtype=model.dtype,
                               device=model.device)
        self._manager = KVCacheManager(self._pool)
        self._runner = ModelRunner(model, processor, self._manager, config.cuda_graphs)
        self._processor = processor
        self._model_cfg = cfg
        self._max_prompt_tokens = getattr(cfg, "max_token_len", None)
        image_tokens = len(config.camera_slots) * cfg.num_image_tokens
        prompt_budget = self._max_prompt_tokens or 0
        # Action reserve: the largest action prefix plus one copy-on-write page for a fork.
        self._action_reserve = self._manager.blocks_for(image_tokens + prompt_budget) + 1
        self._scheduler = Scheduler(config, self._manager, self._action_reserve)
        self._estimator = StepCostEstimator(config.step_cost_quantile, config.step_cost_window)
        self._tree = PrefixCache(self._manager)
        self._metrics = EngineMetrics(cfg.action_horizon,
                                      self._pool.num_blocks * self._pool.bytes_per_block,
                                      config.metrics_window)
        self._frame_index = 0
        self._last_instruction: str | None = None
        self._last_fired: dict[str, float] = {}
        self._events: list[TextEvent] = []
        self._memories: list[MemoryEntry] = []
        self._lock = threading.Lock()
        self._pending_cancels: list[Callable[[], None]] = []
        self._cancel_lock = threading.Lock()
        # submit(): requests waiting for the next cycle, and those being started by a cycle (id -> task)
        self._submissions: list[_Submission] = []
        self._starting: dict[int, str] = {}
        self._submit_lock = threading.Lock()
        self._closed = False
        self._timing = dict.fromkeys(PHASES, 0.0)
        self._cycle_batches: list[int] = []
        self._cycle_tokens = 0
        self._cycle_peak_blocks = 0

    # ---- public API -------------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        """The KV pool (occupancy: ``pool.used_bytes``, ``pool.num_used``)."""
        return self._pool

    @property
    def counters(self) -> WorkCounters:
        """Cumulative model work (vision calls, prefilled tokens, decode steps)."""
        return self._runner.counters

    @property
    def active_requests(self) -> list[Request]:
        """Waiting and running language requests."""
        return self._scheduler.active

    def run_cycle(self, obs: Observation, deadline: float | None = None,
                  on_action: Callable[[ActionChunk], None] | None = None) -> CycleResult:
        """Run one control cycle for ``obs`` (see the module docstring).

        Args:
            obs: the newest observation.
            deadline: ``time.perf_counter()`` instant (s) by which the cycle must end; default the
                cycle's start plus ``action.control_period_s``. Only the ``deadline`` scheduling of
                ``unified`` mode spends slack up to it; every mode records misses.
            on_action: called with the action chunk as soon as it is ready (before any language
                work), e.g. to publish it.

        Returns:
            :class:`CycleResult` with the action chunk, the text events and memory entries produced
            during the cycle, and the cycle's record.

        Raises:
            ValueError: an image slot unknown to ``camera_slots``, no camera present, or a prompt
                longer than the model's prompt budget.
            RuntimeError: the engine was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            try:
                return self._run_cycle(obs, deadline, on_action)
            except BaseException:
                # Submissions the failed cycle took but did not queue still end with one final event.
                with self._submit_lock:
                    abandoned, self._starting = self._starting, {}
                for request_id, task in abandoned.items():
                    self._end_by_id(request_id, task, RequestStatus.DROPPED, obs)
                raise

    def warm_up(self, obs: Observation, on_action: Callable[[ActionChunk], None] | None = None) -> float:
        """Run the action path once (encode, prefill, denoise) for ``obs`` and keep nothing of it.

        One-time costs then land here rather than in the first control cycle: on CUDA the capture
        of the vision tower's and the denoising loop's CUDA graphs (one per image count and prefix
        bucket, so use the robot's cameras and a typical instruction), and everywhere lazy kernel
        and allocator initialisation. Language tasks do not fire; triggers, the instruction
        history, metrics, step-cost estimates and the prefix tree are left as they were, and the
        prefix's pages return to the pool at once. The model work is counted in :attr:`counters`.

        Args:
            obs: a typical observation.
            on_action: called with the warm-up's action chunk (e.g. to check it is finite).

        Returns:
            Seconds taken.

        Raises:
            ValueError: as :meth:`run_cycle` for a bad observation.
            RuntimeError: the engine was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            t0 = time.perf_counter()
            saved = (self._timing, copy.deepcopy(self._estimator), self._pool.peak_used_blocks,
                     self._cycle_peak_blocks)
            self._timing = dict.fromkeys(PHASES, 0.0)
            try:
                images, mask = self._camera_images(obs)
                action_ids = self._prompt_ids(self.config.action.prompt_template, obs)
                features = self._encode(images)
                node = self._prefix_nodes([_PrefixJob((("warm-up", obs.seq),), features, action_ids,
                                                      False, False)])[0]
                actions = self._denoise(node, obs)
                if on_action is not None:
                    on_action(ActionChunk(self._processor.actions_out(actions[0], obs.state), obs.seq, obs.stamp,
                                          time.perf_counter() - t0))
            finally:
                self._tree.clear()
                self._timing, self._estimator, self._pool.peak_used_blocks, self._cycle_peak_blocks = saved
            return time.perf_counter() - t0

    def submit(self, task: str, instruction: str | None = None,
               prompt_template: str | None = None) -> int:
        """Queue one request of language task ``task`` for the next cycle (a question asked on demand).

        The next :meth:`run_cycle` starts it from that cycle's observation, as if the task's trigger
        had fired, except that ``instruction`` (when given) replaces the observation's instruction in
        its prompt and ``prompt_template`` (when given) replaces the task's. From then on it is one of
        the task's requests: admission, priority, ``max_new_tokens``, ``cancel_on_new_instruction``.
        Its events carry the returned id, and exactly one final event ends it: also when it is
        cancelled before a cycle started it (:meth:`cancel`, :meth:`cancel_task`, :meth:`flush`,
        :meth:`close`: status ``cancelled``, ``seq`` -1 and ``stamp`` 0.0, no observation), or when
        its prompt does not fit the model's prompt budget (status ``dropped``, that cycle's ``seq``).

        Args:
            task: name of a language task of the config.
            instruction: the instruction for the prompt's ``{instruction}``; None = the observation's.
            prompt_template: a prompt with ``{instruction}`` (and optionally ``{state}``); None = the
                task's.

        Returns:
            The request id its events will carry.

        Raises:
            KeyError: no such task.
            ValueError: ``prompt_template`` without ``{instruction}``.
            RuntimeError: the engine was closed.

        Thread-safe.
        """
        config = self.config.task(task)
        if prompt_template is not None:
            config = replace(config, prompt_template=prompt_template)   # validated by TaskConfig
        submission = _Submission(new_request_id(), config, instruction)
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._submissions.append(submission)
        return submission.request_id

    def take_events(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Events produced between cycles, with no model work: the final events of requests cancelled
        (and of submissions withdrawn) since the last cycle. A caller that skips cycles (no usable
        observation) calls this instead, so that cancellations still end promptly; every event comes
        out exactly once, here or with a later :class:`CycleResult`."""
        with self._lock:
            self._apply_cancels()
            self._report_ended()
            return self._take_outputs()

    def flush(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Run every waiting and running request to its end (no deadline), e.g. at shutdown or at
        the end of a benchmark; returns the events produced. The pool is empty afterwards.
        Submissions no cycle has started end as ``cancelled`` (they have no observation)."""
        with self._lock:
            self._apply_cancels()
            for submission in self._withdraw(lambda s: True):
                self._end_unstarted(submission, RequestStatus.CANCELLED)
            while self._scheduler.active:
                # now_stamp = -inf: no waiting request is too old while flushing.
                self._start(self._scheduler.admit(-float("inf"), self._prefill_cost, float("inf")))
                if not self._scheduler.running and self._scheduler.waiting:
                    # Nothing running and nothing admissible: the rest can never be served.
                    for request in list(self._scheduler.waiting):
                        self._scheduler.finish(request, RequestStatus.DROPPED)
                while self._scheduler.decode_batch():
                    self._decode_step(self._scheduler.decode_batch())
                self._tree.clear()
                self._report_ended()
            return self._take_outputs()

    def cancel(self, request_id: int) -> bool:
        """Cancel an active request (status ``cancelled``); its pages are freed at once, or at the
        next decode-step boundary when a cycle is running on another thread. Its final event comes
        out with the next :class:`CycleResult` (or :meth:`flush` / :meth:`close`).

        Returns:
            True if the request was active.
        """
        withdrawn = self._withdraw(lambda s: s.request_id == request_id)
        if withdrawn:     # submitted, not started: it ends without an observation
            self._defer(lambda: self._end_unstarted(withdrawn[0], RequestStatus.CANCELLED))
            return True
        with self._submit_lock:
            starting = request_id in self._starting
        if starting:      # a cycle is creating it now: cancel it by id once it is queued
            self._defer(lambda: self._cancel_requests(
                [r for r in self._scheduler.active if r.request_id == request_id]))
            return True
        request = self._scheduler.find(request_id)
        if request is None:
            return False
        self._defer(lambda: self._cancel_requests([request]))
        return True

    def cancel_task(self, task: str) -> int:
        """Cancel every active request of language task ``task``; returns how many.

        Raises:
            KeyError: no such task.
        """
        self.config.task(task)
        withdrawn = self._withdraw(lambda s: s.task.name == task)
        with self._submit_lock:
            starting = {rid for rid, name in self._starting.items() if name == task}
        requests = [r for r in self._scheduler.active if r.task.name == task]

        def cancel() -> None:
            for submission in withdrawn:
                self._end_unstarted(submission, RequestStatus.CANCELLED)
            self._cancel_requests(requests + [r for r in self._scheduler.active
                                              if r.request_id in starting and r not in requests])

        self._defer(cancel)
        return len(requests) + len(withdrawn) + len(starting - {r.request_id for r in requests})

    def metrics(self) -> dict:
        """Summary of :class:`EngineMetrics` since the last :meth:`reset_metrics`."""
        self._metrics.peak_pool_bytes = max(self._metrics.peak_pool_bytes,
                                            self._pool.peak_used_bytes)
        return self._metrics.summary()

    @property
    def metrics_records(self) -> EngineMetrics:
        """The metrics: running totals and the windowed per-cycle and per-request records."""
        return self._metrics

    def reset_metrics(self) -> None:
        """Forget records, totals and the pool's peak (e.g. after a benchmark's warm-up). Not
        needed to bound memory: the records are a window of ``config.metrics_window``."""
        self._metrics.reset()
        self._pool.peak_used_blocks = self._pool.num_used

    def close(self) -> list[TextEvent]:
        """Cancel every active request, free all pages and refuse further cycles; returns the
        final events of the cancelled requests."""
        with self._lock:
            with self._submit_lock:
                self._closed = True     # no submit() after this
            self._apply_cancels()
            for submission in self._withdraw(lambda s: True):
                self._end_unstarted(submission, RequestStatus.CANCELLED)
            self._cancel_requests(self._scheduler.active)
            self._tree.clear()
            self._report_ended()
            return self._take_outputs()[0]

    # ---- the cycle --------------------------------------------------------------------------

    def _run_cycle(self, obs: Observation, deadline: float | None,
                   on_action: Callable[[ActionChunk], None] | None) -> CycleResult:
        t0 = time.perf_counter()
        deadline = t0 + self.config.action.control_period_s if deadline is None else deadline
        before = WorkCounters(**vars(self._runner.counters))
        timing = dict.fromkeys(PHASES, 0.0)
        self._timing = timing
        self._apply_cancels()

        images, mask = self._camera_images(obs)
        new_instruction = obs.instruction != self._last_instruction
        self._last_instruction = obs.instruction
        if new_instruction:
            self._cancel_requests([r for r in self._scheduler.active
                                   if r.task.cancel_on_new_instruction])
        fired = [task for task in self.config.language_tasks
                 if self._fires(task, obs, new_instruction)]
        self._frame_index += 1

        action_ids = self._prompt_ids(self.config.action.prompt_template, obs)
        image_tokens = len(images) * self._model_cfg.num_image_tokens
        requests = [Request(task, obs.seq, obs.stamp, self._prompt_ids(task.prompt_template, obs),
                            image_tokens, mask, t0) for task in fired]
        requests += self._start_submissions(obs, image_tokens, mask, t0)

        # Action first: encode, prefill, denoise, hand out the chunk.
        features = self._encode(images)
        isolated = self.config.mode == "isolated"
        action_path = (("isolated-action", obs.seq),) if isolated else \
            self._prefix_path(obs.seq, mask, action_ids)
        logits, pooled = (False, False) if isolated else self._prefix_needs(action_path, requests)
        node = self._prefix_nodes([_PrefixJob(action_path, features, action_ids, logits, pooled)])[0]
        actions = self._denoise(node, obs)
        if isolated:
            self._tree.clear()
        chunk = ActionChunk(self._processor.actions_out(actions[0], obs.state), obs.seq, obs.stamp,
                            time.perf_counter() - t0)
        if on_action is not None:
            on_action(chunk)

        for request in requests:
            if isolated:
                request.images = images
            else:
                request.image_features = features
            self._scheduler.add(request)
        with self._submit_lock:     # submitted requests are now findable by cancel()
            for request in requests:
                self._starting.pop(request.request_id, None)

        # Language work in the slack.
        overloaded = False
        if self.config.mode == "unified":
            overloaded = self._unified_language(obs, deadline)
        else:
            self._run_to_completion(obs)
        self._tree.clear()
        self._report_ended()

        end = time.perf_counter()
        after = self._runner.counters
        record = CycleRecord(
            seq=obs.seq, frame_latency_s=end - t0, action_latency_s=chunk.latency_s,
            decode_steps=after.decode_steps - before.decode_steps,
            batch_sizes=self._cycle_batches, vision_calls=after.vision_calls - before.vision_calls,
            images_encoded=after.images_encoded - before.images_encoded,
            prefilled_tokens=after.prefilled_tokens - before.prefilled_tokens,
            generated_tokens=self._cycle_tokens, deadline_missed=end > deadline,
            overloaded=overloaded,
            pool_used_bytes=self._cycle_peak_blocks * self._pool.bytes_per_block, **timing)
        self._metrics.add_cycle(record)
        self._metrics.peak_pool_bytes = max(self._metrics.peak_pool_bytes,
                                            self._pool.peak_used_bytes)
        events, memories = self._take_outputs()
        return CycleResult(chunk, events, memories, record)

    def _unified_language(self, obs: Observation, deadline: float) -> bool:
        """Admit and decode language requests in the slack before ``deadline``.

        The deadline scheduler guarantees language a minimum every cycle, slack or not:
        ``min_admissions_per_cycle`` admissions (with their prefills) and
        ``min_decode_steps_per_cycle`` decode steps of the whole batch. Language therefore slows
        down under overload but never stops; a request ends only by its own task's rules.

        Returns:
            True when the cycle was overloaded: the slack could not pay for the guaranteed minimum,
            which ran anyway (the cycle overruns its deadline by that work).
        """
        margin = self.config.slack_margin_s
        budget = float("inf")
        deadline_mode = self.config.scheduling == "deadline"
        if deadline_mode:
            per_token = self._estimator.estimate_prefill(1)
            slack = deadline - time.perf_counter() - margin
            if per_token is not None:
                budget = max(0.0, slack) / per_token if per_token > 0 else float("inf")
        minimum = self.config.min_admissions_per_cycle if deadline_mode else 0
        self._start(self._scheduler.admit(obs.stamp, self._prefill_cost, budget, minimum))
        overloaded = self._scheduler.forced_admissions > 0
        steps = 0
        while True:
            self._apply_cancels()
            batch = self._scheduler.decode_batch()
            if not batch:
                break
            if self.config.scheduling == "fixed_k":
                if steps >= self.config.decode_steps_per_cycle:
                    break
            else:
                # The largest highest-priority prefix of the batch whose estimated step cost fits
                # the slack; stepping it also measures that batch size for the estimate. Without
                # slack, the first min_decode_steps_per_cycle steps still run (whole batch).
                size = self._estimator.fitting_batch(
                    len(batch), deadline - time.perf_counter() - margin)
                if size == 0:
                    if steps >= self.config.min_decode_steps_per_cycle:
                        break
                    size = len(batch)
                    overloaded = True
                batch = batch[:size]
            self._decode_step(batch)
            steps += 1
        return overloaded

    def _run_to_completion(self, obs: Observation) -> None:
        """isolated / shared_prefix: each admitted request decodes to its end, one at a time."""
        while True:
            admitted = self._scheduler.admit(obs.stamp, self._prefill_cost, float("inf"))
            if not admitted:
                break
            for request in admitted:
                self._start([request])
                while request.status == RequestStatus.RUNNING:
                    self._apply_cancels()
                    if request.status != RequestStatus.RUNNING:
                        break
                    self._decode_step([request])
                if self.config.mode == "isolated":
                    self._tree.clear()

    # ---- prefill, denoise, decode -----------------------------------------------------------

    def _encode(self, images: list[np.ndarray]) -> torch.Tensor:
        t = time.perf_counter()
        features = self._runner.encode(images)
        self._timing["encode_s"] += time.perf_counter() - t
        return features

    def _prefix_path(self, obs_seq: int, mask: tuple[bool, ...],
                     prompt_ids: tuple[int, ...]) -> tuple[Hashable, ...]:
        """Key path of a prefix in the cycle's tree, split where the model's mask allows."""
        if self._model_cfg.prompt_mask == "causal":
            return (("images", obs_seq, mask), ("prompt", prompt_ids))
        return (("prefix", obs_seq, mask, prompt_ids),)

    def _prefix_needs(self, path: tuple[Hashable, ...], candidates: list[Request]
                      ) -> tuple[bool, bool]:
        """``(logits, pooled)`` a prefix node at ``path`` must keep.

        The cycle's prefix tree prefills each prefix once, so its node must serve every request
        that will fork it, not only the one whose start triggers the prefill: the next-token logits
        if any not-yet-started request among ``candidates`` maps to ``path``, the pooled hidden
        state if any of those is a memory request.
        """
        users = [r for r in candidates if r.kv is None and
                 self._prefix_path(r.obs_seq, r.camera_mask, tuple(r.prompt_ids)) == path]
        return bool(users), any(r.task.kind == "memory" for r in users)

    def _prefix_nodes(self, jobs: list[_PrefixJob]) -> list[PrefixNode]:
        """Find or prefill every job's prefix; one batched prefill per tree level.

        Level 1 is the whole prefix (bidirectional model, or isolated) or the image block (causal
        model: images bidirectional among themselves); level 2 the prompt forks of a causal model
        (prefilled on top of the cached image KV with ``bidirectional_len = 0``). Jobs for the same
        prefix are one prefill whose outputs are the union of their needs (logits OR, pooled OR).
        """
        merged: dict[tuple[Hashable, ...], _PrefixJob] = {}
        for job in jobs:
            first = merged.setdefault(job.path, replace(job))
            first.logits |= job.logits
            first.pooled |= job.pooled
        for depth in (1, 2):
            rows, pending = [], []
            for job in merged.values():
                if len(job.path) < depth or self._tree.lookup(job.path[:depth]) is not None:
                    continue
                if any(job.path[:depth] == other.path[:depth] for other in pending):
                    continue
                pending.append(job)
                last = len(job.path) == depth
                if depth == 1:
                    embeds = job.features.reshape(-1, job.features.shape[-1])
                    # Images are one bidirectional block; the prompt joins it only in openpi's mask.
                    bidirectional = embeds.shape[0]
                    if last:
                        embeds = torch.cat([embeds, self._runner.embed_prompt(job.prompt_ids)])
                        if self._model_cfg.prompt_mask == "bidirectional":
                            bidirectional = embeds.shape[0]
                    rows.append(PrefillRow(self._manager.new_sequence(), embeds, bidirectional))
                else:
                    parent = self._tree.lookup(job.path[:1])
                    rows.append(PrefillRow(self._manager.fork(parent.seq),
                                           self._runner.embed_prompt(job.prompt_ids), 0))
            if not rows:
                continue
            final = [len(job.path) == depth for job in pending]
            want_logits = any(job.logits for job, f in zip(pending, final) if f)
            want_pooled = any(job.pooled for job, f in zip(pending, final) if f)
            t = time.perf_counter()
            logits, pooled = self._runner.prefill(rows, logits=want_logits, pooled=want_pooled)
            elapsed = time.perf_counter() - t
            self._timing["prefill_s"] += elapsed
            self._estimator.observe_prefill(sum(r.embeds.shape[0] for r in rows), elapsed)
            for b, (job, row) in enumerate(zip(pending, rows)):
                self._tree.insert(job.path[:depth], row.seq,
                                  None if logits is None else logits[b],
                                  None if pooled is None else pooled[b])
            self._cycle_peak_blocks = max(self._cycle_peak_blocks, self._pool.num_used)
        return [self._tree.lookup(job.path) for job in jobs]

    def _denoise(self, node: PrefixNode, obs: Observation) -> torch.Tensor:
        cfg = self._model_cfg
        generator = torch.Generator().manual_seed(self.config.action.noise_seed + obs.seq)
        noise = torch.randn((1, cfg.action_horizon, cfg.action_dim), generator=generator)
        t = time.perf_counter()
        actions = self._runner.denoise(node.seq, noise, self.config.action.num_denoise_steps,
                                       self._processor.state_tensor(obs.state))
        self._timing["denoise_s"] += time.perf_counter() - t
        return actions

    def _prefill_cost(self, request: Request) -> int:
        """Tokens to prefill before ``request`` can start, given the cycle's prefix tree."""
        if self.config.mode == "isolated":
            return request.prefix_len
        path = self._prefix_path(request.obs_seq, request.camera_mask, tuple(request.prompt_ids))
        if self._tree.lookup(path) is not None:
            return 0
        if len(path) == 2 and self._tree.lookup(path[:1]) is not None:
            return len(request.prompt_ids)
        return request.prefix_len

    def _start(self, requests: list[Request]) -> None:
        """Prefill (or find) the admitted requests' prefixes, fork them, sample first tokens."""
        if not requests:
            return
        jobs = []
        for request in requests:
            ids = tuple(request.prompt_ids)
            memory = request.task.kind == "memory"
            if self.config.mode == "isolated":
                features = self._encode(request.images)
                jobs.append(_PrefixJob((("isolated", request.request_id),), features, ids,
                                       True, memory))
            else:
                path = self._prefix_path(request.obs_seq, request.camera_mask, ids)
                node = self._tree.lookup(path)
                if node is not None and (node.logits is None or (memory and node.pooled is None)):
                    raise RuntimeError("a shared prefix was prefilled without the logits or pooled "
                                       "state its requests need")
                logits, pooled = self._prefix_needs(path, self._scheduler.active)
                jobs.append(_PrefixJob(path, request.image_features, ids, logits, pooled))
        nodes = self._prefix_nodes(jobs)
        now = time.perf_counter()
        for request, node in zip(requests, nodes):
            request.kv = self._manager.fork(node.seq)
            request.image_features = None
            request.images = None
            request.pooled = node.pooled
            request.next_logits = node.logits
        tokens = sample_tokens(torch.stack([r.next_logits for r in requests]), requests)
        for request, token in zip(requests, tokens):
            request.t_first_token = now
            self._append_token(request, token)

    def _decode_step(self, batch: list[Request]) -> None:
        t = time.perf_counter()
        logits = self._runner.decode_step([r.kv for r in batch], [r.output_ids[-1] for r in batch])
        tokens = sample_tokens(logits, batch)
        elapsed = time.perf_counter() - t
        self._estimator.observe_decode(len(batch), elapsed)
        self._timing["decode_s"] += elapsed
        self._cycle_batches.append(len(batch))
        self._cycle_peak_blocks = max(self._cycle_peak_blocks, self._pool.num_used)
        for request, token in zip(batch, tokens):
            self._append_token(request, token)

    def _append_token(self, request: Request, token: int) -> None:
        """Record a sampled token, stream its text, and finish the request when it is done.

        The text goes through the request's :class:`IncrementalDetokenizer` (a trailing stop token
        is not text): a partial event carries the text that became stable, none is sent while the
        text is held back, and ``request.text`` is always the concatenation of the deltas sent.
        """
        request.output_ids.append(token)
        self._cycle_tokens += 1
        eos = self._model_cfg.eos_token_id
        if request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(self._processor.detokenize)
        done = request.is_done(eos)
        if not (done and token in request.stop_tokens(eos)):
            request.detokenizer.add(token)
        if done:
            # The final event (from _report_ended) carries the last delta and the whole text.
            self._scheduler.finish(request, RequestStatus.COMPLETED)
            return
        text = request.detokenizer.text
        if len(text) > len(request.text):
            delta, request.text = text[len(request.text):], text
            self._events.append(self._event(request, delta, final=False))

    # ---- helpers ----------------------------------------------------------------------------

    def _camera_images(self, obs: Observation) -> tuple[list[np.ndarray], tuple[bool, ...]]:
        unknown = set(obs.images) - set(self.config.camera_slots)
        if unknown:
            raise ValueError(f"observation has camera slots {sorted(unknown)} not in "
                             f"camera_slots {list(self.config.camera_slots)}")
        images = [obs.images.get(slot) for slot in self.config.camera_slots]
        mask = tuple(image is not None for image in images)
        if not any(mask):
            raise ValueError(f"observation {obs.seq} has no camera image")
        return [image for image in images if image is not None], mask

    def _start_submissions(self, obs: Observation, image_tokens: int, mask: tuple[bool, ...],
                           t_arrival: float) -> list[Request]:
        """Requests for the submissions waiting for this cycle's observation ``obs`` (see
        :meth:`submit`); a prompt over the model's budget ends its submission as ``dropped``."""
        with self._submit_lock:
            submissions, self._submissions = self._submissions, []
            self._starting.update((s.request_id, s.task.name) for s in submissions)
        requests = []
        for submission in submissions:
            try:
                ids = self._prompt_ids(submission.task.prompt_template, obs, submission.instruction)
            except ValueError:    # over the prompt budget: this request only is dropped
                with self._submit_lock:
                    self._starting.pop(submission.request_id, None)
                self._end_unstarted(submission, RequestStatus.DROPPED, obs)
                continue
            requests.append(Request(submission.task, obs.seq, obs.stamp, list(ids), image_tokens,
                                    mask, t_arrival, request_id=submission.request_id))
        return requests

    def _withdraw(self, which: Callable[[_Submission], bool]) -> list[_Submission]:
        """Remove and return the submissions no cycle has started that ``which`` selects."""
        with self._submit_lock:
            taken = [s for s in self._submissions if which(s)]
            self._submissions = [s for s in self._submissions if not which(s)]
        return taken

    def _end_unstarted(self, submission: _Submission, status: RequestStatus,
                       obs: Observation | None = None) -> None:
        """The final event (and request record) of a submission that never became a request."""
        self._end_by_id(submission.request_id, submission.task.name, status, obs)

    def _end_by_id(self, request_id: int, task: str, status: RequestStatus,
                   obs: Observation | None) -> None:
        seq, stamp = (-1, 0.0) if obs is None else (obs.seq, obs.stamp)
        self._events.append(TextEvent(request_id, task, seq, stamp, "", "", [], True, status))
        self._metrics.add_request(RequestRecord(request_id, task, status.value, 0, None, 0.0))

    def _prompt_ids(self, template: str, obs: Observation,
                    instruction: str | None = None) -> tuple[int, ...]:
        """Token ids of ``template`` for ``obs`` (its instruction, or ``instruction`` when given).

        Raises:
            ValueError: longer than the model's prompt budget.
        """
        instruction = obs.instruction if instruction is None else instruction
        ids = tuple(self._processor.prompt_ids(template, instruction, obs.state))
        if self._max_prompt_tokens is not None and len(ids) > self._max_prompt_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the model's budget of "
                             f"{self._max_prompt_tokens} tokens")
        return ids

    def _fires(self, task: TaskConfig, obs: Observation, new_instruction: bool) -> bool:
        trigger = task.trigger
        last = self._last_fired.get(task.name)
        if last is not None and obs.stamp < last:
            # Stamps went backwards (a bag replayed in a loop, a simulator's clock reset): the period
            # restarts from the new time instead of waiting for the stamps to pass the old one.
            last = self._last_fired[task.name] = obs.stamp
        fire = (trigger.on_new_instruction and new_instruction) or \
            (trigger.every_n_frames is not None and self._frame_index % trigger.every_n_frames == 0) \
            or (trigger.every_s is not None and (last is None or obs.stamp - last >= trigger.every_s))
        if fire:
            self._last_fired[task.name] = obs.stamp
        return fire

    def _event(self, request: Request, delta: str, final: bool) -> TextEvent:
        return TextEvent(request.request_id, request.task.name, request.obs_seq, request.stamp,
                         delta, request.text, list(request.output_ids), final, request.status)

    def _report_ended(self) -> None:
        """Final events, memory entries and records of requests that ended."""
        for request in self._scheduler.drain_ended():
            # The held-back text ends the stream: the final delta makes the deltas add up to the text.
            if request.detokenizer is not None:
                request.detokenizer.finish()
                full = request.detokenizer.text
            else:
                full = ""
            delta, request.text = full[len(request.text):], full
            self._events.append(self._event(request, delta, final=True))
            if request.task.kind == "memory" and request.status == RequestStatus.COMPLETED:
                embedding = None if request.pooled is None else \
                    request.pooled.float().cpu().numpy()
                self._memories.append(MemoryEntry(request.request_id, request.task.name,
                                                  request.obs_seq, request.stamp, request.text,
                                                  embedding))
            self._metrics.add_request(RequestRecord(
                request.request_id, request.task.name, request.status.value,
                len(request.output_ids),
                None if request.t_first_token is None else request.t_first_token - request.t_arrival,
                request.t_finish - request.t_arrival))
            request.pooled = None
            request.next_logits = None

    def _take_outputs(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        events, memories = self._events, self._memories
        self._events, self._memories = [], []
        self._cycle_batches, self._cycle_tokens, self._cycle_peak_blocks = [], 0, self._pool.num_used
        return events, memories

    def _cancel_requests(self, requests: list[Request]) -> None:
        for request in requests:
            if not request.status.terminal:
                self._scheduler.finish(request, RequestStatus.CANCELLED)

    def _defer(self, action: Callable[[], None]) -> None:
        """Apply a cancellation now if no cycle runs, else at the next decode-step boundary."""
        with self._cancel_lock:
            self._pending_cancels.append(action)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_cancels()
                self._report_ended()
            finally:
                self._lock.release()

    def _apply_cancels(self) -> None:
        with self._cancel_lock:
            pending, self._pending_cancels = self._pending_cancels, []
        for action in pending:
            action()
