"""`oxygen-bench-model`: a small real run on the CPU, and its argument checks."""

import pytest

from oxygen_ros.bench import model_bench


def test_model_bench_prints_one_row_of_timings(capsys):
    model_bench.main(["--presets", "pi05_tiny", "--cameras", "1", "--prompt-len", "4", "--steps", "2",
                      "--decode-batch", "2", "--warmup", "0", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device=cpu") and lines[0].endswith("eager")
    row = lines[-1].split()
    assert row[0] == "pi05_tiny" and len(row) == 6 and all(float(x) > 0 for x in row[1:])


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--steps", "0"], ["--cameras", "0"], ["--threads", "-1"],
                                  ["--warmup", "-1"], ["--presets", "nope"], ["--device", "gpu"]])
def test_model_bench_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        model_bench.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
