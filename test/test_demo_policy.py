"""The shipped demo policy (oxygen_ros/assets/demo_policy, docs/demo-policy.md): it is installed with the
package, loads through the node's model-loading path with the conventions it records, and a seeded
synchronous episode on it is deterministic and has its measured outcome.

The episode is short (``MAX_STEPS`` control steps of 20 ms, chunks executed ``EXECUTE_STEPS`` at a time, as
the evaluation's lockstep), with the demo's serving configuration: speech and memory prompts of
``demo_policy.json`` and π0.5's subtask loop. Nothing here depends on this machine's speed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]

SEED = 1002          # a cube pose of the evaluation's seeds (outside the training data's seeds 0..99, 2000..2799)
MAX_STEPS = 200      # 4 s of the 10.6 s episode
EXECUTE_STEPS = 10
REPEAT_STEPS = 60    # the determinism check's second episode: the first 1.2 s (6 chunks) again, on a new engine
# What the shipped policy reaches on SEED within MAX_STEPS in the synchronous lockstep schedule (measured).
# A retrained policy behaves differently: re-measure and update (docs/demo-policy.md, "The shipped policy").
# Measured on the shipped policy (four continued stages, the last on the state labels, 2026-12-03): on SEED the
# right grasp point comes from 0.330 m to 0.9 cm of the cube (step 151) and the cube is grasped, not lifted, within
# the 4 s (the policy before: 0.08 cm at step 152, not grasped). Asserted is what holds with margin: reached
# (< 2 cm; measured 0.9) and nothing lifted within 4 s (the expert lifts from 3.3 s); the grasp itself, a matter
# of finger contacts, is printed, not asserted.
NOT_REACHED_IN_4_S = ("lifted", "transferred")


@pytest.fixture(scope="module")
def evaluate():
    pytest.importorskip("gym_aloha")
    from oxygen_ros.tools import evaluate

    return evaluate


@pytest.fixture(scope="module")
def shipped():
    from oxygen_ros.assets import demo_policy_dir, demo_policy_info

    return demo_policy_dir(), demo_policy_info()


def _params(evaluate, checkpoint: Path) -> dict:
    """The synchronous condition's node parameters for the shipped policy, with the demo's subtask loop."""
    args = evaluate.parse_args(["--checkpoint", str(checkpoint), "--episodes", "1",
                                "--max-steps", str(MAX_STEPS), "--execute-steps", str(EXECUTE_STEPS)])
    params = evaluate.node_parameters("sync", args, str(checkpoint))
    info = json.loads((checkpoint / "demo_policy.json").read_text())
    params.update({"subtask_task": "speech", "subtask_prompt_template": info["action_subtask_prompt"],
                   "speech.publish_on_change": True})
    return params


def test_shipped_policy_is_installed_with_the_package(shipped):
    import oxygen_ros

    directory, info = shipped
    package = Path(oxygen_ros.__file__).resolve().parent
    assert directory == package / "assets" / "demo_policy"
    for name in ("model.safetensors", "oxygen_config.json", "demo_policy.json",
                 "assets/aloha_sim/norm_stats.json"):
        assert (directory / name).is_file(), name
    assert info["preset"] == "pi05_demo"


def test_shipped_checkpoint_matches_its_recorded_conventions(evaluate, shipped):
    from oxygen_ros.assets import policy_cameras
    from oxygen_ros.models import get_preset
    from oxygen_ros.models.checkpoint import checkpoint_overrides
    from oxygen_ros.models.conventions import find_norm_stats
    from oxygen_ros.node.parameters import settings_from_values
    from oxygen_ros import demo_task
    from oxygen_ros.tools import demo, sim_robot
    from oxygen_ros.training import train

    directory, info = shipped
    # What the policy records it was trained with: this repository's robot, cameras and prompts.
    assert info["joint_names"] == list(sim_robot.JOINTS)
    assert policy_cameras(info) == info["cameras"]       # pairs of the demo robot's cameras and their slots
    assert info["action_dt_s"] == 0.02
    assert (info["speech_prompt"], info["memory_prompt"], info["action_subtask_prompt"]) == \
        (train.SUBTASK_PROMPT, train.CAPTION_PROMPT, train.ACTION_SUBTASK_PROMPT)
    assert info["instruction"] == demo_task.INSTRUCTION and info["subtasks"] == list(demo_task.SUBTASKS)
    assert info["subtask_in_action_prompt"] > 0
    # Its config is the preset's with the shapes it records apart (image size): horizon 50 (1 s at 50 Hz),
    # 32 padded action dimensions.
    config = json.loads((directory / "oxygen_config.json").read_text())
    # (compared as JSON holds them: the config's tuples, e.g. its image crops, are JSON lists)
    preset = json.loads(json.dumps(dataclasses.asdict(get_preset(info["preset"],
                                                                 **checkpoint_overrides(directory, info["preset"])))))
    assert {k: v for k, v in config.items() if k in preset} == {k: preset[k] for k in config if k in preset}
    assert (config["action_horizon"], config["action_dim"]) == (50, 32)

    # The node's settings from the demo's parameters: π0.5 defaults with the preset's horizon, the statistics
    # found where the policy put them, its prompts on speech and memory.
    params = _params(evaluate, directory)
    settings = settings_from_values(params)
    conv = settings.conventions
    assert (conv.variant, conv.action_horizon) == ("pi05", 50)
    assert conv.action_prompt.template == info["action_prompt"]
    stats, where = find_norm_stats(str(directory), conv)
    assert Path(where) == directory / "assets" / "aloha_sim" / "norm_stats.json"
    assert list(settings.joint_names) == info["joint_names"]
    assert [c.slot for c in settings.cameras] == list(info["cameras"].values())
    assert settings.default_instruction == info["instruction"]
    assert params["speech.prompt_template"] == info["speech_prompt"]
    assert params["memory.prompt_template"] == info["memory_prompt"]

    # The demo's own parameters serve the same (default: the shipped policy, its prompts, the subtask loop).
    args = demo.parse_args([])
    demo_params = demo.node_parameters(args)
    assert Path(demo_params["checkpoint"]) == directory and demo_params["preset"] == info["preset"]
    assert demo_params["subtask_task"] == "speech" and demo_params["speech.publish_on_change"] is True
    assert demo_params["subtask_prompt_template"] == info["action_subtask_prompt"]
    assert args.instruction == demo_params["default_instruction"] == info["instruction"]
    assert demo_params["joint_names"] == info["joint_names"]
    assert dict(zip([t.split("/")[2] for t in demo_params["camera_topics"]], demo_params["camera_slots"])) == \
        info["cameras"]


def _episode(evaluate, params: dict, max_steps: int = MAX_STEPS) -> dict:
    policy = evaluate.EnginePolicy(params)      # the node's loading path: read_settings -> build_engine
    try:
        record = evaluate.run_sync_episode(policy, SEED, EXECUTE_STEPS, max_steps)
    finally:
        policy.close()
    record.pop("sheet")
    return json.loads(json.dumps(record))


def test_seeded_sync_episode_on_the_shipped_weights_is_deterministic(evaluate, shipped):
    directory, info = shipped
    params = _params(evaluate, directory)
    first = _episode(evaluate, params)
    # A freshly built engine repeats the episode's start exactly (a shorter episode is the same episode cut: the
    # length only decides when the lockstep loop stops).
    second = _episode(evaluate, params, REPEAT_STEPS)
    chunks = REPEAT_STEPS // EXECUTE_STEPS
    assert len(second["flags"]) == REPEAT_STEPS and len(second["speech"]) == len(second["memory"]) == chunks
    assert first["flags"][:REPEAT_STEPS] == second["flags"]
    assert first["right_distance"][:REPEAT_STEPS] == second["right_distance"]
    assert first["speech"][:chunks] == second["speech"] and first["memory"][:chunks] == second["memory"]
    assert first["resets"] == 0 and len(first["flags"]) == MAX_STEPS

    flags = np.asarray(first["flags"], bool)
    outcome = evaluate.outcome(flags)
    distance = np.asarray(first["right_distance"])
    spoken = [text.strip() for _, text in first["speech"]]
    print(f"seed {SEED}: outcome {outcome}, right grasp point to cube {distance[0]:.3f} -> min {distance.min():.3f} m "
          f"at step {int(distance.argmin())}, speech {spoken[:12]}, memory {[t for _, t in first['memory']][:6]}")
    # The outcome the shipped policy reaches on this seed (measured; see SEED): the right arm goes to the cube —
    # the grasp point comes from ~0.33 m to within 2 cm of it (measured 0.009 m) — and nothing is lifted within 4 s.
    assert outcome["reached"], outcome
    assert distance[0] > 0.25 and distance.min() < 0.02, (distance[0], distance.min())
    assert not any(outcome[phase] for phase in NOT_REACHED_IN_4_S), outcome
    # Its first utterance is the subtask the task starts with; one utterance per frame, decoded to the end.
    assert len(spoken) == MAX_STEPS // EXECUTE_STEPS and spoken[0] == info["subtasks"][0], spoken
    assert len(first["memory"]) == MAX_STEPS // EXECUTE_STEPS
