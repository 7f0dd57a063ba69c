"""`oxygen-bench-model`: a small real run on the CPU, and its argument checks."""

import pytest

from oxygen_ros.bench import model_bench


def test_model_bench_prints_one_row_of_timings(capsys):
    model_bench.main(["--presets", "pi05_tiny", "--cameras", "1", "--prompt-len", "4", "--num-denoise-steps", "2",
                      "--decode-batch", "2", "--warmup", "0", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device=cpu") and " eager" in lines[0]
    assert lines[0].endswith("weights)") or lines[0].endswith("(no oneDNN ops))")   # the CPU paths used
    row = lines[-1].split()
    assert row[0] == "pi05_tiny" and len(row) == 6 and all(float(x) > 0 for x in row[1:])


def test_model_bench_torch_kernels_switch(capsys):
    from oxygen_ros.models import cpu_fast_paths, native

    model_bench.main(["--presets", "pi0_tiny", "--cameras", "1", "--prompt-len", "4", "--num-denoise-steps", "1",
                      "--decode-batch", "9", "--warmup", "0", "--repeats", "1", "--torch-kernels"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("(torch paths (--torch-kernels))") and lines[-1].split()[0] == "pi0_tiny"
    assert cpu_fast_paths.native_attention_in_use() and cpu_fast_paths.packed_weights_in_use()


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--num-denoise-steps", "0"], ["--cameras", "0"], ["--threads", "-1"],
                                  ["--warmup", "-1"], ["--presets", "nope"], ["--device", "gpu"],
                                  ["--graph-backend", "tpu"]])
def test_model_bench_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        model_bench.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
