"""The one way to build an engine, ROS-free: model + processor, then an :class:`Engine` per
:class:`EngineConfig`, then a warm-up cycle. ``oxygen_node`` (``oxygen_ros/node/model_loading.py``)
and the engine benchmark (``oxygen_ros/bench/engine_bench.py``) both build their engines here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.model_io import ProcessorIO
from oxygen_ros.engine.types import ActionChunk, Observation
from oxygen_ros.models import NormStats, RobotConfig, get_preset, load_model
from oxygen_ros.models.conventions import Conventions
from oxygen_ros.models.processing import Processor
from oxygen_ros.models.tokenizer import TextTokenizer, load_tokenizer

# The warm-up observation's images: black, 224 x 224 RGB (the model's input size).
WARM_UP_IMAGE_SIZE = 224


@dataclass
class ModelParts:
    """A loaded model and its engine processor: engines built on them share the weights.

    Attributes:
        model: the :class:`oxygen_ros.models.VLAModel`.
        processor: the engine's processor (:class:`~oxygen_ros.engine.model_io.ProcessorIO`) over the models package's.
        robot: the robot's dimensions and camera slots.
    """

    model: object
    processor: ProcessorIO
    robot: RobotConfig


def load_parts(preset: str, robot: RobotConfig, *, checkpoint: str | Path | None = None,
               tokenizer: TextTokenizer | str | Path | None = None,
               norm_stats: dict[str, NormStats] | None = None, conventions: Conventions | None = None,
               action_horizon: int | None = None, max_token_len: int | None = None,
               model_overrides: dict | None = None,
               dtype: str = "float32", device: str = "cpu", seed: int = 0) -> ModelParts:
    """Load the model of ``preset`` and its processing.

    Args:
        preset: model preset name (``pi05``, ``pi0``, ``pi05_tiny``, ``pi0_tiny``).
        robot: state / action dimensions and camera slots.
        checkpoint: local checkpoint directory; None = random weights from ``seed``.
        tokenizer: a tokenizer, or the path of the PaliGemma SentencePiece model (None: the tiny
            presets' built-in one).
        norm_stats: ``{"state": ..., "actions": ...}``; None = data already normalised.
        conventions: the checkpoint family's conventions (None: the preset variant's defaults).
        action_horizon, max_token_len: overrides of the preset's (None: the conventions' or preset's).
        model_overrides: other fields of the preset to override (e.g. a checkpoint's recorded ``image_size``,
            :func:`oxygen_ros.models.checkpoint.checkpoint_overrides`); None: none.
        dtype: ``float32`` or ``bfloat16``; device: torch device.

    Raises:
        ValueError, FileNotFoundError: unknown preset, missing tokenizer or checkpoint, inconsistent
            dimensions; everything about the tokenizer and processing fails before the weights load.
    """
    processor = load_processor(preset, robot, tokenizer=tokenizer, norm_stats=norm_stats,
                               conventions=conventions, action_horizon=action_horizon,
                               max_token_len=max_token_len, model_overrides=model_overrides)
    model = load_model(processor.processor.config, checkpoint, dtype=dtype, device=device, seed=seed)
    return ModelParts(model, processor, robot)


def load_processor(preset: str, robot: RobotConfig, *, tokenizer: TextTokenizer | str | Path | None = None,
                   norm_stats: dict[str, NormStats] | None = None, conventions: Conventions | None = None,
                   action_horizon: int | None = None, max_token_len: int | None = None,
                   model_overrides: dict | None = None) -> ProcessorIO:
    """The engine processor of ``preset`` for ``robot`` without loading weights (arguments as
    :func:`load_parts`): a fleet's robots each bring their own processing to one shared model.

    Raises:
        ValueError, FileNotFoundError: unknown preset, missing tokenizer, inconsistent dimensions.
    """
    overrides = dict(model_overrides or {})
    if action_horizon is not None:
        overrides["action_horizon"] = action_horizon
    if max_token_len is not None:
        overrides["max_token_len"] = max_token_len
    config = get_preset(preset, **overrides)
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(config, tokenizer)
    return ProcessorIO(Processor(config, robot, tokenizer, norm_stats, conventions))


def build_engine(parts: ModelParts, config: EngineConfig) -> Engine:
    """An engine over ``parts`` (allocates its KV pool of ``config.kv_budget_mb`` MiB).

    Raises:
        ValueError: the KV budget cannot hold the action task's reserve (the message names
            ``engine.kv_budget_mb``).
    """
    return Engine(parts.model, parts.processor, config)


def warm_up(engine: Engine, state_dim: int, instruction: str = "",
            on_action: Callable[[ActionChunk], None] | None = None) -> float:
    """One :meth:`Engine.warm_up` on a synthetic observation: a black 224 x 224 image in every camera
    slot of the engine, a zero state of ``state_dim`` numbers, ``instruction``; ``on_action``
    receives its action chunk. Returns its seconds (on CUDA: mostly the capture of the CUDA graphs)."""
    black = np.zeros((WARM_UP_IMAGE_SIZE, WARM_UP_IMAGE_SIZE, 3), np.uint8)
    obs = Observation({slot: black for slot in engine.config.camera_slots}, instruction,
                      np.zeros(state_dim, np.float32))
    return engine.warm_up(obs, on_action)
