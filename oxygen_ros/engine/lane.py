"""One robot's cycle steps as a public surface: what a :class:`~oxygen_ros.engine.fleet.Fleet` drives
when it runs the cycles of many robots' engines batched together.

An :class:`~oxygen_ros.engine.engine.Engine` runs its own cycle (:meth:`Engine.run_cycle`) from its
parts (``inputs.py``, ``inbox.py``, ``scheduler.py``, ``language.py``, ``modes.py``, ``action.py``,
``outputs.py``, ``metrics.py``). A fleet runs the same steps for every robot but does the model work
(vision, prefills, denoising, decode steps) once for all of them; between those calls it needs each
robot's own steps, and nothing else: :class:`EngineLane` (``Engine.lane``) is that view. The model
calls stay the fleet's (on the shared :class:`~oxygen_ros.engine.core.EngineCore`); every method here
is one robot's bookkeeping before or after them, with the same code the single-robot cycle runs.

The methods run on the cycle's thread with the core's lock held (the fleet's cycle), except where said.
"""

from __future__ import annotations

from typing import Hashable

import torch

from oxygen_ros.engine.action import ActionWork
from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.inbox import Inbox
from oxygen_ros.engine.inputs import Frame, ObservationReader, Observer
from oxygen_ros.engine.language import LanguageWork
from oxygen_ros.engine.meter import CycleMeter
from oxygen_ros.engine.metrics import CycleRecord, EngineMetrics
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.modes import ModePolicy
from oxygen_ros.engine.outputs import OutputAssembler
from oxygen_ros.engine.prefix_cache import PrefixJob, PrefixNode
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.scheduler import AdmissionPlan, Scheduler
from oxygen_ros.engine.subtask import SubtaskState
from oxygen_ros.engine.types import ActionChunk, Observation, TextEvent


class EngineLane:
    """The cycle steps of one robot's engine (module docstring). Built by the engine from its parts.

    Args:
        config: the robot's engine configuration.
        robot_id: the robot's id (None: a single-robot engine).
        inputs, observer: reads observations; the observe step.
        inbox: submissions and cancellations from other threads.
        scheduler: the robot's language requests and its share of the pool.
        work, mode, action: language work, the mode policy, the action path.
        subtask: the robot's latest subtask (π0.5's subtask loop).
        outputs, metrics: the robot's events and records.
    """

    def __init__(self, config: EngineConfig, robot_id: Hashable, *, inputs: ObservationReader, observer: Observer,
                 inbox: Inbox, scheduler: Scheduler, work: LanguageWork, mode: ModePolicy, action: ActionWork,
                 subtask: SubtaskState, outputs: OutputAssembler, metrics: EngineMetrics):
        self.config, self.robot_id = config, robot_id
        self._inputs, self._observer, self._inbox = inputs, observer, inbox
        self._scheduler, self._work, self._mode, self._action = scheduler, work, mode, action
        self._subtask, self._outputs, self._metrics = subtask, outputs, metrics

    # ---- observe and act ---------------------------------------------------------------------

    @property
    def io(self) -> ModelIO:
        """The robot's pre/post-processing (its camera pixels, state tensor and actions)."""
        return self._work.io

    def use_meter(self, meter: CycleMeter) -> None:
        """Measure the robot's language work (its generated tokens) with ``meter`` from now on."""
        self._work.meter = meter

    def observe(self, obs: Observation, t0: float) -> Frame:
        """The observe step (:meth:`~oxygen_ros.engine.inputs.Observer.observe`): cancellations, cameras,
        triggers, instruction change, action prompt, new requests (arrival ``t0``, a
        ``time.perf_counter()`` instant). Raises ValueError: unknown camera slot, no camera, prompt over
        the model's budget (then call :meth:`abandon`)."""
        return self._observer.observe(obs, t0)

    def action_frame(self, obs: Observation) -> Frame:
        """A warm-up's frame of ``obs``: its cameras and the plain action prompt, no requests; triggers,
        subtask and inbox untouched. Raises ValueError as :meth:`observe`."""
        images, mask = self._inputs.camera_images(obs)
        return Frame(obs, images, mask, self._inputs.prompt_ids(self.config.action.prompt_template, obs), [])

    def action_job(self, frame: Frame, features: torch.Tensor) -> PrefixJob:
        """The action prefix's job of ``frame`` with its cameras' vision ``features``
        ``[N, num_image_tokens, W]`` (the mode's: keyed by robot and frame)."""
        return self._mode.action_job(frame.obs, frame.mask, frame.action_ids, features, frame.requests)

    def state_tensor(self, obs: Observation) -> torch.Tensor | None:
        """π0's continuous state input of ``obs`` (float32 ``[action_dim]``), None for π0.5."""
        return self._work.io.state_tensor(obs.state)

    def noise(self, obs: Observation) -> torch.Tensor:
        """The flow-matching noise of ``obs`` ``[1, H, action_dim]`` (seeded by ``noise_seed + obs.seq``)."""
        return self._action.noise(obs)

    def finish_action(self, frame: Frame, actions: torch.Tensor, t0: float, prompt_ids: tuple[int, ...]) -> ActionChunk:
        """The chunk of ``frame`` from the model's denoised ``actions`` ``[H, action_dim]`` (post-processed
        into the robot's units, latency from ``t0``, with ``prompt_ids`` of its action prompt), then the
        mode's after-action step."""
        chunk = self._action.finish(frame.obs, actions, t0, frame.subtask, prompt_ids)
        self._mode.action_done()
        return chunk

    def enqueue(self, frame: Frame, features: torch.Tensor) -> None:
        """Queue the frame's new requests (with the inputs they keep until prefilled)."""
        for request in frame.requests:
            self._mode.keep_inputs(request, frame.images, features)
            self._scheduler.add(request)
        self._inbox.queued([request.request_id for request in frame.requests])

    def abandon(self, obs: Observation) -> None:
        """A cycle failed for this robot: the submissions its observe step took but did not queue end as
        ``dropped`` (:meth:`Inbox.abandon`)."""
        self._inbox.abandon(obs)

    # ---- language ----------------------------------------------------------------------------

    @property
    def has_waiting(self) -> bool:
        """Whether language requests wait for admission."""
        return bool(self._scheduler.waiting)

    def admit(self, now_stamp: float, prefill_budget: float, minimum: int = 0) -> AdmissionPlan:
        """Admit waiting requests against the robot's share (:meth:`LanguageWork.admit`)."""
        return self._work.admit(now_stamp, prefill_budget, minimum)

    def prefill_cost(self, request: Request) -> int:
        """Tokens to prefill before ``request`` can start (the mode's)."""
        return self._mode.prefill_cost(request)

    def prefix_jobs(self, plan: AdmissionPlan) -> list[PrefixJob]:
        """The prefix jobs of ``plan``'s admitted requests."""
        return self._work.jobs(plan)

    def begin(self, plan: AdmissionPlan, nodes: list[PrefixNode]) -> None:
        """Bind ``plan``'s requests to their prefilled prefix ``nodes`` (in order), sample first tokens."""
        self._work.begin(plan, nodes)

    def apply_cancels(self) -> None:
        """Apply the cancellations other threads asked for (a decode-step boundary)."""
        self._inbox.apply()

    def decode_batch(self) -> list[Request]:
        """The robot's running requests for the next decode step, its own order and batch cap."""
        return self._scheduler.decode_batch()

    def add_token(self, request: Request, token: int) -> None:
        """Count, stream and maybe complete ``request``'s new ``token`` (:meth:`LanguageWork.add_token`)."""
        self._work.add_token(request, token)

    # ---- report ------------------------------------------------------------------------------

    def report_ended(self) -> None:
        """Assemble the final events of the requests that ended and update the subtask from them. Also
        called by the inbox from another thread, with the core's lock held, when no cycle runs."""
        ended = self._scheduler.drain_ended()
        self._outputs.ended(ended)
        self._subtask.ended(ended)     # after ended(): the requests' text is complete

    def take_events(self) -> list[TextEvent]:
        """The text events assembled since the last call, in order."""
        return self._outputs.take()

    def record_cycle(self, record: CycleRecord, pool_peak_bytes: int) -> None:
        """Add the robot's cycle ``record`` to its metrics and raise its pool peak to ``pool_peak_bytes`` [B]."""
        self._metrics.add_cycle(record)
        self._metrics.note_pool_peak(pool_peak_bytes)
