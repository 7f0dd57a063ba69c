"""The control loop: one cycle for one robot or many, after OxyGen (arXiv 2603.14371) with a
deadline-aware scheduler. :class:`~oxygen_ros.engine.engine.Engine` (one robot) and
:class:`~oxygen_ros.engine.fleet.Fleet` (many) are facades over the same :class:`ControlLoop`.

A cycle (:meth:`ControlLoop.run`) serves every robot with a fresh observation, earliest deadline first:

1. observe, per robot: cross-thread cancellations apply (``inbox.py``), the cameras and prompts are read
   (``inputs.py``), triggers fire (``triggers.py``), a new instruction clears the subtask and cancels the
   requests of tasks with ``cancel_on_new_instruction``. A refused observation (unknown camera slot, no
   camera, action prompt over budget) is that robot's error and changes nothing for the others; a
   submitted request whose prompt cannot be built ends alone, as ``dropped`` with the reason;
2. act, batched across robots: one vision call for every camera of every robot, the action prefixes
   prefilled or found in the cycle's prefix tree (``prefix_cache.py``, one batched prefill per tree
   level; the keys carry the robot id, so robots never share a prefix), one denoising loop per number of
   denoising steps; each chunk is handed out at once, before any language work;
3. admit, per robot in least-recently-admitted order, each against its own pages (``scheduler.py``),
   then one batched prefill for the admitted requests of every robot;
4. decode within the budget: batched decode steps across robots and frames, each robot's best request
   first, least-recently-served robot first (so no robot starves another when the batch must shrink);
   the mode's policy (``modes.py``) says how many and how large;
5. report: final events, the subtask loop's update, per-robot records (``outputs.py``, ``metrics.py``).

The loop holds no lock: its callers (the facades) hold the core's lock around each call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Mapping

import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.core import EngineCore
from oxygen_ros.engine.inputs import Frame, action_frame, observe
from oxygen_ros.engine.meter import CycleMeter
from oxygen_ros.engine.metrics import CycleRecord
from oxygen_ros.engine.modes import ModePolicy
from oxygen_ros.engine.outputs import CycleResult
from oxygen_ros.engine.prefix_cache import PrefixJob
from oxygen_ros.engine.realtime import ChunkInFlight, plan_guidance
from oxygen_ros.engine.request import Request, sample_tokens
from oxygen_ros.engine.robot import RobotState, report_ended
from oxygen_ros.engine.scheduler import AdmissionPlan, StepCostEstimator
from oxygen_ros.engine.types import ActionChunk, Observation, RequestStatus, TextEvent
from oxygen_ros.models.rtc import RTCGuidance


@dataclass
class FleetResult:
    """What one cycle produced, per robot.

    Attributes:
        cycles: per robot served this cycle, its :class:`CycleResult` (its chunk, the text events of its
            requests, its record: frame latency, deadline missed, generated tokens of its requests).
        text_events: per robot *not* served this cycle, the text events its running requests produced
            (a robot whose inputs stopped still finishes its utterances); robots without events are absent.
        errors: per robot whose observation was refused, the ValueError (nothing else of that robot ran).
        record: the whole cycle's record (phase times, vision calls, batch sizes over all robots); None
            when no observation was accepted (then the cycle did no model work).
    """

    cycles: dict[Hashable, CycleResult] = field(default_factory=dict)
    text_events: dict[Hashable, list[TextEvent]] = field(default_factory=dict)
    errors: dict[Hashable, ValueError] = field(default_factory=dict)
    record: CycleRecord | None = None

    def events(self, robot: Hashable) -> list[TextEvent]:
        """Every text event of ``robot`` in this result (served or not)."""
        cycle = self.cycles.get(robot)
        return cycle.text_events if cycle is not None else self.text_events.get(robot, [])


class ControlLoop:
    """The cycle's five steps over the robots of one engine core (module docstring).

    Args:
        core: the shared model runner, pool, prefix planner and step-cost estimator.
        config: the loop's settings: ``scheduling``, ``decode_steps_per_cycle``,
            ``min_decode_steps_per_cycle``, ``min_admissions_per_cycle`` (per robot), ``max_batch_size``
            of the whole cross-robot batch, ``slack_margin_s``, ``step_cost_quantile``.
        mode: the mode's policy (what is shared, how much language work a cycle does).

    Attributes:
        robots: the robots served, in the order they were added.
    """

    def __init__(self, core: EngineCore, config: EngineConfig, mode: ModePolicy):
        self.core = core
        self.config = config
        self.mode = mode
        self.robots: dict[Hashable, RobotState] = {}
        self._admit_round = 0
        self._step_index = 0

    def add(self, robot: RobotState) -> None:
        """Serve ``robot`` from the next cycle on (ValueError if its id is served already)."""
        if robot.id in self.robots:
            raise ValueError(f"robot {robot.id!r} is already in the fleet")
        self.robots[robot.id] = robot

    def remove(self, robot_id: Hashable) -> RobotState:
        """Stop serving ``robot_id``; returns its state (KeyError if unknown)."""
        return self.robots.pop(robot_id)

    # ---- the cycle ---------------------------------------------------------------------------

    def run(self, observations: Mapping[Hashable, Observation], deadlines: Mapping[Hashable, float],
            on_action: Callable[[Hashable, ActionChunk], None] | None = None) -> FleetResult:
        """One cycle for the robots of ``observations`` (robot id -> its newest observation), each with
        its ``deadlines`` entry (a ``time.perf_counter()`` instant). ``on_action`` gets ``(robot id,
        chunk)`` for every chunk, in deadline order, before any language work.

        Raises what the model or ``on_action`` raised; the submissions the cycle took then end as
        ``dropped``.
        """
        self.core.threads.apply()
        threads = torch.get_num_threads() if self.core.threads.enabled else 0
        t0 = time.perf_counter()
        meter = self.meter()
        for robot in self.robots.values():
            robot.tokens = 0
        result = FleetResult()
        frames: dict[Hashable, Frame] = {}
        try:
            for robot_id in sorted(observations, key=lambda r: deadlines[r]):
                robot, obs = self.robots[robot_id], observations[robot_id]
                try:
                    frames[robot_id] = observe(robot, obs, t0)
                except ValueError as error:
                    robot.inbox.abandon(obs, f"observation refused: {error}")
                    result.errors[robot_id] = error
                    continue
                robot.last_stamp = obs.stamp
            if not frames:
                return result
            chunks, features = self._act(frames, t0, meter, on_action)
            self.core.threads.observe(time.perf_counter() - t0)
            for robot_id, frame in frames.items():
                self._enqueue(self.robots[robot_id], frame, features[robot_id])
            overloaded = self._language(min(deadlines[r] for r in frames), meter, deadlines)
        except BaseException:
            for robot_id, obs in observations.items():
                self.robots[robot_id].inbox.abandon(obs)
            raise
        finally:
            self.core.planner.tree.clear()
            self.core.threads.update()      # the next cycle's count, off this cycle's action path
        end = time.perf_counter()
        self._report(meter, frames, chunks, deadlines, end - t0, end, overloaded, threads, result)
        return result

    def warm_up(self, observations: Mapping[Hashable, Observation],
                on_action: Callable[[Hashable, ActionChunk], None] | None = None) -> float:
        """The action step once for typical ``observations`` (robot id -> observation), keeping nothing
        of it (no triggers, subtask, metrics, estimates or pool peak change); returns seconds. One-time
        costs (CUDA graph capture per batch, image count and prefix bucket; lazy initialisation) land
        here, not in the first cycle. Raises ValueError for a refused observation."""
        t0 = time.perf_counter()
        pool = self.core.pool
        peak = pool.peak_used_blocks
        meter = self.meter(StepCostEstimator(self.config.step_cost_quantile, 1))
        try:
            frames = {robot_id: action_frame(self.robots[robot_id], obs)
                      for robot_id, obs in observations.items()}
            self._act(frames, t0, meter, on_action, realtime=False)
        finally:
            self.core.planner.tree.clear()
            pool.peak_used_blocks = peak      # warm-up pages are no robot's peak
        return time.perf_counter() - t0

    def drain(self, robot: RobotState) -> None:
        """Run every waiting and running request of ``robot`` to its end, with no deadline (a flush); the
        robot's chunk in flight is forgotten (its next chunk is a first one for real-time chunking)."""
        robot.in_flight = None
        meter = self.meter()
        scheduler = robot.scheduler
        while scheduler.active:
            # now_stamp = -inf: no waiting request is too old while draining.
            self._start([(robot, scheduler.admit(-float("inf"), self.mode.prefill_cost, float("inf")))], meter)
            if not scheduler.running and scheduler.waiting:
                # Nothing running and nothing admissible: the rest can never be served.
                for request in list(scheduler.waiting):
                    scheduler.finish(request, RequestStatus.DROPPED)
            while batch := scheduler.decode_batch():
                self._step([(robot, request) for request in batch], meter)
            self.core.planner.tree.clear()
            report_ended(scheduler, robot.outputs, robot.subtask)

    def meter(self, estimator: StepCostEstimator | None = None) -> CycleMeter:
        """A fresh measurement of a stretch of work (teaching the shared estimator unless given another)."""
        return CycleMeter(self.core.pool, estimator or self.core.estimator, self.core.runner.counters)

    # ---- 1. observe --------------------------------------------------------------------------

    # ---- 2. act ------------------------------------------------------------------------------

    def _act(self, frames: dict[Hashable, Frame], t0: float, meter: CycleMeter,
             on_action: Callable[[Hashable, ActionChunk], None] | None, realtime: bool = True
             ) -> tuple[dict[Hashable, ActionChunk], dict[Hashable, torch.Tensor]]:
        """Encode every robot's cameras in one vision call, prefill the action prefixes (one batched
        call per tree level), denoise them in one batch per number of denoising steps (noise seeded by
        ``noise_seed + obs.seq``, so a frame's chunk is reproducible; with real-time chunking on, each row
        guided toward its robot's chunk in flight: ``realtime.py``), hand the chunks out in ``frames``'
        order. Returns the chunks (robot units ``[H, robot action dim]``, latency counted from ``t0``) and
        each robot's vision features ``[N, num_image_tokens, W]``. ``realtime``: False for a warm-up, which
        neither reads nor keeps a chunk in flight."""
        robots = [self.robots[robot_id] for robot_id in frames]
        runner = self.core.runner
        with meter.phase("encode_s"):
            encoded = runner.encode_groups([(robot.io, frames[robot.id].images) for robot in robots])
        features = {robot.id: f for robot, f in zip(robots, encoded)}
        jobs = [self.mode.action_job(robot.id, frame.obs.seq, frame.mask, frame.action_ids, features[robot.id],
                                     frame.requests)
                for robot, frame in zip(robots, frames.values())]
        nodes = self.core.planner.nodes(jobs, meter)
        groups: dict[tuple[int, bool, float], list[int]] = {}
        states, noises, plans = [], [], {}
        for i, robot in enumerate(robots):
            obs = frames[robot.id].obs
            states.append(robot.io.state_tensor(obs.state))
            generator = torch.Generator().manual_seed(robot.config.action.noise_seed + obs.seq)
            noises.append(torch.randn(robot.noise_shape, generator=generator))
            rtc = robot.config.rtc
            if realtime and rtc.enabled:
                plans[i] = plan = plan_guidance(rtc, robot.in_flight, robot.delays, obs.stamp, *robot.noise_shape[1:])
                for reason in (plan.fallback, "delay_clipped" if plan.clipped else ""):
                    if reason:
                        robot.rtc_counts[reason] = robot.rtc_counts.get(reason, 0) + 1
            beta = rtc.max_guidance_weight if i in plans else 0.0
            groups.setdefault((robot.config.action.num_denoise_steps, states[i] is None, beta), []).append(i)
        actions: dict[int, torch.Tensor] = {}
        with meter.phase("denoise_s"):
            for (steps, stateless, beta), members in groups.items():
                out = runner.denoise_batch([nodes[i].seq for i in members], torch.cat([noises[i] for i in members]),
                                           steps, None if stateless else [states[i] for i in members],
                                           self._guidance([plans.get(i) for i in members], robots[members[0]], beta))
                actions.update(zip(members, out))
        chunks = {}
        for i, (robot, job) in enumerate(zip(robots, jobs)):
            frame = frames[robot.id]
            obs = frame.obs
            plan = plans.get(i)
            chunk = chunks[robot.id] = ActionChunk(
                robot.io.actions_out(actions[i], obs.state), obs.seq, obs.stamp, time.perf_counter() - t0,
                obs.tag, frame.subtask, tuple(job.prompt_ids),
                *((plan.delay_steps, plan.takeover_index, plan.fallback) if plan is not None else ()))
            if plan is not None:
                robot.in_flight = ChunkInFlight(actions[i].detach().float().cpu().clone(), obs.stamp, obs.seq)
                robot.delays.observe_own(chunk.latency_s)
            if not self.mode.shares_prefixes:
                self.core.planner.tree.clear()
            if on_action is not None:
                on_action(robot.id, chunk)
        return chunks, features

    @staticmethod
    def _guidance(plans: list, robot: RobotState, beta: float) -> RTCGuidance | None:
        """The batched guidance of one denoising group's rows (None when no row is guided)."""
        if not any(plan is not None and plan.target is not None for plan in plans):
            return None
        _, horizon, dim = robot.noise_shape
        target = torch.zeros(len(plans), horizon, dim)
        weights = torch.zeros(len(plans), horizon)
        for row, plan in enumerate(plans):
            if plan is not None and plan.target is not None:
                target[row], weights[row] = plan.target, plan.weights
        return RTCGuidance(target, weights, beta)

    def _enqueue(self, robot: RobotState, frame: Frame, features: torch.Tensor) -> None:
        """Queue the frame's new requests with the inputs they keep until prefilled (the mode's)."""
        for request in frame.requests:
            self.mode.keep_inputs(request, frame.images, features)
            robot.scheduler.add(request)
        robot.inbox.queued([request.request_id for request in frame.requests])

    # ---- 3. admit and 4. decode ----------------------------------------------------------------

    def _language(self, deadline: float, meter: CycleMeter, deadlines: Mapping[Hashable, float]) -> bool:
        """The cycle's language work after the action chunks, before ``deadline`` (the earliest of the
        served robots'); True when the slack could not pay for the guaranteed minimum, which ran anyway
        (the cycle overruns its deadline by that work)."""
        mode, estimator = self.mode, self.core.estimator
        if mode.decodes_to_completion:
            for robot in self.robots.values():
                self._to_completion(robot, meter)
            return False
        budget = mode.admission_budget(estimator, deadline)
        order = sorted(self.robots.values(), key=lambda r: (r.admitted_at, deadlines.get(r.id, float("inf"))))
        overloaded = False
        plans = []
        for robot in order:
            if not robot.scheduler.waiting:
                continue
            plan = robot.scheduler.admit(robot.last_stamp, mode.prefill_cost, budget, mode.min_admissions())
            overloaded |= plan.forced > 0
            if plan.admitted:
                if budget != float("inf"):
                    budget = max(0.0, budget - sum(mode.prefill_cost(r) for r in plan.requests))
                robot.admitted_at = self._admit_round
                plans.append((robot, plan))
        self._admit_round += 1
        self._start(plans, meter)
        steps = 0
        while True:
            for robot in self.robots.values():
                robot.inbox.apply()        # a decode-step boundary: cross-thread cancellations
            batch = self._decode_batch()
            if not batch:
                break
            size, forced = mode.step_size(steps, len(batch), estimator, deadline)
            if size == 0:
                break
            overloaded |= forced
            self._step(batch[:size], meter)
            steps += 1
        return overloaded

    def _to_completion(self, robot: RobotState, meter: CycleMeter) -> None:
        """Run-to-completion modes: admit ``robot``'s requests and decode each to its end, one at a time."""
        while True:
            plan = robot.scheduler.admit(robot.last_stamp, self.mode.prefill_cost, float("inf"))
            if not plan.admitted:
                return
            for admission in plan.admitted:
                request = admission.request
                self._start([(robot, AdmissionPlan([admission]))], meter)
                while request.status == RequestStatus.RUNNING:
                    robot.inbox.apply()
                    if request.status != RequestStatus.RUNNING:
                        break
                    self._step([(robot, request)], meter)
                if not self.mode.shares_prefixes:
                    self.core.planner.tree.clear()

    def _start(self, plans: list[tuple[RobotState, AdmissionPlan]], meter: CycleMeter) -> None:
        """Prefill (or find) the prefixes of every plan's admitted requests in one batched call per tree
        level, bind each request to a fork of its prefix, sample the first tokens."""
        plans = [(robot, plan) for robot, plan in plans if plan.admitted]
        if not plans:
            return
        jobs = [self._request_job(robot, request, meter) for robot, plan in plans for request in plan.requests]
        nodes = iter(self.core.planner.nodes(jobs, meter))
        now = time.perf_counter()
        for robot, plan in plans:
            requests = plan.requests
            for admission in plan.admitted:
                node = next(nodes)
                robot.scheduler.bind(admission, node.seq)
                request = admission.request
                request.image_features = None
                request.images = None
                request.pooled = node.pooled
                request.next_logits = node.logits
            tokens = sample_tokens(torch.stack([r.next_logits for r in requests]), requests)
            for request, token in zip(requests, tokens):
                request.t_first_token = now
                self._add_token(robot, request, token, meter)

    def _request_job(self, robot: RobotState, request: Request, meter: CycleMeter) -> PrefixJob:
        """The prefix job of ``request``; a request that kept its own images gets its own vision call."""
        features = None
        if request.images is not None:
            with meter.phase("encode_s"):
                features = self.core.runner.encode(request.images, robot.io)
        return self.mode.request_job(request, features, robot.scheduler.active)

    def _decode_batch(self) -> list[tuple[RobotState, Request]]:
        """The cross-robot decode batch: each robot's own order (priority, then age, up to its
        ``max_batch_size``), merged round-robin, least recently served robot first, up to the loop's
        ``max_batch_size``. Any prefix of it holds every robot's best request before any robot's
        second, and a robot left out of a step goes first in the next."""
        per_robot = [(robot, robot.scheduler.decode_batch()) for robot in self.robots.values()]
        per_robot = sorted(((robot, batch) for robot, batch in per_robot if batch), key=lambda item: item[0].decoded_at)
        depth = max((len(batch) for _, batch in per_robot), default=0)
        merged = [(robot, batch[i]) for i in range(depth) for robot, batch in per_robot if i < len(batch)]
        return merged[:self.config.max_batch_size]

    def _step(self, batch: list[tuple[RobotState, Request]], meter: CycleMeter) -> None:
        """One batched decode step of requests of one or several robots (one token each)."""
        requests = [request for _, request in batch]
        t = time.perf_counter()
        for request in requests:   # within the request's admission charge: cannot fail
            self.core.manager.prepare_append(request.kv, 1)
        logits = self.core.runner.decode_step([r.kv for r in requests], [r.output_ids[-1] for r in requests])
        tokens = sample_tokens(logits, requests)
        meter.decode_step(len(batch), time.perf_counter() - t)
        for (robot, request), token in zip(batch, tokens):
            self._add_token(robot, request, token, meter)
            robot.decoded_at = self._step_index
        self._step_index += 1

    def _add_token(self, robot: RobotState, request: Request, token: int, meter: CycleMeter) -> None:
        """Count, stream and (on a stop token or the last allowed one) complete ``request``'s new ``token``."""
        meter.tokens += 1
        robot.tokens += 1
        if robot.outputs.add_token(request, token):
            robot.scheduler.finish(request, RequestStatus.COMPLETED)

    # ---- 5. report ---------------------------------------------------------------------------

    def _report(self, meter: CycleMeter, frames: dict[Hashable, Frame], chunks: dict[Hashable, ActionChunk],
                deadlines: Mapping[Hashable, float], frame_latency_s: float, end: float, overloaded: bool,
                threads: int, result: FleetResult) -> None:
        """Every robot's final events and subtask update; per served robot its chunk, events and record
        (the cycle's, with its own seq, action latency, deadline miss and generated tokens)."""
        for robot in self.robots.values():
            report_ended(robot.scheduler, robot.outputs, robot.subtask)
        result.record = replace(meter.record(-1, frame_latency_s, max(c.latency_s for c in chunks.values()),
                                             False, overloaded), intra_op_threads=threads)
        peak = self.core.pool.peak_used_bytes
        for robot_id, robot in self.robots.items():
            events = robot.outputs.take()
            if robot_id in frames:
                chunk = chunks[robot_id]
                record = replace(result.record, seq=chunk.seq, action_latency_s=chunk.latency_s,
                                 deadline_missed=end > deadlines[robot_id], generated_tokens=robot.tokens,
                                 batch_sizes=list(result.record.batch_sizes))
                robot.metrics.add_cycle(record)
                robot.metrics.note_pool_peak(peak)
                result.cycles[robot_id] = CycleResult(chunk, events, record)
            elif events:
                result.text_events[robot_id] = events
