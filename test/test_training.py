"""The demo policy's trainer (oxygen_ros/training): a few steps on a tiny generated dataset, the overfit
check on a fixed batch, determinism, and a checkpoint that the project's loader and engine serve."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

# The dataset comes from the demo robot's scene (oxygen_ros.tools.sim_robot imports rclpy and the messages).
pytestmark = [pytest.mark.ros, pytest.mark.slow]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    pytest.importorskip("gym_aloha")
    pytest.importorskip("h5py")
    from oxygen_ros.tools.demo_data import generate_dataset

    directory = tmp_path_factory.mktemp("demo-data")
    # Two episodes with 5 rendered steps per camera each (every 106th of 530): 5 samples per episode.
    generate_dataset(directory, episodes=2, seed=11, image_every=106, progress=False)
    return directory


def _config(dataset, out, **overrides):
    from oxygen_ros.training.train import TrainConfig

    settings = dict(data=dataset, out=out, steps=2, batch_size=3, warmup=2, val_episodes=1, eval_samples=1,
                    log_every=1, progress=False, seed=3)
    settings.update(overrides)
    return TrainConfig(**settings)


def test_loss_decreases_on_a_fixed_batch(dataset):
    from oxygen_ros.models import get_preset, load_model
    from oxygen_ros.training.data import compute_norm_stats, episode_files, load_samples
    from oxygen_ros.training.train import (Batches, build_processor, flow_matching_loss, init_training_weights,
                                           text_loss)

    # The demo preset with 56 px cameras (16 tokens each): the same losses at a quarter of the tokens.
    config = get_preset("pi05_demo", image_size=56)
    samples = load_samples(episode_files(dataset), config.image_size, config.action_horizon)
    batches = Batches(samples, build_processor(config, compute_norm_stats(samples)), 0, 0.0)
    model = init_training_weights(load_model(config, None, dtype="float32", trainable=True), 0).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = np.array([0, 2, 6, 8])              # fixed batch: both episodes, several subtasks
    prompts, targets, _ = batches.language(idx, np.random.default_rng(0))
    flows, texts = [], []
    for _ in range(10):
        image_tokens = model._encode(batches.pixels(idx, "cpu")).reshape(len(idx), -1, config.vlm_width)
        # The same noise and times every step: one fixed objective to descend.
        flow = flow_matching_loss(model, image_tokens, [batches.action_ids[i] for i in idx], batches.actions[idx],
                                  torch.Generator().manual_seed(0))
        text, _ = text_loss(model, image_tokens, prompts, targets)
        assert torch.isfinite(flow) and torch.isfinite(text)
        optimizer.zero_grad()
        (flow + text).backward()
        optimizer.step()
        flows.append(flow.item())
        texts.append(text.item())
    assert flows[-1] < 0.9 * flows[0], flows
    assert texts[-1] < 0.5 * texts[0], texts


def test_trainer_writes_a_checkpoint_the_loader_and_engine_serve(dataset, tmp_path):
    from oxygen_ros.engine import Engine, EngineConfig, Observation
    from oxygen_ros.engine.model_io import ProcessorIO
    from oxygen_ros.models import get_preset, load_model
    from oxygen_ros.models.checkpoint import read_state_dict
    from oxygen_ros.models.conventions import find_norm_stats, resolve_conventions
    from oxygen_ros.models.processing import Processor
    from oxygen_ros.models.tokenizer import load_tokenizer
    from oxygen_ros.models import RobotConfig
    from oxygen_ros.demo_task import INSTRUCTION, JOINTS, read_episode
    from oxygen_ros.training.data import CAMERA_SLOTS, compute_norm_stats, episode_files, load_samples
    from oxygen_ros.training.train import train

    summary = train(_config(dataset, tmp_path / "a"))
    history = summary["history"]
    assert [h["step"] for h in history] == [1, 2]
    assert all(np.isfinite([h["loss"], h["flow"], h["text"]]).all() for h in history)
    assert summary["train_samples"] == 5 and summary["validation_samples"] == 5
    assert set(summary["evaluation"]) == {"train", "validation"}
    assert (tmp_path / "a" / "loss_curve.png").stat().st_size > 1000
    assert json.loads((tmp_path / "a" / "train_log.json").read_text())["history"] == json.loads(json.dumps(history))

    # Same seed, same run: identical losses and weights.
    again = train(_config(dataset, tmp_path / "b", eval_samples=0))
    assert again["history"][-1]["loss"] == history[-1]["loss"]
    first, second = read_state_dict(tmp_path / "a" / "checkpoint"), read_state_dict(tmp_path / "b" / "checkpoint")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    # The node's loading path: the preset's conventions (none named), the statistics the checkpoint carries.
    checkpoint = tmp_path / "a" / "checkpoint"
    policy = json.loads((checkpoint / "demo_policy.json").read_text())
    assert policy["preset"] == "pi05_demo" and policy["joint_names"] == list(JOINTS)
    config = get_preset(policy["preset"])
    saved_config = json.loads((checkpoint / "oxygen_config.json").read_text())
    assert saved_config == json.loads(json.dumps({k: getattr(config, k) for k in config.__dataclass_fields__}))
    conventions = resolve_conventions(config.variant, config.action_horizon, config.max_token_len, str(checkpoint), None)
    assert conventions.action_prompt.template == policy["action_prompt"]
    assert conventions.action_horizon == 50 and conventions.norm_mode == "quantile" and conventions.adaptation is None
    stats, where = find_norm_stats(checkpoint, conventions)
    assert where.endswith("assets/aloha_sim/norm_stats.json")
    expected = compute_norm_stats(load_samples(episode_files(dataset), config.image_size, config.action_horizon))
    for key in ("state", "actions"):
        np.testing.assert_allclose(stats[key].q01, expected[key].q01)
        np.testing.assert_allclose(stats[key].q99, expected[key].q99)
    robot = RobotConfig("aloha_sim", 14, 14, tuple(CAMERA_SLOTS.values()))
    processor = Processor(config, robot, load_tokenizer(config), stats, conventions)
    model = load_model(config, checkpoint, dtype="float32")
    engine = Engine(model, ProcessorIO(processor), EngineConfig.from_dict({
        "mode": "unified", "camera_slots": list(CAMERA_SLOTS.values()), "kv_budget_mb": 8,
        "block_size": 16, "scheduling": "fixed_k", "decode_steps_per_cycle": 4,
        "action": {"prompt_template": policy["action_prompt"], "control_rate_hz": 0.1},
        "language_tasks": [
            {"name": "speech", "prompt_template": policy["speech_prompt"], "trigger": {"every_n_frames": 1},
             "max_new_tokens": 4},
            {"name": "memory", "kind": "memory", "prompt_template": policy["memory_prompt"],
             "trigger": {"every_n_frames": 1}, "max_new_tokens": 4}]}))
    try:
        ep = read_episode(episode_files(dataset)[0])
        obs = Observation({slot: ep.images[camera][2] for camera, slot in CAMERA_SLOTS.items()}, INSTRUCTION,
                          ep.qpos[ep.image_steps[2]], stamp=1.0, seq=1)
        result = engine.run_cycle(obs)
        chunk = result.action.actions
        assert chunk.shape == (50, 14) and np.isfinite(chunk).all()
    finally:
        engine.close()


def test_a_policy_trained_on_the_top_camera_at_another_image_size_is_served_by_the_node_path(dataset, tmp_path):
    """--cameras top --image-size 56: the checkpoint records both (demo_policy.json's cameras, oxygen_config.json's
    image_size), and the node's loading path (read_settings -> build_engine, as the evaluation builds it) serves
    it from the preset's name alone, subscribing to the top camera only."""
    from oxygen_ros.assets import policy_cameras
    from oxygen_ros.models.checkpoint import checkpoint_overrides
    from oxygen_ros.tools import evaluate
    from oxygen_ros.demo_task import read_episode
    from oxygen_ros.training.data import episode_files
    from oxygen_ros.training.train import train

    train(_config(dataset, tmp_path / "top", steps=1, eval_samples=0, cameras=("top",), image_size=56))
    checkpoint = tmp_path / "top" / "checkpoint"
    policy = json.loads((checkpoint / "demo_policy.json").read_text())
    assert policy_cameras(policy) == policy["cameras"] == {"top": "base_0_rgb"}
    assert list(policy_cameras({"cameras": {"right_wrist": "right_wrist_0_rgb", "top": "base_0_rgb"}})) == \
        ["top", "right_wrist"]                     # slot order, whatever the file's
    assert checkpoint_overrides(checkpoint, "pi05_demo") == {"image_size": 56}
    with pytest.raises(ValueError, match="written for preset 'pi05_demo'"):
        checkpoint_overrides(checkpoint, "pi05_tiny")

    args = evaluate.parse_args(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "eval")])
    params = evaluate.node_parameters("sync", args, str(checkpoint))
    assert params["camera_topics"] == ["/cameras/top/image_raw"] and params["camera_slots"] == ["base_0_rgb"]
    engine_policy = evaluate.EnginePolicy(params)
    try:
        assert engine_policy.cameras == ("top",)
        ep = read_episode(episode_files(dataset)[0])
        # (the weights load only into a 56 px model: its position embedding has (56 / 14)^2 rows)
        step = engine_policy.act({"top": ep.images["top"][1]}, ep.qpos[ep.image_steps[1]].astype(np.float64), 1.0)
        assert step.actions.shape == (50, 14) and np.isfinite(step.actions).all()
    finally:
        engine_policy.close()

    # Any order given, the slot order trained (the node orders its slots so); bad lists are refused before any
    # data is read.
    assert _config(dataset, tmp_path / "x", cameras=("right_wrist", "top")).cameras == ("top", "right_wrist")
    for cameras in ((), ("top", "top"), ("front",)):
        with pytest.raises(ValueError, match="cameras"):
            _config(dataset, tmp_path / "bad", cameras=cameras).check()
    with pytest.raises(ValueError, match="multiple of pi05_demo's patch size 14, got 50"):
        _config(dataset, tmp_path / "bad", image_size=50).check()


def test_a_policy_trained_on_a_cropped_top_camera_is_cropped_alike_by_the_node_path(dataset, tmp_path):
    """--crop top=...: oxygen_config.json records the crop under the model's slot, the node's loading path takes it
    back from the checkpoint, and the engine's observe step feeds the model exactly the training's pixels."""
    from oxygen_ros.engine import EngineConfig, Observation
    from oxygen_ros.engine.factory import load_processor
    from oxygen_ros.engine.inputs import ObservationReader
    from oxygen_ros.models import RobotConfig
    from oxygen_ros.models.checkpoint import checkpoint_overrides
    from oxygen_ros.tools import evaluate
    from oxygen_ros.demo_task import JOINTS, read_episode
    from oxygen_ros.training.data import CAMERA_SLOTS, DataMismatchError, episode_files, load_samples
    from oxygen_ros.training.train import parse_args, train

    box = (0.35, 0.35, 112 / 240, 0.35)              # rows 84..196, columns 112..224 of the 240 x 320 frames
    config = parse_args(["--data", str(dataset), "--out", str(tmp_path / "crop"), "--crop", "top=" + ",".join(
        str(v) for v in box), "--steps", "1", "--batch-size", "2", "--warmup", "1", "--val-episodes", "1",
        "--eval-samples", "0", "--image-size", "56"])
    assert config.crops == (("top", *box),)
    config.progress = False
    train(config)
    checkpoint = tmp_path / "crop" / "checkpoint"
    overrides = checkpoint_overrides(checkpoint, "pi05_demo")
    assert overrides == {"image_size": 56, "image_crops": (("base_0_rgb", *box),)}

    robot = RobotConfig("aloha_sim", state_dim=len(JOINTS), action_dim=len(JOINTS),
                        camera_slots=tuple(CAMERA_SLOTS.values()))
    io = load_processor("pi05_demo", robot, model_overrides=overrides)
    assert io.processor.config.image_crop("base_0_rgb") == box and io.processor.config.image_crop(
        "left_wrist_0_rgb") is None
    ep = read_episode(episode_files(dataset)[0])
    images = {CAMERA_SLOTS[c]: ep.images[c][2] for c in ("top", "left_wrist", "right_wrist")}
    assert images["base_0_rgb"].shape == (240, 320, 3)
    reader = ObservationReader(EngineConfig(camera_slots=robot.camera_slots), io, None, 16)
    seen, mask = reader.camera_images(Observation(seq=0, images=images, instruction="x", stamp=0.0))
    assert mask == (True, True, True) and seen[0].shape == (112, 112, 3) and seen[1].shape == (240, 320, 3)
    np.testing.assert_array_equal(seen[0], ep.images["top"][2][84:196, 112:224])
    trained = load_samples(episode_files(dataset)[:1], 56, 50, crops={"top": box}).pixels[2]      # [C, S, S, 3]
    served = io.images_to_pixels(seen)                                                             # [C, 3, S, S]
    torch.testing.assert_close(served, torch.from_numpy(trained).permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0)
    uncropped = load_samples(episode_files(dataset)[:1], 56, 50).pixels[2]
    assert not np.array_equal(uncropped[0], trained[0]) and np.array_equal(uncropped[1:], trained[1:])

    # The node's own settings path serves it (the evaluation builds its engine so).
    args = evaluate.parse_args(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "eval")])
    engine_policy = evaluate.EnginePolicy(evaluate.node_parameters("sync", args, str(checkpoint)))
    try:
        step = engine_policy.act({c: ep.images[c][1] for c in ("top", "left_wrist", "right_wrist")},
                                 ep.qpos[ep.image_steps[1]].astype(np.float64), 1.0)
        assert step.actions.shape == (50, 14) and np.isfinite(step.actions).all()
    finally:
        engine_policy.close()

    # A crop of a camera the model does not see, or a box outside the frame, is refused before any data is read.
    with pytest.raises(ValueError, match="does not see"):
        _config(dataset, tmp_path / "bad", cameras=("top",), crops=(("left_wrist", 0, 0, 0.5, 0.5),)).check()
    with pytest.raises(ValueError, match="image crop of top: .*inside it"):      # named as the user typed it
        _config(dataset, tmp_path / "bad", crops=(("top", 0.6, 0, 0.5, 0.5),)).check()
    with pytest.raises(SystemExit):
        parse_args(["--data", str(dataset), "--crop", "top=0.1,0.2"])
    # A box too small for the frames' resolution is found when the frames are cropped: the data does not fit.
    with pytest.raises(DataMismatchError, match="covers no pixel"):
        load_samples(episode_files(dataset)[:1], 56, 50, crops={"top": (0.0, 0.0, 0.001, 0.001)})


def test_location_targets_only_where_the_cube_lies_on_the_table_and_the_pool_repeats_the_approach(dataset):
    from oxygen_ros.models import get_preset
    from oxygen_ros.demo_task import SUBTASKS, read_episode
    from oxygen_ros.training.data import compute_norm_stats, episode_files, load_samples
    from oxygen_ros.training.train import (APPROACH_SUBTASKS, LOCATE_PROMPT, Batches, build_processor,
                                           locate_target, training_pool)

    # By hand: world position in metres -> whole centimetres (0.1097 m -> 11, 0.543 m -> 54, 0.155 -> 16).
    assert locate_target(np.array([0.1097, 0.543, 0.02])) == "x 11 y 54"
    assert locate_target(np.array([0.004, 0.4, 0.0])) == "x 0 y 40"
    assert locate_target(np.array([-0.031, 0.6049, 0.0])) == "x -3 y 60"

    config = get_preset("pi05_demo", image_size=56)
    files = episode_files(dataset)
    samples = load_samples(files, config.image_size, config.action_horizon)
    for index, path in enumerate(files):
        np.testing.assert_array_equal(samples.cube_start[samples.episode == index],
                                      np.broadcast_to(read_episode(path).cube_start[:3], ((samples.episode == index).sum(), 3)))
    processor = build_processor(config, compute_norm_stats(samples))
    batches = Batches(samples, processor, 0, 0.0, locate=1.0)
    on_table = [c.startswith("the cube is on the ") for c in samples.caption]
    assert any(on_table) and not all(on_table)
    tok = processor.tokenizer
    for i in range(len(samples)):
        if on_table[i]:
            assert batches.locate_text[i] == locate_target(samples.cube_start[i])
            assert tok.decode(batches.locate_target[i]) == batches.locate_text[i]
            assert batches.locate_target[i][-1] == tok.eos_id
        else:
            assert batches.locate_text[i] is None and batches.locate_target[i] is None
    # locate = 1: every on-table sample trains its location after the location prompt; the others never do.
    idx = np.arange(len(samples))
    prompts, targets, is_subtask = batches.language(idx, np.random.default_rng(0))
    loc_prompt = [tok.decode(p) for p in batches.locate_prompt]
    for i in idx:
        if on_table[i]:
            assert targets[i] == batches.locate_target[i] and prompts[i] == batches.locate_prompt[i]
            assert "Cube:" in loc_prompt[i] and not is_subtask[i]
        else:
            assert targets[i] in (batches.subtask_target[i], batches.caption_target[i])
    assert LOCATE_PROMPT.endswith("Cube: ")
    # locate = 0: never the location.
    off = Batches(samples, processor, 0, 0.0, locate=0.0)
    _, targets, _ = off.language(idx, np.random.default_rng(0))
    assert all(t in (off.subtask_target[i], off.caption_target[i]) for i, t in zip(idx, targets))

    approach = [i for i in idx if samples.subtask[i] in APPROACH_SUBTASKS]
    assert approach and len(approach) < len(idx)
    assert sorted(training_pool(samples, idx, 1).tolist()) == idx.tolist()
    tripled = training_pool(samples, idx, 3).tolist()
    for i in idx:
        assert tripled.count(i) == (3 if samples.subtask[i] in APPROACH_SUBTASKS else 1), SUBTASKS[samples.subtask[i]]
    with pytest.raises(ValueError, match="approach_repeat"):
        training_pool(samples, idx, 0)


def test_state_labels_train_in_place_of_the_script_labels(dataset, tmp_path):
    """--subtask-labels state: the samples carry the state rule's labels (/subtask_state) at their steps, the
    checkpoint records the choice, and a file without state labels ends the loading with a message naming
    the relabel command."""
    import h5py
    from oxygen_ros.demo_task import read_episode
    from oxygen_ros.training.data import DataMismatchError, episode_files, load_samples
    from oxygen_ros.training.train import train

    files = episode_files(dataset)
    script = load_samples(files, 32, 4)
    state = load_samples(files, 32, 4, labels="state")
    expected = np.concatenate([read_episode(f).state_subtask[read_episode(f).image_steps] for f in files])
    np.testing.assert_array_equal(state.subtask, expected)
    np.testing.assert_array_equal(state.actions, script.actions)
    summary = train(_config(dataset, tmp_path / "state", subtask_labels="state"))
    policy = json.loads((tmp_path / "state" / "checkpoint" / "demo_policy.json").read_text())
    assert policy["subtask_labels"] == "state" and summary["config"]["subtask_labels"] == "state"
    with pytest.raises(ValueError, match="labels"):
        load_samples(files, 32, 4, labels="clock")
    copy = tmp_path / "old" / "episode_0.hdf5"
    copy.parent.mkdir()
    copy.write_bytes(files[0].read_bytes())
    with h5py.File(copy, "r+") as f:
        del f["subtask_state"]
    with pytest.raises(DataMismatchError, match="--relabel"):
        load_samples([copy], 32, 4, labels="state")


def test_realtime_views_show_the_cameras_round_robin_and_a_newer_joint_state(dataset, tmp_path):
    """--realtime-views: a drawn sample past the start pose is seen as the node sees the real-time robot — one
    camera's frame at the sample's step, the others one and two render periods older (here the episode's
    previous image: images every 106 steps, periods of 1 / (3 Hz · 20 ms) = 16.7 steps), the joint state up to
    one period newer in its prompts; its actions and labels stay the sample's. Start-pose samples and a
    training without the option see every sample as recorded, without drawing from the generator."""
    from oxygen_ros.models import get_preset
    from oxygen_ros.demo_task import INSTRUCTION, read_episode
    from oxygen_ros.training.data import compute_norm_stats, episode_files, load_samples
    from oxygen_ros.training.train import (CAPTION_PROMPT, LOCATE_PROMPT, SUBTASK_PROMPT, Batches,
                                           build_processor, train)

    config = get_preset("pi05_demo", image_size=56)
    files = episode_files(dataset)
    samples = load_samples(files, config.image_size, config.action_horizon)
    qpos = [read_episode(f).qpos.astype(np.float64) for f in files]
    np.testing.assert_array_equal(samples.state_start, [0, len(qpos[0]), len(qpos[0]) + len(qpos[1])])
    processor = build_processor(config, compute_norm_stats(samples))
    idx = np.arange(len(samples))

    recorded = Batches(samples, processor, 0, 0.5)
    rng = np.random.default_rng(7)
    before = rng.bit_generator.state
    views = recorded.views(idx, rng)
    assert rng.bit_generator.state == before                      # nothing drawn: the old batches, draw for draw
    assert not views.realtime.any() and views.action_ids == recorded.action_ids
    np.testing.assert_array_equal(views.rows, np.repeat(idx[:, None], 3, axis=1))

    batches = Batches(samples, processor, 0, 0.5, locate=1.0 / 3.0, realtime_views=1.0)
    io = batches._io
    for seed in range(4):
        views = batches.views(idx, np.random.default_rng(seed))
        np.testing.assert_array_equal(views.realtime, samples.step > 0)
        for b, i in enumerate(idx):
            episode, step = samples.episode[i], samples.step[i]
            if step == 0:
                assert (views.rows[b] == i).all() and views.action_ids[b] == batches.action_ids[i]
                continue
            previous = i - 1                          # the same episode's image 106 steps earlier
            assert samples.episode[previous] == episode and samples.step[previous] == step - 106
            assert sorted(views.rows[b].tolist()) == sorted([i, previous, previous])
            newer = [k for k in range(17) if np.array_equal(views.state[b], qpos[episode][step + k])]
            assert newer, (i, views.state[b])          # the state of one of the next 16 steps (or the step's own)
            assert views.action_ids[b] == io.prompt_ids(batches.action_template[i], INSTRUCTION, views.state[b])
        prompts, targets, _ = batches.language(idx, np.random.default_rng(seed), views)
        for b, i in enumerate(idx):
            state = views.state[b]
            assert prompts[b] in [io.prompt_ids(t, INSTRUCTION, state) for t in (SUBTASK_PROMPT, CAPTION_PROMPT,
                                                                                 LOCATE_PROMPT)]
            assert targets[b] in (batches.subtask_target[i], batches.caption_target[i], batches.locate_target[i])
    rows = np.array([[1, 0, 1], [2, 2, 1]])
    pixels = batches.pixels(idx[:2], "cpu", rows)                  # [B·C, 3, S, S]: camera c from sample rows[b, c]
    for b in range(2):
        for c in range(3):
            image = torch.from_numpy(samples.pixels[rows[b, c], c]).float() / 255.0 * 2.0 - 1.0
            torch.testing.assert_close(pixels[b * 3 + c], image.permute(2, 0, 1), rtol=0, atol=0)

    summary = train(_config(dataset, tmp_path / "rt", realtime_views=1.0))
    policy = json.loads((tmp_path / "rt" / "checkpoint" / "demo_policy.json").read_text())
    assert policy["realtime_views"] == 1.0 and summary["config"]["realtime_views"] == 1.0
    with pytest.raises(ValueError, match="realtime_views"):
        train(_config(dataset, tmp_path / "bad", realtime_views=1.5))


def test_bad_training_settings_raise(dataset, tmp_path):
    from oxygen_ros.training.train import train

    with pytest.raises(FileNotFoundError, match="no data directory"):
        train(_config(tmp_path / "missing", tmp_path / "out"))
    with pytest.raises(ValueError, match="validation episodes"):
        train(_config(dataset, tmp_path / "out", val_episodes=2))
    with pytest.raises(ValueError, match="locate"):
        train(_config(dataset, tmp_path / "out", locate=1.5))


def test_main_without_episodes_ends_with_a_message(tmp_path):
    from oxygen_ros.training import train

    with pytest.raises(SystemExit, match="no episodes"):
        train.main(["--data", str(tmp_path), "--out", str(tmp_path / "out"), "--steps", "1"])
    assert not (tmp_path / "out").exists()
    for bad in (["--locate", "2"], ["--approach-repeat", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            train.parse_args(["--data", str(tmp_path)] + bad)
        assert exit_info.value.code == 2, bad          # argparse's usage error, no traceback


def test_main_with_settings_that_do_not_fit_the_data_ends_with_a_message(dataset, tmp_path):
    """Settings the episodes cannot serve end with a one-line message (DataMismatchError), not a traceback."""
    from oxygen_ros.training import train
    from oxygen_ros.training.data import DataMismatchError

    with pytest.raises(SystemExit, match="train: 2 episodes cannot hold 2 validation episodes"):
        train.main(["--data", str(dataset), "--out", str(tmp_path / "out"), "--steps", "1", "--val-episodes", "2"])
    with pytest.raises(DataMismatchError, match="cannot hold"):
        train.train(_config(dataset, tmp_path / "out", val_episodes=2))
    # a truncated episode file (an interrupted copy) and a foreign HDF5 file: named, not an h5py traceback
    import shutil

    import h5py

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in sorted(dataset.glob("episode_*.hdf5")):
        shutil.copy(f, broken / f.name)
    data = (broken / "episode_1.hdf5").read_bytes()
    (broken / "episode_1.hdf5").write_bytes(data[:len(data) // 3])
    with pytest.raises(SystemExit, match="episode_1.hdf5: not a readable demo episode"):
        train.main(["--data", str(broken), "--out", str(tmp_path / "out"), "--steps", "1", "--val-episodes", "1"])
    with h5py.File(broken / "episode_1.hdf5", "w") as f:
        f["something"] = np.zeros(3)
    with pytest.raises(SystemExit, match="episode_1.hdf5: not a readable demo episode"):
        train.main(["--data", str(broken), "--out", str(tmp_path / "out"), "--steps", "1", "--val-episodes", "1"])


def test_extra_data_trains_and_is_never_held_out(dataset, tmp_path):
    """--extra-data: its episodes join the training split only (here one start-frame episode: one sample),
    the held-out episodes stay the last of --data, and the record says how many were extra."""
    from oxygen_ros.tools.demo_data import generate_dataset
    from oxygen_ros.training import train

    starts = tmp_path / "starts"
    generate_dataset(starts, episodes=1, seed=40, image_every=1_000_000, progress=False)
    summary = train.train(_config(dataset, tmp_path / "out", extra_data=(starts,), steps=1, eval_samples=0))
    assert summary["extra_episodes"] == 1 and summary["episodes"] == 3
    assert summary["train_samples"] == 1 + 5 and summary["validation_samples"] == 5
    assert summary["config"]["extra_data"] == [str(starts)]
    recorded = json.loads((tmp_path / "out" / "checkpoint" / "demo_policy.json").read_text())
    assert recorded["training"]["extra_episodes"] == 1
    with pytest.raises(SystemExit, match="no episodes"):
        train.main(["--data", str(dataset), "--extra-data", str(tmp_path / "empty"), "--out", str(tmp_path / "o2")])
    for twice in ([str(starts), str(starts)], [str(dataset)]):          # a directory counted twice: a usage error
        with pytest.raises(SystemExit) as exit_info:
            train.parse_args(["--data", str(dataset)] + [a for d in twice for a in ("--extra-data", d)])
        assert exit_info.value.code == 2


def test_start_pose_samples_can_weigh_more_and_train_the_location_more_often(dataset):
    """--start-repeat / --start-locate: the samples at step 0 (the start pose, the same state in every episode)
    appear approach_repeat · start_repeat times per pass and draw the location target with their own
    probability; the others are unchanged."""
    from oxygen_ros.models import get_preset
    from oxygen_ros.training.data import compute_norm_stats, episode_files, load_samples
    from oxygen_ros.training.train import Batches, build_processor, training_pool

    config = get_preset("pi05_demo", image_size=56)
    samples = load_samples(episode_files(dataset), config.image_size, config.action_horizon)
    # image_every 106 of 530 steps: steps 0, 106, 212, 318, 424 in each of the two episodes
    assert samples.step.tolist() == [0, 106, 212, 318, 424] * 2
    idx = np.arange(len(samples))
    pool = training_pool(samples, idx, 2, 3).tolist()
    for i in idx:
        base = pool.count(i) if samples.step[i] else pool.count(i) // 3
        assert base == training_pool(samples, idx, 2).tolist().count(i)
        assert pool.count(i) == (6 if samples.step[i] == 0 else base)
    with pytest.raises(ValueError, match="start_repeat"):
        training_pool(samples, idx, 2, 0)

    processor = build_processor(config, compute_norm_stats(samples))
    batches = Batches(samples, processor, 0, 0.0, locate=0.0, start_locate=1.0)
    np.testing.assert_array_equal(batches.locate_p, np.where(samples.step == 0, 1.0, 0.0))
    prompts, targets, _ = batches.language(idx, np.random.default_rng(0))
    for i in idx:
        if samples.step[i] == 0:                 # the cube lies on the table at the start: always located
            assert batches.locate_target[i] is not None and targets[i] == batches.locate_target[i]
        else:
            assert targets[i] in (batches.subtask_target[i], batches.caption_target[i])
    # start_locate None: every sample at --locate's probability (the recipe before these options, draw for draw)
    same = Batches(samples, processor, 0, 0.0, locate=0.25)
    assert (same.locate_p == 0.25).all()


def test_a_training_continues_from_a_checkpoint_with_its_weights_and_normalisation(dataset, tmp_path):
    """--init-from: the weights start at the checkpoint's (not the seeded initialisation), its norm stats are
    kept whatever the data, the record names where it started; a checkpoint of other model settings is refused."""
    from oxygen_ros.models.checkpoint import read_state_dict
    from oxygen_ros.models.config import load_norm_stats
    from oxygen_ros.training import train

    first = train.train(_config(dataset, tmp_path / "a", eval_samples=0, image_size=56))
    source = tmp_path / "a" / "checkpoint"
    # a continued run of 0 learning: lr tiny, so its weights stay the source's to float precision
    continued = train.train(_config(dataset, tmp_path / "b", eval_samples=0, image_size=56, init_from=source,
                                    steps=1, lr=1e-12, start_repeat=2, start_locate=1.0))
    before, after = read_state_dict(source), read_state_dict(tmp_path / "b" / "checkpoint")
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)
    assert continued["history"][0]["loss"] != first["history"][0]["loss"]     # it started elsewhere than step 0
    for name in ("state", "actions"):
        a = load_norm_stats(source / "assets" / "aloha_sim" / "norm_stats.json")[name]
        b = load_norm_stats(tmp_path / "b" / "checkpoint" / "assets" / "aloha_sim" / "norm_stats.json")[name]
        np.testing.assert_array_equal(a.q01, b.q01)
        np.testing.assert_array_equal(a.q99, b.q99)
    recorded = json.loads((tmp_path / "b" / "checkpoint" / "demo_policy.json").read_text())
    assert recorded["training"]["init_from"]["checkpoint"] == str(source)
    assert recorded["training"]["init_from"]["training"]["init_from"] is None       # the source started fresh
    assert recorded["start_repeat"] == 2 and recorded["start_locate"] == 1.0

    with pytest.raises(ValueError, match="image_size"):          # the source is at 56 px, this training at 112
        train.train(_config(dataset, tmp_path / "c", init_from=source))
    with pytest.raises(ValueError, match="cameras"):              # the source saw all three cameras
        train.train(_config(dataset, tmp_path / "c", init_from=source, image_size=56, cameras=("top",)))
    with pytest.raises(ValueError, match="model.safetensors"):
        train.train(_config(dataset, tmp_path / "c", init_from=tmp_path / "nothing"))
    with pytest.raises(SystemExit) as exit_info:                 # the command line: a usage error, no traceback
        train.parse_args(["--data", str(dataset), "--init-from", str(source)])
    assert exit_info.value.code == 2
