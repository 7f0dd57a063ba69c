"""The evaluation's report: the table of the conditions (markdown), a contact sheet PNG per episode, one log
line per episode."""

from __future__ import annotations

from pathlib import Path

from oxygen_ros.demo_task import PHASES, SUBTASKS
from oxygen_ros.tools.evaluate.scoring import outcome, score_episode


def markdown_table(summaries: list[dict]) -> str:
    """The report's table: one row per condition."""
    def pct(s: dict) -> str:
        return f"{s['successes']}/{s['episodes']} ({s['rate']:.0%}, {s['ci95'][0]:.0%}-{s['ci95'][1]:.0%})"

    def acc(a: dict) -> str:
        return "—" if a["accuracy"] is None else f"{a['accuracy']:.0%} ({a['correct']}/{a['total']})"

    def num(x, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    def ms(x) -> str:
        return num(None if x is None else x * 1e3, ".0f")

    lines = ["| condition | reached | grasped | lifted | transferred | grasped at [s] | closest [cm] | subtask acc. | "
             "caption acc. | frame→chunk [ms] | inference [ms] | waiting [ms] | chunks/s (wall) | chunks/s (sim) | "
             "s/episode | transferred at [s] | seam [rad] med / p95 | seam [rad/s] med / p95 | chunk's own [rad/s] med |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def seam(stats: dict | None, fmt: str) -> str:
        return "—" if not stats else f"{stats['median']:{fmt}} / {stats['p95']:{fmt}}"
    for s in summaries:
        closest = s.get("median_closest_m")
        lines.append(f"| {s['condition']} | " + " | ".join(pct(s["success"][p]) for p in PHASES)
                     + f" | {num(s['success']['grasped'].get('median_first_s'), '.1f')}"
                     + f" | {num(None if closest is None else closest * 100, '.1f')}"
                     + f" | {acc(s['subtask'])} | {acc(s['caption'])} | "
                     f"{ms(s['mean_latency_s'])} | {ms(s.get('mean_inference_latency_s'))} | "
                     f"{ms(s.get('mean_waiting_s'))} | "
                     f"{num(s['chunks_per_wall_s'], '.2f')} | {num(s['chunks_per_sim_s'], '.2f')} | "
                     f"{num(s['seconds_per_episode'], '.1f')} | "
                     f"{num(s['success']['transferred'].get('median_first_s'), '.1f')} | "
                     f"{seam((s.get('seams') or {}).get('position'), '.3f')} | "
                     f"{seam((s.get('seams') or {}).get('velocity'), '.2f')} | "
                     f"{num(((s.get('seams') or {}).get('chunk_velocity_change') or {}).get('median'), '.2f')} |")
    return "\n".join(lines)


def contact_sheet(record: dict, condition: str, path: Path) -> Path:
    """A PNG of the top camera over the episode: each frame titled with its time, the ground-truth subtask
    and the phases reached so far; the speech heard nearest before it below (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sheet = record.get("sheet", [])
    cols = max(1, len(sheet))
    fig, axes = plt.subplots(1, cols, figsize=(max(3.2 * cols, 7.0), 3.3), squeeze=False)
    start = record["observed"][0]["t"] if record["observed"] else 0.0
    for ax, (t, image, gt, flags) in zip(axes[0], sheet):
        ax.imshow(image)
        ax.set_axis_off()
        phases = ", ".join(p for p, f in zip(PHASES, flags) if f) or "—"
        heard = [text for stamp, text in record.get("speech", []) if stamp - start <= t + 1e-6]
        ax.set_title(f"t = {t:.1f} s\ntruth: {SUBTASKS[gt]}\nphase: {phases}", fontsize=7)
        if heard:
            ax.text(0.5, -0.06, f"said: {heard[-1].strip()[:40]}", transform=ax.transAxes, ha="center",
                    va="top", fontsize=7)
    result = outcome(record["flags"])
    fig.suptitle(f"{condition}, seed {record['seed']}: " + ", ".join(f"{p} {'yes' if v else 'no'}"
                                                                  for p, v in result.items()), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def episode_line(record: dict) -> str:
    s = score_episode(record)
    reached = ", ".join(f"{p} ({s['first_s'][p]:.1f} s)" for p, v in s["outcome"].items() if v) or "nothing"
    closest = "" if s["closest_m"] is None else f", closest {s['closest_m'] * 100:.1f} cm"
    return (f"{reached}{closest}; subtask {s['subtask_correct']}/{s['subtask_total']}, caption "
            f"{s['caption_correct']}/{s['caption_total']}, {s['chunks']} chunks, {s['wall_s']:.1f} s"
            + ("" if s["mean_latency_s"] is None else f"; frame to chunk {s['mean_latency_s'] * 1e3:.0f} ms")
            + ("" if s["mean_inference_latency_s"] is None else
               f" (inference {s['mean_inference_latency_s'] * 1e3:.0f} ms)")
            + (f"; {s['resent_frames']} frames re-sent" if s["resent_frames"] else "")
            + (f"; ABORTED: {s['aborted']}" if s["aborted"] else ""))
