"""scripts/device_bench.sh in its dry mode (DRY=1): every step of the GPU script end to end on the CPU.

The GPU run is rare (a device is lent to some sessions only), so the script, its flags and the
benches it drives are run here on the tiny preset: the CUDA-graph test it starts, the engine bench
through the graph path with direct calls (buckets, static buffers, replay selection), the model
bench. What is asserted is the structure of what it writes, not timings.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow      # the engine bench end to end on pi05_tiny: ~30-60 s on a loaded 2-core machine
def test_device_bench_dry_mode_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "dry"
    env = {**os.environ, "DRY": "1", "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "device_bench.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "torch" in (out / "gpu.txt").read_text()
    assert "1 passed" in (out / "tests.txt").read_text()

    results = json.loads((out / "engine_bench_pi05_tiny_cpu.json").read_text())
    assert results["preset"] == "pi05_tiny" and results["machine"]["device"] == "cpu"
    assert results["cuda_graphs"] == "direct"
    graphs = results["graphs"]
    assert {key[0] for key in graphs["keys"]} == {"decode", "denoise", "vision"} and graphs["failures"] == 0
    assert graphs["replays"] > graphs["captures"] >= 2
    assert {row["setting"] for row in results["rows"]} >= {"isolated", "shared_prefix", "unified"}
    assert "graph path with direct calls" in (out / "engine_bench_pi05_tiny_cpu.txt").read_text()

    model_lines = (out / "model_bench_cpu.txt").read_text().splitlines()
    assert "direct_graph_path" in model_lines[0]
    row = model_lines[-1].split()
    assert row[0] == "pi05_tiny" and all(float(x) > 0 for x in row[1:])
