"""Many robots on one engine: one model, one KV pool, cross-robot batching, deadline-aware per robot.

A :class:`Fleet` serves R robots from one model instance: a facade over the same
:class:`~oxygen_ros.engine.cycle.ControlLoop` that a single-robot :class:`~oxygen_ros.engine.engine.Engine`
runs, here with R robots (``robot.py``) on the fleet's shared :class:`~oxygen_ros.engine.core.EngineCore`.
Each robot has its own id, camera slots, checkpoint-family
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
from typing import Callable, Hashable, Mapping

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.core import EngineCore
from oxygen_ros.engine.cycle import ControlLoop, FleetResult
from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.model_runner import RunnerModel
from oxygen_ros.engine.modes import mode_policy
from oxygen_ros.engine.robot import new_robot
from oxygen_ros.engine.types import ActionChunk, MemoryEntry, Observation, TextEvent

__all__ = ["Fleet", "FleetResult", "ReleaseClock"]


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
        self._core = EngineCore(model, None, config)
        self._loop = ControlLoop(self._core, config, mode_policy(config, self._core.planner))
        self._engines: dict[Hashable, Engine] = {}     # each robot's engine (its public surface)
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
        """The engine of ``robot_id``: submit, cancel, metrics, active requests, warm-up, flush. Raises KeyError."""
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
            robot = new_robot(self._core, processor, config, robot_id, shared=True)
            self._loop.add(robot)
            engine = self._engines[robot_id] = Engine.of_robot(self._loop, robot)
        return engine

    def remove_robot(self, robot_id: Hashable) -> list[TextEvent]:
        """Remove a robot: every request of it ends with exactly one final event (``cancelled``
        unless it had ended), its pages and its share go back to the pool. Returns the robot's
        events not yet handed out (those final events included). Raises KeyError."""
        with self._core.lock:
            engine = self.robot(robot_id)
            del self._engines[robot_id]
            self._loop.remove(robot_id)
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
                now plus the robot's control period); robots are served earliest deadline first and
                language work fits the slack before the earliest deadline.
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
            return self._loop.run(observations, deadlines, on_action)

    def warm_up(self, observations: Mapping[Hashable, Observation]) -> float:
        """Run the batched action path once for typical observations of the robots given, keep
        nothing of it (no triggers, metrics, estimates or pool peak change); returns seconds. On CUDA
        it captures the graphs of this batch of robots. Raises as :meth:`run_cycle` (ValueError for
        a refused observation here)."""
        with self._core.lock:
            if self._closed:
                raise RuntimeError("fleet is closed")
            for robot in observations:
                self.robot(robot)
            return self._loop.warm_up(observations)

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
