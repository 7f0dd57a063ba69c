"""Closed-loop evaluation of the demo policy in the simulator: ``python -m oxygen_ros.tools.evaluate``.

The command line (``--help``; ``make eval-demo``): runs the chosen conditions, writes ``eval.json``, ``eval.md``
and the contact sheets, and prints the table; ``--worker MODE SPEC`` runs a robot child process instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import yaml

from oxygen_ros.demo_task import INSTRUCTION, SUBTASKS
from oxygen_ros.tools import demo_data
from oxygen_ros.tools.evaluate.conditions import CHUNKING, CONDITIONS, NODE_NAME, node_parameters, plan_runs
from oxygen_ros.tools.evaluate.episode import EPISODE_STEPS
from oxygen_ros.tools.evaluate.node_runs import run_node_condition
from oxygen_ros.tools.evaluate.report import contact_sheet, markdown_table
from oxygen_ros.tools.evaluate.scoring import score_episode, summarise
from oxygen_ros.tools.evaluate.sync import run_sync_condition
from oxygen_ros.tools.evaluate.workers import lockstep_worker, realtime_worker


def evaluate(args) -> dict:
    """Run the selected conditions; writes ``eval.json``, ``eval.md`` and the contact sheets under
    ``args.out``; returns the content of ``eval.json``."""
    # Absolute: the robot's child process runs in a directory of its own and writes its record here.
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.start_seed, args.start_seed + args.episodes))
    checkpoint = args.checkpoint or ""
    summaries = []

    def log(message: str) -> None:
        print(message, flush=True)

    runs = plan_runs(args)
    for condition in args.conditions:
        group = [run for run in runs if run.condition == condition]
        params = node_parameters(condition, args, checkpoint)
        for run in group:
            (out_dir / f"node_params_{run.name.replace('/', '_')}.yaml").write_text(yaml.safe_dump(
                {f"/**/{NODE_NAME}": {"ros__parameters": {**params, **run.params}}}, sort_keys=False))
        wall = time.perf_counter()
        if condition.startswith("node-"):     # one node, the runs interleaved seed by seed
            records = run_node_condition(condition, params, seeds, args, out_dir, log, group)
        else:
            records = {run.name: run_sync_condition(condition, {**params, **run.params}, seeds, args, out_dir, log, run)
                       for run in group}
        wall = round(time.perf_counter() - wall, 1)
        for run in group:
            name = run.name
            episodes = []
            (out_dir / name).mkdir(parents=True, exist_ok=True)
            for record in records[name]:
                # the whole record (phase flags per step, observations with their ground truth, speech, memory,
                # latencies, seams) next to its contact sheet
                (out_dir / name / f"episode_{record['seed']}.json").write_text(
                    json.dumps({k: v for k, v in record.items() if k != "sheet"}))
                score = score_episode(record)
                score["contact_sheet"] = str(contact_sheet(record, name,
                                                           out_dir / name / f"episode_{record['seed']}.png"))
                episodes.append(score)
            summary = summarise(name, episodes)
            # condition_wall_s: the wall time of the condition's runs together (interleaved for the node's)
            summary.update(chunking=run.chunking, delay_steps=run.delay_steps, execute_steps=run.execute_steps,
                           ensemble_m=run.ensemble_m, condition_wall_s=wall)
            summaries.append(summary)
    result = {"checkpoint": checkpoint, "preset": args.preset, "seeds": seeds, "execute_steps": args.execute_steps,
              "ensemble_m": args.ensemble, "chunking": args.chunking, "delays": args.delays,
              "max_steps": args.max_steps, "instruction": INSTRUCTION, "subtasks": list(SUBTASKS),
              "conditions": summaries, "table": markdown_table(summaries)}
    (out_dir / "eval.json").write_text(json.dumps(result, indent=2))
    (out_dir / "eval.md").write_text(result["table"] + "\n")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.tools.evaluate", description=__doc__.split("\n")[0])
    from oxygen_ros.assets import demo_policy_dir

    parser.add_argument("--checkpoint", default=str(demo_policy_dir()),
                        help="checkpoint directory (default: the shipped demo policy, oxygen_ros/assets/demo_policy; "
                             "runs/train-demo/checkpoint after make train-demo; empty: random weights)")
    parser.add_argument("--preset", default="pi05_demo", help="model preset (default pi05_demo)")
    parser.add_argument("--conditions", default=",".join(CONDITIONS),
                        help=f"comma-separated subset of {','.join(CONDITIONS)} (default all)")
    parser.add_argument("--episodes", type=int, default=20, help="episodes per condition (default 20)")
    parser.add_argument("--start-seed", type=int, default=1000,
                        help="cube seed of the first episode (default 1000; training uses 0..99)")
    parser.add_argument("--max-steps", type=int, default=EPISODE_STEPS,
                        help=f"control steps of 20 ms per episode (default {EPISODE_STEPS}: 10.6 s)")
    parser.add_argument("--execute-steps", type=int, default=10,
                        help="lockstep: actions executed per chunk (execution horizon; default 10 = 0.2 s)")
    parser.add_argument("--ensemble", type=float, default=0.0, metavar="M",
                        help="temporal ensembling of overlapping chunks at execution, ACT's weights exp(-M*i) "
                             "(i: a chunk's age in control steps, 0 the oldest; ACT: 0.01); 0 (default): off, "
                             "the newest chunk wins. Every condition but expert (node-realtime: the robot's "
                             "temporal_ensemble_m)")
    parser.add_argument("--chunking", default=None,
                        help="comma-separated execution schemes, each a run of every condition: newest (the newest "
                             "chunk wins), ensemble (temporal ensembling, m = --ensemble or ACT's 0.01), rtc "
                             "(real-time chunking in the engine); default: newest, or ensemble with --ensemble")
    parser.add_argument("--delays", default="0",
                        help="sync, random, expert: comma-separated injected inference delays d [control steps]: the "
                             "robot executes d more steps of the old chunk after each observation (the RTC paper's "
                             "simulated delay); each d is a run, executing max(--execute-steps, d) steps per chunk "
                             "(default 0)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/eval-<timestamp>)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--language-every", type=int, default=1,
                        help="lockstep: a speech and a memory request every N-th frame (default 1)")
    parser.add_argument("--poll-rate", type=float, default=20.0,
                        help="node-lockstep: the node's control_rate_hz, how often it looks for a new complete "
                             "observation [Hz] (default 20)")
    parser.add_argument("--chunk-timeout", type=float, default=120.0,
                        help="node-lockstep: wall seconds to wait for a chunk before the episode is aborted (default 120)")
    parser.add_argument("--resend", type=float, default=5.0,
                        help="node-lockstep: resend the clock and inputs after this many wall seconds without "
                             "a chunk (default 5)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="wall seconds for the node to become active (default 300)")
    parser.add_argument("--control-rate", type=float, default=3.0, help="node-realtime: chunks per second (default 3; the demo runs 4)")
    parser.add_argument("--camera-rate", type=float, default=None,
                        help="node-realtime: images/s per camera (default: the demo's, 3 / the number of cameras "
                             "the policy sees)")
    parser.add_argument("--staleness", type=float, default=1.5, help="node-realtime: staleness limit [s] (default 1.5, the demo's)")
    parser.add_argument("--speech-every", type=float, default=1.0, help="node-realtime: an utterance every N s (default 1)")
    parser.add_argument("--memory-every", type=float, default=1.0, help="node-realtime: a memory entry every N s (default 1; the demo: 2)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="any oxygen node parameter for every condition (repeatable), e.g. "
                             "--param speech.prompt_template:='...'")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    chosen = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CONDITIONS))
    # Always in CONDITIONS order: node-lockstep after node-realtime in one process got no /clock (every
    # cycle skipped clock_not_started; seen twice, cause not found), node-realtime after node-lockstep works.
    args.conditions = [c for c in CONDITIONS if c in chosen]
    if unknown or not args.conditions:
        parser.error((f"unknown conditions {unknown}" if unknown else "no condition given")
                     + f"; choose from {', '.join(CONDITIONS)}")
    for name in ("episodes", "max_steps", "execute_steps", "language_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    problem = demo_data.seed_range_problem("--start-seed", args.start_seed, args.episodes)
    if problem:
        parser.error(problem)
    if not math.isfinite(args.ensemble):
        parser.error("--ensemble must be finite")
    args.chunking = [c.strip() for c in (args.chunking or ("ensemble" if args.ensemble else "newest")).split(",")
                     if c.strip()]
    if not args.chunking or sorted(set(args.chunking) - set(CHUNKING)):
        parser.error(f"--chunking: choose from {', '.join(CHUNKING)}, got {args.chunking}")
    try:
        args.delays = sorted({int(d) for d in args.delays.split(",") if d.strip()})
    except ValueError:
        parser.error(f"--delays must be integers, got {args.delays!r}")
    if not args.delays or args.delays[0] < 0:
        parser.error(f"--delays must be >= 0 control steps, got {args.delays}")
    if args.camera_rate is not None and not args.camera_rate > 0:
        parser.error(f"--camera-rate must be > 0 Hz, got {args.camera_rate}")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        needs = [c for c in args.conditions if c != "expert"]
        if needs:
            parser.error(f"no checkpoint directory {args.checkpoint} (conditions {needs} need one; "
                         "--checkpoint '' runs random weights)")
    if args.out is None:
        args.out = Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation and print the table (or run a robot child process: ``--worker``)."""
    args = parse_args(argv)
    if args.worker:
        mode, spec = args.worker
        return (lockstep_worker if mode == "lockstep" else realtime_worker)(json.loads(spec))
    # The run keeps to itself on DDS unless ROS_DOMAIN_ID is set (children inherit it).
    os.environ.setdefault("ROS_DOMAIN_ID", str(150 + os.getpid() % 80))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"evaluate: cannot create the output directory {args.out}: {error.strerror}") from None
    result = evaluate(args)
    print(result["table"])
    print(f"wrote {Path(args.out) / 'eval.json'}, {Path(args.out) / 'eval.md'} and the contact sheets")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
