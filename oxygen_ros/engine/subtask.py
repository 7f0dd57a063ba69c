"""π0.5's subtask loop: the high-level inference's latest subtask conditions the low-level inference.

π0.5 (arXiv 2504.16054) first decodes a subtask in text ("grasp the cube") from the
observation, then predicts actions from a prompt that carries it. Here the high-level inference is an
ordinary speech-kind language task (``action.subtask_task``); :class:`SubtaskState` keeps, for one robot,
the text of its latest request that ended on a stop token, and :meth:`SubtaskState.action_prompt` chooses
the action prompt of the next cycle: ``action.subtask_prompt_template`` with ``{subtask}`` filled in once a
subtask exists, the family's plain action prompt (``action.prompt_template``) before.

Which requests give a subtask (the rule; docs/architecture.md):

* a request of the source task that ended ``completed`` on one of its stop tokens (the model said the
  subtask was over). A request cut at ``max_new_tokens`` is a truncated subtask, and cancelled, preempted
  or dropped requests have no complete text: none of them changes the subtask;
* prompted with the task's own template and the observation's instruction (an ``Engine.submit`` with
  another instruction or template, e.g. a question over ``~/ask``, answers a question, not the subtask);
* for the instruction in force: a new instruction clears the subtask, and a request triggered under an
  older instruction that completes later is ignored;
* its text with surrounding whitespace stripped; an empty text leaves the previous subtask in place.
"""

from __future__ import annotations

from typing import Callable

from oxygen_ros.engine.config import ActionTaskConfig
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.types import RequestStatus


def fill_subtask(template: str, subtask: str) -> str:
    """``template`` with ``{subtask}`` replaced by ``subtask`` as literal text (its braces escaped, so the
    prompt builder's ``str.format`` of ``{instruction}`` / ``{state}`` leaves them as written). Without
    braces in ``subtask`` this is ``template.replace("{subtask}", subtask)``, as the demo policy's training
    builds its prompts (``oxygen_ros/training/train.py``, ``ACTION_SUBTASK_PROMPT``)."""
    return template.replace("{subtask}", subtask.replace("{", "{{").replace("}", "}}"))


class SubtaskState:
    """The latest subtask of one robot (one per robot, so an engine of several robots holds several).

    Args:
        config: the action task (``subtask_task``, ``subtask_prompt_template``, ``prompt_template``).
        eos_token_id: the model's EOS (the stop token of a task that names none).

    Attributes:
        text: the latest subtask, or None (none yet, or cleared by a new instruction).
        instruction: the instruction in force (the last one :meth:`new_instruction` saw).
        updates: how many times a completed request set the subtask.
        fallbacks: cycles whose subtask prompt did not fit the prompt budget and used the plain prompt.
    """

    def __init__(self, config: ActionTaskConfig, eos_token_id: int):
        self._config = config
        self._eos = eos_token_id
        self.text: str | None = None
        self.instruction: str | None = None
        self.updates = 0
        self.fallbacks = 0

    @property
    def enabled(self) -> bool:
        """Whether the loop is on (``subtask_task`` is set)."""
        return bool(self._config.subtask_task)

    def new_instruction(self, instruction: str) -> None:
        """The robot's instruction changed: the old subtask no longer applies."""
        self.instruction = instruction
        self.text = None

    def ended(self, requests: list[Request]) -> None:
        """Take the subtask from ``requests`` that reached a terminal status (after their text was
        assembled), by the module's rule; the last qualifying one wins."""
        if not self.enabled:
            return
        for request in requests:
            if request.task.name != self._config.subtask_task or not request.subtask_source:
                continue
            if request.status != RequestStatus.COMPLETED or not request.output_ids or \
                    request.output_ids[-1] not in request.stop_tokens(self._eos):
                continue
            if request.instruction != self.instruction:
                continue
            text = request.text.strip()
            if text:
                self.text = text
                self.updates += 1

    def action_templates(self) -> list[tuple[str, str | None]]:
        """The next cycle's action prompt templates in order of preference, each with the subtask it carries:
        the subtask prompt filled with the loop's subtask once there is one, then the plain prompt (None).
        The observe step (``inputs.py``) takes the first whose prompt fits the model's budget and counts a
        skipped subtask prompt in :attr:`fallbacks`."""
        subtask = [(fill_subtask(self._config.subtask_prompt_template, self.text), self.text)] \
            if self.enabled and self.text is not None else []
        return subtask + [(self._config.prompt_template, None)]
