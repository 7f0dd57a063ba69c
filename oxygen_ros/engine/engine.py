"""The unified KV-cache engine: one control cycle per observation.

A cycle (:meth:`Engine.run_cycle`), after OxyGen (arXiv 2603.14371) with a deadline-aware scheduler:

1. observe (``inputs.py``): cross-thread cancellations apply (``inbox.py``), triggers fire
   (``triggers.py``), a new instruction cancels the requests of tasks with
   ``cancel_on_new_instruction`` (there only), the cameras and prompts are read;
2. act: one vision call for the cameras, the action prefix prefilled or found in the cycle's prefix
   tree (``prefix_cache.py``), denoising (``action.py``); the :class:`ActionChunk` is handed out at once.
   With π0.5's subtask loop (``action.subtask_task``) the action prompt carries the robot's latest
   subtask, the text of the source task's latest request that completed on a stop token (``subtask.py``);
3. admit: the scheduler admits waiting language requests (``scheduler.py``: page reservation,
   priority, preemption); their prefixes are prefilled in one batched call per tree level;
4. decode within the budget: batched decode steps of every running request of every frame, as the
   mode's policy decides (``modes.py``: ``fixed_k`` / ``deadline`` scheduling, or to completion);
5. report: final events, memory entries and records (``outputs.py``, ``meter.py``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Hashable

from oxygen_ros.engine.action import ActionWork
from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.core import EngineCore
from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.inbox import Inbox
from oxygen_ros.engine.language import LanguageWork
from oxygen_ros.engine.inputs import ObservationReader, Observer
from oxygen_ros.engine.lane import EngineLane
from oxygen_ros.engine.meter import CycleMeter
from oxygen_ros.engine.metrics import EngineMetrics
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.model_runner import RunnerModel, WorkCounters
from oxygen_ros.engine.modes import mode_policy
from oxygen_ros.engine.outputs import CycleResult, OutputAssembler
from oxygen_ros.engine.prefix_cache import PrefixJob
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.scheduler import StepCostEstimator, action_reserve_blocks
from oxygen_ros.engine.subtask import SubtaskState
from oxygen_ros.engine.triggers import Triggers
from oxygen_ros.engine.types import ActionChunk, MemoryEntry, Observation, RequestStatus, TextEvent


class Engine:
    """Runs the action and language tasks of ``config`` on a π0.5 / π0 ``model``
    (:class:`~oxygen_ros.engine.model_runner.RunnerModel`) with its pre/post-processing
    ``processor`` (:class:`~oxygen_ros.engine.model_io.ModelIO`). ``core``, ``robot_id``: a
    :class:`~oxygen_ros.engine.fleet.Fleet` builds each robot's engine (its lane) on the fleet's
    shared :class:`EngineCore`, with a share of the pool of ``config.kv_budget_mb``; a single-robot
    engine (the default) builds its own core and uses the whole pool.

    Raises ValueError when the KV budget cannot hold the action task's reserve. :meth:`submit`,
    :meth:`cancel` and :meth:`cancel_task` may be called from any thread (``inbox.py``); the other
    methods from one thread.
    """

    def __init__(self, model: RunnerModel, processor: ModelIO, config: EngineConfig, *,
                 core: EngineCore | None = None, robot_id: Hashable = None):
        self.config, self.robot_id = config, robot_id
        cfg = model.config
        own = core is None
        self._core = core = EngineCore(model, processor, config) if own else core
        self._pool, self._manager, self._runner = core.pool, core.manager, core.runner
        self._planner, self._estimator, self._lock = core.planner, core.estimator, core.lock
        max_prompt = getattr(cfg, "max_token_len", None)
        self._inputs = ObservationReader(config, processor, max_prompt, cfg.num_image_tokens, robot_id)
        self._action_reserve = action_reserve_blocks(self._manager, len(config.camera_slots),
                                                     cfg.num_image_tokens, max_prompt)
        self._scheduler = core.scheduler(config, self._action_reserve, robot_id, shared=not own)
        self._metrics = EngineMetrics(cfg.action_horizon, self._pool.num_blocks * self._pool.bytes_per_block,
                                      config.metrics_window)
        self._outputs = OutputAssembler(processor, cfg.eos_token_id, self._metrics)
        self._inbox = Inbox(self._scheduler, self._outputs, self._lock, lambda: self._lane.report_ended())
        self._work = LanguageWork(self._scheduler, self._planner, self._manager, self._runner,
                                  self._outputs, self._inbox.apply, processor)
        self._mode = self._work.mode = mode_policy(config, self._planner, robot_id)
        self._action = ActionWork(config.action, self._planner, self._runner, processor,
                                  cfg.action_horizon, cfg.action_dim)
        # The robot's latest subtask (pi0.5's subtask loop, action.subtask_task; inert when off).
        self._subtask = SubtaskState(config.action, cfg.eos_token_id)
        self._observer = Observer(self._inputs, Triggers(config.language_tasks), self._subtask, self._inbox,
                                  self._scheduler)
        self._lane = EngineLane(config, robot_id, inputs=self._inputs, observer=self._observer, inbox=self._inbox,
                                scheduler=self._scheduler, work=self._work, mode=self._mode, action=self._action,
                                subtask=self._subtask, outputs=self._outputs, metrics=self._metrics)

    # ---- the cycle ---------------------------------------------------------------------------

    def run_cycle(self, obs: Observation, deadline: float | None = None,
                  on_action: Callable[[ActionChunk], None] | None = None) -> CycleResult:
        """Run one control cycle for the newest observation ``obs`` (module docstring); every output
        of the returned :class:`CycleResult` carries ``obs.tag``. ``deadline``: the
        ``time.perf_counter()`` instant (s) the cycle must end by (default: its start plus
        ``action.control_period_s``); ``on_action`` gets the chunk before any language work.
        Raises ValueError for an unknown camera slot, no camera, or a prompt over the model's
        budget; RuntimeError once closed.
        """
        with self._lock:
            self._inbox.check_open()
            t0 = time.perf_counter()
            deadline = t0 + self.config.action.control_period_s if deadline is None else deadline
            try:
                self._work.meter = meter = self._meter()
                frame = self._observer.observe(obs, t0)
                # act: encode, prefill, denoise, hand out
                features = self._work.encode(frame.images)
                chunk = self._act(obs, self._mode.action_job(obs, frame.mask, frame.action_ids, features,
                                                             frame.requests), t0, frame.subtask)
                if on_action is not None:
                    on_action(chunk)
                # admit, then decode within the budget
                self._lane.enqueue(frame, features)
                overloaded = self._mode.language(self._work, obs, deadline)
            except BaseException:
                self._inbox.abandon(obs)   # submissions it took still end with one final event
                raise
            # report
            self._planner.tree.clear()
            self._lane.report_ended()
            end = time.perf_counter()
            record = meter.record(obs.seq, end - t0, chunk.latency_s, end > deadline, overloaded)
            self._lane.record_cycle(record, self._pool.peak_used_bytes)
            return CycleResult(chunk, self._outputs.take(), record)

    def _act(self, obs: Observation, job: PrefixJob, t0: float, subtask: str | None = None) -> ActionChunk:
        chunk = self._action.run(obs, job, t0, self._work.meter, subtask)
        self._mode.action_done()
        return chunk

    # ---- between cycles ----------------------------------------------------------------------

    def warm_up(self, obs: Observation, on_action: Callable[[ActionChunk], None] | None = None) -> float:
        """Run the action path once for a typical ``obs``, keep nothing of it, return seconds: one-time
        costs (CUDA graph capture per image count and prefix bucket, lazy initialisation) land here,
        not in the first cycle. A throw-away meter measures it: triggers, metrics, step-cost
        estimates and the pool's peak stay as they were. Raises as :meth:`run_cycle`."""
        with self._lock:
            self._inbox.check_open()
            t0, peak = time.perf_counter(), self._pool.peak_used_blocks
            try:
                self._work.meter = self._meter(StepCostEstimator(self.config.step_cost_quantile, 1))
                frame = self._lane.action_frame(obs)
                job = PrefixJob((("warm-up", self.robot_id, obs.seq),), self._work.encode(frame.images),
                                frame.action_ids, False, False)
                chunk = self._act(obs, job, t0)
                if on_action is not None:
                    on_action(chunk)
            finally:
                self._planner.tree.clear()
                self._pool.peak_used_blocks = peak      # warm-up pages are no robot's peak
            return time.perf_counter() - t0

    def submit(self, task: str, instruction: str | None = None, prompt_template: str | None = None) -> int:
        """Queue a request of language task ``task`` for the next cycle; returns its id. The next
        cycle starts it as if the task's trigger had fired, with ``instruction`` and
        ``prompt_template`` (when given) replacing the observation's and the task's. One final
        event ends it: also when cancelled before a cycle took it (``cancelled``, ``seq`` -1, stamp
        0.0, no tag) or when its prompt is over the budget (``dropped``). Raises KeyError (no such
        task), ValueError (template without ``{instruction}``), RuntimeError (closed).
        """
        config = self.config.task(task)
        if prompt_template is not None:
            config = replace(config, prompt_template=prompt_template)   # validated by TaskConfig
        return self._inbox.submit(config, instruction)

    def cancel(self, request_id: int) -> bool:
        """Cancel an active or submitted request (status ``cancelled``); True if it was. Its pages
        are freed at once, or at the next decode-step boundary of a running cycle; its final event
        comes with the next :class:`CycleResult` (or :meth:`take_events`, :meth:`flush`, :meth:`close`)."""
        return self._inbox.cancel(request_id)

    def cancel_task(self, task: str) -> int:
        """Cancel every active request of language task ``task`` (KeyError if none); how many."""
        self.config.task(task)
        return self._inbox.cancel_task(task)

    def take_events(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Events produced between cycles with no model work (final events of requests cancelled
        since the last cycle), for a caller that skips cycles; every event comes out exactly once,
        here or with a later :class:`CycleResult`."""
        with self._lock:
            self._inbox.apply()
            self._lane.report_ended()
            return self._outputs.take_with_memory()

    def flush(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Run every waiting and running request to its end (no deadline) and return the events;
        the pool is empty afterwards. Submissions no cycle has started end as ``cancelled``."""
        with self._lock:
            self._inbox.apply()
            self._inbox.withdraw_all(RequestStatus.CANCELLED)
            self._work.meter = self._meter()
            self._work.drain()
            return self._outputs.take_with_memory()

    def close(self) -> list[TextEvent]:
        """Cancel every active request, free all pages and refuse further cycles; returns the
        final events of the cancelled requests."""
        with self._lock:
            self._inbox.close()     # no submit() after this
            self._inbox.apply()
            self._inbox.cancel_all()
            self._planner.tree.clear()
            self._lane.report_ended()
            return self._outputs.take()

    # ---- what it reports ---------------------------------------------------------------------

    @property
    def lane(self) -> EngineLane:
        """This robot's cycle steps for a :class:`~oxygen_ros.engine.fleet.Fleet` that batches them across
        robots (``lane.py``); a single-robot engine's own cycle runs the same steps."""
        return self._lane

    @property
    def pool(self) -> BlockPool:
        """The KV pool (occupancy: ``pool.used_bytes``, ``pool.num_used``)."""
        return self._pool

    @property
    def counters(self) -> WorkCounters:
        """Cumulative model work (vision calls, prefilled tokens, decode steps)."""
        return self._runner.counters

    @property
    def subtask(self) -> SubtaskState:
        """The robot's latest subtask and the loop's counters (``subtask.py``)."""
        return self._subtask

    @property
    def active_requests(self) -> list[Request]:
        """Waiting and running language requests."""
        return self._scheduler.active

    def metrics(self) -> dict:
        """Summary of :class:`EngineMetrics` since the last :meth:`reset_metrics`."""
        self._metrics.note_pool_peak(self._pool.peak_used_bytes)
        return self._metrics.summary()

    @property
    def metrics_records(self) -> EngineMetrics:
        """The metrics: running totals and the windowed per-cycle and per-request records."""
        return self._metrics

    def reset_metrics(self) -> None:
        """Forget records, totals and the pool's peak (e.g. after a benchmark's warm-up)."""
        self._metrics.reset()
        self._pool.peak_used_blocks = self._pool.num_used

    def _meter(self, estimator: StepCostEstimator | None = None) -> CycleMeter:
        return CycleMeter(self._pool, estimator or self._estimator, self._runner.counters)
