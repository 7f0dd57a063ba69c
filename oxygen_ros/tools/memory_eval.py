"""``make eval-memory``: the demo's questions answered through the node's ``~/ask`` with and without ``{memory}``
(docs/memory.md, "Measured: answers with and without memory").

1. **The question set** (:mod:`oxygen_ros.demo_task.questions`): from a recorded run of the demo — the closed-loop
   evaluation's real-time episodes (``python -m oxygen_ros.tools.evaluate --conditions node-realtime ...``: the
   node with the shipped demo policy over DDS, its memory entries as published, and the simulator's caption of the
   scene every 20 ms on the same clock) — with ``--record DIR``; written to ``--questions`` (default the shipped
   set, ``oxygen_ros/demo_task/demo_questions.json``: the episodes' memory entries, their ground truth and the
   questions). Without ``--record`` the shipped set is read.
2. **The answers**: the oxygen node in this process serves ``--checkpoint`` (default ``runs/train-qa/checkpoint``,
   ``make train-qa``), the simulated robot runs beside it in a child process with the cube at seed
   ``--scene-seed`` (a scene none of the episodes had; it executes no action: the node's chunks go to a topic
   nobody reads), so the camera frames never show what a question asks. The node's store (``memory.store.path``)
   holds one episode's entries at a time, moved in time to end when they are loaded (the questions are asked just
   after their episode, as its user would; times in the lines and answers are ages at the time of asking, the
   goal result's ``memory_stamp``), and every question is asked over DDS as an ``~/ask`` goal (task ``speech``,
   ``memory_k`` ``--memory-k``) twice: with
   :data:`~oxygen_ros.demo_task.questions.PROMPT_WITH_MEMORY` and with
   :data:`~oxygen_ros.demo_task.questions.PROMPT_WITHOUT_MEMORY`.
3. **Scores**: answer accuracy per condition and question type (95 % Wilson intervals), the paired difference
   (95 % bootstrap interval over questions), the best constant answer (per type the answer most of the set's
   questions have: what a memoryless answer could at best get without seeing the episode), and the retrieval's precision at 1 and at ``--memory-k`` (the
   retrieved entries against those whose ground truth bears on the answer; ``recall`` on the same store, its
   ``--memory-k`` set checked against the goal's ``memory_entry_ids``), and the retrieved lines read by the QA
   training's rule (:func:`oxygen_ros.demo_task.questions.answer_from_lines`): what a perfect reader of those
   captions would answer, and how often the model's answer is that one. Written to ``<out>/memory_eval.json`` and
   ``<out>/memory_eval.md``.

Command line: ``python -m oxygen_ros.tools.memory_eval [--record DIR] [--checkpoint DIR] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from pathlib import Path

from oxygen_ros.demo_task import questions as qs

NODE_NAME = "oxygen_node"
SHIPPED_QUESTIONS = Path(__file__).resolve().parents[1] / "demo_task" / "demo_questions.json"
SCENE_SEED = 6000
ANSWER_TOKENS = 16


# ---------------------------------------------------------------------------------------------------
# the question set


def episodes_of_record(record_dir: Path) -> list[dict]:
    """The episodes of an evaluation's output directory (``**/episode_<seed>.json`` of the ``node-realtime``
    condition): per episode its seed, memory entries ``(id, stamp, caption)`` and simulator samples.

    Raises:
        FileNotFoundError: no episode record under ``record_dir``.
    """
    files = sorted(record_dir.rglob("episode_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    if not files:
        raise FileNotFoundError(f"no episode_<seed>.json under {record_dir} (run the evaluation's node-realtime "
                                "condition into it: docs/memory.md)")
    episodes = []
    for path in files:
        record = json.loads(path.read_text())
        seed = int(record["seed"])
        entries = [(f"{seed}-{i}", round(float(stamp), 3), str(text))
                   for i, (stamp, text) in enumerate(sorted(record.get("memory", [])))]
        samples = [{"t": float(o["t"]), "caption": str(o["caption"])} for o in record["observed"]]
        episodes.append({"episode": str(seed), "seed": seed, "entries": entries, "samples": samples})
    return episodes


def build_question_set(episodes: list[dict], source: str) -> dict:
    """The question set of ``episodes`` (:func:`episodes_of_record`): per episode its entries and ground truth
    (:class:`~oxygen_ros.demo_task.questions.Truth`, the samples thinned to their caption changes), and the
    questions (their ``holder_at`` time drawn with ``random.Random(seed)``). Episodes without memory entries are
    left out (counted in ``skipped``)."""
    out_episodes, questions, skipped = [], [], []
    for episode in episodes:
        if not episode["entries"]:
            skipped.append(episode["episode"])
            continue
        samples = episode["samples"]
        truth = qs.episode_truth(samples)
        changes = [s for i, s in enumerate(samples) if i == 0 or s["caption"] != samples[i - 1]["caption"]]
        changes.append(samples[-1])
        qset = qs.episode_questions(episode["episode"], samples, episode["entries"], random.Random(episode["seed"]))
        questions += [q.to_json() for q in qset]
        out_episodes.append({"episode": episode["episode"], "seed": episode["seed"],
                             "entries": [list(e) for e in episode["entries"]],
                             "truth": {"start_side": truth.start_side, "first_grasp_s": truth.first_grasp_s,
                                       "carried_until_s": truth.carried_until_s, "last_holder": truth.last_holder,
                                       "start_s": truth.start_s, "end_s": truth.end_s},
                             "caption_changes": changes})
    return {"source": source, "prompt_with_memory": qs.PROMPT_WITH_MEMORY,
            "prompt_without_memory": qs.PROMPT_WITHOUT_MEMORY, "time_tolerance_s": qs.TIME_TOLERANCE_S,
            "episodes": out_episodes, "skipped": skipped, "questions": questions}


# ---------------------------------------------------------------------------------------------------
# scoring


def wilson(successes: int, trials: int) -> tuple[float, float]:
    from oxygen_ros.tools.demo_data import wilson_interval

    return wilson_interval(successes, trials)


def paired_bootstrap(with_memory: list[bool], without: list[bool], seed: int = 0, n: int = 10000
                     ) -> tuple[float, float]:
    """95 % interval of the difference of accuracies (with − without) by resampling the questions (paired)."""
    import numpy as np

    a = np.asarray(with_memory, float) - np.asarray(without, float)
    if len(a) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = a[rng.integers(0, len(a), (n, len(a)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def score(results: list[dict], k: int) -> dict:
    """Accuracy with and without memory (overall and per type), their paired difference, precision at 1 and at
    ``k`` and the share of questions with a relevant entry among the ``k`` retrieved."""
    def block(rows: list[dict]) -> dict:
        out = {"questions": len(rows)}
        for condition in ("with_memory", "without_memory"):
            right = sum(r[condition]["correct"] for r in rows)
            lo, hi = wilson(right, len(rows)) if rows else (float("nan"), float("nan"))
            out[condition] = {"right": right, "accuracy": right / len(rows) if rows else float("nan"),
                              "ci95": [lo, hi]}
        out["difference"] = {
            "accuracy": (out["with_memory"]["accuracy"] - out["without_memory"]["accuracy"]) if rows else float("nan"),
            "ci95": list(paired_bootstrap([r["with_memory"]["correct"] for r in rows],
                                          [r["without_memory"]["correct"] for r in rows]))}
        ranked = [r for r in rows if r["relevant"]]
        for name, depth in (("p_at_1", 1), (f"p_at_{k}", k)):
            values = [qs.precision_at_k(r["ranked"], set(r["relevant"]), depth) for r in ranked]
            values = [v for v in values if v is not None]
            out[name] = sum(values) / len(values) if values else float("nan")
        out[f"hit_at_{k}"] = (sum(any(e in r["relevant"] for e in r["ranked"][:k]) for r in ranked) / len(ranked)
                              if ranked else float("nan"))
        out["with_relevant_entries"] = len(ranked)
        # The lines read by the training's rule (demo_task/questions.py answer_from_lines): what a perfect reader of
        # the retrieved captions would answer, and how often the model's answer is that one (it reads its memory as trained).
        if all("rule" in r for r in rows):
            rule_right = sum(r["rule"]["correct"] for r in rows)
            out["rule"] = {"right": rule_right, "accuracy": rule_right / len(rows) if rows else float("nan"),
                           "ci95": list(wilson(rule_right, len(rows))) if rows else [float("nan")] * 2,
                           "model_follows": (sum(r["with_memory"]["parsed"] == qs.parse_answer(r["rule"]["answer"])
                                                 for r in rows) / len(rows)) if rows else float("nan")}
        # The best any answer without memory can do that does not depend on the episode: per type the answer most
        # of the set's questions have (read off the set itself, so an upper bound for a constant answer).
        constant = 0
        for kind in qs.QUESTION_TYPES:
            answers = [r["answer"] for r in rows if r["type"] == kind]
            constant += max((answers.count(a) for a in set(answers)), default=0)
        out["best_constant"] = {"right": constant, "accuracy": constant / len(rows) if rows else float("nan"),
                                "ci95": list(wilson(constant, len(rows))) if rows else [float("nan")] * 2}
        return out

    summary = {"all": block(results)}
    for kind in qs.QUESTION_TYPES:
        summary[kind] = block([r for r in results if r["type"] == kind])
    return summary


def format_table(summary: dict, k: int) -> str:
    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * x:.0f} %"

    lines = [f"| questions | n | with memory | without memory | difference (95 % CI) | best constant answer | "
             f"the lines read by rule | answer = rule | P@1 | P@{k} | hit@{k} |",
             "|---|---:|---|---|---|---|---|---:|---:|---:|---:|"]
    for name in ("all", *qs.QUESTION_TYPES):
        s = summary[name]
        w, wo, d = s["with_memory"], s["without_memory"], s["difference"]
        lines.append(
            f"| {name} | {s['questions']} | {w['right']} / {s['questions']} = {pct(w['accuracy'])} "
            f"({pct(w['ci95'][0])}-{pct(w['ci95'][1])}) | {wo['right']} / {s['questions']} = {pct(wo['accuracy'])} "
            f"({pct(wo['ci95'][0])}-{pct(wo['ci95'][1])}) | {d['accuracy'] * 100:+.0f} points "
            f"({d['ci95'][0] * 100:+.0f} to {d['ci95'][1] * 100:+.0f}) | {s['best_constant']['right']} / "
            f"{s['questions']} = {pct(s['best_constant']['accuracy'])} | "
            + (f"{s['rule']['right']} / {s['questions']} = {pct(s['rule']['accuracy'])} | {pct(s['rule']['model_follows'])} | "
               if "rule" in s else "n/a | n/a | ") + f"{pct(s['p_at_1'])} | "
            f"{pct(s[f'p_at_{k}'])} | {pct(s[f'hit_at_{k}'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# asking the node


def node_parameters(checkpoint: str, store_path: str) -> dict:
    """The QA node: the demo robot's inputs (tools/evaluate's real-time settings), no periodic speech or memory
    (questions only: nothing of the question scene goes into the store), a slow action rate."""
    from oxygen_ros.assets import policy_cameras, read_policy_file
    from oxygen_ros.demo_task import DT, INSTRUCTION, JOINTS

    policy = read_policy_file(checkpoint)
    if "qa" not in policy:
        raise SystemExit(f"--checkpoint {checkpoint}: not a QA checkpoint (no 'qa' in its demo_policy.json; "
                         "make train-qa writes one)")
    cameras = policy_cameras(policy)
    return {
        "preset": policy["preset"], "checkpoint": checkpoint, "device": "cpu", "dtype": "float32", "conventions": "",
        "joint_names": list(JOINTS), "action_dim": len(JOINTS), "action_names": list(JOINTS), "action_dt_s": DT,
        "camera_topics": [f"/cameras/{camera}/image_raw" for camera in cameras],
        "camera_slots": list(cameras.values()), "camera_transports": ["raw"] * len(cameras),
        "camera_reliability": ["best_effort"] * len(cameras),
        "camera_required": [True] + [False] * (len(cameras) - 1),
        "staleness_limit_s": 1.5, "instruction_topic": "/instruction", "joint_states_topic": "/joint_states",
        "default_instruction": policy.get("instruction", INSTRUCTION), "control_rate_hz": 2.0,
        "speech.trigger.every_s": 0.0, "speech.trigger.every_n_frames": 0,
        "memory.trigger.every_s": 0.0, "memory.trigger.every_n_frames": 0,
        "speech.max_new_tokens": ANSWER_TOKENS, "memory.store.path": store_path}


def _load_episode(path: Path, entries: list) -> None:
    """Make the store at ``path`` hold exactly ``entries`` (stamps at or before now): every entry is removed (the
    retention's age rule, an hour ahead of now), then they are inserted. The node keeps the file open and reads it
    at each question: no reconfiguration between episodes.

    Raises:
        RuntimeError: the store holds other entries afterwards.
    """
    from oxygen_ros.memory import MemoryRecord, RetentionPolicy, open_store

    with open_store(path) as store:
        store.prune(RetentionPolicy(max_age_s=1.0), now_s=time.time() + 3600.0)
        store.insert([MemoryRecord(str(e), float(stamp), str(text)) for e, stamp, text in entries])
        held = sorted(r.entry_id for r in store.records())
    if held != sorted(str(e) for e, _, _ in entries):
        raise RuntimeError(f"the store holds {held}, not the episode's entries")


def ask_all(question_set: dict, args, log) -> list[dict]:
    """Every question of ``question_set`` asked with and without memory (module docstring); one row per question.

    Raises:
        RuntimeError: the node did not become active, the robot process ended, or a goal was refused or failed.
    """
    import rclpy
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient
    from rclpy.context import Context
    from rclpy.node import Node
    from rclpy.parameter import Parameter
    from rclpy.signals import SignalHandlerOptions

    from oxygen_ros.action import Ask
    from oxygen_ros.memory import open_store
    from oxygen_ros.memory.prompt import recall
    from oxygen_ros.node.executor import TransitionExecutor
    from oxygen_ros.node.inputs import stamp_seconds
    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.tools.child_process import package_pythonpath, start_child, stop_child
    from oxygen_ros.tools.evaluate.node_runs import spin_until

    store_path = args.out / "memory.db"
    order = sorted(question_set["episodes"], key=lambda e: min(stamp for _, stamp, _ in e["entries"]))
    if store_path.exists():
        store_path.unlink()
    _load_episode(store_path, order[0]["entries"])
    params = node_parameters(str(args.checkpoint), str(store_path))
    cameras = [t.split("/")[2] for t in params["camera_topics"]]
    robot = start_child([sys.executable, "-P", "-m", "oxygen_ros.tools.sim_robot", "--ros-args",
                         "-p", f"seed:={args.scene_seed}", "-p", f"cameras:={json.dumps(cameras)}",
                         "-p", "camera_rate_hz:=1.0", "-p", "action_chunk_topic:=/memory_eval/unexecuted"],
                        args.out / "sim_robot.log", env=package_pythonpath(os.environ))
    context = Context()
    rclpy.init(args=[], context=context, signal_handler_options=SignalHandlerOptions.NO)
    executor = None
    stop = threading.Event()
    oxygen = client_node = client = None
    rows: list[dict] = []

    def wait_active(timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while oxygen.lifecycle_state != "active":
            if robot.poll() is not None:
                raise RuntimeError(f"the simulated robot exited ({robot.returncode}); see {args.out / 'sim_robot.log'}")
            if oxygen.configure_error or oxygen.autostart_failed or time.monotonic() > deadline:
                raise RuntimeError(f"the oxygen node did not become active: "
                                   f"{oxygen.configure_error or oxygen.autostart_failed or 'timeout'}")
            time.sleep(0.1)

    def wait(future, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not future.done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: no answer within {timeout_s:g} s")
            time.sleep(0.02)
        return future.result()

    def ask(text: str, qid: str, template: str) -> dict:
        goal = Ask.Goal(task="speech", instruction=text, prompt_template=template, memory_k=args.memory_k)
        for attempt in range(3):     # a goal request can be lost in transport: sent again (a new goal)
            try:
                handle = wait(client.send_goal_async(goal), 20.0, f"goal {qid}")
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                log(f"goal {qid}: no response to the goal request within 20 s; sent again")
        if not handle.accepted:
            raise RuntimeError(f"goal {qid} rejected (the node's log says why)")
        response = wait(handle.get_result_async(), 120.0, f"result {qid}")
        result = response.result
        if response.status != GoalStatus.STATUS_SUCCEEDED or result.status != Ask.Result.STATUS_COMPLETED:
            raise RuntimeError(f"goal {qid} ended {response.status}/{result.status}: {result.message}")
        return {"text": result.text, "memory_entry_ids": list(result.memory_entry_ids),
                "memory_stamp_s": stamp_seconds(result.memory_stamp)}

    spinner = threading.Thread(target=lambda: spin_until(executor, stop), daemon=True)
    try:
        oxygen = OxygenNode(NODE_NAME, context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        # the node's own executor (oxygen_ros/node/executor.py): callbacks inline, transitions on a worker; a
        # MultiThreadedExecutor spun here ran its spin_once loop at a full core while an ~/ask goal executed, and
        # its GIL took the control-cycle thread's time (the evaluation ran 10x slower on an idle machine)
        executor = TransitionExecutor(oxygen.runs_long, context=context)
        client_node = Node("memory_eval", context=context)
        client = ActionClient(client_node, Ask, f"/{NODE_NAME}/ask")
        executor.add_node(oxygen)
        executor.add_node(client_node)
        spinner.start()
        wait_active(args.startup_timeout)
        if not client.wait_for_server(timeout_sec=30.0):
            raise RuntimeError(f"no /{NODE_NAME}/ask server")
        for index, episode in enumerate(order):
            name = episode["episode"]
            # the episode moved to end now (node clock: system time), so its questions are asked just after it,
            # as the robot's user would; ages in the lines and answers count from the time of asking
            offset = time.time() - max(stamp for _, stamp, _ in episode["entries"])
            _load_episode(store_path, [(e, stamp + offset, text) for e, stamp, text in episode["entries"]])
            for data in (q for q in question_set["questions"] if q["episode"] == name):
                question = qs.Question.from_json(data).shifted(offset)
                asked = question.ask_text(time.time())
                with_memory = ask(asked, data["qid"], qs.PROMPT_WITH_MEMORY)
                without = ask(asked, data["qid"], qs.PROMPT_WITHOUT_MEMORY)
                now_s = with_memory["memory_stamp_s"]
                with open_store(store_path) as store:     # recall as the node did, at its time of asking
                    records = recall(store, asked, args.memory_k, now_s=now_s)
                top = [r.entry_id for r in records]
                if sorted(with_memory["memory_entry_ids"]) != sorted(top):
                    raise RuntimeError(f"{data['qid']}: the node's memory {with_memory['memory_entry_ids']} is not "
                                       f"recall's {top}")
                lines = sorted((r.stamp_s, r.text) for r in records)
                rule = qs.answer_from_lines(question, lines, now_s)
                row = {"qid": question.qid, "episode": name, "type": question.type, "question": asked,
                       "answer": question.answer, "relevant": list(question.relevant), "ranked": top,
                       "lines": [(round(stamp - offset, 3), text) for stamp, text in lines], "asked_s": now_s - offset,
                       "rule": {"answer": rule, "correct": qs.answer_correct(question, rule, now_s)},
                       "with_memory": {**with_memory, "parsed": qs.parse_answer(with_memory["text"]),
                                       "correct": qs.answer_correct(question, with_memory["text"], now_s)},
                       "without_memory": {"text": without["text"], "parsed": qs.parse_answer(without["text"]),
                                          "correct": qs.answer_correct(question, without["text"], now_s)}}
                rows.append(row)
                log(f"{question.qid}: truth {question.answer!r}; with memory {row['with_memory']['parsed']!r} "
                    f"({'right' if row['with_memory']['correct'] else 'wrong'}), without "
                    f"{row['without_memory']['parsed']!r} ({'right' if row['without_memory']['correct'] else 'wrong'})")
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join(timeout=5.0)
        if executor is not None:
            executor.shutdown(timeout_sec=5.0)
        if client is not None:
            client.destroy()
        if oxygen is not None:
            oxygen.release()
            oxygen.destroy_node()
        if client_node is not None:
            client_node.destroy_node()
        context.try_shutdown()
        context.destroy()
        stop_child(robot)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.tools.memory_eval", description=__doc__.split("\n")[0])
    parser.add_argument("--record", type=Path, default=None,
                        help="an evaluation output directory (node-realtime episodes) to build the question set from")
    parser.add_argument("--questions", type=Path, default=SHIPPED_QUESTIONS,
                        help="the question set: read, or written with --record (default the shipped one)")
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/train-qa/checkpoint"),
                        help="the QA checkpoint the node serves (default runs/train-qa/checkpoint: make train-qa)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/memory-eval-<timestamp>)")
    parser.add_argument("--memory-k", type=int, default=3, help="entries in {memory} (default 3, as the QA "
                        "fine-tune was trained)")
    parser.add_argument("--scene-seed", type=int, default=SCENE_SEED,
                        help=f"cube seed of the scene the questions are asked in (default {SCENE_SEED})")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--build-only", action="store_true", help="write the question set and stop")
    args = parser.parse_args(argv)
    if args.memory_k < 1:
        parser.error(f"--memory-k must be >= 1, got {args.memory_k}")
    if args.record is not None and not args.record.is_dir():
        parser.error(f"--record {args.record}: no such directory")
    if args.record is None and not args.questions.is_file():
        parser.error(f"--questions {args.questions}: no such file (build one with --record)")
    if not args.build_only and not (args.checkpoint / "demo_policy.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no checkpoint there (make train-qa)")
    if args.out is None:
        args.out = Path("runs") / time.strftime("memory-eval-%Y%m%d-%H%M%S")
    return args


def read_question_set(path: Path) -> dict:
    """The question set in ``path`` (the JSON :func:`build_question_set` writes), checked before any node starts.

    Raises:
        ValueError: not JSON, or not a question set: ``episodes`` (each with ``episode`` and at least one entry
            ``[entry_id, stamp_s, caption]``) and ``questions`` (each a :class:`~oxygen_ros.demo_task.questions.
            Question` of a listed episode and a known type) missing or malformed; no question.
    """
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    try:
        episodes = {str(e["episode"]): e for e in data["episodes"]}
        for name, episode in episodes.items():
            entries = episode["entries"]
            if not entries or not all(len(e) == 3 and isinstance(e[2], str) and math.isfinite(float(e[1]))
                                      for e in entries):
                raise ValueError(f"episode {name}: entries must be [entry_id, finite stamp_s, caption], at least "
                                 "one")
        questions = [qs.Question.from_json(q) for q in data["questions"]]
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"{path}: not a question set (made by --record): {type(err).__name__} {err}") from None
    if not questions:
        raise ValueError(f"{path}: no question")
    for question in questions:
        if question.episode not in episodes or question.type not in qs.QUESTION_TYPES:
            raise ValueError(f"{path}: question {question.qid}: unknown episode {question.episode!r} or type "
                             f"{question.type!r}")
        if question.time_s is not None and not math.isfinite(question.time_s) or \
                question.type == "holder_at" and question.time_s is None:
            raise ValueError(f"{path}: question {question.qid}: time_s must be finite (and given for holder_at)")
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.record is not None:
        question_set = build_question_set(episodes_of_record(args.record), str(args.record))
        args.questions.parent.mkdir(parents=True, exist_ok=True)
        args.questions.write_text(json.dumps(question_set, indent=1) + "\n")
        print(f"wrote {args.questions}: {len(question_set['questions'])} questions over "
              f"{len(question_set['episodes'])} episodes (skipped without entries: {question_set['skipped']})")
        if args.build_only:
            return 0
    else:
        try:
            question_set = read_question_set(args.questions)
        except (OSError, ValueError) as err:
            print(f"python -m oxygen_ros.tools.memory_eval: error: --questions {err}", file=sys.stderr)
            return 2
    os.environ.setdefault("ROS_DOMAIN_ID", str(150 + os.getpid() % 80))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = ask_all(question_set, args, lambda line: print(line, flush=True))
    summary = score(rows, args.memory_k)
    table = format_table(summary, args.memory_k)
    result = {"questions_file": str(args.questions), "checkpoint": str(args.checkpoint), "memory_k": args.memory_k,
              "scene_seed": args.scene_seed, "wall_s": round(time.time() - started, 1), "summary": summary,
              "rows": rows}
    (args.out / "memory_eval.json").write_text(json.dumps(result, indent=1))
    (args.out / "memory_eval.md").write_text(table + "\n")
    print(table)
    print(f"wrote {args.out / 'memory_eval.json'} and {args.out / 'memory_eval.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
