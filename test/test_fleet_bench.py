"""The fleet benchmark (``make bench-fleet``) runs both settings for every R and reports consistent rows.

Timings are not asserted (a benchmark measures); what must hold on any machine is the report's structure
and its counts: one fleet and one separate row per R, R x frames robot frames each, the misses a count of
those, the fleet's ratio against the separate row, the table on stdout and the JSON on disk.
"""

import json

import pytest

from oxygen_ros.bench import fleet_bench


@pytest.mark.slow     # every setting end to end (minutes on a loaded 2-core machine)
def test_fleet_bench_smoke(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert fleet_bench.main(["--robots", "1", "2", "--frames", "2", "--rounds", "2", "--n", "2", "--k", "1",
                             "--kv-budget-mb", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert results["control_period_s"] > 0
    rows = {(r["robots"], r["setting"]): r for r in results["rows"]}
    assert list(rows) == [(1, "fleet"), (1, "separate"), (2, "fleet"), (2, "separate")]
    for (robots, setting), row in rows.items():
        assert row["frames"] == 2 and row["robot_frames"] == 2 * robots
        assert 0 <= row["deadline_misses"] <= row["robot_frames"]
        assert row["frame_p50_s"] <= row["frame_p99_s"] and row["worst_robot_p99_s"] > 0
        assert row["aggregate_action_rate_hz"] == pytest.approx(robots * row["robot_action_rate_hz"])
        assert row["tokens_per_s"] > 0      # each robot's speech request decodes k tokens a frame
        ratio = row["aggregate_action_rate_hz"] / rows[(robots, "separate")]["aggregate_action_rate_hz"]
        assert row["throughput_ratio"] == pytest.approx(ratio)
        # the table has the row: R, setting, then its misses as a count of its frames
        assert any(line.split()[:2] == [str(robots), setting]
                   and f"{row['deadline_misses']}/{row['robot_frames']}" in line for line in table.splitlines())
    assert f"JSON written to {out}" in table


def test_fleet_bench_rejects_bad_arguments_before_building_the_model(tmp_path, capsys):
    for argv in (["--robots", "0"], ["--frames", "0"], ["--kv-budget-mb", "0"], ["--period-ms", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            fleet_bench.main(argv + ["--out", str(tmp_path / "x.json")])
        assert exit_.value.code == 2, argv
        assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
