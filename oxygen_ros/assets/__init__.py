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
# The asset directory of a demo checkpoint's normalisation statistics (openpi's name for the ALOHA simulator).
NORM_STATS_ASSET = "aloha_sim"
# The demo robot's cameras (tools/sim_robot.py) -> the model's camera slots (openpi's ALOHA image keys): what a
# policy sees that was trained on all three cameras, and what a demo_policy.json without "cameras" means.
DEMO_CAMERA_SLOTS = {"top": "base_0_rgb", "left_wrist": "left_wrist_0_rgb", "right_wrist": "right_wrist_0_rgb"}


def demo_policy_dir() -> Path:
    """The shipped demo policy's checkpoint directory (absolute path).

    Raises:
        FileNotFoundError: the directory or its weights are missing (a broken install).
    """
    path = Path(__file__).resolve().parent / DEMO_POLICY
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped demo policy is missing: no {path / 'model.safetensors'}")
    return path


def norm_stats_file(checkpoint: str | Path) -> Path:
    """Where a demo checkpoint keeps its normalisation statistics: ``assets/aloha_sim/norm_stats.json`` (openpi's
    layout, found by :func:`oxygen_ros.models.conventions.find_norm_stats`)."""
    return Path(checkpoint) / "assets" / NORM_STATS_ASSET / "norm_stats.json"


def demo_policy_info() -> dict:
    """The shipped policy's ``demo_policy.json`` (preset, prompts, instruction, joint names, cameras ...)."""
    return json.loads((demo_policy_dir() / "demo_policy.json").read_text())


def in_slot_order(cameras) -> tuple[str, ...]:
    """Demo robot camera names in the order of the model's slots they feed (:data:`DEMO_CAMERA_SLOTS`: top,
    left_wrist, right_wrist), the order the node feeds its slots in; other names last, in their given order."""
    order = list(DEMO_CAMERA_SLOTS)
    return tuple(sorted(cameras, key=lambda c: order.index(c) if c in order else len(order)))


def read_policy_file(checkpoint: str | Path) -> dict:
    """``demo_policy.json`` of the checkpoint directory ``checkpoint`` (prompts, instruction, cameras ...),
    or ``{}`` when ``checkpoint`` is empty or has none (e.g. a checkpoint not trained by the demo's trainer)."""
    path = Path(checkpoint) / "demo_policy.json" if checkpoint else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def policy_cameras(policy: dict) -> dict[str, str]:
    """The demo robot's cameras a policy sees -> their model slots, in slot order: its ``demo_policy.json``'s
    ``"cameras"`` (e.g. ``{"top": "base_0_rgb"}`` for a top-camera-only policy), else all three
    (:data:`DEMO_CAMERA_SLOTS`).

    Raises:
        ValueError: an empty map, or a camera / slot that is not one of :data:`DEMO_CAMERA_SLOTS`'s pairs.
    """
    cameras = policy.get("cameras", DEMO_CAMERA_SLOTS)
    if not isinstance(cameras, dict) or not cameras:
        raise ValueError(f"demo_policy.json 'cameras' must map camera names to slots, got {cameras!r}")
    wrong = {c: s for c, s in cameras.items() if DEMO_CAMERA_SLOTS.get(c) != s}
    if wrong:
        raise ValueError(f"demo_policy.json 'cameras': {wrong} are not pairs of the demo robot's cameras and "
                         f"their slots {DEMO_CAMERA_SLOTS}")
    return {camera: cameras[camera] for camera in in_slot_order(cameras)}
