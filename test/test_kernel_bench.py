"""The CPU kernel A/B bench runs every setting (torch paths, each native build this CPU can execute)
and leaves the process's CPU-path switches as it found them. Timings are not asserted."""

import json

import pytest

from oxygen_ros.bench import kernel_bench
from oxygen_ros.models import cpu_fast_paths, native


@pytest.mark.skipif(not native.enabled_by_environment(), reason="native kernels turned off by OXYGEN_NATIVE_KERNELS")
def test_kernel_bench_smoke_covers_every_build_and_restores_the_switches(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert kernel_bench.main(["--rounds", "1", "--batch", "3", "--sizes", "2", "--keys", "20", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    names = ["torch"] + [f"native {name}" for name in native.variants()]
    assert results["settings"] == names and results["sizes"] == [1, 2, 3]
    for label in ("shared", "per-request"):
        for name in names:
            step = results["step"][label][name]
            assert step["step_1_s"] > 0 and step["step_2_s"] > 0 and step["step_3_s"] > 0
            assert step["added_request_s"] == pytest.approx(
                kernel_bench.slope([1, 2, 3], [step["step_1_s"], step["step_2_s"], step["step_3_s"]]))
            assert step["added_request_flop"] > 0
    assert all(results["attention"][name] > 0 for name in names) and results["attention"]["keys"] == 20
    table = capsys.readouterr().out
    assert "3-row / 1-row, shared prefix" in table and "native " + native.variants()[0] in table
    assert "one more request (slope), ms, per-request prefix" in table
    assert cpu_fast_paths.native_attention_in_use() and cpu_fast_paths.packed_weights_in_use() and native.active_variant() == (
        native.variants()[0] if native.variants()[0] != "default" else None)


def test_the_added_request_cost_is_the_least_squares_slope():
    assert kernel_bench.slope([1, 30], [0.010, 0.039]) == pytest.approx(0.001)
    # Points off a line: slope of the fit, not of the end points ((0.4 - 0.1) / 3 = 0.1).
    assert kernel_bench.slope([1, 2, 3, 4], [0.1, 0.3, 0.2, 0.4]) == pytest.approx(0.08)
    with pytest.raises(ValueError, match="two distinct sizes"):
        kernel_bench.slope([5, 5], [0.1, 0.2])


def test_kernel_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        kernel_bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        kernel_bench.main(["--preset", "pi05"])     # full presets need a real tokenizer
    with pytest.raises(SystemExit):
        kernel_bench.main(["--batch", "4", "--sizes", "8"])
    assert "--rounds" in capsys.readouterr().err
