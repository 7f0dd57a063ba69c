"""CPU decode-step A/B: the torch paths against the native decode attention in every build this CPU
can execute, interleaved step by step in one process.

Two measurements, each a median over ``--rounds`` rounds (after one warm-up round) in which every
setting takes one turn (so a machine whose speed drifts slows all settings alike):

* **decode step**: one decode step of 1 request and of ``--batch`` requests over the engine's paged
  KV cache (:class:`oxygen_ros.engine.model_runner.ModelRunner`), as in the engine bench's batch
  scaling: the requests hold a real prefix (every camera of the robot + the action prompt) and then
  ragged numbers of decoded tokens (0..29); either one prefix they all fork (``shared``) or one per
  request, from different observations (``per-request``). Each step appends a token to its
  requests, so the rows grow by a few hundred tokens over a run, for every setting alike. ``--sizes``
  adds batch sizes between 1 and ``--batch``; from all sizes the table gives the cost of one more
  request in the step (the least-squares slope of step time over batch size, ms) and the rate of that
  added work (its FLOP from :func:`oxygen_ros.bench.roofline.count_decode`: the request's row through
  every product, its attention over its keys, its LM-head row), the figure that decides the ×batch /
  ×1 ratio: ``ratio = 1 + (batch - 1) · slope / step_1``.
* **attention**: the attention of one layer of the batched step alone (``gemma.attention`` on
  random fp32 q/K/V of the preset's shapes, every key visible, ``--keys`` keys per row), the part the
  native kernel replaces.

Settings: ``torch`` (no native attention, no oneDNN-packed weights: the engine bench's
``--torch-kernels``), and ``native <variant>`` for each of :func:`oxygen_ros.models.native.variants`
(native attention of that build + packed weights, the default fast paths). Run
``python -m oxygen_ros.bench.kernel_bench`` (``--rounds 2 --batch 3`` for a smoke run); prints a
table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from oxygen_ros.bench.cpu_paths import cpu_kernel_choice
from oxygen_ros.engine import BlockPool, KVCacheManager
from oxygen_ros.engine.model_runner import ModelRunner
from oxygen_ros.engine.model_io import ProcessorIO
from oxygen_ros.models import PRESETS, ROBOTS, cpu_fast_paths, get_preset, get_robot, load_model, load_tokenizer, native
from oxygen_ros.models.gemma import attention
from oxygen_ros.models.processing import Processor
from oxygen_ros.bench.engine_bench import decode_rows
from oxygen_ros.bench.roofline import count_decode


def settings() -> list[str]:
    """``torch`` and ``native <variant>`` for each build this CPU can execute (best first)."""
    return ["torch"] + [f"native {name}" for name in native.variants()]


def _apply(setting: str) -> None:
    """Switch this process to ``setting`` (see :func:`settings`)."""
    cpu_fast_paths.use_packed_weights(setting != "torch")
    cpu_fast_paths.use_native_attention(setting != "torch")
    native.select(None if setting == "torch" else setting.split()[1])


def slope(sizes: list[int], seconds: list[float]) -> float:
    """Least-squares slope of ``seconds`` over ``sizes`` (seconds per added request); needs two
    distinct sizes.

    Raises:
        ValueError: fewer than two distinct sizes, or lists of different lengths.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(f"slope needs two distinct sizes with a time each, got {sizes} and {len(seconds)} times")
    mx, my = statistics.fmean(sizes), statistics.fmean(seconds)
    return sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sum((x - mx) ** 2 for x in sizes)


def run(preset: str, robot_name: str, batch: int, rounds: int, keys: int, kv_budget_mb: float,
        sizes: tuple[int, ...] = ()) -> dict:
    """Every measurement of the module docstring; seconds (medians) per setting. ``sizes``: batch
    sizes measured besides 1 and ``batch``."""
    config = get_preset(preset)
    model = load_model(config, dtype="float32", device="cpu")
    robot = get_robot(robot_name)
    processor = ProcessorIO(Processor(model.config, robot, load_tokenizer(config, None)))
    names = settings()
    for name in names[1:]:
        if not native.load(name.split()[1]):
            raise RuntimeError(f"{name}: {native.status(name.split()[1])}")
    cfg = model.config
    steps = sorted({1, batch, *sizes})
    results: dict = {"settings": names, "sizes": steps, "step": {}, "attention": {}}
    with cpu_kernel_choice(False):
        try:
            for label, shared in (("shared", True), ("per-request", False)):
                pool = BlockPool(cfg.vlm_num_layers, cfg.num_kv_heads, cfg.head_dim, 16, int(kv_budget_mb * 2**20),
                                 dtype=model.dtype, device=model.device)
                manager = KVCacheManager(pool)
                runner = ModelRunner(model, processor, manager, cuda_graphs=False)
                seqs = decode_rows(processor, robot, runner, manager, batch, shared)
                start_keys = statistics.fmean(seq.num_tokens for seq in seqs)
                samples = {(name, size): [] for name in names for size in steps}
                for round_ in range(rounds + 1):   # round 0 warms up (first calls, packing)
                    for name in names:
                        _apply(name)
                        for size in steps:
                            for seq in seqs[:size]:
                                manager.prepare_append(seq, 1)
                            start = time.perf_counter()
                            runner.decode_step(seqs[:size], [5] * size)
                            if round_:
                                samples[(name, size)].append(time.perf_counter() - start)
                # The added request's FLOP at the rows' mean length over the run (each step appended a token).
                mean_keys = round((start_keys + statistics.fmean(seq.num_tokens for seq in seqs)) / 2)
                added = count_decode(cfg, 2, mean_keys, 4).flop - count_decode(cfg, 1, mean_keys, 4).flop
                results["step"][label] = {}
                for name in names:
                    medians = {f"step_{size}_s": statistics.median(samples[(name, size)]) for size in steps}
                    per_request = slope(steps, list(medians.values()))
                    results["step"][label][name] = {**medians, "added_request_s": per_request,
                                                    "added_request_flop": added,
                                                    "added_request_flop_per_s": added / per_request if per_request > 0 else None}
                for seq in seqs:
                    manager.free(seq)
            g = torch.Generator().manual_seed(0)
            hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
            q = torch.randn(batch, 1, heads, hd, generator=g)
            k = torch.randn(batch, keys, kv_heads, hd, generator=g)
            v = torch.randn(batch, keys, kv_heads, hd, generator=g)
            mask = torch.ones(batch, 1, keys, dtype=torch.bool)
            samples = {name: [] for name in names}
            with torch.inference_mode():
                for round_ in range(rounds + 1):
                    for name in names:
                        _apply(name)
                        start = time.perf_counter()
                        attention(q, k, v, mask)
                        if round_:
                            samples[name].append(time.perf_counter() - start)
            results["attention"] = {"batch": batch, "keys": keys, "kv_mb": 2 * k.numel() * 4 / 1e6,
                                    **{name: statistics.median(s) for name, s in samples.items()}}
        finally:   # cpu_kernel_choice restores the two switches
            native.select(None)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.kernel_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="pi05_tiny", choices=sorted(PRESETS))
    parser.add_argument("--robot", default="libero", choices=sorted(ROBOTS))
    parser.add_argument("--batch", type=int, default=30, help="requests in the batched step")
    parser.add_argument("--sizes", type=int, nargs="*", default=[],
                        help="more batch sizes to time, between 1 and --batch (the added request's cost is the "
                             "slope over every size)")
    parser.add_argument("--rounds", type=int, default=20, help="turns of every setting (medians over them)")
    parser.add_argument("--keys", type=int, default=800, help="keys per row in the attention-only part")
    parser.add_argument("--kv-budget-mb", type=float, default=256.0,
                        help="KV pool budget [MiB] (the engine's kv_budget_mb)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--out", default="bench-results/kernel_bench.json")
    args = parser.parse_args(argv)
    if min(args.batch, args.rounds, args.keys) < 1 or args.threads < 0 or args.kv_budget_mb <= 0:
        parser.error("--batch, --rounds and --keys must be >= 1, --threads >= 0, --kv-budget-mb > 0")
    if args.batch < 2 or any(not 1 <= size <= args.batch for size in args.sizes):
        parser.error("--batch must be >= 2 and every --sizes value in [1, --batch]")
    if get_preset(args.preset).tokenizer != "tiny":
        parser.error(f"--preset {args.preset}: this bench runs the tiny presets (built-in tokenizer)")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(args.preset, args.robot, args.batch, args.rounds, args.keys, args.kv_budget_mb, tuple(args.sizes))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    results.update(preset=args.preset, robot=args.robot, batch=args.batch, rounds=args.rounds,
                   machine={"platform": platform.platform(), "processor": platform.processor(),
                            "torch": torch.__version__, "threads": torch.get_num_threads(),
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "load_average_after": load})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    _print(results)
    print(f"\nJSON written to {out}")
    return 0


def _print(results: dict) -> None:
    m, batch = results["machine"], results["batch"]
    print(f"preset {results['preset']} (float32), robot {results['robot']}, {m['threads']} threads, "
          f"{m['processor'] or platform.machine()} ({m['cpu_capability']}), torch {m['torch']}, "
          f"{results['rounds']} interleaved rounds, load average after {m['load_average_after']}")
    names = results["settings"]
    print(f"\n| decode step, ms | {' | '.join(names)} |")
    print("|---" * (len(names) + 1) + "|")
    for label, per in results["step"].items():
        for size in results["sizes"]:
            cells = " | ".join(f"{1e3 * per[n][f'step_{size}_s']:.2f}" for n in names)
            print(f"| {size} request(s), {label} prefix | {cells} |")
        ratios = " | ".join(f"{per[n][f'step_{batch}_s'] / per[n]['step_1_s']:.2f}x" for n in names)
        print(f"| {batch}-row / 1-row, {label} prefix | {ratios} |")
        added = " | ".join(f"{1e3 * per[n]['added_request_s']:.3f}" for n in names)
        print(f"| one more request (slope), ms, {label} prefix | {added} |")
        rates = " | ".join("-" if per[n]["added_request_flop_per_s"] is None
                           else f"{per[n]['added_request_flop_per_s'] / 1e9:.1f}" for n in names)
        flop = per[names[0]]["added_request_flop"] / 1e6
        print(f"| its work ({flop:.1f} MFLOP), GFLOP/s, {label} prefix | {rates} |")
    att = results["attention"]
    cells = " | ".join(f"{1e3 * att[n]:.2f}" for n in names)
    print(f"| attention of one layer, {att['batch']} rows x {att['keys']} keys ({att['kv_mb']:.1f} MB K/V) "
          f"| {cells} |")


if __name__ == "__main__":
    raise SystemExit(main())
