"""One robot's state in an engine: plain data that the control loop (``cycle.py``) reads and updates.

A single-robot :class:`~oxygen_ros.engine.engine.Engine` holds one :class:`RobotState`, a
:class:`~oxygen_ros.engine.fleet.Fleet` one per robot; the loop runs the same steps over all of them.
Everything here is the robot's own: its configuration and checkpoint-family processing, how its
observations are read, its triggers, its π0.5 subtask, its scheduler (over the whole pool or its share
of a fleet's pool), its inbox of cross-thread submissions and cancellations, its outputs and metrics,
and the loop's bookkeeping of when it was last admitted and decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Hashable

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.core import EngineCore
from oxygen_ros.engine.inbox import Inbox
from oxygen_ros.engine.inputs import ObservationReader, Triggers
from oxygen_ros.engine.metrics import EngineMetrics
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.outputs import OutputAssembler
from oxygen_ros.engine.realtime import ChunkInFlight, DelayEstimator
from oxygen_ros.engine.scheduler import Scheduler, action_reserve_blocks
from oxygen_ros.engine.subtask import SubtaskState


@dataclass(eq=False)
class RobotState:
    """One robot of an engine (module docstring).

    Attributes:
        id: the robot id (None: a single-robot engine); its requests and prefix keys carry it.
        config: the robot's engine configuration (cameras, action task, language tasks).
        io: its pre/post-processing (camera pixels, prompts, state tensor, actions out).
        reader: reads its observations (cameras, prompt ids, the requests a frame starts).
        triggers: when its language tasks fire.
        subtask: its latest subtask (π0.5's subtask loop; inert when off).
        scheduler: its language requests and their pages.
        outputs: its text events and memory entries.
        metrics: its cycle and request records.
        inbox: submissions and cancellations from other threads.
        noise_shape: the flow-matching noise of one chunk ``(1, H, action_dim)``.
        action_reserve: pages kept for its action prefix (its largest, plus one), never given to language.
        last_stamp: the stamp (s) of its newest observation a cycle accepted (admission's clock).
        admitted_at: the loop's admission round in which it last admitted (fair admission order).
        decoded_at: the loop's decode step that last took one of its requests (fair batch order).
        tokens: tokens its requests generated in the current cycle.
        delays: its inference delay in control steps (real-time chunking, ``realtime.py``).
        in_flight: the chunk it executes (real-time chunking keeps it), None before the first.
        rtc_counts: chunks denoised plainly with real-time chunking on, by reason, and ``delay_clipped``.
    """

    id: Hashable
    config: EngineConfig
    io: ModelIO
    reader: ObservationReader
    triggers: Triggers
    subtask: SubtaskState
    scheduler: Scheduler
    outputs: OutputAssembler
    metrics: EngineMetrics
    inbox: Inbox
    noise_shape: tuple[int, int, int]
    action_reserve: int
    last_stamp: float = -float("inf")
    admitted_at: int = -1
    decoded_at: int = -1
    tokens: int = 0
    delays: DelayEstimator | None = None
    in_flight: ChunkInFlight | None = None
    rtc_counts: dict[str, int] = field(default_factory=dict)


def report_ended(scheduler: Scheduler, outputs: OutputAssembler, subtask: SubtaskState) -> None:
    """Assemble the final events of the robot's requests that ended, then update its subtask from them
    (after the events: their text is complete)."""
    ended = scheduler.drain_ended()
    outputs.ended(ended)
    subtask.ended(ended)


def new_robot(core: EngineCore, io: ModelIO, config: EngineConfig, robot_id: Hashable = None,
              shared: bool = False) -> RobotState:
    """A robot on ``core``: over the whole pool, or (``shared``, a fleet's robot) over its share
    ``config.kv_budget_mb`` of the pool.

    Raises:
        ValueError: the share does not fit, or the pool (share) cannot hold the action task's reserve.
    """
    model = core.runner.model.config
    max_prompt = getattr(model, "max_token_len", None)
    reserve = action_reserve_blocks(core.manager, len(config.camera_slots), model.num_image_tokens, max_prompt)
    scheduler = core.scheduler(config, reserve, robot_id, shared=shared)
    metrics = EngineMetrics(model.action_horizon, core.pool.num_blocks * core.pool.bytes_per_block,
                            config.metrics_window)
    outputs = OutputAssembler(io, model.eos_token_id, metrics)
    subtask = SubtaskState(config.action, model.eos_token_id)
    inbox = Inbox(scheduler, outputs, core.lock, partial(report_ended, scheduler, outputs, subtask))
    return RobotState(robot_id, config, io,
                      ObservationReader(config, io, max_prompt, model.num_image_tokens, robot_id),
                      Triggers(config.language_tasks), subtask, scheduler, outputs, metrics, inbox,
                      (1, model.action_horizon, model.action_dim), reserve, delays=DelayEstimator(config.rtc))
