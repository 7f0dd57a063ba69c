"""What the control loop's observe step (``cycle.py``) reads from an observation: the camera images
and their mask, prompt token ids within the model's prompt budget, which language tasks fire for it
(every N frames, every T seconds of observation time, on a new instruction: :class:`Triggers`,
configured by :class:`~oxygen_ros.engine.config.TriggerConfig`) and the requests a cycle starts from
it; together a :class:`Frame`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

import numpy as np

from oxygen_ros.engine.config import EngineConfig, TaskConfig
from oxygen_ros.engine.inbox import Inbox
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.types import Observation, RequestStatus

if TYPE_CHECKING:
    from oxygen_ros.engine.robot import RobotState


@dataclass
class Frame:
    """What a cycle's observe step read from one observation: the present cameras' ``images`` and
    their ``mask``, the action prompt's token ids, the language ``requests`` it starts and the
    ``subtask`` in the action prompt (None: the plain prompt)."""

    obs: Observation
    images: list[np.ndarray]
    mask: tuple[bool, ...]
    action_ids: tuple[int, ...]
    requests: list[Request]
    subtask: str | None = None


def observe(robot: RobotState, obs: Observation, t0: float) -> Frame:
    """The control loop's observe step for one robot: apply the cross-thread cancellations, read the camera
    images, fire the triggers (a new instruction clears the subtask and cancels the requests of tasks with
    ``cancel_on_new_instruction``), choose the action prompt (the subtask prompt once the loop has a subtask
    and it fits the prompt budget, else the plain one) and build the requests ``obs`` starts (arrival ``t0``,
    a ``time.perf_counter()`` instant).

    Raises:
        ValueError: an unknown camera slot, no camera, or the plain action prompt or a fired task's prompt
            over the model's budget.
    """
    robot.inbox.apply()
    images, mask = robot.reader.camera_images(obs)
    fired, new_instruction = robot.triggers.observe(obs)
    if new_instruction:
        robot.subtask.new_instruction(obs.instruction)
        robot.inbox.cancel_requests([r for r in robot.scheduler.active if r.task.cancel_on_new_instruction])
    for template, subtask in robot.subtask.action_templates():
        try:
            action_ids = robot.reader.prompt_ids(template, obs)
            break
        except ValueError:
            if subtask is None:
                raise
            robot.subtask.fallbacks += 1
    requests = robot.reader.requests(obs, mask, fired, robot.inbox, t0)
    return Frame(obs, images, mask, action_ids, requests, subtask)


def action_frame(robot: RobotState, obs: Observation) -> Frame:
    """A warm-up's frame of ``obs``: its cameras and the plain action prompt, no requests; triggers, subtask
    and inbox untouched. Raises ValueError as :func:`observe`."""
    images, mask = robot.reader.camera_images(obs)
    return Frame(obs, images, mask, robot.reader.prompt_ids(robot.config.action.prompt_template, obs), [])


class ObservationReader:
    """Reads observations for one engine.

    Args:
        config: the engine configuration (camera slots).
        io: the model's pre/post-processing (prompt token ids).
        max_prompt_tokens: the model's prompt budget in tokens, or None for no limit.
        image_tokens_per_camera: the model's tokens per camera image.
        robot: the robot id its requests carry (:attr:`Request.robot`; None: a single-robot engine).
    """

    def __init__(self, config: EngineConfig, io: ModelIO, max_prompt_tokens: int | None,
                 image_tokens_per_camera: int, robot: Hashable = None):
        self._robot = robot
        self._slots = tuple(config.camera_slots)
        self._tasks = {task.name: task for task in config.language_tasks}
        self._io = io
        self._max_prompt_tokens = max_prompt_tokens
        self._tokens_per_camera = image_tokens_per_camera

    def camera_images(self, obs: Observation) -> tuple[list[np.ndarray], tuple[bool, ...]]:
        """The present cameras' images in ``camera_slots`` order (each the part the model sees:
        :meth:`ModelIO.camera_view`) and the slots' presence mask.

        Raises:
            ValueError: a slot unknown to ``camera_slots``, or no camera present.
        """
        unknown = set(obs.images) - set(self._slots)
        if unknown:
            raise ValueError(f"observation has camera slots {sorted(unknown)} not in "
                             f"camera_slots {list(self._slots)}")
        images = [obs.images.get(slot) for slot in self._slots]
        mask = tuple(image is not None for image in images)
        if not any(mask):
            raise ValueError(f"observation {obs.seq} has no camera image")
        return [self._io.camera_view(slot, image) for slot, image in zip(self._slots, images) if image is not None], mask

    def prompt_ids(self, template: str, obs: Observation,
                   instruction: str | None = None) -> tuple[int, ...]:
        """Token ids of ``template`` for ``obs`` (its instruction, or ``instruction`` when given).

        Raises:
            ValueError: longer than the model's prompt budget.
        """
        instruction = obs.instruction if instruction is None else instruction
        ids = tuple(self._io.prompt_ids(template, instruction, obs.state))
        if self._max_prompt_tokens is not None and len(ids) > self._max_prompt_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the model's budget of "
                             f"{self._max_prompt_tokens} tokens")
        return ids

    def requests(self, obs: Observation, mask: tuple[bool, ...], fired: list[TaskConfig],
                 inbox: Inbox, t_arrival: float) -> list[Request]:
        """The requests of the tasks that ``fired`` and of the submissions waiting in ``inbox``, for
        ``obs`` (cameras ``mask``). A fired task's prompt over the budget raises ValueError. A
        submission whose prompt cannot be built (over the budget, or a template the prompt builder
        refuses) ends that submission only, as ``dropped`` with the reason: one bad request never
        costs the robot its cycle or another request."""
        image_tokens = sum(mask) * self._tokens_per_camera
        requests = [Request(task, obs.seq, obs.stamp, self.prompt_ids(task.prompt_template, obs),
                            image_tokens, mask, t_arrival, tag=obs.tag, instruction=obs.instruction,
                            robot=self._robot)
                    for task in fired]
        for submission in inbox.take():
            try:
                ids = self.prompt_ids(submission.task.prompt_template, obs, submission.instruction)
            except Exception as error:      # the request is the unit of failure, not the cycle
                inbox.end_unstarted(submission, RequestStatus.DROPPED, obs,
                                    reason=f"prompt not built: {type(error).__name__}: {error}")
                continue
            instruction = obs.instruction if submission.instruction is None else submission.instruction
            own = instruction == obs.instruction and \
                submission.task.prompt_template == self._tasks[submission.task.name].prompt_template
            requests.append(Request(submission.task, obs.seq, obs.stamp, list(ids), image_tokens,
                                    mask, t_arrival, request_id=submission.request_id, tag=obs.tag,
                                    instruction=instruction, subtask_source=own, robot=self._robot))
        return requests


class Triggers:
    """The trigger state of the language tasks: frames seen, each task's last firing, the last
    instruction.

    Args:
        tasks: the language tasks, in configuration order.
    """

    def __init__(self, tasks: list[TaskConfig] | tuple[TaskConfig, ...]):
        self._tasks = list(tasks)
        self._frame_index = 0
        self._last_instruction: str | None = None
        self._last_fired: dict[str, float] = {}

    def observe(self, obs: Observation) -> tuple[list[TaskConfig], bool]:
        """``(tasks that fire for obs, whether its instruction is new)``; advances the frame count.

        Time triggers read ``obs.stamp`` (s). Stamps that go backwards (a bag replayed in a loop, a
        simulator's clock reset) restart a task's period from the new time instead of waiting for
        the stamps to pass the old one.
        """
        new_instruction = obs.instruction != self._last_instruction
        self._last_instruction = obs.instruction
        fired = [task for task in self._tasks if self._fires(task, obs, new_instruction)]
        self._frame_index += 1
        return fired, new_instruction

    def _fires(self, task: TaskConfig, obs: Observation, new_instruction: bool) -> bool:
        trigger = task.trigger
        last = self._last_fired.get(task.name)
        if last is not None and obs.stamp < last:
            last = self._last_fired[task.name] = obs.stamp
        fire = (trigger.on_new_instruction and new_instruction) or \
            (trigger.every_n_frames is not None and self._frame_index % trigger.every_n_frames == 0) \
            or (trigger.every_s is not None and (last is None or obs.stamp - last >= trigger.every_s))
        if fire:
            self._last_fired[task.name] = obs.stamp
        return fire
