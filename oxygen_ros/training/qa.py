"""Fine-tunes the demo policy to answer questions about the demo from the memory lines in its prompt
(``python -m oxygen_ros.training.qa``; ``make train-qa``; docs/memory.md, "Measured: answers with and without
memory").

What it is trained on: generated examples only — no recorded episode, no evaluation seed.

* **Episodes**: timelines of the transfer-cube task drawn at random (:func:`synthetic_episode`): the cube starts on
  the right or in the middle of the table (gym-aloha's ``sample_box_pose`` range, x ∈ [0, 0.2] m, binned at 5 cm as
  the captions bin it), the right gripper reaches it after a random time or never, may lift it, hand it over,
  drop it (it lands on a random side) and grasp it again; a random start stamp in [1.70e9, 1.85e9] s (node
  clock: wall time) and length 10-30 s. The simulator-like samples every 0.1 s carry
  :func:`oxygen_ros.demo_task.scene_caption`'s captions.
* **Memory entries** every 2 s (± 0.3 s) with noise the demo's captions have: each entry missing with p = 0.1, its
  caption wrong with a per-episode p ∈ [0.05, 0.35] (half of them the caption of a moment 1-3 s away, half any
  caption).
* **Questions** of :mod:`oxygen_ros.demo_task.questions` (the evaluation's code), asked 0-15 s after the episode
  ends (:data:`ASK_DELAY_S`); the memory lines are what the node puts into ``{memory}``: the entries go into a
  SQLite store and :func:`oxygen_ros.memory.prompt.recall` / :func:`~oxygen_ros.memory.prompt.memory_text` pick
  and write them with their ages at the time of asking (``--memory-k``, default 3).
* **Targets** (:func:`oxygen_ros.demo_task.questions.answer_from_lines`): with memory, the answer the lines give
  by a fixed rule (the side in the
  oldest "on the <side> of the table" line, else ``right``, the likelier start; the age of the newest line that says the right gripper holds the cube
  in the air, or ``never``; the holder in the line nearest the asked time, however far; the holder in the newest line that names one) —
  copied, not guessed, so a wrong caption gives a wrong target exactly as it would mislead a reader; a quarter of
  the examples have no memory (``Memory: none``) and the true answer as target (the prior: what the model can know
  without memory; ``unknown`` for a time).
* **Images**: the demo cameras at the start pose of cube seeds 4000-4031 (rendered once), one set per example.

Only the language path is trained (text cross-entropy on the answer tokens); the vision tower and the action
expert are frozen. The checkpoint is the demo policy's layout plus ``qa`` in ``demo_policy.json``; serve it with
the node and ask with :data:`~oxygen_ros.demo_task.questions.PROMPT_WITH_MEMORY` (``tools/memory_eval.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.demo_task import questions as qs

IMAGE_SEEDS = range(4000, 4032)     # start-pose images of these cube seeds (never an evaluation seed)
CAPTIONS = ("the cube is on the left of the table", "the cube is on the middle of the table",
            "the cube is on the right of the table", "the cube is in the air",
            "the right gripper holds the cube on the table", "the right gripper holds the cube in the air",
            "the left gripper holds the cube on the table", "the left gripper holds the cube in the air",
            "both grippers hold the cube")


def _side(rng: random.Random) -> str:
    """A start side as gym-aloha draws the cube: x uniform in [0, 0.2] m, "middle" within 5 cm of x = 0."""
    return "right" if rng.uniform(0.0, 0.2) > 0.05 else "middle"


def synthetic_episode(rng: random.Random) -> list[dict]:
    """One random timeline of the task as simulator samples ``{"t", "caption"}`` every 0.1 s (module docstring)."""
    t0 = rng.uniform(1.70e9, 1.85e9)
    length = rng.uniform(10.0, 30.0)
    segments: list[tuple[float, str]] = []      # (duration, caption)
    side = _side(rng)
    on_table = lambda s: f"the cube is on the {s} of the table"  # noqa: E731
    segments.append((rng.uniform(1.0, 8.0), on_table(side)))
    for _ in range(3):                          # grasp attempts
        if rng.random() < 0.15:
            break                               # never grasped (again)
        segments.append((rng.uniform(0.3, 3.0), "the right gripper holds the cube on the table"))
        if rng.random() < 0.15:                 # let go on the table
            segments.append((rng.uniform(0.5, 4.0), on_table(side)))
            continue
        segments.append((rng.uniform(1.0, 10.0), "the right gripper holds the cube in the air"))
        fate = rng.random()
        if fate < 0.45:                         # handed over
            segments.append((rng.uniform(0.3, 3.0), "both grippers hold the cube"))
            segments.append((rng.uniform(1.0, 10.0), "the left gripper holds the cube in the air"))
            if rng.random() < 0.8:
                break
            segments.append((0.2, "the cube is in the air"))
        elif fate < 0.7:                        # dropped
            segments.append((0.2, "the cube is in the air"))
        else:
            break                               # still carried
        side = rng.choice(qs.SIDES)
        segments.append((rng.uniform(0.5, 5.0), on_table(side)))
    samples, t, i = [], 0.0, 0
    while t <= length:
        while i < len(segments) - 1 and t >= sum(d for d, _ in segments[:i + 1]):
            i += 1
        samples.append({"t": t0 + t, "caption": segments[i][1]})
        t = round(t + 0.1, 6)
    return samples


def synthetic_entries(samples: list[dict], rng: random.Random, period_s: float = 2.0
                      ) -> list[tuple[str, float, str]]:
    """Memory entries ``(id, stamp, caption)`` of an episode every ``period_s`` ± 0.3 s with the captions' noise
    (module docstring)."""
    wrong = rng.uniform(0.05, 0.35)
    start, end = samples[0]["t"], samples[-1]["t"]
    entries, stamp, n = [], start + rng.uniform(0.0, period_s), 0
    while stamp <= end:
        if rng.random() >= 0.1:
            caption = qs.truth_at(samples, stamp)
            if rng.random() < wrong:
                caption = (qs.truth_at(samples, stamp + rng.choice((-1, 1)) * rng.uniform(1.0, 3.0))
                           if rng.random() < 0.5 else rng.choice(CAPTIONS))
            entries.append((f"e{n}", round(stamp, 1), caption))
            n += 1
        stamp += period_s + rng.uniform(-0.3, 0.3)
    return entries


ASK_DELAY_S = 15.0     # questions are asked up to this long after their episode ends [s]


def no_memory_target(question: qs.Question) -> str:
    """Without memory: the true answer, where it is a word; ``unknown`` for a time."""
    return qs.UNKNOWN if question.answer.startswith("t=") else question.answer


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str         # the template with {memory} filled, {instruction} still a field
    question: str
    answer: str


def make_examples(n_episodes: int, seed: int, memory_k: int = 3, no_memory: float = 0.25) -> list[Example]:
    """Examples of ``n_episodes`` synthetic episodes (four questions each), through a real store and ``recall``."""
    from oxygen_ros.memory import MemoryRecord, open_store
    from oxygen_ros.memory.prompt import fill_memory, memory_text, recall

    rng = random.Random(seed)
    examples = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(n_episodes):
            samples = synthetic_episode(rng)
            entries = synthetic_entries(samples, rng)
            if not entries:
                continue
            questions = qs.episode_questions(f"syn{n}", samples, entries, rng)
            with open_store(Path(tmp) / f"{n}.db", synchronous="normal") as store:
                store.insert([MemoryRecord(e, stamp, text) for e, stamp, text in entries])
                for question in questions:
                    now_s = samples[-1]["t"] + rng.uniform(0.0, ASK_DELAY_S)     # asked after the episode
                    asked = question.ask_text(now_s)
                    if rng.random() < no_memory:
                        examples.append(Example(qs.PROMPT_WITHOUT_MEMORY, asked, no_memory_target(question)))
                        continue
                    records = recall(store, asked, memory_k, now_s=now_s)
                    text, _ = memory_text(records, now_s)
                    lines = sorted((r.stamp_s, r.text) for r in records)
                    examples.append(Example(fill_memory(qs.PROMPT_WITH_MEMORY, text), asked,
                                            qs.answer_from_lines(question, lines, now_s)))
            (Path(tmp) / f"{n}.db").unlink()
    return examples


def start_images(cameras: dict[str, str], seeds=IMAGE_SEEDS) -> list[dict[str, np.ndarray]]:
    """Per seed the demo robot's camera frames at the start pose (after the cube settled): ``{slot: uint8 image}``."""
    from oxygen_ros.demo_task import SETTLE_S
    from oxygen_ros.tools.sim_robot import AlohaScene

    frames = []
    for seed in seeds:
        scene = AlohaScene(seed=seed)
        try:
            scene.step(SETTLE_S)
            frames.append({slot: scene.render(camera) for camera, slot in cameras.items()})
        finally:
            scene.close()
    return frames


def train_qa(args: argparse.Namespace) -> dict:
    """The fine-tune (module docstring); writes ``<out>/checkpoint`` and ``<out>/train_log.json``."""
    from oxygen_ros.assets import norm_stats_file, policy_cameras, read_policy_file
    from oxygen_ros.models import get_preset, load_model
    from oxygen_ros.models.checkpoint import checkpoint_overrides
    from oxygen_ros.models.config import load_norm_stats
    from oxygen_ros.training.train import (build_processor, greedy_text, learning_rate, text_loss,
                                           write_checkpoint, TrainConfig)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    policy = read_policy_file(args.init_from)
    if not policy:
        raise SystemExit(f"--init-from {args.init_from}: no demo_policy.json (a demo policy checkpoint is needed)")
    cameras = policy_cameras(policy)
    config = get_preset(policy["preset"], **checkpoint_overrides(args.init_from, policy["preset"]))
    processor = build_processor(config, load_norm_stats(norm_stats_file(args.init_from)), tuple(cameras))
    model = load_model(config, args.init_from, dtype="float32", device="cpu", seed=args.seed, trainable=True)
    started = time.perf_counter()
    examples = make_examples(args.episodes, args.seed, args.memory_k)
    held_out = make_examples(args.eval_episodes, args.seed + 1_000_003, args.memory_k)
    data_s = time.perf_counter() - started
    tok = processor.tokenizer
    budget = processor.conventions.max_token_len

    def encode(example: Example) -> tuple[list[int], list[int]]:
        from oxygen_ros.models.processing import build_prompt_tokens, PromptLayout

        prompt = build_prompt_tokens(tok, example.question, PromptLayout(example.prompt, truncation="instruction"),
                                     budget, None)
        return prompt, tok.encode(example.answer) + [tok.eos_id]

    # --time-repeat: the examples whose answer is a time (copied digit by digit) drawn that many times as often
    examples = [e for e in examples
                for _ in range(args.time_repeat if qs.answer_time(e.answer, 0.0) is not None else 1)]
    encoded = [encode(e) for e in examples]
    longest = max(len(p) for p, _ in encoded)
    frames = start_images(cameras, IMAGE_SEEDS[:args.image_sets])
    with torch.no_grad():
        pixels = torch.stack([processor.images(f)[0] for f in frames])           # [S, C, 3, H, W]
        s, c = pixels.shape[:2]
        image_tokens = model._encode(pixels.reshape(s * c, *pixels.shape[2:])).reshape(s, -1, config.vlm_width)
    for p in model.vision_tower.parameters():
        p.requires_grad_(False)
    for p in model.projector.parameters():
        p.requires_grad_(False)
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    schedule = TrainConfig(data=Path("."), steps=args.steps, lr=args.lr, warmup=args.warmup)
    extra = {k: v for k, v in policy.items() if k not in ("preset", "conventions", "tokenizer", "joint_names",
                                                           "action_dt_s", "cameras", "instruction", "action_prompt",
                                                           "speech_prompt", "memory_prompt", "action_subtask_prompt",
                                                           "subtasks")}
    base_facts = {"init_from": str(args.init_from), "steps": args.steps, "batch_size": args.batch_size,
                  "lr": args.lr, "memory_k": args.memory_k, "episodes": args.episodes, "examples": len(examples),
                  "prompt_with_memory": qs.PROMPT_WITH_MEMORY, "prompt_without_memory": qs.PROMPT_WITHOUT_MEMORY}
    rng = np.random.default_rng(args.seed)
    history, window = [], []
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, schedule)
        idx = rng.integers(0, len(encoded), args.batch_size)
        images = image_tokens[rng.integers(0, len(image_tokens), args.batch_size)]
        loss, correct = text_loss(model, images, [encoded[i][0] for i in idx], [encoded[i][1] for i in idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        window.append((loss.item(), correct.float().mean().item()))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = np.mean(window, axis=0)
            history.append({"step": step + 1, "loss": float(mean[0]), "token_accuracy": float(mean[1]),
                            "seconds": round(time.perf_counter() - start, 1)})
            print(f"step {step + 1}: loss {mean[0]:.4f}, token accuracy {mean[1]:.3f}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            window = []
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            # a usable checkpoint part-way (a long CPU run can be stopped and still served); the final one replaces it
            write_checkpoint(model, processor, args.out, {**extra, "qa": {
                **base_facts, "partial": True, "step": step + 1, "seconds": round(time.perf_counter() - start, 1)}},
                tuple(cameras))
            model.train()
    seconds = time.perf_counter() - start
    model.eval()
    # held-out generated examples, greedy decoding: exact answers
    right = 0
    for example in held_out[:args.eval_samples]:
        prompt, _ = encode(example)
        out = greedy_text(model, image_tokens[0], prompt, tok.eos_id, 16)
        right += qs.parse_answer(tok.decode(out)) == qs.parse_answer(example.answer)
    n_eval = min(len(held_out), args.eval_samples)
    facts = {
        "init_from": str(args.init_from), "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
        "warmup": args.warmup, "seed": args.seed, "memory_k": args.memory_k, "episodes": args.episodes,
        "time_repeat": args.time_repeat,
        "examples": len(examples), "longest_prompt_tokens": longest, "image_seeds": [IMAGE_SEEDS[0], IMAGE_SEEDS[args.image_sets - 1]],
        "data_seconds": round(data_s, 1), "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / max(1, args.steps), 4), "final": history[-1] if history else None,
        "held_out_exact": {"right": right, "of": n_eval},
        "prompt_with_memory": qs.PROMPT_WITH_MEMORY, "prompt_without_memory": qs.PROMPT_WITHOUT_MEMORY,
        "trained_on": "generated episodes and memory entries (oxygen_ros/training/qa.py); no recorded episode"}
    extra["qa"] = facts
    directory = write_checkpoint(model, processor, args.out, extra, tuple(cameras))
    summary = {**facts, "history": history, "checkpoint": str(directory)}
    (args.out / "train_log.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out generated questions: {right} / {n_eval} exact; checkpoint {directory}")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from oxygen_ros.assets import demo_policy_dir

    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.training.qa", description=__doc__.split("\n")[0])
    parser.add_argument("--init-from", type=Path, default=demo_policy_dir(),
                        help="the demo policy checkpoint to start from (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path("runs/train-qa"), help="output directory")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--episodes", type=int, default=3000, help="generated episodes (four questions each)")
    parser.add_argument("--eval-episodes", type=int, default=50, help="generated held-out episodes")
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--time-repeat", type=int, default=1,
                        help="draw the examples whose answer is a time this many times as often (default 1)")
    parser.add_argument("--memory-k", type=int, default=3, help="entries in {memory} (the evaluation's)")
    parser.add_argument("--image-sets", type=int, default=len(IMAGE_SEEDS),
                        help=f"start-pose image sets (cube seeds from {IMAGE_SEEDS[0]}; at most {len(IMAGE_SEEDS)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=200, help="a checkpoint every N steps (0: only at the end)")
    args = parser.parse_args(argv)
    if not 1 <= args.image_sets <= len(IMAGE_SEEDS):
        parser.error(f"--image-sets must be in [1, {len(IMAGE_SEEDS)}], got {args.image_sets}")
    for name in ("steps", "batch_size", "episodes", "eval_episodes", "memory_k", "threads", "log_every", "time_repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be > 0, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> int:
    train_qa(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
