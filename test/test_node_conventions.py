"""Checkpoint-family conventions on the node: the shipped robot configs, the defaults, contradictions that
fail configure, and round trips through the real topics (JointState in → ActionChunk / JointTrajectory out)
for an ALOHA and a DROID configuration, with a model whose action output is known.

The model: pi05_tiny with ``action_out_proj`` weight 0 and bias ``C``, saved as an openpi checkpoint with
its ``assets/<asset>/norm_stats.json``. Its velocity is then ``C`` everywhere, so the Euler integration from
the noise x₁ gives x₀ = x₁ − C exactly (S steps of −C/S); x₁ is the engine's documented noise of the
observation (``torch.Generator`` seeded with ``noise_seed + seq``, noise_seed 0). The expected robot actions
follow from openpi's formulas, written out in test_conventions_reference.py (sources listed there).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from test_conventions_reference import _lerobot_checkpoint, aloha_actions, aloha_state, q_unnorm
from node_support import REPO_ROOT, Harness, file_parameters, node_section, tiny_parameters, wait_for

pytestmark = pytest.mark.ros

ALOHA_JOINTS = ["left_waist", "left_shoulder", "left_elbow", "left_forearm_roll", "left_wrist_angle",
                "left_wrist_rotate", "left_gripper", "right_waist", "right_shoulder", "right_elbow",
                "right_forearm_roll", "right_wrist_angle", "right_wrist_rotate", "right_gripper"]
ARM_JOINTS = [j for j in ALOHA_JOINTS if not j.endswith("gripper")]
FR3_JOINTS = [f"fr3_joint{i}" for i in range(1, 8)] + ["fr3_finger_joint1"]
C = torch.linspace(-0.6, 0.9, 32)


def _settings(ros_context, parameters):
    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.node.parameters import read_settings

    node = OxygenNode(context=ros_context, parameter_overrides=parameters)
    try:
        return read_settings(node)
    finally:
        node.destroy_node()


def _configure_error(ros_context, **changes) -> str | None:
    from rclpy.lifecycle import TransitionCallbackReturn

    from oxygen_ros.node.oxygen_node import OxygenNode

    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(autostart=False, **changes))
    try:
        ok = node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        return None if ok else node.configure_error
    finally:
        node.destroy_node()


@pytest.mark.parametrize("name, family, horizon, has_state", [
    ("pi05_aloha", "openpi/pi05_aloha", 50, True), ("pi05_droid", "openpi/pi05_droid", 15, True),
    ("pi05_libero", "openpi/pi05_libero", 10, False)])
def test_shipped_robot_configs_select_their_family(ros_context, name, family, horizon, has_state):
    settings = _settings(ros_context, file_parameters(REPO_ROOT / "config" / f"{name}.yaml", autostart=False))
    conv = settings.conventions
    assert (conv.name, conv.action_horizon, conv.binding) == (family, horizon, True)
    assert conv.action_prompt.has_state is has_state
    assert settings.action_dim == conv.action_dim and settings.action_dt_s == pytest.approx(conv.action_dt_s, rel=1e-4)
    data = node_section(yaml.safe_load((REPO_ROOT / "config" / f"{name}.yaml").read_text()))["ros__parameters"]
    assert data["action_horizon"] == horizon and data["conventions"] == family


def test_presets_default_to_their_variants_normalisation(ros_context):
    for preset, mode in (("pi0", "mean_std"), ("pi05", "quantile"), ("pi0_tiny", "mean_std")):
        conv = _settings(ros_context, tiny_parameters(autostart=False, preset=preset, allow_random_weights=True)
                         ).conventions
        assert (conv.state_norm.mode, conv.action_norm.mode, conv.binding) == (mode, mode, False), preset
    # an explicit setting overrides the defaults (nothing binding to contradict)
    conv = _settings(ros_context, tiny_parameters(autostart=False, norm_mode="mean_std")).conventions
    assert conv.action_norm.mode == "mean_std"


def test_settings_contradicting_the_checkpoint_or_family_fail_naming_both(ros_context, tmp_path):
    _lerobot_checkpoint(tmp_path, "pi05", relative=False)   # QUANTILES, chunk_size 20, 8-D state, 7 actions
    checkpoint = {"checkpoint": str(tmp_path), "action_dim": 0, "joint_names": [f"j{i}" for i in range(8)],
                  "publish_trajectory": False, "trajectory_joint_names": ["action_0"]}
    cases = [
        ({"norm_mode": "mean_std"}, ["parameter norm_mode", "'mean_std'", "'quantile'", "config.json"]),
        ({"action_horizon": 10}, ["parameter action_horizon", "10", "20"]),
        ({"conventions": "openpi/pi05_droid"}, ["parameter conventions", "'openpi/pi05_droid'", "'lerobot/pi05'"]),
        ({"joint_names": ["a", "b"]},
         ["parameter joint_names (number of joints)", "2", "8"]),
        ({"preset": "pi0_tiny"}, ["variant", "'pi0'", "'pi05'"]),
    ]
    for changes, words in cases:
        error = _configure_error(ros_context, **{**checkpoint, **changes})
        assert error is not None and "\n" not in error, changes
        for word in words:
            assert word in error, (changes, error)
    # a named family binds as well: DROID's horizon, its required wrist camera
    droid = {"conventions": "openpi/pi05_droid", "action_dim": 0, "action_dt_s": 0.0, "joint_names": FR3_JOINTS,
             "trajectory_joint_names": ["fr3_joint1"], "camera_required": [True, True]}
    error = _configure_error(ros_context, **droid, action_horizon=50)
    assert "parameter action_horizon is 50 but conventions openpi/pi05_droid says 15" in error
    error = _configure_error(ros_context, **{**droid, "camera_required": [True, False]})
    assert "camera_required" in error and "left_wrist_0_rgb" in error and "wrist_image_left" in error


def test_a_lerobot_checkpoint_directory_brings_its_conventions_and_statistics(ros_context, tmp_path):
    from rclpy.lifecycle import TransitionCallbackReturn

    from oxygen_ros.models import load_model, save_checkpoint
    from oxygen_ros.node.oxygen_node import OxygenNode

    save_checkpoint(load_model("pi05_tiny"), tmp_path, layout="lerobot")
    _lerobot_checkpoint(tmp_path, "pi05", relative=True)    # chunk_size 20, 8-D state, 7 actions, quantiles
    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(
        autostart=False, checkpoint=str(tmp_path), joint_names=[f"j{i}" for i in range(8)], action_dim=0,
        trajectory_joint_names=["action_0"]))
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS, node.configure_error
        conv = node._settings.conventions
        assert (conv.name, conv.action_horizon, conv.action_norm.mode, conv.delta_mask) == \
            ("lerobot/pi05", 20, "quantile", (True,) * 6 + (False,))
        assert node._settings.action_dim == 7 and node.engine.metrics_records.action_horizon == 20
    finally:
        node.destroy_node()


def test_non_finite_statistics_fail_configure(ros_context, tmp_path):
    stats = {"norm_stats": {"state": {"mean": [0.0] * 7, "std": [1.0] * 7, "q01": [-1.0] * 7, "q99": [1.0] * 7},
                            "actions": {"mean": [0.0] * 7, "std": [1.0] * 7, "q01": [-1.0] * 7,
                                        "q99": [1.0] * 7}}}
    stats["norm_stats"]["actions"]["q01"][3] = float("nan")
    path = tmp_path / "norm_stats.json"
    path.write_text(json.dumps(stats))
    error = _configure_error(ros_context, norm_stats_path=str(path))
    assert error is not None and "'actions'" in error and "q01[3]" in error and "nan" in error


# ---- round trips through the real topics ------------------------------------------------------------

def _known_checkpoint(directory, asset: str, dim: int, seed: int) -> dict:
    """pi05_tiny with action_out_proj = 0·h + C as an openpi checkpoint, with 32-D openpi-style statistics
    (zero beyond ``dim``) in assets/<asset>/norm_stats.json; returns the statistics (float64 lists)."""
    from oxygen_ros.models import load_model, save_checkpoint

    model = load_model("pi05_tiny")
    with torch.no_grad():
        model.action_out_proj.weight.zero_()
        model.action_out_proj.bias.copy_(C)
    save_checkpoint(model, directory, layout="openpi")
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-2.0, -0.5, dim).tolist() + [0.0] * (32 - dim)
    q99 = rng.uniform(0.5, 2.0, dim).tolist() + [0.0] * (32 - dim)
    stats = {"state": {"mean": [0.0] * 32, "std": [1.0] * dim + [0.0] * (32 - dim), "q01": q01, "q99": q99},
             "actions": {"mean": [0.0] * 32, "std": [1.0] * dim + [0.0] * (32 - dim),
                         "q01": [q * 0.5 for q in q01], "q99": [q * 1.5 for q in q99]}}
    (directory / "assets" / asset).mkdir(parents=True)
    (directory / "assets" / asset / "norm_stats.json").write_text(json.dumps({"norm_stats": stats}))
    return stats


def _model_output(seq: int, horizon: int) -> np.ndarray:
    """x₀ = x₁ − C, x₁ the engine's noise of observation ``seq``."""
    noise = torch.randn((1, horizon, 32), generator=torch.Generator().manual_seed(seq))
    return (noise[0].double() - C.double()).numpy()


def _round_trip(tmp_path, family, asset, joints, positions, extra):
    stats = _known_checkpoint(tmp_path / "ckpt", asset, len(joints), seed=len(joints))
    parameters = tiny_parameters(**{
        "checkpoint": str(tmp_path / "ckpt"), "conventions": family, "joint_names": joints,
        "action_dim": 0, "action_dt_s": 0.0, "num_denoise_steps": 2, "control_rate_hz": 2.0,
        "speech.enabled": False, "memory.enabled": False, "default_instruction": "fold_the towel\n", **extra})
    harness = Harness(parameters, joint_names=joints)
    harness.joint_positions = positions
    assert wait_for(lambda: harness.node.lifecycle_state == "active", 60.0), harness.node.configure_error
    assert wait_for(lambda: harness.count("chunk") >= 2, 60.0)
    return harness, stats


@pytest.mark.dds
def test_aloha_round_trip_flips_converts_and_adds_the_delta_joints_back(tmp_path):
    # grippers 0.3 and 0.8 (ALOHA's normalised linear position), joints in rad
    positions = [0.1, -0.4, 0.6, -1.0, 0.3, 0.7, 0.3, -0.2, 0.5, -0.7, 1.2, -0.3, 0.0, 0.8]
    harness, stats = _round_trip(tmp_path, "openpi/pi05_aloha", "trossen", ALOHA_JOINTS, positions, {
        "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"], "camera_required": [True, False],
        "publish_trajectory": True, "trajectory_joint_names": ARM_JOINTS})
    try:
        chunk = harness.received["chunk"][-1]
        assert (chunk.horizon, chunk.action_dim, list(chunk.action_names)) == (50, 14, ALOHA_JOINTS)
        assert chunk.dt == pytest.approx(0.02)
        state = np.float32(positions).astype(np.float64).tolist()   # the node's state is float32
        adapted = aloha_state(state)
        a = stats["actions"]
        expected = []
        for row in _model_output(chunk.observation_seq, 50):
            absolute = q_unnorm(row[:14], a["q01"], a["q99"], 1e-6)
            absolute = [v + (0.0 if i in (6, 13) else adapted[i]) for i, v in enumerate(absolute)]
            expected.append(aloha_actions(absolute))
        expected = np.array(expected)
        got = np.array(chunk.actions, dtype=np.float64).reshape(50, 14)
        assert np.allclose(got, expected, rtol=1e-6, atol=5e-6), np.abs(got - expected).max()
        # the JointTrajectory carries the 12 absolute arm joint positions, one point per 20 ms
        assert wait_for(lambda: harness.count("trajectory") >= 1)
        trajectory = next(t for t in reversed(harness.received["trajectory"]))
        assert list(trajectory.joint_names) == ARM_JOINTS and len(trajectory.points) == 50
        columns = [ALOHA_JOINTS.index(j) for j in ARM_JOINTS]
        positions_of = np.array([p.positions for p in trajectory.points])
        assert any(np.array_equal(np.array(c.actions, np.float64).reshape(50, 14)[:, columns], positions_of)
                   for c in harness.received["chunk"]), "the trajectory is a chunk's arm joints"
        last = trajectory.points[-1]
        assert last.time_from_start.sec + last.time_from_start.nanosec * 1e-9 == pytest.approx(1.0)
    finally:
        harness.close()


@pytest.mark.dds
def test_droid_round_trip_unnormalises_and_slices_to_the_robot(tmp_path):
    positions = [0.2, -0.6, 0.1, -2.0, 0.05, 1.9, 0.7, 0.04]
    velocity_names = [f"fr3_joint{i}_velocity" for i in range(1, 8)] + ["gripper_position"]
    harness, stats = _round_trip(tmp_path, "openpi/pi05_droid", "droid", FR3_JOINTS, positions, {
        "camera_required": [True, True], "action_names": velocity_names, "publish_trajectory": False,
        "trajectory_joint_names": velocity_names[:1]})
    try:
        chunk = harness.received["chunk"][-1]
        assert (chunk.horizon, chunk.action_dim, list(chunk.action_names)) == (15, 8, velocity_names)
        assert chunk.dt == pytest.approx(1 / 15)
        a = stats["actions"]
        expected = np.array([q_unnorm(row[:8], a["q01"], a["q99"], 1e-6)
                             for row in _model_output(chunk.observation_seq, 15)])
        got = np.array(chunk.actions, dtype=np.float64).reshape(15, 8)
        assert np.allclose(got, expected, rtol=1e-6, atol=5e-6), np.abs(got - expected).max()
        assert harness.count("trajectory") == 0
    finally:
        harness.close()


def test_statistics_come_from_the_checkpoint_or_fail_saying_what_is_missing(tmp_path):
    """openpi's assets/<asset>/norm_stats.json of the named family; another robot's, several without a
    family, none at all, or a norm_stats_path that disagrees: one-line errors naming the files."""
    from types import SimpleNamespace

    from oxygen_ros.models import get_conventions
    from oxygen_ros.models.conventions import variant_defaults
    from oxygen_ros.node.model_loading import load_statistics

    def stats(q01=-1.0):
        entry = {"mean": [0.0] * 8, "std": [1.0] * 8, "q01": [q01] * 8, "q99": [1.0] * 8}
        return json.dumps({"norm_stats": {"state": entry, "actions": entry}})

    def checkpoint(name, assets):
        for asset in assets:
            (tmp_path / name / "assets" / asset).mkdir(parents=True)
            (tmp_path / name / "assets" / asset / "norm_stats.json").write_text(stats())
        (tmp_path / name).mkdir(exist_ok=True)
        return str(tmp_path / name)

    droid = get_conventions("openpi/pi05_droid")
    found = load_statistics(SimpleNamespace(checkpoint=checkpoint("ok", ["droid"]), norm_stats_path="",
                                            conventions=droid))
    assert found["actions"].q01.tolist() == [-1.0] * 8
    (tmp_path / "other.json").write_text(stats(q01=-2.0))
    cases = [
        (checkpoint("none", []), "", droid, ["carries no normalisation statistics", "assets/droid/norm_stats.json"]),
        (checkpoint("trossen", ["trossen"]), "", droid, ["expects assets/droid/norm_stats.json", "trossen"]),
        (checkpoint("two", ["droid", "trossen"]), "", variant_defaults("pi05", 50, 200),
         ["['droid', 'trossen']", "conventions"]),
        (checkpoint("differs", ["droid"]), str(tmp_path / "other.json"), droid,
         ["norm_stats_path", "other.json", "differs", "assets/droid/norm_stats.json", "q01"]),
    ]
    for directory, path, conv, words in cases:
        with pytest.raises(ValueError) as error:
            load_statistics(SimpleNamespace(checkpoint=directory, norm_stats_path=path, conventions=conv))
        assert "\n" not in str(error.value)
        for word in words:
            assert word in str(error.value), (directory, str(error.value))
    with pytest.raises(FileNotFoundError, match="checkpoint .*missing does not exist"):
        load_statistics(SimpleNamespace(checkpoint=str(tmp_path / "missing"), norm_stats_path="", conventions=droid))
