"""Many robots on one engine: one model, one KV pool, cross-robot batching, deadline-aware per robot.

A :class:`Fleet` serves R robots from one model instance. Each robot is a *lane*: an
:class:`~oxygen_ros.engine.engine.Engine` built on the fleet's shared
:class:`~oxygen_ros.engine.core.EngineCore`, with its own id, camera slots, checkpoint-family
processing (:class:`~oxygen_ros.engine.model_io.ModelIO`), action task and control period, language
tasks and triggers, π0.5 subtask state (``subtask.py``: the ``{subtask}`` of its action prompt is its
own latest subtask), inbox (``submit`` / ``cancel``), outputs and metrics, and its own share of the KV
pool (its ``kv_budget_mb``) in which its requests are admitted, preempted and charged exactly as in a
single-robot engine. One :meth:`Fleet.run_cycle` serves every robot with a fresh observation:

1. observe, per robot (its triggers, instruction changes, requests); a robot whose observation is
   refused (unknown camera slot, no camera, prompt over budget) is reported in
   :attr:`FleetResult.errors` and changes nothing for the others;
2. act, batched across robots: one vision call for every camera of every robot, one batched prefill
   per prefix-tree level (the keys carry the robot id, so robots never share a prefix), one denoising
   loop over the batch of prefixes per number of denoising steps; the chunks are handed out in
   earliest-deadline-first order;
3. admit per robot, in least-recently-admitted order, each robot against its own share of the pool,
   then one batched prefill for the admitted requests of every robot;
4. batched decode steps across robots and frames within the slack before the earliest deadline
   (``deadline`` scheduling) or ``decode_steps_per_cycle`` of them (``fixed_k``); a step's batch
   takes each robot's best request in turn, least-recently-served robot first, so when the batch must
   shrink (``max_batch_size``, slack) no robot starves another;
5. report per robot.

The fleet's :class:`~oxygen_ros.engine.config.EngineConfig` holds the shared settings: the pool
(``kv_budget_mb``, ``block_size``), the scheduling (``scheduling``, ``decode_steps_per_cycle``,
``min_decode_steps_per_cycle``, ``min_admissions_per_cycle`` — per robot, ``max_batch_size`` of the
whole cross-robot batch, ``slack_margin_s``, the step-cost estimate), ``cuda_graphs``. A robot's
config gives the rest (cameras, action, language tasks, ``max_waiting``, its per-robot batch cap
``max_batch_size``, ``metrics_window``) and its share ``kv_budget_mb``; its ``mode`` must be
``unified``, its ``block_size`` and ``scheduling`` the fleet's. :class:`ReleaseClock` paces robots of
different control rates (which robots are due, their deadlines). docs/fleet.md has the design.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Mapping

import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.core import EngineCore
from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.inputs import Frame
from oxygen_ros.engine.lane import EngineLane
from oxygen_ros.engine.meter import CycleMeter
from oxygen_ros.engine.metrics import CycleRecord
from oxygen_ros.engine.modes import admission_budget, decode_within_budget
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.model_runner import RunnerModel
from oxygen_ros.engine.outputs import CycleResult
from oxygen_ros.engine.request import Request, sample_tokens
from oxygen_ros.engine.scheduler import StepCostEstimator
from oxygen_ros.engine.types import ActionChunk, MemoryEntry, Observation, TextEvent


@dataclass
class FleetResult:
    """What one fleet cycle produced.

    Attributes:
        cycles: per robot served this cycle, its :class:`CycleResult` (its chunk, the text events of its
            requests, its record: frame latency, deadline missed, generated tokens of its requests).
        text_events: per robot *not* served this cycle, the text events its running requests produced
            (a robot whose inputs stopped still finishes its utterances); robots without events are absent.
        errors: per robot whose observation was refused, the ValueError (nothing else of that robot ran).
        record: the whole cycle's record (phase times, vision calls, batch sizes over all robots).
    """

    cycles: dict[Hashable, CycleResult] = field(default_factory=dict)
    text_events: dict[Hashable, list[TextEvent]] = field(default_factory=dict)
    errors: dict[Hashable, ValueError] = field(default_factory=dict)
    record: CycleRecord | None = None

    def events(self, robot: Hashable) -> list[TextEvent]:
        """Every text event of ``robot`` in this result (served or not)."""
        cycle = self.cycles.get(robot)
        return cycle.text_events if cycle is not None else self.text_events.get(robot, [])


class ReleaseClock:
    """Periodic releases of robots with different control periods, for an earliest-deadline-first loop.

    Robot ``r`` is released at ``t_r, t_r + T_r, ...``; a cycle served at its release has the deadline
    ``release + T_r``. A robot that fell more than a period behind skips the missed releases (they are
    counted in :attr:`skipped`) and is released at once. Times are any monotonic seconds (the node:
    ``time.perf_counter()``; tests: a virtual clock).
    """

    def __init__(self):
        self._period: dict[Hashable, float] = {}
        self._release: dict[Hashable, float] = {}
        self.skipped: dict[Hashable, int] = {}

    def add(self, robot: Hashable, period_s: float, now: float) -> None:
        """Release ``robot`` every ``period_s`` seconds (> 0), first at ``now``."""
        if not period_s > 0:
            raise ValueError(f"control period of {robot!r} must be > 0, got {period_s}")
        self._period[robot] = period_s
        self._release[robot] = now
        self.skipped[robot] = 0

    def remove(self, robot: Hashable) -> None:
        """Stop releasing ``robot`` (no-op if unknown)."""
        self._period.pop(robot, None)
        self._release.pop(robot, None)
        self.skipped.pop(robot, None)

    def due(self, now: float) -> dict[Hashable, float]:
        """Robots released by ``now`` with their deadlines, earliest deadline first."""
        due = {r: t + self._period[r] for r, t in self._release.items() if t <= now}
        return dict(sorted(due.items(), key=lambda item: item[1]))

    def served(self, robot: Hashable, now: float) -> None:
        """``robot``'s current release was served at ``now``: schedule its next one."""
        period = self._period[robot]
        release = self._release[robot] + period
        if release + period <= now:      # more than a period behind: skip, restart from now
            missed = int((now - release) // period)
            self.skipped[robot] += missed
            release += missed * period
        self._release[robot] = release

    def next_release(self) -> float | None:
        """The earliest pending release (None without robots)."""
        return min(self._release.values(), default=None)


class Fleet:
    """One model and one KV pool serving many robots (module docstring).

    Args:
        model: the VLA (:class:`~oxygen_ros.engine.model_runner.RunnerModel`), shared by every robot.
        config: the fleet's shared settings (module docstring); its ``mode`` must be ``unified``.

    Raises:
        ValueError: ``config.mode`` is not ``unified``.

    :meth:`run_cycle`, :meth:`add_robot`, :meth:`remove_robot`, :meth:`warm_up` and :meth:`close` run
    on one thread (or are serialised by the caller); a robot's :meth:`Engine.submit`,
    :meth:`Engine.cancel` and :meth:`Engine.cancel_task` (through :meth:`robot`) from any thread.
    """

    def __init__(self, model: RunnerModel, config: EngineConfig):
        if config.mode != "unified":
            raise ValueError(f"a fleet runs mode unified (cross-robot batching), got {config.mode!r}")
        self.config = config
        self._model = model
        self._core = EngineCore(model, None, config)
        self._engines: dict[Hashable, Engine] = {}     # each robot's engine; the cycle drives its .lane
        self._meters: dict[Hashable, CycleMeter] = {}
        self._last_stamp: dict[Hashable, float] = {}
        self._admitted_at: dict[Hashable, int] = {}
        self._decoded_at: dict[Hashable, int] = {}
        self._admit_round = 0
        self._step_index = 0
        self._closed = False

    # ------------------------------------------------------------------ robots

    @property
    def core(self) -> EngineCore:
        """The shared model runner, pool, prefix tree and estimator."""
        return self._core

    @property
    def robots(self) -> list[Hashable]:
        """The robot ids, in the order they were added."""
        return list(self._engines)

    def robot(self, robot_id: Hashable) -> Engine:
        """The engine (lane) of ``robot_id``: submit, cancel, metrics, active requests. Raises KeyError."""
        try:
            return self._engines[robot_id]
        except KeyError:
            raise KeyError(f"no robot {robot_id!r} in the fleet") from None

    def add_robot(self, robot_id: Hashable, processor: ModelIO, config: EngineConfig) -> Engine:
        """Add a robot with its own processing and configuration; it is served from the next cycle.

        Its share of the pool is ``config.kv_budget_mb`` (whole pages), which must hold its action
        reserve (its largest action prefix plus one page) and fit in the unassigned pages.

        Raises:
            ValueError: the id is taken, the share does not fit, or the config does not suit the fleet
                (``mode`` not unified, another ``block_size`` or ``scheduling``).
            RuntimeError: the fleet is closed.
        """
        if config.mode != "unified":
            raise ValueError(f"robot {robot_id!r}: a fleet's robots run mode unified, got {config.mode!r}")
        for name in ("block_size", "scheduling"):
            if getattr(config, name) != getattr(self.config, name):
                raise ValueError(f"robot {robot_id!r}: {name} {getattr(config, name)!r} differs from "
                                 f"the fleet's {getattr(self.config, name)!r}")
        with self._core.lock:
            if self._closed:
                raise RuntimeError("fleet is closed")
            if robot_id in self._engines:
                raise ValueError(f"robot {robot_id!r} is already in the fleet")
            engine = Engine(self._model, processor, config, core=self._core, robot_id=robot_id)
            self._engines[robot_id] = engine
            self._meters[robot_id] = self._lane_meter()
        return engine

    def remove_robot(self, robot_id: Hashable) -> list[TextEvent]:
        """Remove a robot: every request of it ends with exactly one final event (``cancelled``
        unless it had ended), its pages and its share go back to the pool. Returns the robot's
        events not yet handed out (those final events included). Raises KeyError."""
        with self._core.lock:
            engine = self.robot(robot_id)
            del self._engines[robot_id]
            for table in (self._meters, self._last_stamp, self._admitted_at, self._decoded_at):
                table.pop(robot_id, None)
        events = engine.close()
        self._core.release(robot_id)
        return events

    # ------------------------------------------------------------------ cycles

    def run_cycle(self, observations: Mapping[Hashable, Observation],
                  deadlines: Mapping[Hashable, float] | None = None,
                  on_action: Callable[[Hashable, ActionChunk], None] | None = None) -> FleetResult:
        """Serve every robot of ``observations`` (robot id -> its newest observation) in one cycle.

        Args:
            deadlines: per robot the ``time.perf_counter()`` instant its cycle must end by (default:
                the cycle's start plus the robot's control period); robots are served earliest
                deadline first and language work fits the slack before the earliest deadline.
            on_action: gets ``(robot_id, chunk)`` for every chunk, in deadline order, before any
                language work.

        Returns:
            The :class:`FleetResult`. A refused observation (ValueError: unknown camera slot, no
            camera, prompt over budget) is reported in its ``errors`` and affects no other robot.

        Raises:
            KeyError: an observation of an unknown robot. RuntimeError: closed. Errors of the model
            itself propagate (the submissions the cycle took end as ``dropped``).
        """
        with self._core.lock:
            if self._closed:
                raise RuntimeError("fleet is closed")
            unknown = [r for r in observations if r not in self._engines]
            if unknown:
                raise KeyError(f"observations of robots {unknown!r} not in the fleet")
            t0 = time.perf_counter()
            deadlines = {r: (deadlines or {}).get(r, t0 + self._engines[r].config.action.control_period_s)
                         for r in observations}
            order = sorted(observations, key=lambda r: deadlines[r])
            meter = CycleMeter(self._core.pool, self._core.estimator, self._core.runner.counters)
            lanes = self._lanes()
            for robot, lane in lanes.items():
                lane.use_meter(self._meters[robot])
            result = FleetResult()
            frames: dict[Hashable, Frame] = {}
            for robot in order:
                lane, obs = lanes[robot], observations[robot]
                try:
                    frames[robot] = lane.observe(obs, t0)
                except ValueError as error:
                    lane.abandon(obs)
                    result.errors[robot] = error
                    continue
                self._last_stamp[robot] = obs.stamp
            try:
                chunks, features = self._act(frames, t0, meter, on_action)
                for robot, frame in frames.items():
                    lanes[robot].enqueue(frame, features[robot])
                earliest = min((deadlines[r] for r in frames), default=float("inf"))
                overloaded = self._language(earliest, meter, deadlines)
            except BaseException:
                for robot, frame in frames.items():
                    lanes[robot].abandon(frame.obs)
                raise
            finally:
                self._core.planner.tree.clear()
            end = time.perf_counter()
            for lane in lanes.values():
                lane.report_ended()
            result.record = meter.record(-1, end - t0, max((c.latency_s for c in chunks.values()),
                                                           default=0.0), False, overloaded)
            peak = self._core.pool.peak_used_bytes
            for robot, lane in lanes.items():
                events = lane.take_events()
                if robot in frames:
                    chunk = chunks[robot]
                    record = replace(result.record, seq=chunk.seq, action_latency_s=chunk.latency_s,
                                     deadline_missed=end > deadlines[robot],
                                     generated_tokens=self._meters[robot].tokens,
                                     batch_sizes=list(result.record.batch_sizes))
                    self._meters[robot] = self._lane_meter()
                    lane.record_cycle(record, peak)
                    result.cycles[robot] = CycleResult(chunk, events, record)
                elif events:
                    result.text_events[robot] = events
            return result

    def warm_up(self, observations: Mapping[Hashable, Observation]) -> float:
        """Run the batched action path once for typical observations of the robots given, keep
        nothing of it (no triggers, metrics, estimates or pool peak change); returns seconds. On CUDA
        it captures the graphs of this batch of robots. Raises as :meth:`run_cycle` (ValueError for
        a refused observation here)."""
        with self._core.lock:
            if self._closed:
                raise RuntimeError("fleet is closed")
            t0 = time.perf_counter()
            pool = self._core.pool
            peak = pool.peak_used_blocks
            meter = CycleMeter(pool, StepCostEstimator(self.config.step_cost_quantile, 1),
                               self._core.runner.counters)
            try:
                frames = {robot: self.robot(robot).lane.action_frame(obs) for robot, obs in observations.items()}
                self._act(frames, t0, meter, None)
            finally:
                self._core.planner.tree.clear()
                pool.peak_used_blocks = peak
            return time.perf_counter() - t0

    def metrics(self) -> dict[Hashable, dict]:
        """Per robot, its engine's metrics summary (:meth:`Engine.metrics`)."""
        return {robot: engine.metrics() for robot, engine in self._engines.items()}

    def reset_metrics(self) -> None:
        """Forget every robot's records and the pool's peak."""
        for engine in self._engines.values():
            engine.reset_metrics()

    def take_events(self) -> dict[Hashable, list[TextEvent]]:
        """Per robot, the events produced between cycles (cancellations); robots without are absent."""
        out = {}
        for robot, engine in list(self._engines.items()):
            events, _ = engine.take_events()
            if events:
                out[robot] = events
        return out

    def flush(self) -> dict[Hashable, tuple[list[TextEvent], list[MemoryEntry]]]:
        """Run every robot's requests to their end (no deadline), robot by robot (:meth:`Engine.flush`)."""
        return {robot: engine.flush() for robot, engine in list(self._engines.items())}

    def close(self) -> dict[Hashable, list[TextEvent]]:
        """Remove every robot (each request ends once) and refuse further cycles; per robot its
        final events."""
        with self._core.lock:
            self._closed = True
        return {robot: self.remove_robot(robot) for robot in list(self._engines)}

    # ------------------------------------------------------------------ cycle steps

    def _lanes(self) -> dict[Hashable, EngineLane]:
        """Every robot's cycle steps (:attr:`Engine.lane`), in the order the robots were added."""
        return {robot: engine.lane for robot, engine in self._engines.items()}

    def _lane_meter(self) -> CycleMeter:
        # A robot's meter only counts its generated tokens: the shared work is timed once by the
        # cycle's meter (which alone teaches the shared step-cost estimator).
        return CycleMeter(self._core.pool, StepCostEstimator(1.0, 1), self._core.runner.counters)

    def _act(self, frames: dict[Hashable, Frame], t0: float, meter: CycleMeter,
             on_action: Callable[[Hashable, ActionChunk], None] | None
             ) -> tuple[dict[Hashable, ActionChunk], dict[Hashable, torch.Tensor]]:
        """Encode every robot's cameras in one vision call, prefill the action prefixes (one batched
        call per tree level), denoise them in one batch per number of denoising steps, hand the
        chunks out in ``frames``' (deadline) order."""
        if not frames:
            return {}, {}
        robots = list(frames)
        lanes = [self._engines[r].lane for r in robots]
        runner = self._core.runner
        with meter.phase("encode_s"):
            encoded = runner.encode_groups([(lane.io, frames[r].images) for r, lane in zip(robots, lanes)])
        features = dict(zip(robots, encoded))
        jobs = [lane.action_job(frames[r], features[r]) for r, lane in zip(robots, lanes)]
        nodes = dict(zip(robots, self._core.planner.nodes(jobs, meter)))
        groups: dict[tuple[int, bool], list[Hashable]] = {}
        states = {}
        noises = {}
        for robot, lane in zip(robots, lanes):
            obs = frames[robot].obs
            states[robot] = lane.state_tensor(obs)
            noises[robot] = lane.noise(obs)
            key = (lane.config.action.num_denoise_steps, states[robot] is None)
            groups.setdefault(key, []).append(robot)
        actions = {}
        with meter.phase("denoise_s"):
            for (steps, stateless), members in groups.items():
                out = runner.denoise_batch([nodes[r].seq for r in members],
                                           torch.cat([noises[r] for r in members]), steps,
                                           None if stateless else [states[r] for r in members])
                actions.update(zip(members, out))
        chunks = {}
        for robot, lane, job in zip(robots, lanes, jobs):
            frame = frames[robot]
            chunk = chunks[robot] = lane.finish_action(frame, actions[robot], t0, tuple(job.prompt_ids))
            if on_action is not None:
                on_action(robot, chunk)
        return chunks, features

    def _language(self, deadline: float, meter: CycleMeter, deadlines: dict[Hashable, float]) -> bool:
        """Admission per robot and batched decode steps across robots within the slack before
        ``deadline`` (UnifiedMode's rules, over every robot); True when overloaded."""
        config, estimator = self.config, self._core.estimator
        deadline_mode = config.scheduling == "deadline"
        budget = admission_budget(config, estimator, deadline)
        # Admission: least recently admitted robot first, each against its own share of the pool.
        lanes = self._lanes()
        order = sorted(lanes, key=lambda r: (self._admitted_at.get(r, -1), deadlines.get(r, float("inf"))))
        overloaded = False
        plans = []
        for robot in order:
            lane = lanes[robot]
            if not lane.has_waiting:
                continue
            plan = lane.admit(self._last_stamp.get(robot, -float("inf")), budget,
                              config.min_admissions_per_cycle if deadline_mode else 0)
            overloaded |= plan.forced > 0
            if plan.admitted:
                if budget != float("inf"):
                    cost = sum(lane.prefill_cost(r) for r in plan.requests)
                    budget = max(0.0, budget - cost)
                self._admitted_at[robot] = self._admit_round
                plans.append((lane, plan, lane.prefix_jobs(plan)))
        self._admit_round += 1
        if plans:
            nodes = self._core.planner.nodes([job for _, _, jobs in plans for job in jobs], meter)
            start = 0
            for lane, plan, jobs in plans:
                lane.begin(plan, nodes[start:start + len(jobs)])
                start += len(jobs)

        def apply_cancels() -> None:
            for lane in lanes.values():
                lane.apply_cancels()

        return decode_within_budget(config, estimator, deadline, apply_cancels, self._decode_batch,
                                    lambda batch: self._step(batch, meter)) or overloaded

    def _decode_batch(self) -> list[tuple[Hashable, Request]]:
        """The cross-robot decode batch: each robot's own order (priority, then age, up to its
        ``max_batch_size``), merged round-robin, least recently served robot first, up to the
        fleet's ``max_batch_size``. Any prefix of it holds every robot's best request before any
        robot's second, and a robot left out of a step goes first in the next."""
        per_robot = [(robot, lane.decode_batch()) for robot, lane in self._lanes().items()]
        per_robot = [(robot, batch) for robot, batch in per_robot if batch]
        per_robot.sort(key=lambda item: self._decoded_at.get(item[0], -1))
        merged = []
        depth = max((len(batch) for _, batch in per_robot), default=0)
        for i in range(depth):
            merged.extend((robot, batch[i]) for robot, batch in per_robot if i < len(batch))
        return merged[:self.config.max_batch_size]

    def _step(self, batch: list[tuple[Hashable, Request]], meter: CycleMeter) -> None:
        """One batched decode step of requests of several robots (one token each)."""
        manager, runner = self._core.manager, self._core.runner
        requests = [request for _, request in batch]
        t = time.perf_counter()
        for request in requests:   # within the request's admission charge: cannot fail
            manager.prepare_append(request.kv, 1)
        logits = runner.decode_step([r.kv for r in requests], [r.output_ids[-1] for r in requests])
        tokens = sample_tokens(logits, requests)
        meter.decode_step(len(batch), time.perf_counter() - t)
        for (robot, request), token in zip(batch, tokens):
            self._engines[robot].lane.add_token(request, token)
            self._decoded_at[robot] = self._step_index
        self._step_index += 1
