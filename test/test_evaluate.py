"""Closed-loop evaluation (oxygen_ros/tools/evaluate/): the scripted expert scores as the data says, a
synchronous episode is deterministic, the report has its structure, and the node on simulated time runs the
lockstep over real DDS. Random weights (pi05_demo, seeded): no trained checkpoint needed."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]

SEED = 1000   # the evaluation's first seed; the expert transfers the cube on it


@pytest.fixture(scope="module")
def evaluate():
    pytest.importorskip("gym_aloha")
    from oxygen_ros.tools import evaluate

    return evaluate


def _args(evaluate, tmp_path, *extra):
    return evaluate.parse_args(["--checkpoint", "", "--episodes", "1", "--start-seed", str(SEED),
                                "--out", str(tmp_path), *extra])


def test_expert_outcome_matches_the_data_generators_replay(evaluate):
    from oxygen_ros import demo_task
    from oxygen_ros.tools import demo_data

    record = evaluate.run_sync_episode(evaluate.ExpertPolicy(), SEED, execute_steps=10)
    score = evaluate.score_episode(record)
    replay = demo_data.generate_episode(SEED, cameras=())
    # The lockstep schedule executes the expert's actions step for step: the same physics as the data's replay.
    assert score["outcome"] == dict(zip(demo_task.PHASES, map(bool, replay.outcome)))
    np.testing.assert_array_equal(np.asarray(record["flags"], bool), replay.phases)
    assert score["outcome"]["grasped"] and score["outcome"]["transferred"]
    assert score["closest_m"] == min(record["right_distance"]) < demo_task.REACH_TOLERANCE
    assert score["steps"] == evaluate.EPISODE_STEPS and len(record["observed"]) == evaluate.EPISODE_STEPS // 10
    # The script's labels against the state-based ground truth: they differ only within 0.4 s of a segment
    # boundary, and while the left gripper closes (7.0-8.4 s: the rule says "release" once it closes on the
    # cube, the script from 8.4 s, when the right gripper opens; docs/demo-policy.md, "Ground-truth subtask").
    assert score["subtask_total"] == len(record["observed"])
    boundaries = np.array([start for start, _ in demo_data.plan_transfer(np.zeros(3), {
        arm: (np.zeros(3), np.array([1.0, 0.0, 0.0, 0.0])) for arm in demo_task.ARMS}).segments[1:]])
    differ = [k * 10 * demo_task.DT for k, o in enumerate(record["observed"]) if o["subtask"] != replay.subtask[k * 10]]
    assert len(differ) == score["subtask_total"] - score["subtask_correct"]
    assert all(np.abs(boundaries - t).min() <= 0.4 + 1e-9 or 7.0 - 1e-9 <= t < 8.4 for t in differ), differ
    # The ground truth walks through the subtasks in order on a successful episode.
    truth = [o["subtask"] for o in record["observed"]]
    assert truth[0] == 0 and truth[-1] == len(demo_task.SUBTASKS) - 1 and truth == sorted(truth)
    assert [o["caption"] for o in record["observed"]][-1] == "the left gripper holds the cube in the air"


def test_phase_times_are_the_first_step_and_the_final_transfer(evaluate):
    from oxygen_ros.demo_task import DT, PHASES

    dt = DT
    flags = np.zeros((10, 4), bool)
    flags[3:, 0] = True            # reached from step 3 on
    flags[5:7, 1] = True           # grasped at step 5, let go at 7
    flags[2, 3] = flags[8:, 3] = True   # transferred at 2 (lost again), and from 8 to the end
    times = evaluate.phase_times(flags.tolist())
    assert times == {"reached": round(3 * dt, 3), "grasped": round(5 * dt, 3), "lifted": None,
                     "transferred": round(8 * dt, 3)}
    flags[-1, 3] = False           # not held at the end: no transfer (outcome's rule)
    assert evaluate.phase_times(flags)["transferred"] is None and not evaluate.outcome(flags)["transferred"]
    assert evaluate.phase_times(np.zeros((0, 4), bool)) == dict.fromkeys(PHASES)


def test_ground_truth_rules(evaluate):
    from oxygen_ros.demo_task import SceneState
    from oxygen_ros.demo_task import state_subtask as ground_truth_subtask

    def state(z, on_table=False, right_fingers=0, distance=0.2, left_fingers=0, left_on_right=False):
        return SceneState(cube=np.array([0.1, 0.5, z]), right_fingers=right_fingers, left_fingers=left_fingers,
                          on_table=on_table, right_distance=distance, left_on_right=left_on_right)

    def position(left, right):
        p = np.zeros(14)
        p[6], p[13] = left, right
        return p

    rest = 0.02
    gt = ground_truth_subtask
    assert gt(state(rest, on_table=True), rest, position(1.0, 1.0)) == 0                   # move to the cube
    assert gt(state(rest, on_table=True, distance=0.01), rest, position(1.0, 1.0)) == 1    # at it: grasp
    assert gt(state(rest + 0.05, right_fingers=1), rest, position(1.0, 0.6)) == 2          # lift
    assert gt(state(rest + 0.15), rest, position(1.0, 0.6)) == 3                            # hand over
    assert gt(state(rest + 0.15), rest, position(0.9, 0.6)) == 4                            # left closing: release
    # The left fingers stopped on the right ones (or on the cube) while still reading open: closing, release.
    assert gt(state(rest + 0.15, right_fingers=2, left_on_right=True), rest, position(0.96, 0.6)) == 4
    assert gt(state(rest + 0.15, right_fingers=2, left_fingers=1), rest, position(0.96, 0.6)) == 4
    assert gt(state(rest, on_table=True), rest, position(0.6, 1.0)) == 0                   # dropped: fetch again


def test_sync_and_expert_report_and_sync_is_deterministic(evaluate, tmp_path):
    result = evaluate.evaluate(_args(evaluate, tmp_path, "--conditions", "sync,expert", "--max-steps", "20"))
    assert [c["condition"] for c in result["conditions"]] == ["sync", "expert"]
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["table"] == result["table"] == (tmp_path / "eval.md").read_text().strip()
    for summary in result["conditions"]:
        assert summary["episodes"] == 1 and set(summary["success"]) == {"reached", "grasped", "lifted", "transferred"}
        for phase in summary["success"].values():
            assert phase["episodes"] == 1 and 0.0 <= phase["ci95"][0] <= phase["rate"] <= phase["ci95"][1] <= 1.0
        episode = summary["per_episode"][0]
        assert episode["steps"] == 20 and episode["sim_s"] == pytest.approx(0.4) and episode["chunks"] == 2
        assert (tmp_path / summary["condition"] / f"episode_{SEED}.png").stat().st_size > 1000
        assert f"| {summary['condition']} |" in result["table"]
    sync = result["conditions"][0]["per_episode"][0]
    # Speech and memory on every frame, decoded to the end in the frame's cycle: two of each, scored.
    assert sync["subtask_total"] == 2 and sync["caption_total"] == 2 and sync["mean_latency_s"] > 0

    # A second synchronous run of the same seed on a freshly built engine: the same episode, bit for bit.
    first = json.loads((tmp_path / "sync" / f"episode_{SEED}.json").read_text())
    args = _args(evaluate, tmp_path / "again", "--conditions", "sync", "--max-steps", "20")
    policy = evaluate.EnginePolicy(evaluate.node_parameters("sync", args, ""))
    try:
        record = evaluate.run_sync_episode(policy, SEED, args.execute_steps, args.max_steps)
    finally:
        policy.close()
    second = json.loads(json.dumps({k: v for k, v in record.items() if k != "sheet"}))
    assert first["final_position"] == second["final_position"]
    assert first["flags"] == second["flags"] and first["observed"] == second["observed"]
    assert first["speech"] == second["speech"] and first["memory"] == second["memory"] and len(first["speech"]) == 2
    sim = evaluate.EpisodeSim(SEED)
    start = np.asarray(sim.scene.joint_state()[0])
    sim.close()
    assert not np.allclose(first["final_position"], start, atol=1e-4), "the policy's actions moved nothing"


def test_bad_arguments_are_usage_errors(evaluate, tmp_path, capsys):
    for extra in (["--start-seed", "-5"], ["--start-seed", str(2 ** 32 - 1), "--episodes", "2"],
                  ["--conditions", ","], ["--episodes", "0"]):
        with pytest.raises(SystemExit):
            evaluate.parse_args(["--checkpoint", "", "--conditions", "expert", *extra])
    assert "--episodes must be >= 1, got 0" in capsys.readouterr().err       # names the option and the value
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="cannot create the output directory"):
        evaluate.main(["--checkpoint", "", "--conditions", "expert", "--out", str(blocker / "x")])


def test_lockstep_inputs_are_reliable_and_realtime_inputs_best_effort(evaluate, tmp_path):
    """The lockstep robot publishes each frame's inputs once: a lost best-effort sample would never be replaced
    and the frame never completed (the joint state, sent with the images, was lost on a loaded machine:
    "stale joint state (0.20 s)" until the episode aborted). Every input of a lockstep condition is reliable."""
    from oxygen_ros.demo_task import CAMERAS
    from oxygen_ros.node.parameters import settings_from_values

    args = _args(evaluate, tmp_path)
    for condition in ("node-lockstep", "sync", "random"):
        params = evaluate.node_parameters(condition, args, "")
        settings = settings_from_values(params)
        assert settings.joint_states_reliability == "reliable", condition
        assert [c.reliability for c in settings.cameras] == ["reliable"] * len(CAMERAS), condition
    realtime = settings_from_values(evaluate.node_parameters("node-realtime", args, ""))
    assert realtime.joint_states_reliability == "best_effort"       # the demo's robot streams at 50 Hz
    with pytest.raises(ValueError, match="joint_states_reliability"):
        settings_from_values(dict(params, joint_states_reliability="sometimes"))


def test_node_lockstep_runs_over_dds_on_simulated_time(evaluate, tmp_path):
    result = evaluate.evaluate(_args(evaluate, tmp_path, "--conditions", "node-lockstep", "--max-steps", "20"))
    summary = result["conditions"][0]
    episode = summary["per_episode"][0]
    assert summary["aborted"] == 0 and episode["aborted"] is None
    # The robot process ended cleanly (a failure after its record would be counted here, the episode kept).
    assert summary["robot_exit_failures"] == 0 and episode["robot_exit"] == 0
    # Two observations, two chunks received by the robot, 20 steps of 20 ms executed on the simulated clock.
    assert episode["chunks"] == 2 and episode["steps"] == 20 and episode["sim_s"] == pytest.approx(0.4)
    # Every frame got a speech and a memory request; their finals came back over DDS with the frame's stamp.
    assert episode["subtask_total"] == 2 and episode["caption_total"] == 2
    record = json.loads((tmp_path / "node-lockstep" / f"episode_{SEED}.json").read_text())
    offset = evaluate.EPISODE_CLOCK_S
    assert [round(o["t"] - offset, 6) for o in record["observed"]] == [0.2, 0.4]
    params = (tmp_path / "node_params_node-lockstep.yaml").read_text()
    assert "use_sim_time: true" in params and "staleness_limit_s: 0.01" in params


def test_sync_with_temporal_ensembling_runs_is_deterministic_and_averages_the_chunks(evaluate, tmp_path):
    """``--ensemble 0.01``: a chunk every 5 steps, so in steps 5-9 the first chunk's actions 5-9 and the second's
    0-4 overlap and are averaged with ACT's weights (1 and exp(-0.01 x 5)). The episode is deterministic, and
    replaying the hand-computed averages in a fresh scene ends in the same state."""
    import math

    extra = ("--conditions", "sync", "--max-steps", "10", "--execute-steps", "5", "--ensemble", "0.01")
    result = evaluate.evaluate(_args(evaluate, tmp_path, *extra))
    assert result["ensemble_m"] == 0.01
    episode = result["conditions"][0]["per_episode"][0]
    assert episode["steps"] == 10 and episode["chunks"] == 2
    first = json.loads((tmp_path / "sync" / f"episode_{SEED}.json").read_text())

    class Recording:
        """The engine policy, keeping the chunks it returns."""

        def __init__(self, policy):
            self.policy, self.chunks = policy, []
            self.cameras = policy.cameras

        def start(self, seed):
            self.policy.start(seed)

        def act(self, images, position, t):
            step = self.policy.act(images, position, t)
            self.chunks.append(step.actions.copy())
            return step

        def finish(self):
            self.policy.finish()

    args = _args(evaluate, tmp_path / "again", *extra)
    policy = Recording(evaluate.EnginePolicy(evaluate.node_parameters("sync", args, "")))
    try:
        record = evaluate.run_sync_episode(policy, SEED, args.execute_steps, args.max_steps, ensemble_m=args.ensemble)
    finally:
        policy.policy.close()
    assert record["final_position"] == first["final_position"] and record["flags"] == first["flags"]
    assert record["observed"] == first["observed"]

    a, b = policy.chunks
    w = math.exp(-0.01 * 5)
    ensembled = [a[i] for i in range(5)] + [(a[5 + i] + w * b[i]) / (1 + w) for i in range(5)]
    newest = [a[i] for i in range(5)] + [b[i] for i in range(5)]

    def replay(actions):
        sim = evaluate.EpisodeSim(SEED, width=64, height=48)
        try:
            for action in actions:
                sim.execute(action)
            return sim.scene.joint_state()[0]
        finally:
            sim.close()

    np.testing.assert_allclose(replay(ensembled), record["final_position"], rtol=0, atol=1e-9)
    assert not np.allclose(replay(newest), record["final_position"], rtol=0, atol=1e-6), \
        "ensembling changed nothing: the newest-chunk execution ends in the same state"


def test_contact_sheet_times_cover_the_whole_episode(evaluate):
    """The default 10.6 s episode keeps its frames (0-8 s every 2 s, 10.4 s); a longer or shorter one spreads
    them over its own length, the last 0.2 s before its end (so a transfer late in a 20 s episode shows)."""
    assert evaluate.sheet_times() == evaluate.SHEET_TIMES_S == (0.0, 2.0, 4.0, 6.0, 8.0, 10.4)
    assert evaluate.sheet_times(990) == (0.0, 4.0, 8.0, 12.0, 16.0, 19.6)       # 19.8 s: every 4 s
    assert evaluate.sheet_times(300) == (0.0, 2.0, 4.0, 5.8)                    # 6 s
    assert evaluate.sheet_times(50) == (0.0, 0.8)                               # 1 s


def test_runs_cross_the_execution_schemes_with_the_injected_delays(evaluate, tmp_path, capsys):
    from oxygen_ros.tools.evaluate.conditions import plan_runs

    args = _args(evaluate, tmp_path, "--conditions", "expert,sync,node-realtime", "--chunking", "newest,rtc",
                 "--delays", "20,0")
    runs = {run.name: run for run in plan_runs(args)}
    assert list(runs) == ["node-realtime/newest/d0", "node-realtime/rtc/d0", "sync/newest/d0", "sync/newest/d20",
                          "sync/rtc/d0", "sync/rtc/d20", "expert/newest/d0", "expert/newest/d20"]
    # the paper's lockstep: s = max(--execute-steps, d) actions per chunk, guidance toward the whole overlap H - s
    rtc = runs["sync/rtc/d20"]
    assert rtc.execute_steps == 20 and rtc.delay_steps == 20 and rtc.ensemble_m == 0.0
    assert rtc.params == {"rtc.enabled": True, "rtc.execution_horizon": 30, "rtc.delay_mode": "fixed",
                          "rtc.fixed_delay_steps": 20}
    assert runs["sync/newest/d0"].params == {} and runs["sync/newest/d0"].execute_steps == 10
    # in real time the delay is measured; a chunk every 1 / (3 Hz * 20 ms) ~ 17 steps
    assert runs["node-realtime/rtc/d0"].params == {"rtc.enabled": True, "rtc.execution_horizon": 33,
                                                   "rtc.delay_mode": "auto"}
    assert [r.name for r in plan_runs(_args(evaluate, tmp_path, "--conditions", "sync"))] == ["sync"]
    ensemble = plan_runs(_args(evaluate, tmp_path, "--conditions", "sync", "--chunking", "ensemble"))[0]
    assert ensemble.ensemble_m == 0.01 and ensemble.name == "sync"
    for extra in (["--chunking", "fastest"], ["--delays", "-1"], ["--delays", "five"]):
        with pytest.raises(SystemExit):
            evaluate.parse_args(["--checkpoint", "", "--conditions", "sync", *extra])
    assert "--delays must be integers" in capsys.readouterr().err


def test_an_injected_delay_keeps_the_old_chunk_for_d_steps_and_switches_at_action_d(evaluate):
    # The expert's chunks are cuts of one trajectory: executed from action d on after d steps of the previous
    # chunk, every switch continues the motion exactly (seam 0); before the first chunk the robot holds.
    record = evaluate.run_sync_episode(evaluate.ExpertPolicy(), SEED, execute_steps=10, max_steps=60, delay_steps=5)
    assert record["delay_steps"] == 5 and record["chunks"] == 6
    assert len(record["seams"]) == 5
    assert all(position == 0.0 and velocity == 0.0 for position, velocity, _ in record["seams"]), record["seams"]
    with pytest.raises(ValueError, match="delay_steps"):
        evaluate.run_sync_episode(evaluate.ExpertPolicy(), SEED, execute_steps=10, max_steps=20, delay_steps=11)
