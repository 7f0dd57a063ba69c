"""When the language tasks fire: every N frames, every T seconds of observation time, on a new
instruction (:class:`~oxygen_ros.engine.config.TriggerConfig`)."""

from __future__ import annotations

from oxygen_ros.engine.config import TaskConfig
from oxygen_ros.engine.types import Observation


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
