"""Builds the model, its processing and the engine from the node's settings (the ``configure`` step).

The engine asks for the small :class:`oxygen_ros.engine.Processor` protocol; :class:`EngineProcessor`
implements it on top of the models package's :class:`oxygen_ros.models.processing.Processor`
(openpi's resize-with-pad, normalisation, state discretisation and prompt building).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from oxygen_ros.engine import Engine, EngineConfig
from oxygen_ros.models import RobotConfig, load_model, load_norm_stats
from oxygen_ros.models.processing import (ACTION_PROMPT, LANGUAGE_PROMPT, PI0_PROMPT, Processor,
                                          build_prompt_tokens, discretize_state, resize_with_pad)
from oxygen_ros.models.tokenizer import load_tokenizer
from oxygen_ros.node.parameters import NodeSettings


class EngineProcessor:
    """The engine's processor protocol over the models package's :class:`Processor`.

    Args:
        processor: model + robot processing (tokenizer, norm stats, dimensions).
    """

    def __init__(self, processor: Processor):
        self._processor = processor
        self._config = processor.config

    def images_to_pixels(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` images (any sizes) → fp32 ``[N, 3, 224, 224]`` in [-1, 1]."""
        return torch.stack([resize_with_pad(image, self._config.image_size) for image in images])

    def prompt_ids(self, template: str, instruction: str, state: np.ndarray | None) -> list[int]:
        """BOS + tokens of ``template``; ``{state}`` is filled with the discretised, normalised state.

        Raises:
            ValueError: the template has ``{state}`` and ``state`` is None or of the wrong dimension.
        """
        bins = None
        if "{state}" in template:
            if state is None:
                raise ValueError("the prompt template has {state} but the observation has no state")
            bins = discretize_state(self._processor.normalized_state(state))
        return build_prompt_tokens(self._processor.tokenizer, instruction, template, self._config.max_token_len,
                                   bins)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of generated token ids (special tokens dropped)."""
        return self._processor.tokenizer.decode(list(ids))

    def state_tensor(self, state: np.ndarray | None) -> torch.Tensor | None:
        """π0's continuous state input (fp32 ``[32]``); None for π0.5 (state in the prompt)."""
        if state is None:
            return None
        return self._processor.model_state(state)

    def actions_out(self, actions: torch.Tensor) -> np.ndarray:
        """Model actions ``[H, 32]`` → float32 robot actions ``[H, action_dim]`` (unnormalised)."""
        return self._processor.actions(actions).astype(np.float32)


def action_prompt(variant: str) -> str:
    """The action task's prompt template of a model variant (``pi05`` or ``pi0``)."""
    return ACTION_PROMPT if variant == "pi05" else PI0_PROMPT


def engine_config(settings: NodeSettings, variant: str) -> EngineConfig:
    """The :class:`EngineConfig` of the node's settings (tasks ``speech`` and ``memory``).

    Raises:
        ValueError: invalid values (from the engine's own validation).
    """
    tasks = []
    if settings.speech_enabled:
        trigger = {"on_new_instruction": settings.speech_on_new_instruction,
                   "every_n_frames": settings.speech_every_n_frames or None,
                   "every_s": settings.speech_every_s or None}
        tasks.append({"name": "speech", "kind": "speech", "trigger": trigger,
                      "prompt_template": settings.speech_prompt_template or LANGUAGE_PROMPT,
                      "max_new_tokens": settings.speech_max_new_tokens,
                      "cancel_on_new_instruction": settings.speech_cancel_on_new_instruction,
                      "priority": 1})
    if settings.memory_enabled:
        tasks.append({"name": "memory", "kind": "memory", "trigger": {"every_s": settings.memory_every_s},
                      "prompt_template": settings.memory_prompt_template or LANGUAGE_PROMPT,
                      "max_new_tokens": settings.memory_max_new_tokens})
    return EngineConfig.from_dict({
        "mode": settings.engine_mode, "scheduling": settings.engine_scheduling,
        "decode_steps_per_cycle": settings.decode_steps_per_cycle, "kv_budget_bytes": settings.kv_budget_bytes,
        "block_size": settings.block_size, "max_batch_size": settings.max_batch_size,
        "camera_slots": [camera.slot for camera in settings.cameras],
        "action": {"prompt_template": action_prompt(variant), "control_period_s": settings.control_period_s,
                   "num_denoise_steps": settings.num_denoise_steps},
        "language_tasks": tasks})


def build_engine(settings: NodeSettings) -> Engine:
    """Load the model and build the engine (allocates the KV pool).

    Raises:
        ValueError, FileNotFoundError, RuntimeError: unknown preset, missing checkpoint / tokenizer /
            norm stats, inconsistent dimensions, or a KV budget too small; the message says which.
    """
    model = load_model(settings.preset, settings.checkpoint or None, dtype=settings.dtype,
                       device=settings.device, seed=settings.seed)
    robot = RobotConfig(name=settings.preset, state_dim=len(settings.joint_names), action_dim=settings.action_dim,
                        camera_slots=tuple(camera.slot for camera in settings.cameras),
                        norm_mode=settings.norm_mode)
    tokenizer = load_tokenizer(model.config, settings.tokenizer_path or None)
    norm_stats = load_norm_stats(settings.norm_stats_path) if settings.norm_stats_path else None
    processor = EngineProcessor(Processor(model.config, robot, tokenizer, norm_stats))
    return Engine(model, processor, engine_config(settings, model.config.variant))
