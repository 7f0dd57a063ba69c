"""Reference vectors of every checkpoint family: raw robot inputs → the exact prompt, state, cameras; a raw
model output ``[H, 32]`` + the state → the robot's actions.

The expected values are derived here, in float64, from the references' documented formulas (below), never
by calling the product's processing; the product must match them (prompt strings identical, numbers within
1e-6). Sources of the facts (paths inside Physical-Intelligence/openpi and huggingface/lerobot; the same
table with every fact is docs/conventions.md):

| fact | source |
|---|---|
| π0.5 prompt ``Task: {clean}, State: {bins};\\nAction: ``; π0 / no-state: BOS + clean, then ``\\n`` tokenised on its own; clean = strip, ``_``/``\\n`` → space; bins ``digitize(x, linspace(-1, 1, 257)[:-1]) - 1`` of the unpadded state; over-long prompts keep their first tokens | openpi src/openpi/models/tokenizer.py; src/openpi/transforms.py (TokenizePrompt before PadStatesAndActions) |
| ``pi05_libero``: discrete_state_input=False; horizons pi05_droid 15, pi05_libero 10, pi0_droid 10, others 50 | openpi src/openpi/training/config.py, src/openpi/models/pi0_config.py |
| quantile ``(x - q01)/(q99 - q01 + 1e-6)·2 - 1`` and back ``(y + 1)/2·(q99 - q01 + 1e-6) + q01``; mean/std ``(x - mean)/(std + 1e-6)``, back ``y·(std + 1e-6) + mean``; π0.5 quantile, π0 mean/std | openpi src/openpi/transforms.py; src/openpi/training/config.py (use_quantile_norm) |
| delta dims: ALOHA ``make_bool_mask(6, -1, 6, -1)``, pi0_libero ``(6, -1)``; added back after unnormalising, against the adapted state | openpi src/openpi/training/config.py, src/openpi/transforms.py, src/openpi/policies/policy.py |
| ALOHA: flips ``[1,-1,-1,1,1,1,1,1,-1,-1,1,1,1,1]``; state gripper g → l = g·(0.05800-0.01844)+0.01844 → asin((0.022² + l² - 0.036²)/(2·0.022·l)) → (θ-0.5476)/(1.6296-0.5476); action gripper (a+0.5476+0.6213)/(1.4910+0.6213); cam_high required, wrists optional | openpi src/openpi/policies/aloha_policy.py |
| DROID: 8 = 7 joints + gripper, exterior + wrist cameras required, right wrist zero-filled and masked; LIBERO: 8-D state, 7 actions | openpi src/openpi/policies/droid_policy.py, libero_policy.py |
| LeRobot π0.5: the same prompt (state normalised, not padded); quantile ``2(x - q01)/(q99 - q01) - 1`` (no epsilon), back ``(y + 1)(q99 - q01)/2 + q01`` | lerobot src/lerobot/policies/pi05/processor_pi05.py; src/lerobot/processor/normalize_processor.py |
| LeRobot π0: ``task + "\\n"`` (only where missing), no cleaning, one string; mean/std ``(x - mean)/(std + 1e-8)``, back ``y·std + mean``; relative actions against the raw state, excluded names kept absolute | lerobot src/lerobot/policies/pi0/processor_pi0.py; normalize_processor.py; relative_action_processor.py |
| missing camera: −1 pixels, mask false (openpi: zeros in uint8) | openpi aloha_policy.py; lerobot src/lerobot/policies/pi05/modeling_pi05.py |
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from oxygen_ros.models import NormStats, RobotConfig, get_conventions, get_preset
from oxygen_ros.models.conventions import lerobot_conventions, lerobot_norm_stats
from oxygen_ros.models.processing import Processor
from oxygen_ros.models.tokenizer import TinyTokenizer

TOK = TinyTokenizer(1024)
RAW_INSTRUCTION = "  pick_up the\nred cube  "
CLEAN = "pick up the red cube"
FLIP = [1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1]
ALOHA_DELTA = [True] * 6 + [False] + [True] * 6 + [False]


# ---- the references' formulas, written out ------------------------------------------------------

def bin_of(y: float) -> int:
    """openpi's digitize(y, linspace(-1, 1, 257)[:-1]) - 1 by hand: the edges are k/128 - 1."""
    if y < -1.0:
        return -1
    return min(255, math.floor((y + 1.0) * 128.0))


def q_norm(x, q01, q99, eps):
    return [(xi - lo) / (hi - lo + eps) * 2.0 - 1.0 for xi, lo, hi in zip(x, q01, q99)]


def q_unnorm(y, q01, q99, eps):
    return [(yi + 1.0) / 2.0 * (hi - lo + eps) + lo for yi, lo, hi in zip(y, q01, q99)]


def z_norm(x, mean, std, eps):
    return [(xi - m) / (s + eps) for xi, m, s in zip(x, mean, std)]


def z_unnorm(y, mean, std, eps):
    return [yi * (s + eps) + m for yi, m, s in zip(y, mean, std)]


def aloha_state(state):
    """openpi AlohaInputs._decode_state (adapt_to_pi=True)."""
    out = [f * s for f, s in zip(FLIP, state)]
    for i in (6, 13):
        linear = out[i] * (0.05800 - 0.01844) + 0.01844
        ratio = (0.022 ** 2 + linear ** 2 - 0.036 ** 2) / (2 * 0.022 * linear)
        theta = math.asin(max(-1.0, min(1.0, ratio)))
        out[i] = (theta - 0.5476) / (1.6296 - 0.5476)
    return out


def aloha_actions(row):
    """openpi AlohaOutputs._encode_actions (adapt_to_pi=True)."""
    out = [f * a for f, a in zip(FLIP, row)]
    for i in (6, 13):
        out[i] = (out[i] + 0.5476 - (-0.6213)) / (1.4910 - (-0.6213))
    return out


# ---- fixtures --------------------------------------------------------------------------------

def _model_output(horizon: int, seed: int) -> np.ndarray:
    """A raw model output [H, 32] in float64 (values the model could produce, around [-1.5, 1.5])."""
    return np.random.default_rng(seed).uniform(-1.5, 1.5, size=(horizon, 32))


def _processor(family: str, stats: dict[str, NormStats] | None, conventions=None) -> Processor:
    conv = conventions or get_conventions(family)
    config = get_preset(f"{conv.variant}_tiny", action_horizon=conv.action_horizon)
    robot = RobotConfig(family, conv.state_dim, conv.action_dim, tuple(c.slot for c in conv.cameras))
    return Processor(config, robot, TOK, stats, conv)


def _stats(q01, q99, mean, std) -> NormStats:
    return NormStats(mean=np.array(mean, float), std=np.array(std, float), q01=np.array(q01, float),
                     q99=np.array(q99, float))


def _parts_and_tokens(proc: Processor, instruction: str, state, text_parts: list[str]):
    """The processor's prompt parts equal ``text_parts`` and its tokens are BOS + each part's own tokens."""
    assert proc.prompt(instruction, state) == text_parts
    expected = [TOK.bos_id]
    for part in text_parts:
        expected += TOK.encode(part)
    assert proc.prompt_tokens(instruction, state) == expected


FRAME = np.random.default_rng(7).integers(0, 256, (48, 64, 3), dtype=np.uint8)

# DROID / LIBERO statistics: 8-D state, 8-D (DROID) or 7-D (LIBERO) actions; openpi keeps 32-D padded
# statistics for some assets, so the unused dims are zero (degenerate) — they must be ignored.
Q01 = [-1.0, -2.0, 0.0, 0.5, -0.25, -3.0, 1.0, 0.0]
Q99 = [1.0, 2.0, 4.0, 1.5, 0.75, 3.0, 2.0, 1.0]
MEAN = [0.2, -0.1, 2.0, 1.0, 0.25, 0.0, 1.5, 0.5]
STD = [0.5, 1.0, 1.5, 0.25, 0.5, 2.0, 0.5, 0.25]
PAD = [0.0] * 24
ARM_STATS = {"state": _stats(Q01 + PAD, Q99 + PAD, MEAN + PAD, STD + PAD),
             "actions": _stats([q - 0.5 for q in Q01] + PAD, [q + 0.5 for q in Q99] + PAD,
                               [m + 0.1 for m in MEAN] + PAD, [s * 2 for s in STD] + PAD)}
# below q01 | at q01 | the middle | at q99 | above q99 | inside, inside, inside
ARM_STATE = [-1.3, -2.0, 2.0, 1.5, 1.0, -0.5, 1.25, 0.9]


def test_discretisation_is_the_references_and_not_clipped():
    from oxygen_ros.models.conventions import discretize_state

    values = [-1.3, -1.0, -0.999, 0.0, 0.5, 0.999, 1.0, 1.7]
    assert discretize_state(values).tolist() == [-1, 0, 0, 128, 192, 255, 255, 255]
    assert [bin_of(v) for v in values] == [-1, 0, 0, 128, 192, 255, 255, 255]
    edges = [k / 128 - 1 for k in range(256)]
    assert discretize_state(edges).tolist() == list(range(256))
    assert discretize_state([e - 1e-12 for e in edges[1:]]).tolist() == list(range(255))


# ---- openpi DROID ----------------------------------------------------------------------------------

def test_openpi_pi05_droid():
    proc = _processor("openpi/pi05_droid", ARM_STATS)
    conv = proc.conventions
    assert (conv.action_horizon, conv.state_dim, conv.action_dim, conv.action_dt_s) == (15, 8, 8, 1 / 15)
    s = ARM_STATS["state"]
    y = q_norm(ARM_STATE, s.q01, s.q99, 1e-6)
    assert np.allclose(proc.normalized_state(ARM_STATE), y, rtol=0, atol=1e-12)
    bins = [bin_of(v) for v in y]
    # below q01 → -1; at q01 → 0; the range's middle sits 2.5e-7 below 0 (the 1e-6 epsilon) → 127;
    # at q99 → just below 1 → 255; above → 255 (not clipped to 255 from beyond, just the last bin).
    assert bins[:5] == [-1, 0, 127, 255, 255]
    text = f"Task: {CLEAN}, State: {' '.join(map(str, bins))};\nAction: "
    _parts_and_tokens(proc, RAW_INSTRUCTION, ARM_STATE, [text])
    assert len(text.split("State: ")[1].split(";")[0].split()) == 8     # the robot's 8 numbers, not 32
    assert proc.prompt("", ARM_STATE) == [f"Task: , State: {' '.join(map(str, bins))};\nAction: "]
    assert proc.model_state(ARM_STATE) is None
    # cameras: exterior + wrist both required; the right wrist is never used (always masked)
    pixels, mask = proc.images({"base_0_rgb": FRAME, "left_wrist_0_rgb": FRAME})
    assert mask.tolist() == [True, True] and conv.camera("right_wrist_0_rgb") is None
    with pytest.raises(ValueError, match="wrist_image_left"):
        proc.images({"base_0_rgb": FRAME})
    # actions: unnormalise the first 8 dims, nothing else
    raw = _model_output(15, 1)
    a = ARM_STATS["actions"]
    expected = [q_unnorm(row[:8], a.q01, a.q99, 1e-6) for row in raw]
    assert np.allclose(proc.robot_actions(raw, ARM_STATE), expected, rtol=0, atol=1e-6)


def test_openpi_pi0_droid():
    proc = _processor("openpi/pi0_droid", ARM_STATS)
    assert proc.conventions.action_horizon == 10
    _parts_and_tokens(proc, RAW_INSTRUCTION, ARM_STATE, [CLEAN, "\n"])
    _parts_and_tokens(proc, "", ARM_STATE, ["", "\n"])
    s = ARM_STATS["state"]
    expected_state = z_norm(ARM_STATE, s.mean, s.std, 1e-6) + [0.0] * 24
    model_state = proc.model_state(ARM_STATE)
    assert model_state.dtype == torch.float32 and model_state.shape == (32,)
    assert np.allclose(model_state.double().numpy(), expected_state, rtol=1e-7, atol=1e-7)
    raw = _model_output(10, 2)
    a = ARM_STATS["actions"]
    expected = [z_unnorm(row[:8], a.mean, a.std, 1e-6) for row in raw]
    assert np.allclose(proc.robot_actions(raw, ARM_STATE), expected, rtol=0, atol=1e-6)


def test_pi0_mean_std_not_quantiles():
    """The issue's example: mean 0.2, std 0.5 (q01 -0.8, q99 1.2): 0.7 → 1.0 and -0.3 → -1.0 with
    mean/std; quantiles would give 0.5 and -0.5."""
    stats = {"state": _stats([-0.8] * 8, [1.2] * 8, [0.2] * 8, [0.5] * 8), "actions": ARM_STATS["actions"]}
    state = [0.7, -0.3] * 4
    model_state = _processor("openpi/pi0_droid", stats).model_state(state)
    assert np.allclose(model_state[:8].double().numpy(), [0.5 / 0.500001, -0.5 / 0.500001] * 4, atol=1e-7)


# ---- openpi LIBERO ---------------------------------------------------------------------------------

def test_openpi_pi05_libero_has_no_state_in_the_prompt():
    proc = _processor("openpi/pi05_libero", ARM_STATS)
    conv = proc.conventions
    assert (conv.action_horizon, conv.state_dim, conv.action_dim) == (10, 8, 7)
    assert not conv.action_prompt.has_state
    _parts_and_tokens(proc, RAW_INSTRUCTION, None, [CLEAN, "\n"])   # the state is not needed at all
    assert proc.model_state(ARM_STATE) is None
    raw = _model_output(10, 3)
    a = ARM_STATS["actions"]
    expected = [q_unnorm(row[:7], a.q01, a.q99, 1e-6) for row in raw]
    assert np.allclose(proc.robot_actions(raw, ARM_STATE), expected, rtol=0, atol=1e-6)
    assert np.allclose(proc.robot_actions(raw), expected, rtol=0, atol=1e-6)   # no delta: no state needed


def test_openpi_pi0_libero_adds_the_state_to_the_first_six():
    proc = _processor("openpi/pi0_libero", ARM_STATS)
    assert proc.conventions.action_horizon == 50
    _parts_and_tokens(proc, RAW_INSTRUCTION, ARM_STATE, [CLEAN, "\n"])
    raw = _model_output(50, 4)
    a = ARM_STATS["actions"]
    expected = []
    for row in raw:
        absolute = z_unnorm(row[:7], a.mean, a.std, 1e-6)
        expected.append([v + (ARM_STATE[i] if i < 6 else 0.0) for i, v in enumerate(absolute)])
    assert np.allclose(proc.robot_actions(raw, ARM_STATE), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="state"):
        proc.robot_actions(raw)


# ---- openpi ALOHA ----------------------------------------------------------------------------------

ALOHA_Q01 = [-1.5, -0.5, -1.0, -2.0, -1.0, -2.5, 0.0, -1.5, -0.5, -1.0, -2.0, -1.0, -2.5, 0.0]
ALOHA_Q99 = [1.5, 1.0, 1.5, 2.0, 1.5, 2.5, 1.0, 1.5, 1.0, 1.5, 2.0, 1.5, 2.5, 1.0]
ALOHA_STATS = {
    "state": _stats(ALOHA_Q01 + [0.0] * 18, ALOHA_Q99 + [0.0] * 18, [0.1] * 14 + [0.0] * 18,
                    [0.7] * 14 + [0.0] * 18),
    "actions": _stats([q * 0.5 for q in ALOHA_Q01], [q * 0.5 for q in ALOHA_Q99], [0.05] * 14, [0.3] * 14)}
# left: joints, gripper 0.3 (normalised linear); right: joints, gripper 0.8; a joint beyond q99
ALOHA_RAW_STATE = [0.1, -0.4, 0.6, -1.0, 0.3, 2.7, 0.3, -0.2, 0.5, -0.7, 1.2, -0.3, 0.0, 0.8]


@pytest.mark.parametrize("family", ["openpi/pi05_aloha", "openpi/pi0_aloha"])
def test_openpi_aloha(family):
    proc = _processor(family, ALOHA_STATS)
    conv = proc.conventions
    assert (conv.action_horizon, conv.state_dim, conv.action_dim, conv.action_dt_s) == (50, 14, 14, 0.02)
    adapted = aloha_state(ALOHA_RAW_STATE)
    assert np.allclose(proc.adapted_state(ALOHA_RAW_STATE), adapted, rtol=0, atol=1e-12)
    s = ALOHA_STATS["state"]
    if family == "openpi/pi05_aloha":
        y = q_norm(adapted, s.q01, s.q99, 1e-6)
        bins = [bin_of(v) for v in y]
        assert bins[5] == 255   # 2.7 is above q99
        _parts_and_tokens(proc, RAW_INSTRUCTION, ALOHA_RAW_STATE,
                          [f"Task: {CLEAN}, State: {' '.join(map(str, bins))};\nAction: "])
        assert len(proc.prompt(CLEAN, ALOHA_RAW_STATE)[0].split("State: ")[1].split(";")[0].split()) == 14
    else:
        _parts_and_tokens(proc, RAW_INSTRUCTION, ALOHA_RAW_STATE, [CLEAN, "\n"])
        expected_state = z_norm(adapted, s.mean, s.std, 1e-6) + [0.0] * 18
        assert np.allclose(proc.model_state(ALOHA_RAW_STATE).double().numpy(), expected_state, atol=1e-6)
    # cameras: cam_high required, a missing wrist is masked with -1 pixels
    pixels, mask = proc.images({"base_0_rgb": FRAME, "right_wrist_0_rgb": FRAME})
    assert mask.tolist() == [True, False, True] and torch.all(pixels[1] == -1.0)
    with pytest.raises(ValueError, match="cam_high"):
        proc.images({"left_wrist_0_rgb": FRAME})
    # actions: unnormalise, add the adapted state to the 12 arm joints, flip, gripper affine map
    raw = _model_output(50, 5)
    a = ALOHA_STATS["actions"]
    expected = []
    for row in raw:
        absolute = q_unnorm(row[:14], a.q01, a.q99, 1e-6) if family == "openpi/pi05_aloha" \
            else z_unnorm(row[:14], a.mean, a.std, 1e-6)
        absolute = [v + (adapted[i] if ALOHA_DELTA[i] else 0.0) for i, v in enumerate(absolute)]
        expected.append(aloha_actions(absolute))
    got = proc.robot_actions(raw, ALOHA_RAW_STATE)
    assert got.shape == (50, 14) and np.allclose(got, expected, rtol=0, atol=1e-6)


def test_aloha_gripper_constants_by_hand():
    """Two points of the gripper maps worked by hand: state g = 0.5 → l = 0.5·0.03956 + 0.01844 = 0.03822 m;
    action 0 → (0 + 0.5476 + 0.6213)/(1.4910 + 0.6213) = 1.1689/2.1123."""
    proc = _processor("openpi/pi05_aloha", None)
    state = [0.0] * 14
    state[6] = 0.5
    linear = 0.5 * (0.05800 - 0.01844) + 0.01844
    assert linear == pytest.approx(0.03822, abs=1e-12)
    theta = math.asin((0.022 ** 2 + linear ** 2 - 0.036 ** 2) / (2 * 0.022 * linear))
    assert proc.adapted_state(state)[6] == pytest.approx((theta - 0.5476) / 1.082, abs=1e-12)
    out = proc.robot_actions(np.zeros((1, 32)), [0.0] * 14)
    assert out[0, 6] == pytest.approx(1.1689 / 2.1123, abs=1e-12)
    assert out[0, 13] == pytest.approx(1.1689 / 2.1123, abs=1e-12)


# ---- LeRobot ---------------------------------------------------------------------------------------

def _lerobot_checkpoint(directory, variant: str, relative: bool) -> None:
    """A LeRobot pi05 / pi0 checkpoint directory's conventions files (no weights needed here)."""
    from safetensors.numpy import save_file

    config = {
        "type": variant, "chunk_size": 20, "n_action_steps": 20, "max_state_dim": 32, "max_action_dim": 32,
        "input_features": {"observation.images.top": {"type": "VISUAL", "shape": [3, 224, 224]},
                           "observation.images.wrist": {"type": "VISUAL", "shape": [3, 224, 224]},
                           "observation.state": {"type": "STATE", "shape": [8]}},
        "output_features": {"action": {"type": "ACTION", "shape": [7]}},
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES" if variant == "pi05" else "MEAN_STD",
                                  "ACTION": "QUANTILES" if variant == "pi05" else "MEAN_STD"},
        "tokenizer_max_length": 200 if variant == "pi05" else 48,
        "use_relative_actions": relative, "relative_exclude_joints": ["gripper"],
        "action_feature_names": [f"joint_{i}" for i in range(6)] + ["gripper"],
    }
    (directory / "config.json").write_text(json.dumps(config))
    stats = {"observation.state.q01": np.full(8, -2.0), "observation.state.q99": np.full(8, 2.0),
             "observation.state.mean": np.full(8, 0.5), "observation.state.std": np.full(8, 0.25),
             "action.q01": np.array([-1.0, -1, -1, -1, -1, -1, 0]), "action.q99": np.array([3.0, 3, 3, 3, 3, 3, 1]),
             "action.mean": np.full(7, 1.0), "action.std": np.full(7, 2.0)}
    save_file({k: v.astype(np.float32) for k, v in stats.items()},
              str(directory / "policy_preprocessor_step_2_normalizer_processor.safetensors"))
    save_file({k: v.astype(np.float32) for k, v in stats.items() if k.startswith("action.")},
              str(directory / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    norm_map = {"VISUAL": "IDENTITY", "STATE": config["normalization_mapping"]["STATE"],
                "ACTION": config["normalization_mapping"]["ACTION"]}
    (directory / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "norm_map": norm_map, "features": {}},
         "state_file": "policy_preprocessor_step_2_normalizer_processor.safetensors"},
        {"registry_name": "tokenizer_processor", "config": {"max_length": config["tokenizer_max_length"]}}]}))
    (directory / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {"eps": 1e-8, "norm_map": norm_map, "features": {}},
         "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"}]}))


def test_lerobot_pi05_from_its_checkpoint_files(tmp_path):
    _lerobot_checkpoint(tmp_path, "pi05", relative=True)
    conv = lerobot_conventions(tmp_path)
    stats, where = lerobot_norm_stats(tmp_path)
    assert "normalizer_processor" in where
    assert (conv.name, conv.action_horizon, conv.state_dim, conv.action_dim, conv.max_token_len) == \
        ("lerobot/pi05", 20, 8, 7, 200)
    assert conv.delta_mask == (True,) * 6 + (False,) and conv.delta_state == "raw"
    assert [(c.slot, c.key, c.required) for c in conv.cameras] == [
        ("base_0_rgb", "observation.images.top", False), ("left_wrist_0_rgb", "observation.images.wrist", False)]
    proc = _processor("lerobot/pi05", stats, conv)
    # q01 -2, q99 2, no epsilon: y = 2(x + 2)/4 - 1 = x/2, so x = 2·(-1.3, -1, -0.999, 0, 0.5, 0.999, 1, 1.7)
    state = [-2.6, -2.0, -1.998, 0.0, 1.0, 1.998, 2.0, 3.4]
    # in LeRobot's float32 arithmetic (torch tensors): x/2 to float32's precision, each value exactly its own
    lerobot = [float(np.float32(2.0) * (np.float32(x) + np.float32(2.0)) / np.float32(4.0) - np.float32(1.0))
               for x in state]
    assert proc.normalized_state(state).tolist() == lerobot
    assert np.allclose(lerobot, [x / 2 for x in state], rtol=0, atol=1e-7)
    _parts_and_tokens(proc, RAW_INSTRUCTION, state,
                      ["Task: pick up the red cube, State: -1 0 0 128 192 255 255 255;\nAction: "])
    pixels, mask = proc.images({"base_0_rgb": FRAME})       # LeRobot masks any missing camera
    assert mask.tolist() == [True, False] and torch.all(pixels[1] == -1.0)
    raw = _model_output(20, 6)
    expected = []
    for row in raw:
        absolute = [(y + 1.0) * (hi - lo) / 2.0 + lo for y, lo, hi in zip(row[:7], [-1.0] * 6 + [0.0], [3.0] * 6 + [1.0])]
        expected.append([v + (state[i] if i < 6 else 0.0) for i, v in enumerate(absolute)])
    assert np.allclose(proc.robot_actions(raw, state), expected, rtol=0, atol=1e-6)


def test_lerobot_rtc_config_and_n_action_steps_become_the_rtc_defaults(tmp_path):
    """LeRobot's rtc_config (and, without one, n_action_steps) give the defaults of the node's rtc.* parameters;
    an explicit parameter wins and rtc.enabled stays the node's."""
    from oxygen_ros.node.parameters import DECLARATIONS, checkpoint_rtc_defaults, default_value

    defaults = {name: default_value(name) for name in DECLARATIONS}
    _lerobot_checkpoint(tmp_path, "pi05", relative=False)
    conv = lerobot_conventions(tmp_path)
    assert conv.action_steps == 20 and conv.rtc is None
    assert checkpoint_rtc_defaults(defaults, conv) == {}                  # n_action_steps = H: no overlap
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_action_steps": 8}))
    assert checkpoint_rtc_defaults(defaults, lerobot_conventions(tmp_path)) == {"execution_horizon": 12}
    rtc = {"enabled": True, "prefix_attention_schedule": "EXP", "max_guidance_weight": 5.0, "execution_horizon": 14,
           "debug": False, "debug_maxlen": 100}
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_action_steps": 8, "rtc_config": rtc}))
    conv = lerobot_conventions(tmp_path)
    assert (conv.rtc.enabled, conv.rtc.schedule, conv.rtc.max_guidance_weight, conv.rtc.execution_horizon) == \
        (True, "exp", 5.0, 14)
    assert "RTC on (exp, beta 5, s 14)" in conv.describe()
    assert checkpoint_rtc_defaults(defaults, conv) == {"execution_horizon": 14, "schedule": "exp",
                                                       "max_guidance_weight": 5.0}
    explicit = {**defaults, "rtc.schedule": "zeros", "rtc.execution_horizon": 30}
    assert checkpoint_rtc_defaults(explicit, conv) == {"max_guidance_weight": 5.0}
    for bad in ({**rtc, "prefix_attention_schedule": "COSINE"}, {**rtc, "max_guidance_weight": 0}, "on"):
        (tmp_path / "config.json").write_text(json.dumps({**config, "rtc_config": bad}))
        with pytest.raises(ValueError, match="rtc_config"):
            lerobot_conventions(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_action_steps": 21}))
    with pytest.raises(ValueError, match="action_steps"):
        lerobot_conventions(tmp_path)


def test_lerobot_pi0_from_its_checkpoint_files(tmp_path):
    _lerobot_checkpoint(tmp_path, "pi0", relative=False)
    conv = lerobot_conventions(tmp_path)
    stats, _ = lerobot_norm_stats(tmp_path)
    assert (conv.name, conv.action_horizon, conv.max_token_len, conv.delta_mask) == ("lerobot/pi0", 20, 48, ())
    proc = _processor("lerobot/pi0", stats, conv)
    # no cleaning, "\n" appended only where missing, one string
    _parts_and_tokens(proc, RAW_INSTRUCTION, None, [RAW_INSTRUCTION + "\n"])
    _parts_and_tokens(proc, "stack it\n", None, ["stack it\n"])
    _parts_and_tokens(proc, "", None, ["\n"])
    state = [0.5, 0.75, 0.0, 1.0, -0.25, 0.5, 2.0, 0.25]
    expected_state = [(x - 0.5) / (0.25 + 1e-8) for x in state] + [0.0] * 24
    assert np.allclose(proc.model_state(state).double().numpy(), expected_state, rtol=1e-7, atol=1e-7)
    raw = _model_output(20, 7)
    expected = [[y * 2.0 + 1.0 for y in row[:7]] for row in raw]     # y·std + mean, no epsilon back
    assert np.allclose(proc.robot_actions(raw, state), expected, rtol=0, atol=1e-6)


# ---- prompts: over-long instructions, resize convention ----------------------------------------------

def test_over_long_prompt_keeps_its_first_tokens_as_openpi():
    proc = _processor("openpi/pi05_droid", ARM_STATS)
    instruction = "pick up the red cube and place it on the blue plate " * 30
    s = ARM_STATS["state"]
    bins = " ".join(str(bin_of(v)) for v in q_norm(ARM_STATE, s.q01, s.q99, 1e-6))
    full = [TOK.bos_id] + TOK.encode(f"Task: {instruction.strip()}, State: {bins};\nAction: ")
    assert len(full) > 200
    assert proc.prompt_tokens(instruction, ARM_STATE) == full[:200]
    pi0 = _processor("openpi/pi0_droid", ARM_STATS)
    full = [TOK.bos_id] + TOK.encode(CLEAN + " " + instruction.strip()) + TOK.encode("\n")
    assert pi0.prompt_tokens(CLEAN + " " + instruction, None) == full[:48]


def test_resize_conventions():
    """openpi: PIL bilinear on uint8, zero pad; LeRobot: torch bilinear without antialiasing."""
    from PIL import Image

    from oxygen_ros.models.processing import resize_with_pad

    image = np.random.default_rng(3).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    new_h = int(120 / (200 / 224))
    top = (224 - new_h) // 2
    pil = np.asarray(Image.fromarray(image).resize((224, new_h), resample=Image.BILINEAR)).astype(np.float64)
    openpi = resize_with_pad(image, 224, "pil_bilinear").permute(1, 2, 0).double().numpy()
    assert np.allclose(openpi[top:top + new_h], pil / 255.0 * 2.0 - 1.0, atol=1e-6)
    assert np.all(openpi[:top] == -1.0) and np.all(openpi[top + new_h:] == -1.0)
    x = torch.from_numpy(image).permute(2, 0, 1)[None].double() / 255.0
    torch_ref = torch.nn.functional.interpolate(x, size=(new_h, 224), mode="bilinear", align_corners=False)
    lerobot = resize_with_pad(image, 224, "torch_bilinear")
    assert torch.allclose(lerobot[:, top:top + new_h].double(), torch_ref[0].clamp(0, 1) * 2 - 1, atol=1e-4)
    assert get_conventions("openpi/pi05_droid").image_resize == "pil_bilinear"
    assert get_conventions("lerobot/pi05").image_resize == "torch_bilinear"


# ---- statistics that would make the output non-finite -----------------------------------------------

def test_non_finite_or_degenerate_statistics_are_rejected_naming_key_dimension_and_value():
    def with_(key, name, index, value):
        stats = {k: NormStats(**{n: None if getattr(v, n) is None else getattr(v, n).copy()
                                 for n in ("mean", "std", "q01", "q99")}) for k, v in ARM_STATS.items()}
        getattr(stats[key], name)[index] = value
        return stats

    with pytest.raises(ValueError, match=r"'actions'.*q01\[3\] is nan"):
        _processor("openpi/pi05_droid", with_("actions", "q01", 3, float("nan")))
    with pytest.raises(ValueError, match=r"'state'.*mean\[1\] is inf"):
        _processor("openpi/pi05_droid", with_("state", "mean", 1, float("inf")))
    with pytest.raises(ValueError, match=r"'actions'.*q99\[2\] = -0.5 is not above q01\[2\] = -0.5"):
        _processor("openpi/pi05_droid", with_("actions", "q99", 2, ARM_STATS["actions"].q01[2]))
    with pytest.raises(ValueError, match=r"'state'.*std\[5\] = 0.0"):
        _processor("openpi/pi0_droid", with_("state", "std", 5, 0.0))
    # a zero std is harmless under quantile normalisation, and zero-padded unused dims are ignored
    _processor("openpi/pi05_droid", with_("state", "std", 5, 0.0))
    assert ARM_STATS["actions"].q99[20] == ARM_STATS["actions"].q01[20] == 0.0


# ---- openpi pi0_aloha_sim (issue 38, item 11a) ----------------------------------------------------

def test_openpi_pi0_aloha_sim_absolute_actions_and_default_prompt():
    """openpi ``pi0_aloha_sim`` (config.py: Pi0Config(), LeRobotAlohaDataConfig(default_prompt="Transfer cube",
    use_delta_joint_actions=False), adapt_to_pi left at True; aloha_policy.py): π0, mean/std, the ALOHA
    adaptation, **no** delta dims (the unnormalised output is absolute), statistics under the dataset's repo
    id, "Transfer cube" when no instruction is given."""
    proc = _processor("openpi/pi0_aloha_sim", ALOHA_STATS)
    conv = proc.conventions
    assert (conv.variant, conv.action_horizon, conv.state_dim, conv.action_dim) == ("pi0", 50, 14, 14)
    assert conv.delta_mask == () and conv.adaptation is not None
    assert conv.default_prompt == "Transfer cube"
    assert conv.norm_stats_asset == "lerobot/aloha_sim_transfer_cube_human"
    adapted = aloha_state(ALOHA_RAW_STATE)
    s = ALOHA_STATS["state"]
    _parts_and_tokens(proc, "Transfer cube", ALOHA_RAW_STATE, ["Transfer cube", "\n"])
    expected_state = z_norm(adapted, s.mean, s.std, 1e-6) + [0.0] * 18
    assert np.allclose(proc.model_state(ALOHA_RAW_STATE).double().numpy(), expected_state, atol=1e-6)
    raw = _model_output(50, 6)
    a = ALOHA_STATS["actions"]
    expected = [aloha_actions(z_unnorm(row[:14], a.mean, a.std, 1e-6)) for row in raw]    # nothing added back
    got = proc.robot_actions(raw, ALOHA_RAW_STATE)
    assert np.allclose(got, expected, rtol=0, atol=1e-6)
    pixels, mask = proc.images({"base_0_rgb": FRAME})
    assert mask.tolist() == [True, False, False]


# ---- state bins on their edges, in each reference's own arithmetic (issue 38, item 11b) -------------

def _one_dim(family: str, q01: float, q99: float) -> Processor:
    conv = get_conventions(family).replace(state_dim=1, action_dim=1)
    stats = {"state": _stats([q01], [q99], [0.0], [1.0]), "actions": _stats([q01], [q99], [0.0], [1.0])}
    config = get_preset("pi05_tiny", action_horizon=conv.action_horizon)
    return Processor(config, RobotConfig(family, 1, 1, tuple(c.slot for c in conv.cameras)), TOK, stats, conv)


def test_openpi_bins_a_state_on_an_edge_in_float64():
    """openpi normalises in float64 numpy: a state equal to q01 = 0.7 is exactly −1 → bin 0. Stored as float32
    first (0.699999988…) it would be below −1 → bin −1: the state must reach the prompt as float64."""
    proc = _one_dim("openpi/pi05_droid", 0.7, 1.7)
    assert (0.7 - 0.7) / (1.7 - 0.7 + 1e-6) * 2.0 - 1.0 == -1.0 and bin_of(-1.0) == 0
    assert proc.state_bins([0.7]).tolist() == [0]
    assert proc.state_bins(np.array([0.7], dtype=np.float32)).tolist() == [-1]    # what float32 storage did


def test_lerobot_bins_a_state_in_its_float32_arithmetic():
    """LeRobot normalises float32 torch tensors, ``2·(x − q01)/(q99 − q01) − 1``: with q01 = −1, q99 = 1 a state
    1e-9 below the edge −0.5 is −0.5 in float32 (its spacing there is 6e-8) → bin 64; float64 arithmetic would
    give −0.500000001 → bin 63."""
    x = -0.5 - 1e-9
    lerobot = float(np.float32(2.0) * (np.float32(x) + np.float32(1.0)) / np.float32(2.0) - np.float32(1.0))
    assert lerobot == -0.5 and bin_of(lerobot) == 64 and bin_of(2.0 * (x + 1.0) / 2.0 - 1.0) == 63
    assert torch.equal(2.0 * (torch.tensor([x], dtype=torch.float32) + 1.0) / 2.0 - 1.0, torch.tensor([-0.5]))
    proc = _one_dim("lerobot/pi05", -1.0, 1.0)
    assert proc.state_bins([x]).tolist() == [64]
    edges = [k / 128 - 1 for k in range(1, 256)]     # exact in float32 too: each edge is its own bin
    assert [int(proc.state_bins([e])[0]) for e in edges] == list(range(1, 256))


def test_joint_states_reach_the_prompt_as_float64():
    """The node keeps JointState's float64 positions (node/inputs.py) and the engine's Observation keeps them
    (engine/types.py), so openpi's bins see the state as received."""
    from oxygen_ros.engine.types import Observation
    from oxygen_ros.node.inputs import InputStore

    store = InputStore((), ["a", "b"], "")
    state = store.map_joint_state(["b", "a"], [0.1, 0.7])
    assert state.dtype == np.float64 and state.tolist() == [0.7, 0.1]
    obs = Observation(images={"base_0_rgb": FRAME}, instruction="x", state=state)
    assert obs.state.dtype == np.float64 and obs.state.tolist() == [0.7, 0.1]
