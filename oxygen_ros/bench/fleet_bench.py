"""Fleet benchmark: R robots on one engine (:class:`~oxygen_ros.engine.fleet.Fleet`) against R separate
engines on the same hardware, ROS-free (docs/fleet.md, docs/benchmarks.md).

Every robot runs the engine benchmark's workload (``oxygen_ros/bench/engine_bench.py``): each frame
one speech request of exactly N tokens (no early stop) on the action prompt, k decode steps per frame
(``fixed_k``), S = 10 denoising steps, its own stream of random observations (every camera slot of
``--robot``). For each R in ``--robots``:

* ``fleet``: one model, one engine, one KV pool of R x ``--kv-budget-mb``; a round is one fleet cycle
  that serves all R robots (one vision call, batched prefill, denoising and decode steps);
* ``separate``: R engines on the same model weights (R KV pools, no batching across them); a round
  runs one cycle of each engine in turn, as R processes sharing one device would take turns.

All R observations of a round are released at its start. A robot's frame latency is from that release
to its chunk's cycle end (for ``separate``: behind the engines before it in the round); its action rate
is H over the round time (each robot gets one chunk per round). A deadline miss is a frame latency
above the control period (``--period-ms``; default twice the median round of the fleet at R = 1).
Tokens/s: the generated tokens of all robots over the summed round times. The two settings of one R
take turns in ``--rounds`` chunks of frames (interleaved), so a machine whose speed drifts slows both
alike; the throughput ratio is fleet / separate aggregate action rate (per-round medians).

Usage: ``python -m oxygen_ros.bench.fleet_bench --robots 1 2 4 8 --frames 20`` (``make bench-fleet``);
a table on stdout, JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.bench.cpu_paths import cpu_kernel_choice, cpu_kernels
from oxygen_ros.bench.engine_bench import _observation_stream, speech
from oxygen_ros.bench.table import Column, print_table, write_json
from oxygen_ros.engine import EngineConfig
from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.factory import ModelParts, load_parts
from oxygen_ros.engine.fleet import Fleet
from oxygen_ros.models import PRESETS, ROBOTS, get_preset, get_robot
from oxygen_ros.models.processing import ACTION_PROMPT
from oxygen_ros.models.tokenizer import TinyTokenizer

INSTRUCTION = "pick up the red cube and put it in the bowl"


def robot_config(parts: ModelParts, n: int, k: int, kv_budget_mb: float, cuda_graphs: bool) -> EngineConfig:
    """One robot's engine configuration: the engine benchmark's unified ``fixed_k`` setting."""
    return EngineConfig.from_dict({
        "mode": "unified", "scheduling": "fixed_k", "decode_steps_per_cycle": k,
        "kv_budget_mb": kv_budget_mb, "camera_slots": list(parts.robot.camera_slots),
        "action": {"prompt_template": ACTION_PROMPT, "control_rate_hz": 1.0, "num_denoise_steps": 10},
        "language_tasks": [speech(n)], "max_batch_size": 256, "max_waiting": 256,
        "cuda_graphs": cuda_graphs})


class FleetSetting:
    """R robots on one :class:`Fleet`; :meth:`round` serves all of them in one cycle."""

    name = "fleet"

    def __init__(self, parts: ModelParts, config: EngineConfig, robots: int, warmup: int):
        fleet_config = EngineConfig.from_dict({
            "mode": "unified", "scheduling": "fixed_k", "decode_steps_per_cycle": config.decode_steps_per_cycle,
            "kv_budget_mb": robots * config.kv_budget_mb, "camera_slots": list(config.camera_slots),
            "max_batch_size": 256 * robots, "cuda_graphs": config.cuda_graphs})
        self.fleet = Fleet(parts.model, fleet_config)
        self.streams = {}
        for r in range(robots):
            self.fleet.add_robot(r, parts.processor, config)
            self.streams[r] = _observation_stream(parts.robot, 100 + r, INSTRUCTION)
        self.fleet.warm_up({r: next(stream) for r, stream in self.streams.items()})
        for _ in range(warmup):
            self.round()

    def round(self) -> tuple[list[float], int]:
        """One round: (per robot frame latency [s], generated tokens)."""
        result = self.fleet.run_cycle({r: next(stream) for r, stream in self.streams.items()})
        latencies = [result.cycles[r].record.frame_latency_s for r in self.streams]
        return latencies, sum(c.record.generated_tokens for c in result.cycles.values())

    def close(self) -> None:
        self.fleet.close()


class SeparateSetting:
    """R separate engines on the same weights; :meth:`round` runs one cycle of each in turn."""

    name = "separate"

    def __init__(self, parts: ModelParts, config: EngineConfig, robots: int, warmup: int):
        self.engines = [Engine(parts.model, parts.processor, config) for _ in range(robots)]
        self.streams = [_observation_stream(parts.robot, 100 + r, INSTRUCTION) for r in range(robots)]
        for engine, stream in zip(self.engines, self.streams):
            engine.warm_up(next(stream))
        for _ in range(warmup):
            self.round()

    def round(self) -> tuple[list[float], int]:
        release = time.perf_counter()
        latencies, tokens = [], 0
        for engine, stream in zip(self.engines, self.streams):
            result = engine.run_cycle(next(stream))
            latencies.append(time.perf_counter() - release)
            tokens += result.record.generated_tokens
        return latencies, tokens

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def measure(settings: list, frames: int, rounds: int) -> list[dict]:
    """Per setting: per-robot latencies, round times, tokens; the settings take turns in chunks."""
    samples = [{"latencies": [], "rounds": [], "tokens": 0} for _ in settings]
    chunks = [frames // rounds + (i < frames % rounds) for i in range(rounds)]
    for chunk in chunks:
        for setting, sample in zip(settings, samples):
            for _ in range(chunk):
                t = time.perf_counter()
                latencies, tokens = setting.round()
                sample["rounds"].append(time.perf_counter() - t)
                sample["latencies"].append(latencies)
                sample["tokens"] += tokens
    return samples


def summarise(name: str, robots: int, sample: dict, horizon: int, period: float) -> dict:
    """One table row from a setting's samples."""
    latencies = np.array(sample["latencies"])          # [frames, R]
    round_p50 = float(np.median(sample["rounds"]))
    return {"setting": name, "robots": robots, "frames": len(sample["rounds"]),
            "round_p50_s": round_p50,
            "robot_action_rate_hz": horizon / round_p50,
            "aggregate_action_rate_hz": robots * horizon / round_p50,
            "frame_p50_s": float(np.percentile(latencies, 50)),
            "frame_p99_s": float(np.percentile(latencies, 99)),
            "worst_robot_p99_s": float(np.percentile(latencies, 99, axis=0).max()),
            "deadline_misses": int((latencies > period).sum()),
            "robot_frames": int(latencies.size),
            "tokens_per_s": sample["tokens"] / sum(sample["rounds"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oxygen-bench-fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="pi05_tiny", choices=sorted(PRESETS))
    parser.add_argument("--robot", default="libero", choices=sorted(ROBOTS))
    parser.add_argument("--robots", type=int, nargs="+", default=[1, 2, 4, 8], help="R values")
    parser.add_argument("--n", type=int, default=20, help="speech tokens per frame (N)")
    parser.add_argument("--k", type=int, default=5, help="decode steps per frame (k)")
    parser.add_argument("--frames", type=int, default=20, help="measured rounds per setting")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up rounds (N/k are added)")
    parser.add_argument("--rounds", type=int, default=4, help="chunks in which the two settings take turns")
    parser.add_argument("--period-ms", type=float, default=0.0,
                        help="control period of every robot [ms] (0: twice the fleet's median round at R = 1)")
    parser.add_argument("--kv-budget-mb", type=float, default=64.0, help="KV budget per robot [MiB]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokenizer-path", default=None,
                        help="PaliGemma SentencePiece model for full presets, or 'tiny' (random weights)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default="bench-results/fleet_bench.json")
    args = parser.parse_args(argv)
    if min(args.robots + [args.n, args.k, args.frames, args.rounds]) < 1 or args.warmup < 0 \
            or args.period_ms < 0 or args.kv_budget_mb <= 0:
        parser.error("--robots, --n, --k, --frames, --rounds must be >= 1; --warmup, --period-ms >= 0; "
                     "--kv-budget-mb > 0")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch has no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    tokenizer = TinyTokenizer(config.vocab_size) if args.tokenizer_path == "tiny" else args.tokenizer_path
    parts = load_parts(args.preset, get_robot(args.robot), tokenizer=tokenizer, dtype=args.dtype,
                       device=args.device)
    with cpu_kernel_choice(False):
        return _run(args, parts)


def _run(args: argparse.Namespace, parts: ModelParts) -> int:
    horizon = parts.model.config.action_horizon
    config = robot_config(parts, args.n, args.k, args.kv_budget_mb, args.cuda_graphs)
    warmup = args.warmup + math.ceil(args.n / args.k)
    results = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "device": args.device,
                           "cpu_kernels": cpu_kernels(parts.model.device, parts.model.config, False)},
               "preset": args.preset, "robot": args.robot, "N": args.n, "k": args.k, "horizon": horizon,
               "frames": args.frames, "args": vars(args), "rows": []}
    period = args.period_ms / 1e3
    out = Path(args.out)
    for robots in args.robots:
        settings = [FleetSetting(parts, config, robots, warmup), SeparateSetting(parts, config, robots, warmup)]
        try:
            samples = measure(settings, args.frames, max(1, min(args.rounds, args.frames)))
        finally:
            for setting in settings:
                setting.close()
        if period == 0.0:
            period = 2.0 * float(np.median(samples[0]["rounds"]))
        rows = [summarise(s.name, robots, sample, horizon, period) for s, sample in zip(settings, samples)]
        rows[0]["throughput_ratio"] = rows[0]["aggregate_action_rate_hz"] / rows[1]["aggregate_action_rate_hz"]
        rows[1]["throughput_ratio"] = 1.0
        results["rows"] += rows
        results["control_period_s"] = period
        write_json(out, results)
        print(f"[bench] R={robots}: fleet round {1e3 * rows[0]['round_p50_s']:.1f} ms, separate "
              f"{1e3 * rows[1]['round_p50_s']:.1f} ms", file=sys.stderr, flush=True)
    _print(results)
    print(f"\nJSON written to {out}")
    return 0


COLUMNS = [
    Column("R", 4, lambda r: str(r["robots"]), "<"),
    Column("setting", 9, lambda r: r["setting"], "<"),
    Column("robot act Hz", 13, lambda r: f"{r['robot_action_rate_hz']:.1f}"),
    Column("aggr act Hz", 12, lambda r: f"{r['aggregate_action_rate_hz']:.1f}"),
    Column("frame p50 ms", 13, lambda r: f"{1e3 * r['frame_p50_s']:.1f}"),
    Column("frame p99 ms", 13, lambda r: f"{1e3 * r['frame_p99_s']:.1f}"),
    Column("worst p99 ms", 13, lambda r: f"{1e3 * r['worst_robot_p99_s']:.1f}"),
    Column("misses", 10, lambda r: f"{r['deadline_misses']}/{r['robot_frames']}"),
    Column("tok/s", 9, lambda r: f"{r['tokens_per_s']:.0f}"),
    Column("ratio", 8, lambda r: f"{r['throughput_ratio']:.2f}x"),
]


def _print(results: dict) -> None:
    m = results["machine"]
    print(f"preset {results['preset']}, robot {results['robot']}, N={results['N']}, k={results['k']}, "
          f"H={results['horizon']}, {results['frames']} rounds/setting, {m['threads']} threads on "
          f"{m['device']} ({m['processor'] or m['platform']}); control period "
          f"{1e3 * results['control_period_s']:.1f} ms")
    print_table(COLUMNS, results["rows"])


if __name__ == "__main__":
    raise SystemExit(main())
