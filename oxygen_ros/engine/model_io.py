"""What the engine needs to turn robot data into model inputs and model outputs into robot data.

:class:`ModelIO` is that interface (images to pixels, prompts to token ids, token ids to text, the
state input, actions out); :class:`ProcessorIO` implements it over the models package's
:class:`~oxygen_ros.models.processing.Processor` (the checkpoint family's resize-with-pad, robot
adaptation, normalisation, state discretisation, prompt layouts and action post-processing, the
tokenizer), so that ROS-free callers (benchmarks, notebooks) and the node build engines the same way.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from oxygen_ros.models.conventions import PromptLayout
from oxygen_ros.models.processing import Processor, build_prompt_tokens, resize_with_pad


class ModelIO(Protocol):
    """Pre/post-processing the engine needs from the model package."""

    def camera_view(self, slot: str, image: np.ndarray) -> np.ndarray:
        """The part of camera ``slot``'s uint8 ``[H, W, 3]`` frame the model sees (its crop, or the frame)."""

    def images_to_pixels(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` images -> float ``[N, 3, 224, 224]`` in [-1, 1] (resize with pad)."""

    def prompt_ids(self, template: str, instruction: str, state: np.ndarray | None) -> list[int]:
        """Token ids of ``template`` filled with the instruction (and the state where it has
        ``{state}``), BOS included."""

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of generated token ids."""

    def state_tensor(self, state: np.ndarray | None) -> torch.Tensor | None:
        """Normalised, padded float32 state ``[action_dim]`` for models that take a continuous state
        token (π0); None for models that read the state in the prompt (π0.5)."""

    def actions_out(self, actions: torch.Tensor, state: np.ndarray | None) -> np.ndarray:
        """Model actions ``[H, action_dim]`` and the state of the observation they were computed from
        -> float32 robot actions (unnormalised, delta dimensions made absolute against that state,
        robot adaptation, sliced)."""


class ProcessorIO:
    """Implements :class:`ModelIO` with a models-package :class:`Processor`.

    Prompt templates are matched to the family's layouts: the template of its action prompt or of its
    language prompt gets that layout (cleaning, separately tokenised parts, truncation); any other
    template (a node's own speech or memory prompt) gets openpi's cleaning and keeps its trailing
    anchor when cut.

    Args:
        processor: model + robot + family processing (tokenizer, norm stats, conventions).
    """

    def __init__(self, processor: Processor):
        self._processor = processor
        self._config = processor.config
        conv = processor.conventions
        self._layouts = {conv.language_prompt.template: conv.language_prompt,
                         conv.action_prompt.template: conv.action_prompt}

    @property
    def processor(self) -> Processor:
        """The models-package processor (conventions, norm stats, tokenizer)."""
        return self._processor

    def camera_view(self, slot: str, image: np.ndarray) -> np.ndarray:
        """The model's crop of camera ``slot``'s frame (:meth:`Processor.camera_view`)."""
        return self._processor.camera_view(slot, image)

    def images_to_pixels(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` images (any sizes) -> fp32 ``[N, 3, 224, 224]`` in [-1, 1], resized as the
        family resizes."""
        method = self._processor.conventions.image_resize
        return torch.stack([resize_with_pad(image, self._config.image_size, method) for image in images])

    def prompt_ids(self, template: str, instruction: str, state: np.ndarray | None) -> list[int]:
        """BOS + tokens of ``template``; ``{state}`` gets the discretised, normalised state.

        Raises:
            ValueError: the template has ``{state}`` and ``state`` is None or of a wrong dimension.
        """
        layout = self._layouts.get(template) or PromptLayout(template, truncation="instruction")
        if layout.has_state and state is None:
            raise ValueError("the prompt template has {state} but the observation has no state")
        bins = self._processor.state_bins(state) if layout.has_state else None
        return build_prompt_tokens(self._processor.tokenizer, instruction, layout,
                                   self._processor.conventions.max_token_len, bins)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of generated token ids."""
        return self._processor.tokenizer.decode(list(ids))

    def state_tensor(self, state: np.ndarray | None) -> torch.Tensor | None:
        """π0's continuous state input (fp32 ``[32]``); None for π0.5 (state in the prompt)."""
        if state is None:
            return None
        return self._processor.model_state(state)

    def actions_out(self, actions: torch.Tensor, state: np.ndarray | None) -> np.ndarray:
        """Model actions ``[H, 32]`` and the state they were computed from -> float32 robot actions
        ``[H, action_dim]`` (unnormalised, delta dimensions made absolute, robot adaptation applied).

        Raises:
            ValueError: a family with delta actions and no state.
        """
        return self._processor.robot_actions(actions, state).astype(np.float32)
