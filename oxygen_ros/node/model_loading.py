"""Builds the model, its processing and the engine from the node's settings, and warms the engine
up (the ``configure`` step).

The robot (state and action dimensions, camera slots) comes from the node's parameters; the engine's
processor is :class:`oxygen_ros.engine.processing.ModelProcessor` over the models package's
:class:`oxygen_ros.models.processing.Processor` (openpi's resize-with-pad, normalisation, state
discretisation and prompt building).
"""

from __future__ import annotations

import numpy as np

from oxygen_ros.engine import Engine, EngineConfig, Observation
from oxygen_ros.engine.processing import ModelProcessor
from oxygen_ros.models import RobotConfig, load_model, load_norm_stats
from oxygen_ros.models.processing import ACTION_PROMPT, LANGUAGE_PROMPT, PI0_PROMPT, Processor
from oxygen_ros.models.tokenizer import load_tokenizer
from oxygen_ros.node.parameters import NodeSettings


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
        "camera_slots": list(settings.model_camera_slots),
        "action": {"prompt_template": action_prompt(variant), "control_period_s": settings.control_period_s,
                   "num_denoise_steps": settings.num_denoise_steps},
        "language_tasks": tasks, "cuda_graphs": settings.cuda_graphs})


def build_engine(settings: NodeSettings) -> Engine:
    """Load the model and build the engine (allocates the KV pool).

    Raises:
        ValueError, FileNotFoundError, RuntimeError: unknown preset, missing checkpoint / tokenizer /
            norm stats, inconsistent dimensions, or a KV budget too small; the message says which.
    """
    model = load_model(settings.preset, settings.checkpoint or None, dtype=settings.dtype,
                       device=settings.device, seed=settings.seed)
    robot = RobotConfig(name=settings.preset, state_dim=len(settings.joint_names), action_dim=settings.action_dim,
                        camera_slots=settings.model_camera_slots,
                        norm_mode=settings.norm_mode)
    tokenizer = load_tokenizer(model.config, settings.tokenizer_path or None)
    norm_stats = load_norm_stats(settings.norm_stats_path) if settings.norm_stats_path else None
    processor = ModelProcessor(Processor(model.config, robot, tokenizer, norm_stats))
    return Engine(model, processor, engine_config(settings, model.config.variant))


def warm_up(engine: Engine, settings: NodeSettings, on_action=None) -> float:
    """One :meth:`Engine.warm_up` on a synthetic observation shaped like the robot's: a black
    224 x 224 image in every camera slot, a zero state of ``joint_names``, the default
    instruction; ``on_action`` receives its action chunk. Returns its seconds (on CUDA: mostly the
    capture of the CUDA graphs)."""
    black = np.zeros((224, 224, 3), np.uint8)
    obs = Observation({camera.slot: black for camera in settings.cameras}, settings.default_instruction,
                      np.zeros(len(settings.joint_names), np.float32))
    return engine.warm_up(obs, on_action)

