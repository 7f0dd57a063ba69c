"""Pre/post-processing, tokenizers, prompts and robot/norm-stat data."""

import logging

import numpy as np
import pytest
import torch

from oxygen_ros.models import NormStats, RobotConfig, get_conventions, get_preset, get_robot, load_norm_stats
from oxygen_ros.models.config import save_norm_stats
from oxygen_ros.models.conventions import Normalization, variant_defaults
from oxygen_ros.models.processing import (ACTION_PROMPT, LANGUAGE_PROMPT, Processor, build_prompt_tokens,
                                          discretize_state, pad_to, resize_with_pad)
from oxygen_ros.models.tokenizer import TinyTokenizer, load_tokenizer


def _stats(dim, seed=0):
    rng = np.random.default_rng(seed)
    mean, std = rng.normal(size=dim), rng.uniform(0.5, 2.0, size=dim)
    return NormStats(mean=mean, std=std, q01=mean - 2 * std, q99=mean + 2 * std)


def test_uint8_and_float_images_identical_and_pad_is_exactly_minus_one():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(120, 200, 3), dtype=np.uint8)
    from_uint8 = resize_with_pad(image)
    from_float = resize_with_pad(image.astype(np.float32) / 255.0)
    assert from_uint8.shape == (3, 224, 224) and from_uint8.dtype == torch.float32
    assert torch.equal(from_uint8, from_float)
    new_h = int(120 / (200 / 224))
    top = (224 - new_h) // 2
    assert torch.all(from_uint8[:, :top] == -1.0) and torch.all(from_uint8[:, top + new_h:] == -1.0)
    assert from_uint8[:, top:top + new_h].min() >= -1.0 and from_uint8.max() <= 1.0
    assert not torch.all(from_uint8[:, top] == -1.0)
    batch = resize_with_pad(np.stack([image, image]))
    assert batch.shape == (2, 3, 224, 224) and torch.equal(batch[1], from_uint8)
    with pytest.raises(ValueError, match="image"):
        resize_with_pad(np.zeros((10, 10), dtype=np.uint8))


def test_square_224_image_is_only_scaled():
    image = np.arange(224 * 224 * 3, dtype=np.int64).reshape(224, 224, 3) % 256
    out = resize_with_pad(image.astype(np.uint8))
    assert torch.allclose(out, torch.as_tensor(image, dtype=torch.float32).permute(2, 0, 1) / 255 * 2 - 1)


def test_normalisation_round_trip_and_discretisation():
    stats = _stats(7)
    x = np.random.default_rng(1).normal(size=(5, 7))
    for mode in ("quantile", "mean_std", "identity"):
        norm = Normalization(mode)
        assert np.allclose(norm.unnormalize(norm.normalize(x, stats), stats), x)
    assert np.allclose(Normalization("quantile").normalize(stats.q99, stats), 1.0, atol=1e-5)
    # Not clipped: below -1 is bin -1 (openpi / LeRobot digitize - 1).
    assert discretize_state(np.array([-1.5, -1.0, 0.0, 0.999, 1.0, 2.0])).tolist() == [-1, 0, 128, 255, 255, 255]


def test_state_and_actions_padded_to_32_and_sliced_back():
    config = get_preset("pi0_tiny")
    robot = RobotConfig("arm7", state_dim=7, action_dim=7, camera_slots=("base_0_rgb",))
    stats = {"state": _stats(7, 1), "actions": _stats(7, 2)}
    proc = Processor(config, robot, TinyTokenizer(config.vocab_size), stats)
    assert proc.conventions.state_norm.mode == proc.conventions.action_norm.mode == "mean_std"   # π0 default
    state = np.arange(7.0)
    model_state = proc.model_state(state)
    assert model_state.shape == (32,) and torch.all(model_state[7:] == 0)
    actions = np.random.default_rng(3).normal(size=(10, 7))
    padded = torch.as_tensor(pad_to(Normalization("mean_std").normalize(actions, stats["actions"]), 32))
    assert padded.shape == (10, 32)
    assert np.allclose(proc.robot_actions(padded, state), actions)
    with pytest.raises(ValueError, match="exceeds"):
        pad_to(np.zeros(40), 32)
    with pytest.raises(ValueError, match="exceed"):  # π0's state projection takes 32 inputs
        Processor(config, RobotConfig("big", 40, 7, ("base_0_rgb",)), TinyTokenizer(config.vocab_size))
    with pytest.raises(ValueError, match="shape"):
        proc.normalized_state(np.zeros(8))


def test_pi05_keeps_a_40_dim_state_whole_in_the_prompt_and_slices_7_dim_actions():
    config = get_preset("pi05_tiny")
    tok = TinyTokenizer(config.vocab_size)
    robot = RobotConfig("big", state_dim=40, action_dim=7, camera_slots=("base_0_rgb",))
    proc = Processor(config, robot, tok, {"state": _stats(40), "actions": _stats(7, 2)})
    state = np.linspace(-2.0, 2.0, 40)
    normalized = proc.normalized_state(state)
    assert normalized.shape == (40,)
    assert proc.conventions.action_norm.mode == "quantile"   # π0.5 default
    text = tok.decode(proc.prompt_tokens("stack", state))
    bins = " ".join(str(b) for b in discretize_state(normalized))
    assert text == ACTION_PROMPT.format(instruction="stack", state=bins) and len(bins.split()) == 40
    assert proc.model_state(state) is None
    actions = np.random.default_rng(4).normal(size=(10, 7))
    padded = torch.as_tensor(pad_to(Normalization("quantile").normalize(actions, proc.norm_stats["actions"]), 32))
    assert np.allclose(proc.robot_actions(padded, state), actions)


def test_pi05_action_prompt_carries_discretised_state():
    config = get_preset("pi05_tiny")
    tok = TinyTokenizer(config.vocab_size)
    proc = Processor(config, get_robot("libero"), tok, {"state": _stats(8), "actions": _stats(7)})
    state = _stats(8).mean
    text = tok.decode(proc.prompt_tokens("pick_up the\ncube ", state))
    normalized = proc.normalized_state(state)
    # The robot's own 8 numbers, not padded to 32 (openpi tokenises the state before PadStatesAndActions).
    assert normalized.shape == (8,) and np.allclose(normalized, 0.0, atol=1e-5)
    bins = " ".join(str(b) for b in discretize_state(normalized))
    assert len(bins.split()) == 8
    assert text == ACTION_PROMPT.format(instruction="pick up the cube", state=bins)
    assert tok.decode(proc.prompt_tokens("pick up the cube", task="language")) == \
        LANGUAGE_PROMPT.format(instruction="pick up the cube")
    with pytest.raises(ValueError, match="state"):
        proc.prompt_tokens("x")


def test_over_long_prompt_is_truncated_with_warning_keeping_anchor(caplog):
    tok = TinyTokenizer(1024)
    instruction = "pick up the red cube and place it on the blue plate " * 20
    with caplog.at_level(logging.WARNING):
        tokens = build_prompt_tokens(tok, instruction, LANGUAGE_PROMPT, max_len=30)
    assert len(tokens) <= 30 and tokens[0] == tok.bos_id
    assert tok.decode(tokens).endswith(". Subtask: ") and tok.decode(tokens).startswith("Task: pick up")
    assert "truncated" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert build_prompt_tokens(tok, instruction, LANGUAGE_PROMPT, max_len=30) == tokens
    assert "truncated" not in caplog.text, "the same truncation is logged once, not every control cycle"
    with pytest.raises(ValueError, match="too small"):
        build_prompt_tokens(tok, "x", LANGUAGE_PROMPT, max_len=3)


def test_tiny_tokenizer_round_trips_and_keeps_specials():
    tok = load_tokenizer(get_preset("pi05_tiny"))
    text = "Task: Öffne die Schublade_2, State: 0 17 255;\nAction: "
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == 2 and max(ids) < 1024 and tok.decode(ids) == text
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert len(tok.encode(" ".join(str(i) for i in range(256)))) == 256
    with pytest.raises(ValueError, match="tokenizer_path"):
        load_tokenizer(get_preset("pi05"))


def test_processor_images_mask_missing_cameras():
    config = get_preset("pi05_tiny")
    proc = Processor(config, get_robot("aloha"), TinyTokenizer(config.vocab_size))
    frame = np.zeros((48, 64, 3), dtype=np.uint8)
    pixels, mask = proc.images({"base_0_rgb": frame, "right_wrist_0_rgb": frame})
    assert pixels.shape == (3, 3, 224, 224) and mask.tolist() == [True, False, True]
    assert torch.all(pixels[1] == -1.0)
    with pytest.raises(ValueError, match="unknown camera"):
        proc.images({"front": frame})


def test_norm_stats_json_round_trip(tmp_path):
    stats = {"state": _stats(8), "actions": NormStats(mean=np.zeros(7), std=np.ones(7))}
    save_norm_stats(stats, tmp_path / "norm_stats.json")
    loaded = load_norm_stats(tmp_path / "norm_stats.json")
    assert np.allclose(loaded["state"].q99, stats["state"].q99) and loaded["actions"].q01 is None
    assert {r: get_robot(r).action_dim for r in ("libero", "droid", "aloha")} == {"libero": 7, "droid": 8, "aloha": 14}


@pytest.mark.parametrize("corrupt, expected", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),                     # cut off mid-file
    (lambda text: text.replace("[", "{", 1), "not valid JSON"),                   # a stray brace
    (lambda text: text.replace('"std": [', '"std": ["x", ', 1), "state.std is not a list of numbers"),
    (lambda text: text.replace('"mean": [', '"mean": [1.0, ', 1), "lists of different lengths"),
    (lambda text: "[1, 2]", "no 'norm_stats' mapping"),
])
def test_corrupt_norm_stats_json_names_the_file_and_the_fault(tmp_path, corrupt, expected):
    """A corrupt ``norm_stats.json`` fails with the file's path and what is wrong, not the JSON library's
    message alone (issue 38, item 10)."""
    path = tmp_path / "assets" / "aloha_sim" / "norm_stats.json"
    path.parent.mkdir(parents=True)
    save_norm_stats({"state": _stats(8), "actions": _stats(7)}, path)
    path.write_text(corrupt(path.read_text()))
    with pytest.raises(ValueError) as info:
        load_norm_stats(path)
    assert str(path) in str(info.value) and expected in str(info.value), str(info.value)


def test_truncated_norm_stats_json_says_it_ends_early(tmp_path):
    path = tmp_path / "norm_stats.json"
    save_norm_stats({"state": _stats(8)}, path)
    path.write_text(path.read_text()[:-40])
    with pytest.raises(ValueError, match="truncated") as info:
        load_norm_stats(path)
    assert str(path) in str(info.value)
