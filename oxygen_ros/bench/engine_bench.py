"""Engine benchmark: the OxyGen paper's protocol (arXiv 2603.14371) on one model, ROS-free.

Settings, all measured in one run on the same model and inputs:
    * ``isolated``: action task and each language task with their own encode + prefill + private
      cache, decoding run to completion (openpi-style);
    * ``shared_prefix``: one encode and one prefill per distinct prompt, decoding to completion;
    * ``unified``: sharing plus cross-frame continuous batching, fixed k decode steps per frame
      (the paper's protocol) and the deadline-aware scheduler.
One speech request of exactly N tokens per frame (no early stop), N in {5, 10, 20, 30},
k in {1, 5, 10}, S = 10 denoising steps, H = the preset's horizon (10 for the tiny presets), and a
two-task mode (speech with the action prompt + memory with the language prompt).

Bound (the model's own costs, measured in the same run): with P = vision + prefill of one prefix,
D = the denoising loop and d = one decode step of ONE request, isolated execution costs
``2P + D + N·d`` per frame and unified at best ``P + D + k·d``; the best speedup is their ratio
(unified reaches it only if a batched decode step costs about as much as a single one). Two-task
mode: isolated ``3P + D + 2N·d`` against unified ``P + (P - V) + D + k·d`` (the memory prompt needs
its own prefill, V = vision time, shared). Speedup = unified action rate / isolated action rate,
where the action rate is H / frame latency.

Timing statistic: medians. Frame latencies, P, V, D and d are per-frame medians, so a few frames
slowed by other processes on a shared machine do not decide a ratio (means are in the JSON).
Interleaving: the settings compared with each other (per N: the action task alone, isolated,
shared_prefix, unified at every k; and the two-task group) run side by side, each on its own engine,
taking turns in ``--rounds`` chunks of frames, so a machine whose speed drifts over minutes slows all of
them alike; each row's bound uses its group's own P, V, D and d. The header shows their medians over
the groups.

Deadline mode: the control period lies halfway between unified's best frame (P + D + d) and an
isolated frame at the largest N (2P + D + N·d), so isolated misses it on most cycles.

Usage: ``oxygen-bench-engine --frames 30`` (``--frames 2 --warmup 1 --n 3 --k 1 5 --deadline-frames 3``
for a smoke run); writes a table to
stdout and JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from oxygen_ros.engine import BlockPool, CycleResult, EngineConfig, KVCacheManager, Observation
from oxygen_ros.engine.config import MIB
from oxygen_ros.engine.factory import ModelParts, build_engine, load_parts
from oxygen_ros.engine.model_runner import ModelRunner, PrefillRow
from oxygen_ros.bench.cpu_paths import cpu_kernel_choice, cpu_kernels
from oxygen_ros.bench.table import Column, fmt, print_table, write_json
from oxygen_ros.models import PRESETS, ROBOTS, get_preset, get_robot, load_tokenizer
from oxygen_ros.models.tokenizer import TinyTokenizer
from oxygen_ros.models.processing import ACTION_PROMPT, LANGUAGE_PROMPT

# The paper's reported speedups over isolated execution (RTX 4090, π0.5): best 3.7x; k = 5 curve.
PAPER_BEST = 3.7
PAPER_K5 = {5: 1.27, 10: 1.60, 20: 2.35, 30: 2.98}


def _observation_stream(robot, seed: int, instruction: str) -> Iterator[Observation]:
    """Endless random observations (every camera slot, a state), stamped 0.1 s apart."""
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        yield Observation({slot: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
                           for slot in robot.camera_slots}, instruction,
                          rng.uniform(-1, 1, robot.state_dim).astype(np.float32),
                          stamp=0.1 * i, seq=i)


def _observations(robot, count: int, seed: int, instruction: str) -> list[Observation]:
    return list(itertools.islice(_observation_stream(robot, seed, instruction), count))


class Session:
    """One engine fed its own observation stream: warmed up, then measured frame by frame or in
    chunks that :meth:`Bench.interleaved` alternates with other sessions.

    Args:
        bench: the benchmark (model parts, KV budget).
        config: the engine configuration; warmup: frames run before measuring.
    """

    def __init__(self, bench: "Bench", config: EngineConfig, warmup: int):
        self.config = config
        self.engine = build_engine(bench.parts, config)
        self._stream = _observation_stream(bench.robot, 0, bench.instruction)
        for _ in range(warmup):
            self.engine.run_cycle(next(self._stream))
        self.engine.reset_metrics()

    def step(self) -> CycleResult:
        return self.engine.run_cycle(next(self._stream))

    def run(self, frames: int) -> None:
        for _ in range(frames):
            self.step()

    def summary(self) -> dict:
        """The engine's summary of the frames since warm-up plus ``tokens_per_s_at_period``:
        tokens over the robot time of those frames, frames starting one control period apart (a
        frame that overruns delays the next): the steady-state throughput a robot sees."""
        summary = self.engine.metrics()
        period = self.config.action.control_period_s
        cycles = self.engine.metrics_records.cycles
        wall = sum(max(period, c.frame_latency_s) for c in cycles)
        summary["tokens_per_s_at_period"] = sum(c.generated_tokens for c in cycles) / wall
        return summary

    def close(self, summary: dict) -> dict:
        """Print the progress line, flush and close the engine; returns ``summary``."""
        _progress(self.config, summary)
        self.engine.flush()
        self.engine.close()
        return summary


def _progress(config: EngineConfig, summary: dict) -> None:
    tasks = "+".join(f"{t.name}:{t.max_new_tokens}" for t in config.language_tasks) or "action"
    print(f"[bench] {config.mode} {config.scheduling} k={config.decode_steps_per_cycle} {tasks}: "
          f"frame p50 {1e3 * summary['frame_latency_s']['p50']:.1f} ms", file=sys.stderr, flush=True)


class Bench:
    """Builds engines on one model (:func:`oxygen_ros.engine.factory.build_engine`) and runs the settings.

    Args:
        parts: the model, its engine processor and the robot (camera slots).
        frames: measured frames per setting; warmup: frames before measuring (at least enough for
            unified's batch to reach steady state).
        kv_budget_mb: KV pool budget of each engine [MiB] (the engine's ``kv_budget_mb``).
        cuda_graphs: the engine's ``cuda_graphs``.
    """

    def __init__(self, parts: ModelParts, frames: int, warmup: int, kv_budget_mb: float,
                 cuda_graphs: bool = True):
        self.parts = parts
        self.model, self.processor, self.robot = parts.model, parts.processor, parts.robot
        self.frames, self.warmup, self.kv_budget_mb = frames, warmup, kv_budget_mb
        self.cuda_graphs = cuda_graphs
        self.instruction = "pick up the red cube and put it in the bowl"

    def config(self, mode: str, tasks: list[dict], scheduling: str = "fixed_k", k: int = 1,
               period: float = 1e3) -> EngineConfig:
        """The engine configuration of one setting; ``period``: the control period [s] (the default,
        1000 s, never binds)."""
        return EngineConfig.from_dict({
            "mode": mode, "scheduling": scheduling, "decode_steps_per_cycle": k,
            "kv_budget_mb": self.kv_budget_mb, "camera_slots": list(self.robot.camera_slots),
            "action": {"prompt_template": ACTION_PROMPT, "control_rate_hz": 1.0 / period,
                       "num_denoise_steps": 10},
            "language_tasks": tasks, "max_batch_size": 256, "max_waiting": 256,
            "cuda_graphs": self.cuda_graphs})

    def run(self, config: EngineConfig, warmup: int | None = None, drain: int = 0) -> dict:
        """Warm up, run the measured frames; :meth:`Session.summary` of them, plus, with ``drain``
        > 0, ``window_tokens_per_s``: the tokens of the requests triggered by the measured frames
        over the robot time from the first measured frame's start to the end of the frame in which
        the last of them completed (up to ``drain`` more frames run, whose own requests are not
        counted), and ``window_drain_frames``; None if some request of the window did not complete
        within ``drain`` frames."""
        session = Session(self, config, self.warmup if warmup is None else warmup)
        period = config.action.control_period_s
        # Every task triggers on every frame in this benchmark.
        expected = self.frames * len(config.language_tasks)
        window: set[int] = set()
        finished, window_tokens, robot_time, drained = 0, 0, 0.0, 0
        for index in range(self.frames + drain):
            if index >= self.frames and finished == expected:
                break
            result = session.step()
            if index < self.frames:
                window.add(result.action.seq)
            robot_time += max(period, result.record.frame_latency_s)
            drained += index >= self.frames
            for event in result.text_events:
                if event.seq in window and event.final:
                    finished += 1
                    window_tokens += len(event.token_ids)
            if index == self.frames - 1:
                summary = session.summary()
        if drain:
            complete = finished == expected
            summary["window_tokens_per_s"] = window_tokens / robot_time if complete else None
            summary["window_drain_frames"] = drained if complete else None
        return session.close(summary)

    def interleaved(self, specs: list[tuple[EngineConfig, int]], rounds: int) -> list[dict]:
        """Summaries of several settings measured side by side: one :class:`Session` per
        ``(config, warmup)``, each warmed up, then ``rounds`` rounds in which every session runs
        its next chunk of the measured frames in turn. A machine whose speed drifts over minutes
        (other tenants, clocks) then slows every setting alike, and the ratios between them hold.
        """
        sessions = [Session(self, config, warmup) for config, warmup in specs]
        rounds = max(1, min(rounds, self.frames))
        chunks = [self.frames // rounds + (i < self.frames % rounds) for i in range(rounds)]
        for chunk in chunks:
            for session in sessions:
                session.run(chunk)
        return [session.close(session.summary()) for session in sessions]


def speech(n: int) -> dict:
    return {"name": "speech", "prompt_template": ACTION_PROMPT, "trigger": {"every_n_frames": 1},
            "max_new_tokens": n, "stop_token_ids": [], "admission": "wait", "max_wait_s": 1e9}


def memory(n: int) -> dict:
    return {"name": "memory", "prompt_template": LANGUAGE_PROMPT, "trigger": {"every_n_frames": 1},
            "max_new_tokens": n, "stop_token_ids": [], "kind": "memory", "admission": "wait",
            "max_wait_s": 1e9}


def decode_rows(processor, robot, runner: ModelRunner, manager: KVCacheManager, batch: int,
                shared_prefix: bool) -> list:
    """``batch`` decode rows (KV sequences of ``manager``) as a decode step meets them: each over a
    real prefix (every camera + the action prompt) followed by 0..29 decoded tokens (row ``i`` has
    ``i % 30``). ``shared_prefix``: all fork one prefix; otherwise each has its own observation's."""
    roots = []
    for obs in _observations(robot, 1 if shared_prefix else batch, 99, "describe the scene"):
        features = runner.encode(list(obs.images.values()))
        ids = processor.prompt_ids(ACTION_PROMPT, obs.instruction, obs.state)
        embeds = torch.cat([features.reshape(-1, features.shape[-1]), runner.embed_prompt(ids)])
        root = manager.new_sequence()
        manager.reserve([root], [embeds.shape[0]])
        runner.prefill([PrefillRow(root, embeds, embeds.shape[0])], logits=False)
        roots.append(root)
    seqs = [manager.fork(roots[i % len(roots)]) for i in range(batch)]
    for i, seq in enumerate(seqs):
        for _ in range(i % 30):
            manager.prepare_append(seq, 1)
            runner.decode_step([seq], [5])
    return seqs


def batch_scaling(model, processor, robot, kv_budget_mb: float, batch: int, repeats: int,
                  shared_prefix: bool = True, cuda_graphs: bool = True) -> dict:
    """Median seconds of one decode step for 1 and for ``batch`` requests over paged KV
    (``repeats`` steps of each, alternating).

    The requests hold a real prefix (every camera + the action prompt) and then ragged numbers of
    decoded tokens (0..29). ``shared_prefix``: they fork one prefix (the issue's protocol);
    otherwise each has its own observation's prefix, as in a cross-frame batch.
    """
    cfg = model.config
    pool = BlockPool(cfg.vlm_num_layers, cfg.num_kv_heads, cfg.head_dim, 16, int(kv_budget_mb * MIB),
                     dtype=model.dtype, device=model.device)
    manager = KVCacheManager(pool)
    runner = ModelRunner(model, processor, manager, cuda_graphs)
    seqs = decode_rows(processor, robot, runner, manager, batch, shared_prefix)
    # The two sizes alternate, so a machine whose speed drifts affects both alike.
    samples: dict[int, list[float]] = {1: [], batch: []}
    for _ in range(repeats):
        for size in samples:
            for seq in seqs[:size]:
                manager.prepare_append(seq, 1)
            t = time.perf_counter()
            runner.synchronized(runner.decode_step(seqs[:size], [5] * size))
            samples[size].append(time.perf_counter() - t)
    times = {size: float(np.median(values)) for size, values in samples.items()}
    return {"batch": batch, "shared_prefix": shared_prefix, "step_1_s": times[1],
            f"step_{batch}_s": times[batch], "ratio": times[batch] / times[1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oxygen-bench-engine", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="pi05_tiny", choices=sorted(PRESETS))
    parser.add_argument("--robot", default="libero", choices=sorted(ROBOTS),
                        help="camera slots and state/action dims")
    parser.add_argument("--action-horizon", type=int, default=None,
                        help="action horizon H (default the preset's; the paper's protocol uses 10)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=int, default=30, help="measured frames per setting")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up frames (unified adds N/k)")
    parser.add_argument("--n", type=int, nargs="+", default=[5, 10, 20, 30],
                        help="decode lengths N (the paper's N: each language task's max_new_tokens, no stop token)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 5, 10],
                        help="decode steps per frame (the paper's k: the engine's decode_steps_per_cycle; the "
                             "two-task mode uses 5 if listed, else the first)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="rounds in which the settings of one group take turns (chunks of frames)")
    parser.add_argument("--deadline-frames", type=int, default=60)
    parser.add_argument("--kv-budget-mb", type=float, default=256.0,
                        help="KV pool budget of each engine [MiB] (the engine's kv_budget_mb)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--tokenizer-path", default=None,
                        help="PaliGemma SentencePiece model for full presets, or 'tiny' for the offline "
                             "tiny tokenizer over the preset's vocabulary (timing with random weights)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on CUDA, replay vision, denoise and decode steps from CUDA graphs (the engine's cuda_graphs; "
                             "--no-cuda-graphs: eager)")
    parser.add_argument("--graph-backend", choices=["cuda", "direct"], default="cuda",
                        help="'direct': run the CUDA-graph path (batch and length buckets, static buffers, "
                             "replay selection) with direct calls instead of capture and replay, on any device "
                             "(the GPU path checked on the CPU; implies --cuda-graphs)")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="on the CPU: no native decode attention and no oneDNN-prepacked weights "
                             "(the plain torch / MKL paths, for A/B)")
    parser.add_argument("--out", default="bench-results/engine_bench.json")
    args = parser.parse_args(argv)
    if min(args.frames, args.rounds, args.deadline_frames, *args.n, *args.k) < 1:
        parser.error("--frames, --rounds, --deadline-frames, --n and --k must be >= 1")
    if args.warmup < 0 or args.threads < 0 or args.kv_budget_mb <= 0:
        parser.error("--warmup and --threads must be >= 0, --kv-budget-mb > 0")
    if args.action_horizon is not None and args.action_horizon < 1:
        parser.error("--action-horizon must be >= 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch ({torch.__version__}) has no CUDA device")
    horizon = {} if args.action_horizon is None else {"action_horizon": args.action_horizon}
    config = get_preset(args.preset, **horizon)
    # Check the tokenizer before building the model (a full preset takes a while to build).
    if args.tokenizer_path == "tiny":
        tokenizer = TinyTokenizer(config.vocab_size)
    elif args.tokenizer_path is not None and config.tokenizer == "tiny":
        parser.error(f"--tokenizer-path: preset {args.preset} uses its built-in tiny tokenizer; drop the option")
    else:
        try:
            tokenizer = load_tokenizer(config, args.tokenizer_path)
        except (ValueError, FileNotFoundError) as error:
            parser.error(f"--tokenizer-path: {error} (or --tokenizer-path tiny for timing with random weights)")
    if args.threads:
        torch.set_num_threads(args.threads)

    with cpu_kernel_choice(args.torch_kernels):
        return _run(args, config, tokenizer)


def _run(args: argparse.Namespace, config, tokenizer) -> int:
    """Every setting of :func:`main` with validated arguments; returns the exit status."""
    robot = get_robot(args.robot)
    parts = load_parts(args.preset, robot, tokenizer=tokenizer, action_horizon=config.action_horizon,
                       dtype=args.dtype, device=args.device)
    model, processor = parts.model, parts.processor
    if args.graph_backend == "direct":
        args.cuda_graphs = True
        model.enable_cuda_graphs(backend="direct")
    bench = Bench(parts, args.frames, args.warmup, args.kv_budget_mb, args.cuda_graphs)
    horizon = model.config.action_horizon
    results: dict = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                                 "torch": torch.__version__, "threads": torch.get_num_threads(),
                                 "device": args.device, "device_name": _device_name(model.device)},
                     "tokenizer": args.tokenizer_path or "preset",
                     "cuda_graphs": ("direct" if args.graph_backend == "direct"
                                     else args.cuda_graphs and model.device.type == "cuda"),
                     "cpu_kernels": cpu_kernels(model.device, model.config, args.torch_kernels),
                     "preset": args.preset, "dtype": args.dtype, "robot": args.robot,
                     "frames": args.frames, "horizon": horizon, "args": vars(args), "rows": []}
    out = Path(args.out)

    def save() -> None:
        # Written after every group too, so a run stopped by a time limit keeps what it measured.
        write_json(out, results)

    # One group of interleaved settings per N: the action task alone (P, V, D), isolated (d = one
    # decode step of one request), shared_prefix and unified for every k; bounds use the group's own
    # costs. The two-task mode is a group of its own.
    rows = results["rows"]
    groups = []
    for n in args.n:
        specs = [(bench.config("isolated", []), args.warmup),
                 (bench.config("isolated", [speech(n)]), args.warmup),
                 (bench.config("shared_prefix", [speech(n)]), args.warmup)]
        specs += [(bench.config("unified", [speech(n)], k=k), args.warmup + math.ceil(n / k))
                  for k in args.k]
        action, iso, shared, *unified = bench.interleaved(specs, args.rounds)
        costs = _costs(action, iso)
        groups.append(costs)
        print(f"[bench] N={n}: P = {1e3 * costs['P']:.1f} ms (vision {1e3 * costs['V']:.1f}), "
              f"D = {1e3 * costs['D']:.1f} ms, d = {1e3 * costs['d']:.2f} ms", file=sys.stderr, flush=True)
        rows.append(_row("isolated", n, None, iso, iso, horizon))
        rows.append(_row("shared_prefix", n, None, shared, iso, horizon))
        for k, uni in zip(args.k, unified):
            row = _row("unified", n, k, uni, iso, horizon)
            row["bound"] = (2 * costs["P"] + costs["D"] + n * costs["d"]) / \
                (costs["P"] + costs["D"] + k * costs["d"])
            row["pct_of_bound"] = 100.0 * row["speedup"] / row["bound"]
            row["paper"] = PAPER_K5.get(n) if k == 5 else None
            rows.append(row)
        save()

    # Two-task mode: speech (action prompt) + memory (language prompt), N tokens each, k = 5.
    n2, k2 = max(args.n), 5 if 5 in args.k else args.k[0]
    action2, iso2, uni2 = bench.interleaved(
        [(bench.config("isolated", []), args.warmup),
         (bench.config("isolated", [speech(n2), memory(n2)]), args.warmup),
         (bench.config("unified", [speech(n2), memory(n2)], k=k2), args.warmup + math.ceil(n2 / k2))],
        args.rounds)
    c2 = _costs(action2, iso2)
    two = _row("unified two-task", n2, k2, uni2, iso2, horizon)
    two["bound"] = (3 * c2["P"] + c2["D"] + 2 * n2 * c2["d"]) / \
        (c2["P"] + (c2["P"] - c2["V"]) + c2["D"] + k2 * c2["d"])
    two["pct_of_bound"] = 100.0 * two["speedup"] / two["bound"]
    rows.append(_row("isolated two-task", n2, None, iso2, iso2, horizon))
    rows.append(two)
    save()
    p_cost, v_cost, d_cost_denoise, d_cost = (float(np.median([g[key] for g in groups]))
                                              for key in ("P", "V", "D", "d"))

    # Deadline mode: a control period that isolated at the largest N misses on most cycles.
    n_max = max(args.n)
    period = 0.5 * ((p_cost + d_cost_denoise + d_cost) + (2 * p_cost + d_cost_denoise + n_max * d_cost))
    deadline_frames = Bench(parts, args.deadline_frames, args.warmup, bench.kv_budget_mb, bench.cuda_graphs)
    dl = deadline_frames.run(bench.config("unified", [speech(n_max)], scheduling="deadline",
                                          period=period), warmup=args.warmup + n_max, drain=2 * n_max)
    iso_dl = deadline_frames.run(bench.config("isolated", [speech(n_max)], period=period))
    k1 = deadline_frames.run(bench.config("unified", [speech(n_max)], k=1, period=period),
                             warmup=args.warmup + n_max, drain=2 * n_max)
    results["deadline"] = {"control_period_s": period, "N": n_max, "frames": args.deadline_frames,
                           "unified_misses": dl["deadline_misses"],
                           "isolated_misses": iso_dl["deadline_misses"],
                           "unified_tokens_per_s": dl["tokens_per_s"],
                           "unified_tokens_per_s_at_period": dl["tokens_per_s_at_period"],
                           "k1_tokens_per_s": k1["tokens_per_s"],
                           "k1_tokens_per_s_at_period": k1["tokens_per_s_at_period"],
                           "k1_misses": k1["deadline_misses"],
                           "unified_window_tokens_per_s": dl["window_tokens_per_s"],
                           "k1_window_tokens_per_s": k1["window_tokens_per_s"],
                           "unified_window_drain_frames": dl["window_drain_frames"],
                           "k1_window_drain_frames": k1["window_drain_frames"],
                           "unified_completion_p50_s": dl["completion_s"]["p50"],
                           "k1_completion_p50_s": k1["completion_s"]["p50"],
                           "unified_mean_decode_steps": dl["mean_decode_steps_per_frame"],
                           "summary": dl}

    results["batch_scaling"] = batch_scaling(model, processor, robot, bench.kv_budget_mb, 30, repeats=15,
                                             cuda_graphs=bench.cuda_graphs)
    results["batch_scaling_cross_frame"] = batch_scaling(model, processor, robot, bench.kv_budget_mb, 30,
                                                         repeats=15, shared_prefix=False,
                                                         cuda_graphs=bench.cuda_graphs)
    results["costs_s"] = {"P": p_cost, "V": v_cost, "D": d_cost_denoise, "d": d_cost}
    results["costs_s_per_group"] = {**{f"N={n}": g for n, g in zip(args.n, groups)}, "two-task": c2}
    results["paper"] = {"best": PAPER_BEST, "k5": PAPER_K5, "gpu": "RTX 4090"}

    graphs = model.cuda_graphs
    if results["cuda_graphs"] and graphs is not None:
        results["graphs"] = {"captures": graphs.captures, "replays": graphs.replays,
                             "evictions": graphs.evictions, "failures": graphs.failures,
                             "keys": [list(key) for key in graphs.keys()]}
    _print(results)
    save()
    print(f"\nJSON written to {out}")
    return 0


def _costs(action: dict, isolated: dict) -> dict:
    """P (vision + prefill), V (vision), D (denoising) from the action-only setting's per-phase
    medians; d (one decode step of one request) from an isolated setting's per-frame decode time
    over its steps per frame."""
    phases = action["phase_p50_s"]
    steps = max(1.0, isolated["mean_decode_steps_per_frame"] or 0.0)
    return {"P": phases["encode_s"] + phases["prefill_s"], "V": phases["encode_s"],
            "D": phases["denoise_s"], "d": isolated["phase_p50_s"]["decode_s"] / steps}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _row(setting: str, n: int, k: int | None, summary: dict, isolated: dict, horizon: int) -> dict:
    """One table row; latency, action rate (H / latency) and speedup from per-frame medians."""
    latency = summary["frame_latency_s"]["p50"]
    return {"setting": setting, "N": n, "k": k, "frame_latency_s": latency,
            "frame_latency_mean_s": summary["frame_latency_s"]["mean"],
            "action_rate_hz": horizon / latency,
            "tokens_per_s": summary["tokens_per_s"],
            "speedup": isolated["frame_latency_s"]["p50"] / latency,
            "bound": None, "pct_of_bound": None, "paper": None,
            "mean_batch": summary["mean_batch_size"], "ttft_p50_s": summary["ttft_s"]["p50"],
            "vision_calls_per_frame": summary["vision_calls_per_frame"],
            "prefilled_tokens_per_frame": summary["prefilled_tokens_per_frame"],
            "peak_pool_mib": summary["peak_pool_bytes"] / 2**20,
            "deadline_misses": summary["deadline_misses"]}


# The table of the rows (per-frame medians; means in the JSON).
COLUMNS = [
    Column("setting", 18, lambda r: r["setting"], "<"),
    Column("N", 4, lambda r: str(r["N"])),
    Column("k", 4, lambda r: fmt(r["k"], "d")),
    Column("frame ms", 10, lambda r: f"{1e3 * r['frame_latency_s']:.1f}"),
    Column("act Hz", 9, lambda r: f"{r['action_rate_hz']:.1f}"),
    Column("tok/s", 9, lambda r: fmt(r["tokens_per_s"], ".0f")),
    Column("speedup", 9, lambda r: f"{r['speedup']:.2f}x"),
    Column("bound", 8, lambda r: fmt(r["bound"], ".2f")),
    Column("%bound", 8, lambda r: fmt(r["pct_of_bound"], ".0f")),
    Column("paper", 7, lambda r: fmt(r["paper"], ".2f")),
    Column("batch", 7, lambda r: fmt(r["mean_batch"], ".1f")),
    Column("vis/fr", 7, lambda r: f"{r['vision_calls_per_frame']:.1f}"),
    Column("pref tok", 9, lambda r: f"{r['prefilled_tokens_per_frame']:.0f}"),
    Column("pool MiB", 9, lambda r: f"{r['peak_pool_mib']:.2f}"),
]


def _graphs_note(results: dict) -> str:
    """The header's note on the graph path: off, CUDA graphs, or direct calls (with the counters)."""
    mode = results.get("cuda_graphs")
    if not mode:
        return ""
    name = "graph path with direct calls" if mode == "direct" else "CUDA graphs"
    counts = results.get("graphs")
    if counts is None:
        return f", {name} (vision, denoise, decode)"
    return (f", {name} (vision, denoise, decode: {counts['captures']} captured, {counts['replays']} replays, "
            f"{counts['evictions']} evicted, {counts['failures']} failed)")


def _print(results: dict) -> None:
    c = results["costs_s"]
    print(f"preset {results['preset']} ({results['dtype']}), robot {results['robot']}, "
          f"{results['frames']} frames/setting, H={results['horizon']}, "
          f"{results['machine']['threads']} threads on {results['machine']['device']} "
          f"({results['machine']['device_name']}), tokenizer {results['tokenizer']}"
          f"{_graphs_note(results)}"
          f"{', ' + results['cpu_kernels'] if results.get('cpu_kernels') else ''}")
    print(f"P = {1e3 * c['P']:.1f} ms (vision {1e3 * c['V']:.1f}), D = {1e3 * c['D']:.1f} ms, "
          f"d = {1e3 * c['d']:.2f} ms")
    print("frame ms / act Hz / speedup: per-frame medians (means in the JSON)")
    print_table(COLUMNS, results["rows"])
    d = results["deadline"]
    print(f"\ndeadline mode: period {1e3 * d['control_period_s']:.1f} ms, N={d['N']}, "
          f"{d['frames']} frames: misses unified {d['unified_misses']}, isolated "
          f"{d['isolated_misses']}, unified k=1 {d['k1_misses']}; decode steps/frame "
          f"{fmt(d['unified_mean_decode_steps'], '.1f')}")
    print(f"  tokens/s at the control period: deadline {fmt(d['unified_tokens_per_s_at_period'], '.0f')}"
          f" vs k=1 {fmt(d['k1_tokens_per_s_at_period'], '.0f')} (per busy second: "
          f"{fmt(d['unified_tokens_per_s'], '.0f')} vs {fmt(d['k1_tokens_per_s'], '.0f')}); "
          f"completion p50 {fmt(d['unified_completion_p50_s'], '.3f')} s vs "
          f"{fmt(d['k1_completion_p50_s'], '.3f')} s")
    print(f"  tokens/s of the window's {d['frames']} requests until the last completes: deadline "
          f"{fmt(d['unified_window_tokens_per_s'], '.0f')} ({fmt(d['unified_window_drain_frames'], 'd')} "
          f"drain frames) vs k=1 {fmt(d['k1_window_tokens_per_s'], '.0f')} "
          f"({fmt(d['k1_window_drain_frames'], 'd')})")
    for key, label in (("batch_scaling", "one shared prefix"),
                       ("batch_scaling_cross_frame", "a prefix per request")):
        b = results[key]
        step_b = b["step_{}_s".format(b["batch"])]
        print(f"batch scaling ({label}): decode step x1 {1e3 * b['step_1_s']:.2f} ms, "
              f"x{b['batch']} {1e3 * step_b:.2f} ms, ratio {b['ratio']:.2f} (target <= 2)")
    print(f"paper (RTX 4090): best {PAPER_BEST}x; k=5: " +
          ", ".join(f"N={n}: {s}x" for n, s in PAPER_K5.items()))


if __name__ == "__main__":
    raise SystemExit(main())
