"""Builds the model, its processing and the engine from the node's settings, and warms the engine
up (the ``configure`` step).

The checkpoint family's conventions (``settings.conventions``, resolved from the checkpoint, the
``conventions`` parameter or the preset's defaults by :func:`oxygen_ros.node.parameters.read_settings`)
set the model's action horizon and prompt budget, the prompt layouts, the normalisation and the action
post-processing. The normalisation statistics come from the checkpoint directory (LeRobot processor
files, or openpi's ``assets/<asset>/norm_stats.json``) or from ``norm_stats_path``. The engine's
processor is :class:`oxygen_ros.engine.model_io.ProcessorIO` over the models package's
:class:`oxygen_ros.models.processing.Processor`.
"""

from __future__ import annotations

import numpy as np

from oxygen_ros.engine import Engine, EngineConfig, Observation
from oxygen_ros.engine.model_io import ProcessorIO
from oxygen_ros.models import NormStats, RobotConfig, get_preset, load_model, load_norm_stats
from oxygen_ros.models.conventions import Conventions, find_norm_stats
from oxygen_ros.models.processing import Processor
from oxygen_ros.models.tokenizer import load_tokenizer
from oxygen_ros.node.parameters import NodeSettings


def engine_config(settings: NodeSettings, conventions: Conventions) -> EngineConfig:
    """The :class:`EngineConfig` of the node's settings (tasks ``speech`` and ``memory``); the action
    task and the default language prompts use the family's prompt templates.

    Raises:
        ValueError: invalid values (from the engine's own validation).
    """
    language = conventions.language_prompt.template
    tasks = []
    if settings.speech_enabled:
        trigger = {"on_new_instruction": settings.speech_on_new_instruction,
                   "every_n_frames": settings.speech_every_n_frames or None,
                   "every_s": settings.speech_every_s or None}
        tasks.append({"name": "speech", "kind": "speech", "trigger": trigger,
                      "prompt_template": settings.speech_prompt_template or language,
                      "max_new_tokens": settings.speech_max_new_tokens,
                      "cancel_on_new_instruction": settings.speech_cancel_on_new_instruction,
                      "priority": 1})
    if settings.memory_enabled:
        tasks.append({"name": "memory", "kind": "memory", "trigger": {"every_s": settings.memory_every_s},
                      "prompt_template": settings.memory_prompt_template or language,
                      "max_new_tokens": settings.memory_max_new_tokens})
    return EngineConfig.from_dict({
        "mode": settings.engine_mode, "scheduling": settings.engine_scheduling,
        "decode_steps_per_cycle": settings.decode_steps_per_cycle, "kv_budget_bytes": settings.kv_budget_bytes,
        "block_size": settings.block_size, "max_batch_size": settings.max_batch_size,
        "camera_slots": list(settings.model_camera_slots),
        "action": {"prompt_template": conventions.action_prompt.template,
                   "control_period_s": settings.control_period_s,
                   "num_denoise_steps": settings.num_denoise_steps},
        "language_tasks": tasks, "cuda_graphs": settings.cuda_graphs})


def _differs(a: dict[str, NormStats], b: dict[str, NormStats]) -> str | None:
    """The first statistic present in both sets whose values differ (over their common length)."""
    for key in sorted(set(a) & set(b)):
        for name in ("mean", "std", "q01", "q99"):
            x, y = getattr(a[key], name), getattr(b[key], name)
            if x is None or y is None:
                continue
            n = min(x.size, y.size)
            if not np.allclose(x[:n], y[:n], rtol=1e-6, atol=1e-9, equal_nan=True):
                return f"{key}.{name}"
    return None


def load_statistics(settings: NodeSettings) -> dict[str, NormStats] | None:
    """The normalisation statistics: ``norm_stats_path`` and / or what the checkpoint carries.

    Returns:
        the statistics, or None (identity) where neither gives any and there is no checkpoint
        (random weights) or the family normalises nothing.

    Raises:
        ValueError: ``norm_stats_path`` and the checkpoint's statistics differ (both named), or a
            checkpoint whose family normalises but no statistics anywhere.
        FileNotFoundError: ``norm_stats_path`` does not exist.
    """
    conv = settings.conventions
    explicit = load_norm_stats(settings.norm_stats_path) if settings.norm_stats_path else None
    carried = find_norm_stats(settings.checkpoint, conv) if settings.checkpoint else None
    if explicit is not None and carried is not None:
        differing = _differs(explicit, carried[0])
        if differing:
            raise ValueError(f"parameter norm_stats_path {settings.norm_stats_path} differs from the statistics "
                             f"the checkpoint carries, {carried[1]} (first in {differing}): remove the parameter "
                             "or fix it")
    stats = explicit if explicit is not None else None if carried is None else carried[0]
    if stats is None and settings.checkpoint and (conv.state_norm.mode, conv.action_norm.mode) != ("identity",) * 2:
        where = f"assets/{conv.norm_stats_asset}/norm_stats.json" if conv.norm_stats_asset else \
            "assets/<asset>/norm_stats.json or LeRobot processor files"
        raise ValueError(f"checkpoint {settings.checkpoint} carries no normalisation statistics ({where}) and "
                         f"norm_stats_path is empty; {conv.source} normalises with {conv.norm_mode}")
    return stats


def build_engine(settings: NodeSettings) -> Engine:
    """Load the model and build the engine (allocates the KV pool).

    Raises:
        ValueError, FileNotFoundError, RuntimeError: unknown preset, missing checkpoint / tokenizer /
            norm stats, non-finite or degenerate norm stats, inconsistent dimensions, or a KV budget too
            small; the message says which.
    """
    conv = settings.conventions
    config = get_preset(settings.preset, action_horizon=conv.action_horizon, max_token_len=conv.max_token_len)
    robot = RobotConfig(name=settings.preset, state_dim=len(settings.joint_names), action_dim=settings.action_dim,
                        camera_slots=settings.model_camera_slots)
    # Everything that can be wrong with the statistics, tokenizer or conventions fails before the weights load.
    processor = Processor(config, robot, load_tokenizer(config, settings.tokenizer_path or None),
                          load_statistics(settings), conv)
    model = load_model(config, settings.checkpoint or None, dtype=settings.dtype, device=settings.device,
                       seed=settings.seed)
    return Engine(model, ProcessorIO(processor), engine_config(settings, conv))


def warm_up(engine: Engine, settings: NodeSettings, on_action=None) -> float:
    """One :meth:`Engine.warm_up` on a synthetic observation shaped like the robot's: a black
    224 x 224 image in every camera slot, a zero state of ``joint_names``, the default
    instruction; ``on_action`` receives its action chunk. Returns its seconds (on CUDA: mostly the
    capture of the CUDA graphs)."""
    black = np.zeros((224, 224, 3), np.uint8)
    obs = Observation({camera.slot: black for camera in settings.cameras}, settings.default_instruction,
                      np.zeros(len(settings.joint_names), np.float32))
    return engine.warm_up(obs, on_action)

