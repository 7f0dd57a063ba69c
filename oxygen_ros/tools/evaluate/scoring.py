"""Scoring of the evaluation's episode records: the task's outcome and phase times, the subtask and caption
accuracy of the published speech and memory against the ground truth, latency and rates, per episode and per
condition (success rates with their 95 % Wilson interval)."""

from __future__ import annotations

import numpy as np

from oxygen_ros.demo_task import DT, PHASES, SUBTASKS
from oxygen_ros.tools.demo_data import wilson_interval


def text_matches(text: str, label: str) -> bool:
    """A decoded text is correct when, stripped of surrounding blanks, it equals the label."""
    return text.strip() == label


def outcome(flags) -> dict[str, bool]:
    """Per phase: reached at some step; ``transferred`` at the last step (demo_data's definition)."""
    flags = np.asarray(flags, bool).reshape(-1, len(PHASES))
    if len(flags) == 0:
        return {phase: False for phase in PHASES}
    result = flags.any(axis=0)
    result[3] = bool(flags[-1, 3])
    return dict(zip(PHASES, map(bool, result)))


def phase_times(flags) -> dict[str, float | None]:
    """Per phase: when the episode first got there [s after the start; control steps of ``DT``], ``None`` if
    it never did (:func:`outcome`'s success). ``transferred`` counts from the start of the final run of steps
    that hold it (it must hold at the end); the others from their first step."""
    flags = np.asarray(flags, bool).reshape(-1, len(PHASES))
    times: dict[str, float | None] = {}
    for i, phase in enumerate(PHASES):
        column = flags[:, i]
        if i == 3:
            if len(column) == 0 or not column[-1]:
                times[phase] = None
                continue
            off = np.flatnonzero(~column)
            first = int(off[-1]) + 1 if len(off) else 0
        else:
            if not column.any():
                times[phase] = None
                continue
            first = int(np.argmax(column))
        times[phase] = round(first * DT, 3)
    return times


def _nearest_before(observed: list[dict], t: float) -> dict | None:
    """The ground-truth record at or just before sim/clock time ``t`` (observations are in time order)."""
    times = [o["t"] for o in observed]
    i = int(np.searchsorted(times, t + 1e-6, side="right")) - 1
    return observed[i] if i >= 0 else None


def score_episode(record: dict) -> dict:
    """Outcome, subtask and caption accuracy, latency and rates of one episode record."""
    observed = record["observed"]
    speech_ok = speech_n = caption_ok = caption_n = 0
    for stamp, text in record.get("speech", []):
        truth = _nearest_before(observed, stamp)
        if truth is not None:
            speech_n += 1
            speech_ok += text_matches(text, SUBTASKS[truth["subtask"]])
    for stamp, text in record.get("memory", []):
        truth = _nearest_before(observed, stamp)
        if truth is not None:
            caption_n += 1
            caption_ok += text_matches(text, truth["caption"])
    latencies = record.get("latencies", [])
    inference = record.get("inference_latencies") or []
    # frame to chunk minus the engine's inference latency of the same chunk: the time before the engine took the
    # frame (queueing behind the previous cycle, the node's polling, delivery)
    waiting = [total - engine for total, engine in zip(latencies, inference) if engine is not None] \
        if len(inference) == len(latencies) else []
    measured = [x for x in inference if x is not None]
    frames = record.get("frames") or []
    wall = record.get("wall_s") or 0.0
    distances = record.get("right_distance") or []
    return {"seed": record["seed"], "outcome": outcome(record["flags"]), "first_s": phase_times(record["flags"]),
            "steps": len(record["flags"]),
            "closest_m": float(min(distances)) if distances else None,
            "subtask_correct": speech_ok, "subtask_total": speech_n,
            "caption_correct": caption_ok, "caption_total": caption_n,
            "chunks": record.get("chunks", 0), "mean_latency_s": float(np.mean(latencies)) if latencies else None,
            "mean_inference_latency_s": float(np.mean(measured)) if measured else None,
            "mean_waiting_s": float(np.mean(waiting)) if waiting else None,
            "max_latency_s": float(np.max(latencies)) if latencies else None,
            "resent_frames": sum(1 for _, _, sends in frames if sends > 1),
            "chunks_per_wall_s": record.get("chunks", 0) / wall if wall > 0 else None,
            "wall_s": round(wall, 2), "sim_s": round(record.get("sim_s", 0.0), 3),
            "resets": record.get("resets", 0), "aborted": record.get("aborted"),
            "robot_exit": record.get("robot_exit", 0),
            # per chunk switch: the largest jump over the arm joints of the command [rad] and its velocity [rad/s]
            # (in-process conditions also: the new chunk's own velocity change after the switch [rad/s])
            "seams": [list(map(float, seam)) for seam in record.get("seams", [])]}


def seam_statistics(episodes: list[dict]) -> dict:
    """Median and 95th percentile over every chunk switch of the episodes: ``position`` [rad] and ``velocity``
    [rad/s] jumps (``score_episode``'s ``seams``), and ``chunk_velocity_change`` [rad/s], the new chunk's own
    step-to-step velocity change just after the switch where recorded (the scale of velocity jumps any chunk
    has); ``switches`` counts them (the statistics are None without any)."""
    seams = [seam + [float("nan")] * (3 - len(seam)) for e in episodes for seam in e.get("seams", [])]
    seams = np.array(seams, np.float64).reshape(-1, 3)
    stats: dict = {"switches": len(seams)}
    for column, key in enumerate(("position", "velocity", "chunk_velocity_change")):
        values = seams[:, column]
        values = values[np.isfinite(values)]
        stats[key] = ({"median": float(np.median(values)), "p95": float(np.percentile(values, 95))}
                      if len(values) else None)
    return stats


def summarise(condition: str, episodes: list[dict]) -> dict:
    """Per condition: success per phase with its 95 % Wilson interval, accuracies, means."""
    n = len(episodes)
    success = {}
    for phase in PHASES:
        k = sum(e["outcome"][phase] for e in episodes)
        low, high = wilson_interval(k, n)
        success[phase] = {"successes": k, "episodes": n, "rate": k / n if n else 0.0,
                          "ci95": [round(low, 4), round(high, 4)]}

    def accuracy(key: str) -> dict:
        ok = sum(e[f"{key}_correct"] for e in episodes)
        total = sum(e[f"{key}_total"] for e in episodes)
        return {"correct": ok, "total": total, "accuracy": ok / total if total else None}

    latencies = [e["mean_latency_s"] for e in episodes if e["mean_latency_s"] is not None]

    def mean_of(key: str) -> float | None:
        values = [e[key] for e in episodes if e.get(key) is not None]
        return float(np.mean(values)) if values else None
    chunks = sum(e["chunks"] for e in episodes)
    wall = sum(e["wall_s"] for e in episodes)
    sim = sum(e["sim_s"] for e in episodes)
    closest = [e["closest_m"] for e in episodes if e.get("closest_m") is not None]
    for phase in PHASES:
        times = [e["first_s"][phase] for e in episodes if (e.get("first_s") or {}).get(phase) is not None]
        success[phase]["median_first_s"] = float(np.median(times)) if times else None
    return {"condition": condition, "episodes": n, "success": success, "subtask": accuracy("subtask"),
            "caption": accuracy("caption"),
            "median_closest_m": float(np.median(closest)) if closest else None,
            "mean_latency_s": float(np.mean(latencies)) if latencies else None,
            "mean_inference_latency_s": mean_of("mean_inference_latency_s"),
            "mean_waiting_s": mean_of("mean_waiting_s"),
            "resent_frames": sum(e.get("resent_frames", 0) for e in episodes),
            "chunks_per_wall_s": chunks / wall if wall else None, "chunks_per_sim_s": chunks / sim if sim else None,
            "seconds_per_episode": wall / n if n else None,
            "aborted": sum(1 for e in episodes if e["aborted"]),
            "robot_exit_failures": sum(1 for e in episodes if e.get("robot_exit")),
            "seams": seam_statistics(episodes), "per_episode": episodes}
