"""The engine's :class:`~oxygen_ros.engine.model_runner.Processor` over ``oxygen_ros.models``.

Wraps the models package's processing (openpi's resize-with-pad, normalisation, state
discretisation, prompt building with deliberate truncation, tokenizer) so that ROS-free callers
(benchmarks, notebooks) and the node build engines the same way.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from oxygen_ros.models.processing import (Processor, build_prompt_tokens, discretize_state,
                                          resize_with_pad)


class ModelProcessor:
    """Implements the engine's processor protocol with a models-package :class:`Processor`.

    Args:
        processor: model + robot processing (tokenizer, norm stats, dimensions).
    """

    def __init__(self, processor: Processor):
        self._processor = processor
        self._config = processor.config

    def images_to_pixels(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` images (any sizes) -> fp32 ``[N, 3, 224, 224]`` in [-1, 1]."""
        return torch.stack([resize_with_pad(image, self._config.image_size) for image in images])

    def prompt_ids(self, template: str, instruction: str, state: np.ndarray | None) -> list[int]:
        """BOS + tokens of ``template``; ``{state}`` gets the discretised, normalised state.

        Raises:
            ValueError: the template has ``{state}`` and ``state`` is None or of a wrong dimension.
        """
        bins = None
        if "{state}" in template:
            if state is None:
                raise ValueError("the prompt template has {state} but the observation has no state")
            bins = discretize_state(self._processor.normalized_state(state))
        return build_prompt_tokens(self._processor.tokenizer, instruction, template,
                                   self._config.max_token_len, bins)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of generated token ids."""
        return self._processor.tokenizer.decode(list(ids))

    def state_tensor(self, state: np.ndarray | None) -> torch.Tensor | None:
        """π0's continuous state input (fp32 ``[32]``); None for π0.5 (state in the prompt)."""
        if state is None:
            return None
        return self._processor.model_state(state)

    def actions_out(self, actions: torch.Tensor) -> np.ndarray:
        """Model actions ``[H, 32]`` -> float32 robot actions ``[H, action_dim]`` (unnormalised)."""
        return self._processor.actions(actions).astype(np.float32)
