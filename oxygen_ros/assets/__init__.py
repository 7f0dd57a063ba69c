"""Data files shipped with the package: the trained demo policy (docs/demo-policy.md).

``demo_policy/`` is the checkpoint directory written by ``python -m oxygen_ros.training.train``
(``runs/train-demo/checkpoint``) for the shipped run: ``model.safetensors`` (openpi layout, float32,
``pi05_demo``: 1.64 M parameters), ``oxygen_config.json`` (the preset), ``assets/aloha_sim/norm_stats.json``
(openpi normalisation statistics of the 14 ALOHA joints) and ``demo_policy.json`` (conventions, prompts,
cameras -> slots, joint names, training facts). It is installed with the package (CMakeLists.txt installs
the whole ``oxygen_ros`` directory), so :func:`demo_policy_dir` finds it from the source tree and from
``install/``.
"""

from __future__ import annotations

import json
from pathlib import Path

DEMO_POLICY = "demo_policy"


def demo_policy_dir() -> Path:
    """The shipped demo policy's checkpoint directory (absolute path).

    Raises:
        FileNotFoundError: the directory or its weights are missing (a broken install).
    """
    path = Path(__file__).resolve().parent / DEMO_POLICY
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped demo policy is missing: no {path / 'model.safetensors'}")
    return path


def demo_policy_info() -> dict:
    """The shipped policy's ``demo_policy.json`` (preset, prompts, instruction, joint names, cameras ...)."""
    return json.loads((demo_policy_dir() / "demo_policy.json").read_text())
