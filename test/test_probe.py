"""The start-frame probe (oxygen_ros/training/probe.py): its parsing and statistics by hand, and a run on the
shipped policy whose truth is the scene's own cube position."""
from __future__ import annotations

import math

import numpy as np
import pytest

from oxygen_ros.training import probe


def test_location_answers_are_parsed_or_nan():
    assert probe._location("x 11 y 54") == (11.0, 54.0)
    for text in ("", "x 11", "y 11 x 54", "x eleven y 54", "x 1 y 2 z 3"):
        assert all(math.isnan(v) for v in probe._location(text))


def test_correlation_is_nan_where_a_side_does_not_vary():
    assert probe._corr(np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])) == pytest.approx(1.0)
    assert probe._corr(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    assert math.isnan(probe._corr(np.array([5.0, 5.0, 5.0]), np.array([1.0, 2.0, 3.0])))
    assert math.isnan(probe._corr(np.array([1.0]), np.array([1.0])))


def test_bad_command_lines_are_usage_errors(capsys):
    for argv in (["--seeds", "2"], ["--start-seed", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            probe.parse_args(argv)
        assert exit_info.value.code == 2
    assert "--start-seed must be >= 0" in capsys.readouterr().err


def test_a_directory_without_demo_policy_json_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no demo_policy.json"):
        probe.main(["--checkpoint", str(tmp_path), "--seeds", "3"])
    policy = tmp_path / "demo_policy.json"
    for text, message in (("{", "not readable JSON"), ("{}", "with a 'preset' name"), ("[1]", "with a 'preset' name")):
        policy.write_text(text)
        with pytest.raises(SystemExit, match=message):
            probe.main(["--checkpoint", str(tmp_path), "--seeds", "3"])


def test_json_output_has_no_nan():
    assert probe._nan_to_none({"a": [1.0, math.nan], "b": {"c": math.nan}, "d": "x"}) == \
        {"a": [1.0, None], "b": {"c": None}, "d": "x"}


@pytest.mark.slow
def test_probe_of_the_shipped_policy_on_three_start_frames():
    pytest.importorskip("gym_aloha")
    from oxygen_ros.assets import demo_policy_dir
    from oxygen_ros.tools.demo_data import generate_episode

    result = probe.probe(demo_policy_dir(), [1000, 1001, 1002])
    # The truth is where the scene's cube settled (the demonstrations' own cube_start), in cm.
    for seed, truth in zip((1000, 1001, 1002), result["truth_cm"]):
        cube = generate_episode(seed, image_every=1_000_000, cameras=()).cube_start
        assert truth == pytest.approx([cube[0] * 100, cube[1] * 100], abs=0.01)
    answers, truths = np.array(result["answer_cm"]), np.array(result["truth_cm"])
    assert result["unreadable"] == 0          # the policy answers in the trained form "x <cm> y <cm>"
    # (the truth is reported rounded to 0.01 cm, the error computed before that rounding)
    assert result["error_cm"] == pytest.approx(np.hypot(*(answers - truths).T).tolist(), abs=0.02)
    assert result["mean_error_cm"] == pytest.approx(float(np.mean(result["error_cm"])), abs=0.01)
    assert set(result["chunk_end"]) == set(probe.PROBED_JOINTS)
    assert all(entry["rms_rad"] >= 0 for entry in result["chunk_end"].values())
