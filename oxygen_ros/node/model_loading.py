"""Builds the engine of the node's settings (the ``configure`` step) with the ROS-free factory
(:mod:`oxygen_ros.engine.factory`, which the engine benchmark uses too), and warms it up.

The checkpoint family's conventions (``settings.conventions``, resolved from the checkpoint, the
``conventions`` parameter or the preset's defaults by :func:`oxygen_ros.node.parameters.read_settings`)
set the model's action horizon and prompt budget, the prompt layouts, the normalisation and the action
post-processing. The normalisation statistics come from the checkpoint directory (LeRobot processor
files, or openpi's ``assets/<asset>/norm_stats.json``) or from ``norm_stats_path``. The engine's own
configuration is ``settings.engine``, built and validated once from the parameters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from oxygen_ros.engine import Engine, factory
from oxygen_ros.models import NormStats, RobotConfig, load_norm_stats
from oxygen_ros.models.checkpoint import checkpoint_overrides
from oxygen_ros.models.conventions import find_norm_stats
from oxygen_ros.node.parameters import NodeSettings


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
        FileNotFoundError: ``norm_stats_path`` or the ``checkpoint`` directory does not exist.
    """
    if settings.checkpoint and not Path(settings.checkpoint).exists():
        raise FileNotFoundError(f"checkpoint {settings.checkpoint} does not exist")
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
    """Load the model and build the engine of ``settings.engine`` (allocates the KV pool).

    Raises:
        ValueError, FileNotFoundError, RuntimeError: unknown preset, missing checkpoint / tokenizer /
            norm stats, non-finite or degenerate norm stats, inconsistent dimensions, or a KV budget too
            small (naming ``engine.kv_budget_mb``); the message says which.
    """
    return factory.build_engine(load_parts(settings), settings.engine)


def robot_config(settings: NodeSettings) -> RobotConfig:
    """The robot's dimensions and the model's camera slots of ``settings``."""
    return RobotConfig(name=settings.preset, state_dim=len(settings.joint_names), action_dim=settings.action_dim,
                       camera_slots=settings.model_camera_slots)


def processing_arguments(settings: NodeSettings) -> dict:
    """The keyword arguments of :func:`oxygen_ros.engine.factory.load_processor` of ``settings``: the
    tokenizer, the normalisation statistics, the checkpoint family's conventions (horizon, prompt budget) and
    the model settings the checkpoint records apart from the preset's
    (:func:`oxygen_ros.models.checkpoint.checkpoint_overrides`, e.g. a demo policy's ``image_size``).

    Raises:
        ValueError, FileNotFoundError: as :func:`load_statistics`; ValueError also for a checkpoint written for
            another preset.
    """
    conv = settings.conventions
    # load_statistics first: it names a missing checkpoint directory
    stats = load_statistics(settings)
    overrides = checkpoint_overrides(settings.checkpoint, settings.preset) if settings.checkpoint else None
    return dict(tokenizer=settings.tokenizer_path or None, norm_stats=stats,
                conventions=conv, action_horizon=conv.action_horizon, max_token_len=conv.max_token_len,
                model_overrides=overrides)


def model_key(settings: NodeSettings) -> tuple:
    """What decides the model's weights and shapes: robots whose keys are equal can share one model
    (the fleet node). ``(preset, checkpoint, dtype, device, seed, action horizon, prompt budget)``."""
    conv = settings.conventions
    return (settings.preset, settings.checkpoint or "", settings.dtype, settings.device, settings.seed,
            conv.action_horizon, conv.max_token_len)


def load_parts(settings: NodeSettings) -> factory.ModelParts:
    """The model and the robot's processing of ``settings`` (:func:`oxygen_ros.engine.factory.load_parts`).

    Raises:
        as :func:`build_engine`, less the KV budget.
    """
    # Everything that can be wrong with the statistics, tokenizer or conventions fails before the weights load.
    return factory.load_parts(settings.preset, robot_config(settings), checkpoint=settings.checkpoint or None,
                              dtype=settings.dtype, device=settings.device, seed=settings.seed,
                              **processing_arguments(settings))


def load_processor(settings: NodeSettings):
    """The robot's processing of ``settings`` for a model loaded already (:func:`model_key` equal).

    Raises:
        as :func:`processing_arguments`, and ValueError for dimensions that contradict the family.
    """
    return factory.load_processor(settings.preset, robot_config(settings), **processing_arguments(settings))


def warm_up(engine: Engine, settings: NodeSettings, on_action=None) -> float:
    """:func:`oxygen_ros.engine.factory.warm_up` with the robot's state size and the default instruction;
    ``on_action`` receives its action chunk. Returns its seconds."""
    return factory.warm_up(engine, len(settings.joint_names), settings.default_instruction, on_action)
