"""Building models from presets and loading / saving checkpoints (local directories only)."""

from __future__ import annotations

import torch

from .config import get_preset
from .vla import VLAModel


def load_model(preset: str, checkpoint_dir: str | None = None, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", seed: int | None = None) -> VLAModel:
    """Build the model of ``preset`` (``pi05``, ``pi0``, ``pi05_tiny``, ``pi0_tiny``) in eval mode.

    Args:
        preset: preset name (see :data:`oxygen_ros.models.config.PRESETS`).
        checkpoint_dir: None = seeded random weights.
        dtype: torch.float32 / torch.bfloat16 or their names; default the preset's dtype.
        device: target device.
        seed: random-init seed (default ``config.seed``).

    Raises:
        ValueError: unknown preset or dtype.
    """
    config = get_preset(preset)
    model = VLAModel(config).init_random(config.seed if seed is None else seed)
    model.to_dtype(_resolve_dtype(dtype, config))
    return model.to(device).eval()


def _resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None:
        return config.torch_dtype
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
        return names[dtype]
    return dtype
