"""The engine benchmark runs every setting end to end and reports consistent counters.

Timings are not asserted (a benchmark measures); what must hold whatever the machine is the
structure of the report and the work counters: sharing halves vision calls and prefilled tokens,
every row's bound is computed, and the deadline comparison reports the window throughput.
"""

import json

import pytest

from oxygen_ros.bench import engine_bench


@pytest.mark.slow     # every setting end to end (minutes on a loaded 2-core machine)
def test_engine_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert engine_bench.main(["--frames", "2", "--warmup", "1", "--n", "3", "--k", "1", "5",
                              "--rounds", "2", "--deadline-frames", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "batch scaling" in table and "deadline mode" in table

    rows = {(r["setting"], r["k"]): r for r in results["rows"]}
    assert set(rows) == {("isolated", None), ("shared_prefix", None), ("unified", 1), ("unified", 5),
                         ("isolated two-task", None), ("unified two-task", 5)}
    iso, shared = rows[("isolated", None)], rows[("shared_prefix", None)]
    # One speech request per frame with the action prompt: isolated encodes and prefills twice.
    assert iso["vision_calls_per_frame"] == 2.0
    for key in (("shared_prefix", None), ("unified", 1), ("unified", 5)):
        assert rows[key]["vision_calls_per_frame"] == 1.0
        assert rows[key]["prefilled_tokens_per_frame"] * 2 == iso["prefilled_tokens_per_frame"]
    assert shared["speedup"] > 0
    # Two tasks with different prompts: one vision call, each prompt prefilled once.
    assert rows[("unified two-task", 5)]["vision_calls_per_frame"] == 1.0
    assert rows[("isolated two-task", None)]["vision_calls_per_frame"] == 3.0
    for key in (("unified", 1), ("unified", 5), ("unified two-task", 5)):
        assert rows[key]["bound"] > 1.0 and rows[key]["pct_of_bound"] > 0
    assert set(results["costs_s_per_group"]) == {"N=3", "two-task"}

    deadline = results["deadline"]
    assert deadline["frames"] == 3
    # Every request of the window completes within the drain frames, so the window throughput exists.
    assert deadline["unified_window_tokens_per_s"] > 0 and deadline["k1_window_tokens_per_s"] > 0
    for key in ("batch_scaling", "batch_scaling_cross_frame"):
        assert results[key]["batch"] == 30 and results[key]["ratio"] > 0
    assert results["cpu_kernels"].endswith("oneDNN-packed weights")


def test_engine_bench_torch_kernels_switch_is_reported_and_undone(tmp_path, capsys):
    from oxygen_ros.models import cpu_fast_paths, native

    out = tmp_path / "bench.json"
    assert engine_bench.main(["--frames", "1", "--warmup", "0", "--n", "2", "--k", "1", "--rounds", "1",
                              "--deadline-frames", "1", "--torch-kernels", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["cpu_kernels"] == "torch paths (--torch-kernels)"
    assert "torch paths (--torch-kernels)" in capsys.readouterr().out
    assert cpu_fast_paths.native_attention_in_use() and cpu_fast_paths.packed_weights_in_use()     # the process's setting is restored


def test_engine_bench_rejects_bad_arguments_before_building_the_model(tmp_path, capsys):
    not_a_model = tmp_path / "not_a.model"
    not_a_model.write_text("not a SentencePiece model")
    for argv in (["--deadline-frames", "0"], ["--action-horizon", "0"], ["--rounds", "0"],
                 ["--preset", "pi05", "--tokenizer-path", str(tmp_path / "missing.model")],
                 ["--preset", "pi05", "--tokenizer-path", str(not_a_model)],
                 ["--preset", "pi05_tiny", "--tokenizer-path", str(not_a_model)]):
        try:
            engine_bench.main(argv + ["--out", str(tmp_path / "x.json")])
        except SystemExit as exit_:
            assert exit_.code == 2, argv
        else:
            raise AssertionError(f"{argv} was accepted")
        assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

