"""The unified KV-cache engine for one robot: a facade over the control loop (``cycle.py``).

:class:`Engine` builds the engine core (model runner, KV pool, prefix planner, step-cost estimator:
``core.py``), the robot's state (``robot.py``) and a :class:`~oxygen_ros.engine.cycle.ControlLoop` with
the mode's policy (``modes.py``), and runs one control cycle per observation (the cycle's steps:
``cycle.py``). A :class:`~oxygen_ros.engine.fleet.Fleet` runs the same loop for many robots; its
:meth:`~oxygen_ros.engine.fleet.Fleet.robot` hands out an :class:`Engine` of one of its robots, whose
submissions, cancellations, metrics, warm-up, flush and close are this class's and whose cycles are the
fleet's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Protocol

from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.core import EngineCore
from oxygen_ros.engine.cycle import ControlLoop
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.model_runner import RunnerModel, WorkCounters
from oxygen_ros.engine.modes import mode_policy
from oxygen_ros.engine.metrics import EngineMetrics
from oxygen_ros.engine.outputs import CycleResult
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.robot import RobotState, new_robot, report_ended
from oxygen_ros.engine.subtask import SubtaskState
from oxygen_ros.engine.types import ActionChunk, MemoryEntry, Observation, RequestStatus, TextEvent


class RobotEngine(Protocol):
    """What a node calls on the engine of its robot: :class:`Engine` (a robot of its own) and the
    fleet server's :class:`~oxygen_ros.engine.fleet_server.RobotClient` (one robot of a shared fleet)
    implement it. Their methods' contracts are :class:`Engine`'s."""

    config: EngineConfig

    def run_cycle(self, obs: Observation, deadline: float | None = None,
                  on_action: Callable[[ActionChunk], None] | None = None) -> CycleResult: ...

    def warm_up(self, obs: Observation, on_action: Callable[[ActionChunk], None] | None = None) -> float: ...

    def submit(self, task: str, instruction: str | None = None, prompt_template: str | None = None) -> int: ...

    def cancel(self, request_id: int) -> bool: ...

    def observe_delay(self, delay_s: float) -> None: ...

    def cancel_task(self, task: str) -> int: ...

    def take_events(self) -> tuple[list[TextEvent], list[MemoryEntry]]: ...

    def flush(self) -> tuple[list[TextEvent], list[MemoryEntry]]: ...

    def close(self) -> list[TextEvent]: ...

    def metrics(self) -> dict: ...

    def reset_metrics(self) -> None: ...

    @property
    def pool(self): ...

    @property
    def counters(self) -> WorkCounters: ...

    @property
    def subtask(self) -> SubtaskState: ...

    @property
    def active_requests(self) -> list[Request]: ...

    @property
    def metrics_records(self) -> EngineMetrics: ...


class Engine:
    """Runs the action and language tasks of ``config`` on a π0.5 / π0 ``model``
    (:class:`~oxygen_ros.engine.model_runner.RunnerModel`) with its pre/post-processing
    ``processor`` (:class:`~oxygen_ros.engine.model_io.ModelIO`), for one robot over the whole KV pool
    of ``config.kv_budget_mb``.

    Raises ValueError when the KV budget cannot hold the action task's reserve. :meth:`submit`,
    :meth:`cancel` and :meth:`cancel_task` may be called from any thread (``inbox.py``); the other
    methods from one thread.
    """

    def __init__(self, model: RunnerModel, processor: ModelIO, config: EngineConfig):
        core = EngineCore(model, processor, config)
        loop = ControlLoop(core, config, mode_policy(config, core.planner))
        self._bind(loop, new_robot(core, processor, config), owns_loop=True)

    @classmethod
    def of_robot(cls, loop: ControlLoop, robot: RobotState) -> "Engine":
        """The engine of ``robot``, one of the robots of a fleet's ``loop``: its cycles are the loop's
        (:meth:`run_cycle` raises RuntimeError), everything else is as for a robot of its own."""
        engine = cls.__new__(cls)
        engine._bind(loop, robot, owns_loop=False)
        return engine

    def _bind(self, loop: ControlLoop, robot: RobotState, owns_loop: bool) -> None:
        self.config, self.robot_id = robot.config, robot.id
        self._loop, self._robot, self._owns_loop = loop, robot, owns_loop
        self._core = loop.core
        self._lock = loop.core.lock
        # what tests of admission, prompts and the step-cost estimate read
        self._action_reserve, self._scheduler, self._estimator = robot.action_reserve, robot.scheduler, loop.core.estimator
        self._inputs = robot.reader
        if owns_loop:
            loop.add(robot)

    # ---- the cycle ---------------------------------------------------------------------------

    def run_cycle(self, obs: Observation, deadline: float | None = None,
                  on_action: Callable[[ActionChunk], None] | None = None) -> CycleResult:
        """Run one control cycle for the newest observation ``obs`` (``cycle.py``); every output of the
        returned :class:`CycleResult` carries ``obs.tag``. ``deadline``: the ``time.perf_counter()``
        instant (s) the cycle must end by (default: now plus ``action.control_period_s``); ``on_action``
        gets the chunk before any language work.

        Raises ValueError for an unknown camera slot, no camera, or a prompt over the model's budget;
        RuntimeError once closed, or for a fleet's robot (the fleet runs its cycles).
        """
        if not self._owns_loop:
            raise RuntimeError(f"robot {self.robot_id!r} is served by its fleet's cycles (Fleet.run_cycle)")
        with self._lock:
            self._robot.inbox.check_open()
            if deadline is None:
                deadline = time.perf_counter() + self.config.action.control_period_s
            result = self._loop.run({self.robot_id: obs}, {self.robot_id: deadline},
                                    None if on_action is None else (lambda _robot, chunk: on_action(chunk)))
            if self.robot_id in result.errors:
                raise result.errors[self.robot_id]
            return result.cycles[self.robot_id]

    # ---- between cycles ----------------------------------------------------------------------

    def warm_up(self, obs: Observation, on_action: Callable[[ActionChunk], None] | None = None) -> float:
        """Run the action path once for a typical ``obs``, keep nothing of it, return seconds: one-time
        costs (CUDA graph capture per image count and prefix bucket, lazy initialisation) land here,
        not in the first cycle. A throw-away meter measures it: triggers, metrics, step-cost
        estimates and the pool's peak stay as they were. Raises as :meth:`run_cycle` (a fleet's robot
        warms up alone, serialised with the fleet's cycles)."""
        with self._lock:
            self._robot.inbox.check_open()
            return self._loop.warm_up({self.robot_id: obs},
                                      None if on_action is None else (lambda _robot, chunk: on_action(chunk)))

    def submit(self, task: str, instruction: str | None = None, prompt_template: str | None = None) -> int:
        """Queue a request of language task ``task`` for the next cycle; returns its id. The next
        cycle starts it as if the task's trigger had fired, with ``instruction`` and
        ``prompt_template`` (when given) replacing the observation's and the task's. One final
        event ends it: also when cancelled before a cycle took it (``cancelled``, ``seq`` -1, stamp
        0.0, no tag) or when its prompt cannot be built or is over the budget (``dropped``, with the
        reason). Raises KeyError (no such task), ValueError (a template without ``{instruction}``
        or with a field other than ``{instruction}`` / ``{state}``), RuntimeError (closed).
        """
        config = self.config.task(task)
        if prompt_template is not None:
            config = replace(config, prompt_template=prompt_template)   # validated by TaskConfig
        return self._robot.inbox.submit(config, instruction)

    def cancel(self, request_id: int) -> bool:
        """Cancel an active or submitted request (status ``cancelled``); True if it was. Its pages
        are freed at once, or at the next decode-step boundary of a running cycle; its final event
        comes with the next :class:`CycleResult` (or :meth:`take_events`, :meth:`flush`, :meth:`close`)."""
        return self._robot.inbox.cancel(request_id)

    def cancel_task(self, task: str) -> int:
        """Cancel every active request of language task ``task`` (KeyError if none); how many."""
        self.config.task(task)
        return self._robot.inbox.cancel_task(task)

    def observe_delay(self, delay_s: float) -> None:
        """Real-time chunking: a chunk's measured inference delay (s from its observation's stamp to the chunk
        ready, in the robot's clock: simulated time counts simulated steps), for the estimate of the next
        cycles' delay ``d`` (``realtime.py``). Without any, the engine's own wall-clock measurements are used.
        Any thread, also from ``on_action`` inside :meth:`run_cycle`. Raises ValueError for a negative or
        non-finite delay."""
        self._robot.delays.observe(delay_s)

    @property
    def rtc_counts(self) -> dict[str, int]:
        """Chunks denoised plainly with real-time chunking on, by reason (``realtime.py``), and ``delay_clipped``."""
        return dict(self._robot.rtc_counts)

    def take_events(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Events produced between cycles with no model work (final events of requests cancelled
        since the last cycle), for a caller that skips cycles; every event comes out exactly once,
        here or with a later :class:`CycleResult`."""
        with self._lock:
            robot = self._robot
            robot.inbox.apply()
            report_ended(robot.scheduler, robot.outputs, robot.subtask)
            return robot.outputs.take_with_memory()

    def flush(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Run every waiting and running request to its end (no deadline) and return the events;
        the robot's pages are free afterwards. Submissions no cycle has started end as ``cancelled``."""
        with self._lock:
            robot = self._robot
            robot.inbox.apply()
            robot.inbox.withdraw_all(RequestStatus.CANCELLED)
            self._loop.drain(robot)
            return robot.outputs.take_with_memory()

    def close(self) -> list[TextEvent]:
        """Cancel every active request, free all pages and refuse further cycles; returns the
        final events of the cancelled requests."""
        with self._lock:
            robot = self._robot
            robot.inbox.close()     # no submit() after this
            robot.inbox.apply()
            robot.inbox.cancel_all()
            self._core.planner.tree.clear()
            report_ended(robot.scheduler, robot.outputs, robot.subtask)
            return robot.outputs.take()

    # ---- what it reports ---------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        """The KV pool (occupancy: ``pool.used_bytes``, ``pool.num_used``); a fleet's whole pool."""
        return self._core.pool

    @property
    def counters(self) -> WorkCounters:
        """Cumulative model work (vision calls, prefilled tokens, decode steps)."""
        return self._core.runner.counters

    @property
    def subtask(self) -> SubtaskState:
        """The robot's latest subtask and the loop's counters (``subtask.py``)."""
        return self._robot.subtask

    @property
    def active_requests(self) -> list[Request]:
        """Waiting and running language requests."""
        return self._robot.scheduler.active

    def metrics(self) -> dict:
        """Summary of :class:`EngineMetrics` since the last :meth:`reset_metrics`."""
        self._robot.metrics.note_pool_peak(self._core.pool.peak_used_bytes)
        return self._robot.metrics.summary()

    @property
    def metrics_records(self) -> EngineMetrics:
        """The metrics: running totals and the windowed per-cycle and per-request records."""
        return self._robot.metrics

    def reset_metrics(self) -> None:
        """Forget records, totals and the pool's peak (e.g. after a benchmark's warm-up)."""
        self._robot.metrics.reset()
        pool = self._core.pool
        pool.peak_used_blocks = pool.num_used

