"""Engine frames under each intra-op thread setting, idle and beside a CPU hog, interleaved in one run.

``python -m oxygen_ros.bench.threads_bench [--preset pi05_tiny] [--settings 0 1 2] [--rounds 4] [--frames 6]``

One engine per ``intra_op_threads`` setting (0 = follow the machine, ``oxygen_ros/engine/threads.py``; n =
n threads), all on one model, each fed its own observation stream (libero's cameras, a speech request of
``--tokens`` tokens per frame, ``fixed_k`` with k = 1, S = 10). Each round runs a block of ``--frames``
frames idle, then a block beside a hog (one process spinning on one core; ``--no-hog``: idle blocks only);
within a block the settings take turns frame by frame, so load drift hits them alike. Every engine sets
torch's thread count back to its own at its cycle's start. The hog is paused (SIGSTOP) between its
blocks and ended at the end of the run.

Printed per condition and setting: frame wall time p50 / p90 (ms) over the measured frames and, for the
automatic setting, the thread counts it ran with. The first ``--warmup`` frames of each engine are not
measured. ``--out`` writes the raw per-frame records as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from oxygen_ros.bench.engine_bench import Bench, Session, speech
from oxygen_ros.engine.factory import load_parts
from oxygen_ros.models import PRESETS, get_robot


def _hog() -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.threads_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pi05_tiny", choices=sorted(PRESETS))
    parser.add_argument("--robot", default="libero")
    parser.add_argument("--settings", type=int, nargs="+", default=[0, 1, 2],
                        help="intra_op_threads values to compare (0 = follow the machine)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--frames", type=int, default=6, help="frames per setting per block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=5, help="speech tokens per frame's request")
    parser.add_argument("--no-hog", action="store_true", help="idle blocks only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if min(args.rounds, args.frames, args.tokens) < 1 or args.warmup < 0 or min(args.settings) < 0:
        parser.error("--rounds, --frames and --tokens must be >= 1, --warmup and --settings >= 0")
    robot = get_robot(args.robot)
    parts = load_parts(args.preset, robot)
    bench = Bench(parts, frames=0, warmup=args.warmup, kv_budget_mb=32)
    config = bench.config("unified", [speech(args.tokens)])
    sessions = {s: Session(bench, dataclasses.replace(config, intra_op_threads=s), args.warmup) for s in args.settings}
    conditions = ["idle"] if args.no_hog else ["idle", "hog"]
    records: list[dict] = []
    load_before = os.getloadavg()
    hog = None if args.no_hog else _hog()
    try:
        if hog is not None:
            hog.send_signal(signal.SIGSTOP)
        for round_ in range(args.rounds):
            for condition in conditions:
                if hog is not None:
                    hog.send_signal(signal.SIGCONT if condition == "hog" else signal.SIGSTOP)
                for frame in range(args.frames):
                    for setting, session in sessions.items():
                        start = time.perf_counter()
                        session.step()
                        records.append({"round": round_, "condition": condition, "setting": setting, "frame": frame,
                                        "seconds": time.perf_counter() - start,
                                        "threads": session.engine._core.threads.threads})
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    result = {"preset": args.preset, "robot": args.robot, "cpus": os.cpu_count(), "torch": torch.__version__,
              "hog_pid": None if hog is None else hog.pid,
              "load_before": load_before, "load_after": os.getloadavg(), "args": vars(args), "records": records}
    print(f"{args.preset}, {args.robot}, speech {args.tokens} tokens/frame, {args.rounds} rounds x {args.frames} "
          f"frames per block; load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.2f}' for x in result['load_after'])}")
    print(f"{'condition':<10}{'setting':<10}{'p50 ms':>9}{'p90 ms':>9}  threads used")
    for condition in conditions:
        for setting in args.settings:
            rows = [r for r in records if r["condition"] == condition and r["setting"] == setting]
            seconds = [r["seconds"] for r in rows]
            used = {t: sum(1 for r in rows if r["threads"] == t) for t in sorted({r["threads"] for r in rows})}
            label = "auto" if setting == 0 else str(setting)
            print(f"{condition:<10}{label:<10}{1e3 * statistics.median(seconds):>9.1f}"
                  f"{1e3 * _percentile(seconds, 0.9):>9.1f}  {used}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    for session in sessions.values():
        session.engine.close()
    return result


if __name__ == "__main__":
    main()
