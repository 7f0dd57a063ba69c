"""Start-frame probe of a demo policy: does it see where the cube is before its own arm has moved?

Every episode's first cycle shows the arms at their home pose and the cube somewhere on the table: the
state (in the prompt) is the same in every episode, so only the cameras can tell the policy where to reach.
Later in a demonstration the expert's arm is already on its way and its pose (in the prompt and in the
images) gives the cube's position away — a policy can fit its training samples from that cue without ever
reading the cube off the image (the "copycat" shortcut of behaviour cloning), and then, in closed loop,
starts every episode towards the same place. Offline metrics over random training samples, which are mostly
mid-motion, do not show it; this probe does.

For each fresh cube seed it renders the policy's cameras at the start pose (:func:`generate_episode`,
the demonstrations' own scene and settling) and asks the checkpoint, through the model's inference paths
(:func:`~oxygen_ros.models.reference.reference_generate`, :func:`~oxygen_ros.models.reference.reference_actions`):

* the cube's location (the training's ``"...;\\nCube: "`` prompt): the error against the truth [cm], and
  the spread of the answers against the spread of the truth (answers that do not vary with the cube are
  a policy that does not look);
* the first action chunk (the plain action prompt, seeded noise): the right arm's targets at the chunk's
  end (1 s) against the expert's, as a correlation over the seeds per joint (waist, shoulder, elbow) and an
  rms error [rad].

Run: ``python -m oxygen_ros.training.probe`` (the shipped policy, seeds 1000-1029; ``--help``). Writes
nothing; prints one line per seed and a summary (``--json`` for the summary as JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.assets import demo_policy_dir, norm_stats_file, policy_cameras, read_policy_file
from oxygen_ros.models import get_preset, load_model
from oxygen_ros.models.checkpoint import checkpoint_overrides
from oxygen_ros.models.config import load_norm_stats
from oxygen_ros.models.reference import reference_actions
from oxygen_ros.demo_task import JOINTS, write_episode
from oxygen_ros.tools.demo_data import generate_episode
from oxygen_ros.training.data import load_samples
from oxygen_ros.training.train import Batches, build_processor, greedy_text

# The right arm's first three joints in JOINTS order (gym-aloha: the left arm's 7 values, then the right's):
# where the arm goes is mostly these.
PROBED_JOINTS = ("right_arm_waist", "right_arm_shoulder", "right_arm_elbow")
# Fewest seeds a probe takes: a spread and a correlation over two points say nothing (two points always correlate ±1).
MIN_SEEDS = 3


def _location(text: str) -> tuple[float, float]:
    """``(x, y)`` [cm] of an answer ``"x <cm> y <cm>"``; NaNs when the answer is not of that form."""
    parts = text.split()
    try:
        if len(parts) == 4 and parts[0] == "x" and parts[2] == "y":
            return float(parts[1]), float(parts[3])
    except ValueError:
        pass
    return math.nan, math.nan


def probe(checkpoint: str | Path, seeds: list[int], device: str = "cpu", seed: int = 0) -> dict:
    """Probe ``checkpoint`` (a demo trainer's checkpoint directory) on the start frames of ``seeds``.

    Returns:
        ``{"seeds": [...], "truth_cm": [[x, y], ...], "answer_cm": [[x, y], ...], "error_cm": [...],
        "mean_error_cm", "median_error_cm", "truth_std_cm": [x, y], "answer_std_cm": [x, y],
        "unreadable": n, "chunk_end": {joint: {"corr", "rms_rad"}}}`` — NaN where undefined
        (e.g. a correlation of answers that do not vary; ``--json`` prints null).

    Raises:
        FileNotFoundError: no ``demo_policy.json`` or norm statistics in ``checkpoint``.
        ValueError: fewer than :data:`MIN_SEEDS` seeds, a ``demo_policy.json`` that is not a JSON object naming
            a preset, a checkpoint of another preset than it names, or weights that do not load.
    """
    if len(seeds) < MIN_SEEDS:
        raise ValueError(f"probe needs at least {MIN_SEEDS} seeds (a correlation of two points is always ±1), "
                         f"got {len(seeds)}")
    checkpoint = Path(checkpoint)
    policy_file = checkpoint / "demo_policy.json"
    if not policy_file.is_file():
        raise FileNotFoundError(f"{checkpoint}: no demo_policy.json (not a demo trainer's checkpoint)")
    try:
        policy = read_policy_file(checkpoint)
    except ValueError as error:                      # json.JSONDecodeError is a ValueError
        raise ValueError(f"{policy_file}: not readable JSON ({error})") from None
    if not isinstance(policy, dict) or not isinstance(policy.get("preset"), str):
        raise ValueError(f"{policy_file}: expected a JSON object with a 'preset' name")
    preset = policy["preset"]
    config = get_preset(preset, **checkpoint_overrides(checkpoint, preset))
    slots = policy_cameras(policy)                   # camera -> model slot, in slot order
    cameras = tuple(slots)
    stats = load_norm_stats(norm_stats_file(checkpoint))
    try:
        model = load_model(config, checkpoint, dtype="float32", device=device)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as error:                       # e.g. a truncated safetensors file (SafetensorError)
        raise ValueError(f"{checkpoint}: its weights do not load ({type(error).__name__}: {error})") from None
    processor = build_processor(config, stats, cameras)
    crops = {camera: tuple(crop[1:]) for crop in config.image_crops
             for camera, slot in slots.items() if slot == crop[0]}
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for s in seeds:       # the start frame only: one image step per episode
            episode = generate_episode(s, image_every=1_000_000, cameras=cameras)
            files.append(write_episode(episode, Path(tmp) / f"episode_{len(files)}.hdf5", compression=None))
        samples = load_samples(files, config.image_size, config.action_horizon, cameras=cameras, crops=crops)
    batches = Batches(samples, processor, seed, subtask_in_action_prompt=0.0, locate=1.0)
    tokenizer = processor.tokenizer
    gen = torch.Generator().manual_seed(seed)
    columns = [JOINTS.index(j) for j in PROBED_JOINTS]
    answers, predicted_end = [], []
    with torch.inference_mode():
        for i in range(len(samples)):
            tokens = model.encode_images(batches.pixels(np.array([i]), model.device)).reshape(1, -1, config.vlm_width)
            text = tokenizer.decode(greedy_text(model, tokens[0], batches.locate_prompt[i], tokenizer.eos_id,
                                                batches.max_target))
            answers.append(_location(text))
            ids = torch.tensor([batches.action_ids[i]])
            embeds = torch.cat((tokens, model.embed_tokens(ids).to(tokens.dtype)), 1)
            noise = torch.randn((1, config.action_horizon, config.action_dim), generator=gen)
            normed = reference_actions(model, embeds, torch.ones(embeds.shape[:2], dtype=torch.bool), noise)
            actions = processor.conventions.action_norm.unnormalize(
                normed[0, :, :len(JOINTS)].double().numpy(), stats["actions"])
            predicted_end.append(actions[-1, columns])
    truth = samples.cube_start[:, :2] * 100.0
    answer = np.asarray(answers, np.float64)
    error = np.hypot(*(answer - truth).T)
    expert_end = samples.actions[:, -1, columns]
    predicted = np.asarray(predicted_end)
    chunk_end = {}
    for k, joint in enumerate(PROBED_JOINTS):
        chunk_end[joint] = {"corr": _corr(predicted[:, k], expert_end[:, k]),
                            "rms_rad": float(np.sqrt(np.mean((predicted[:, k] - expert_end[:, k]) ** 2)))}
    readable = ~np.isnan(error)
    return {"checkpoint": str(checkpoint), "seeds": list(seeds), "truth_cm": truth.round(2).tolist(),
            "answer_cm": answer.tolist(), "error_cm": error.round(2).tolist(),
            "mean_error_cm": float(error[readable].mean()) if readable.any() else math.nan,
            "median_error_cm": float(np.median(error[readable])) if readable.any() else math.nan,
            "truth_std_cm": truth.std(axis=0).round(2).tolist(),
            "answer_std_cm": (answer[readable].std(axis=0).round(2).tolist() if readable.any()
                              else [math.nan, math.nan]),
            "unreadable": int((~readable).sum()), "chunk_end": chunk_end}


def _nan_to_none(value):
    """``value`` with every NaN float replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation; NaN when either side does not vary (or fewer than 2 values)."""
    if len(a) < 2 or np.std(a) < 1e-12 or np.std(b) < 1e-12:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.training.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a demo trainer's checkpoint directory (default: the shipped demo policy)")
    parser.add_argument("--start-seed", type=int, default=1000, help="first cube seed (default 1000)")
    parser.add_argument("--seeds", type=int, default=30, help=f"how many seeds, >= {MIN_SEEDS} (default 30)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if args.seeds < MIN_SEEDS:
        parser.error(f"--seeds must be >= {MIN_SEEDS} (a correlation of two points is always ±1), got {args.seeds}")
    if args.start_seed < 0:
        parser.error(f"--start-seed must be >= 0, got {args.start_seed}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkpoint = args.checkpoint or demo_policy_dir()
    try:
        result = probe(checkpoint, list(range(args.start_seed, args.start_seed + args.seeds)))
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"probe: {error}") from None
    if args.json:
        print(json.dumps(_nan_to_none(result), indent=2, allow_nan=False))
        return 0
    for s, t, a, e in zip(result["seeds"], result["truth_cm"], result["answer_cm"], result["error_cm"]):
        print(f"seed {s}: cube at x {t[0]:.1f} y {t[1]:.1f} cm, answer x {a[0]:.0f} y {a[1]:.0f}, error {e:.1f} cm")
    print(f"location at the start frame: mean error {result['mean_error_cm']:.1f} cm, median "
          f"{result['median_error_cm']:.1f} cm; spread of the answers x {result['answer_std_cm'][0]:.1f} y "
          f"{result['answer_std_cm'][1]:.1f} cm against the truth's x {result['truth_std_cm'][0]:.1f} y "
          f"{result['truth_std_cm'][1]:.1f} cm; unreadable {result['unreadable']}")
    print("first chunk's end (1 s) vs the expert's: " + ", ".join(
        f"{j} corr {v['corr']:.2f} rms {v['rms_rad']:.3f} rad" for j, v in result["chunk_end"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
