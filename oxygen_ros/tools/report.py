"""End-of-run summary and plots of a demo run, read back from its rosbag2 (and the engine's cycle records).

A run directory (``runs/<timestamp>/``, written by :mod:`oxygen_ros.tools.demo`) holds ``bag/`` (rosbag2
MCAP of every topic) and ``engine_cycles.json`` (the engine's per-cycle ``CycleRecord``s as dicts; the
node publishes only windowed aggregates, so the demo copies them from the in-process engine). This
module reads them back with ``rosbags`` (which also proves the bag readable) and writes:

* ``summary.json`` — the figures :func:`format_summary` prints: the task's outcome (the simulated robot's
  last ``/task_outcome``: reached, grasped, lifted, transferred), action chunks and their rate, speech
  utterances with their text and the subtasks spoken (``~/speech_text`` in order, repeats collapsed),
  memory entries and their captions, tokens/s, deadline misses, dropped frames, peak KV pool;
* ``timeline.png`` — per control cycle the encode / prefill / denoise / decode times, and below it each
  language request's life across frames (trigger frame → final frame, a dot per frame that streamed
  text);
* ``contact_sheet.png`` — sampled action chunks, each with the newest frame of every camera it could
  have used and its actions.

Command line: ``python -m oxygen_ros.tools.report runs/<timestamp>`` (re-creates the files).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rosbags.highlevel import AnyReader  # noqa: E402

from oxygen_ros.tools.bag_recorder import project_typestore  # noqa: E402

# oxygen_ros/Speech status codes (msg/Speech.msg STATUS_*) by name; this module reads bags without rclpy
# or the generated message classes, hence the numbers.
SPEECH_STATUS_NAMES = {0: "in progress", 1: "completed", 2: "cancelled", 3: "dropped"}
_PHASES = (("encode_s", "encode"), ("prefill_s", "prefill"), ("denoise_s", "denoise"), ("decode_s", "decode"))


def _stamp_ns(header) -> int:
    return header.stamp.sec * 1_000_000_000 + header.stamp.nanosec


@dataclass
class RunData:
    """What a run produced, in bag order. Times ``t`` are the bag's receive times [s since bag start]."""

    chunks: list[dict] = field(default_factory=list)      # t, seq, stamp_ns, latency_s, actions [H, D]
    speech: list[dict] = field(default_factory=list)      # t, id, sequence, final, status, text, stamp_ns
    memory: list[dict] = field(default_factory=list)      # t, id, text, stamp_ns, embedding_dim
    speech_text: list[str] = field(default_factory=list)  # ~/speech_text messages, in order
    outcomes: list[dict] = field(default_factory=list)    # /task_outcome JSON messages, in order
    statuses: list = field(default_factory=list)          # EngineStatus messages (rosbags objects)
    frames: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)  # topic -> (stamp_ns, rgb)
    cycles: list[dict] = field(default_factory=list)      # engine CycleRecord dicts
    control_rate: dict | None = None                      # control_rate.json: the node's rate and its changes
    duration_s: float = 0.0
    topics: dict[str, int] = field(default_factory=dict)  # topic -> messages in the bag


_REPORTED = ("oxygen_ros/msg/ActionChunk", "oxygen_ros/msg/Speech", "oxygen_ros/msg/MemoryEntry",
             "oxygen_ros/msg/EngineStatus", "sensor_msgs/msg/Image", "std_msgs/msg/String")
OUTCOME_TOPIC = "/task_outcome"      # the simulated robot's (sim_robot.OUTCOME_TOPIC, at the root namespace)
PHASES = ("reached", "grasped", "lifted", "transferred")


def _read_rosbag2(bag: Path):
    """(start_ns, duration_ns, topic counts, iterator of (topic, msgtype, log_ns, message)) via rosbags."""
    reader = AnyReader([bag], default_typestore=project_typestore())
    reader.open()
    counts = {c.topic: c.msgcount for c in reader.connections}

    def messages():
        try:
            for connection, log_ns, raw in reader.messages():
                if connection.msgtype in _REPORTED:
                    yield connection.topic, connection.msgtype, log_ns, reader.deserialize(raw, connection.msgtype)
        finally:
            reader.close()

    return reader.start_time, reader.duration, counts, messages()


def _read_mcap_files(files: list[Path]):
    """The same from bare MCAP files (no metadata.yaml: the recorder was killed before it wrote it), read
    record by record with the ``mcap`` library, so a file without its summary section or cut off mid-record
    still yields every complete message before the cut."""
    from mcap.records import Channel, Message, Schema
    from mcap.stream_reader import StreamReader

    typestore = project_typestore()
    records = []
    for path in files:
        schemas: dict[int, str] = {}
        channels: dict[int, tuple[str, int]] = {}
        with open(path, "rb") as stream:
            try:
                for record in StreamReader(stream, validate_crcs=False).records:
                    if isinstance(record, Schema):
                        schemas[record.id] = record.name
                    elif isinstance(record, Channel):
                        channels[record.id] = (record.topic, record.schema_id)
                    elif isinstance(record, Message) and record.channel_id in channels:
                        topic, schema_id = channels[record.channel_id]
                        records.append((topic, schemas.get(schema_id, ""), record.log_time, record.data))
            except Exception:  # noqa: BLE001  a truncated tail (killed writer): keep what was complete
                pass
    if not records:
        raise FileNotFoundError(f"no readable messages in {', '.join(str(f) for f in files)}")
    records.sort(key=lambda r: r[2])
    counts: dict[str, int] = {}
    for topic, *_ in records:
        counts[topic] = counts.get(topic, 0) + 1
    start = records[0][2]

    def messages():
        for topic, msgtype, log_ns, raw in records:
            if msgtype in _REPORTED:
                yield topic, msgtype, log_ns, typestore.deserialize_cdr(raw, msgtype)

    return start, records[-1][2] - start + 1, counts, messages()


def load_run(run_dir: Path | str) -> RunData:
    """Read ``run_dir/bag`` (and ``engine_cycles.json`` when present). A bag without ``metadata.yaml``
    (the demo was killed) is read from its ``*.mcap`` files directly.

    Raises:
        FileNotFoundError: no run directory, or no rosbag2 / MCAP file in it.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory")
    bag = run_dir / "bag"
    if (bag / "metadata.yaml").is_file():
        start, duration_ns, counts, messages = _read_rosbag2(bag)
    else:
        files = sorted(bag.glob("*.mcap")) if bag.is_dir() else []
        if not files:
            raise FileNotFoundError(f"no rosbag2 (metadata.yaml) and no .mcap file in {bag}")
        start, duration_ns, counts, messages = _read_mcap_files(files)
    data = RunData()
    data.duration_s = duration_ns * 1e-9
    data.topics = counts
    for topic, kind, log_ns, msg in messages:
        t = (log_ns - start) * 1e-9
        if kind.endswith("ActionChunk"):
            data.chunks.append({"t": t, "seq": int(msg.observation_seq), "stamp_ns": _stamp_ns(msg.header),
                                "latency_s": float(msg.inference_latency),
                                "actions": np.asarray(msg.actions).reshape(msg.horizon, msg.action_dim),
                                "names": list(msg.action_names)})
        elif kind.endswith("Speech"):
            data.speech.append({"t": t, "id": msg.utterance_id, "sequence": int(msg.sequence),
                                "final": bool(msg.final), "status": int(msg.status), "text": msg.text,
                                "task": msg.task, "stamp_ns": _stamp_ns(msg.header)})
        elif kind.endswith("MemoryEntry"):
            data.memory.append({"t": t, "id": msg.entry_id, "text": msg.text,
                                "stamp_ns": _stamp_ns(msg.header), "embedding_dim": len(msg.embedding)})
        elif kind.endswith("EngineStatus"):
            data.statuses.append(msg)
        elif kind.endswith("String"):
            if topic == OUTCOME_TOPIC:
                try:
                    outcome = json.loads(msg.data)
                except ValueError:
                    continue        # not ours: a foreign publisher on the topic
                if isinstance(outcome, dict):
                    data.outcomes.append(outcome)
            elif topic.endswith("/speech_text"):
                data.speech_text.append(msg.data)
        elif msg.encoding == "rgb8" and msg.step == msg.width * 3:
            pixels = np.asarray(msg.data, dtype=np.uint8).reshape(msg.height, msg.width, 3)
            data.frames.setdefault(topic, []).append((_stamp_ns(msg.header), pixels[::2, ::2]))
    cycles_file = run_dir / "engine_cycles.json"
    if cycles_file.is_file():
        data.cycles = json.loads(cycles_file.read_text())
    rate_file = run_dir / "control_rate.json"
    if rate_file.is_file():
        data.control_rate = json.loads(rate_file.read_text())
    return data


def _collapse(texts: list[str]) -> list[str]:
    """``texts`` stripped, blanks dropped, consecutive repeats collapsed (the order kept)."""
    out: list[str] = []
    for text in (t.strip() for t in texts):
        if text and (not out or out[-1] != text):
            out.append(text)
    return out


def summarize(data: RunData) -> dict:
    """The run's figures as a JSON-ready dict (rates per second of the span that had action chunks)."""
    chunk_times = [c["t"] for c in data.chunks]
    span = chunk_times[-1] - chunk_times[0] if len(chunk_times) > 1 else 0.0
    finals = [s for s in data.speech if s["final"]]
    completed = [s for s in finals if s["status"] == 1]
    last = data.statuses[-1] if data.statuses else None
    latencies = [c["latency_s"] for c in data.chunks]
    phase_ms = {name: float(np.mean([c[key] for c in data.cycles]) * 1e3) if data.cycles else None
                for key, name in _PHASES}
    total_tokens = sum(c["generated_tokens"] for c in data.cycles)
    busy = sum(c["frame_latency_s"] for c in data.cycles)
    per_10s = (lambda n: 10.0 * n / span) if span > 0 else (lambda n: None)
    return {
        "bag_duration_s": data.duration_s,
        "active_span_s": span,
        "action_chunks": len(data.chunks),
        "action_chunks_per_s": (len(data.chunks) - 1) / span if span > 0 else None,
        "action_horizon": int(data.chunks[0]["actions"].shape[0]) if data.chunks else None,
        "action_rate_hz": ((len(data.chunks) - 1) * data.chunks[0]["actions"].shape[0] / span
                           if span > 0 else None),
        "inference_latency_mean_s": float(np.mean(latencies)) if latencies else None,
        "speech_utterances_final": len(finals),
        "speech_utterances_completed": len(completed),
        "speech_completed_per_10s": per_10s(len(completed)),
        "speech_by_status": {name: sum(s["status"] == code for s in finals) for code, name in SPEECH_STATUS_NAMES.items()
                             if code},
        "speech_texts": [s["text"] for s in completed],
        "memory_entries": len(data.memory),
        "memory_entries_per_10s": per_10s(len(data.memory)),
        "memory_texts": [m["text"] for m in data.memory],
        "memory_captions": _collapse([m["text"] for m in data.memory]),
        "subtasks_spoken": _collapse(data.speech_text),
        "task_outcome": data.outcomes[-1] if data.outcomes else None,
        # tokens over engine busy time (the engine's definition) and over wall time.
        "tokens_per_s_engine": total_tokens / busy if busy > 0 else (last.tokens_per_second if last else None),
        "tokens_per_s_wall": total_tokens / span if span > 0 and data.cycles else None,
        "deadline_misses": int(last.deadline_misses) if last else None,
        # Over the run's recorded cycles (the node's counter above also counts cycles before the recording).
        "deadline_missed_cycles": sum(bool(c["deadline_missed"]) for c in data.cycles) if data.cycles else None,
        "deadline_missed_pct": (100.0 * sum(bool(c["deadline_missed"]) for c in data.cycles) / len(data.cycles)
                                if data.cycles else None),
        "control_rate": data.control_rate,
        "control_rate_run": _describe_rates(data.control_rate, data.cycles) if data.control_rate else None,
        "dropped_frames": int(last.dropped_frames) if last else None,
        "dropped_requests": int(last.dropped_requests) if last else None,
        "kv_pool_peak_bytes": int(max(s.kv_pool_peak_bytes for s in data.statuses)) if last else None,
        "kv_pool_capacity_bytes": int(last.kv_pool_capacity_bytes) if last else None,
        "cycles_recorded": len(data.cycles),
        "phase_mean_ms": phase_ms,
        # cycles per intra-op thread count (records of an older engine have none: empty)
        "intra_op_threads_cycles": {str(n): k for n, k in sorted(Counter(
            c["intra_op_threads"] for c in data.cycles if c.get("intra_op_threads")).items())},
        "camera_frames": {topic: len(frames) for topic, frames in data.frames.items()},
        "topics": data.topics,
    }


def _describe_rates(log: dict, cycles: list[dict]) -> str:
    """The control-rate line (``tools/demo_rate.py``; imported here, not at the top: it brings the engine)."""
    from oxygen_ros.tools.demo_rate import describe_rates

    return describe_rates(log, cycles)


def format_summary(summary: dict) -> str:
    """Human-readable lines of :func:`summarize`'s figures."""
    def num(value, fmt: str = ".2f") -> str:
        return "n/a" if value is None else format(value, fmt)

    peak, capacity = summary["kv_pool_peak_bytes"], summary["kv_pool_capacity_bytes"]
    pool = (f"{peak / 2**20:.2f} MiB of {capacity / 2**20:.0f} MiB ({100 * peak / capacity:.1f} %)"
            if peak is not None and capacity else "n/a")
    phases = ", ".join(f"{name} {num(value, '.1f')}" for name, value in summary["phase_mean_ms"].items())
    outcome = summary.get("task_outcome")
    task = ("n/a (no /task_outcome in the bag)" if not outcome else
            " ".join(f"{phase} {'✓' if outcome.get(phase) else '✗'}" for phase in PHASES)
            + f"  (cube seed {outcome.get('seed')}, {num(outcome.get('sim_time_s'), '.1f')} s simulated)")
    rate = summary.get("control_rate_run")
    threads = ", ".join(f"{n} ({cycles} cycles)" for n, cycles in (summary.get("intra_op_threads_cycles") or {}).items())
    if summary.get("deadline_missed_cycles") is not None:
        misses = (f"{summary['deadline_missed_cycles']} of {summary['cycles_recorded']} cycles "
                  f"({summary['deadline_missed_pct']:.1f} %)")
    else:
        misses = num(summary["deadline_misses"], "d")
    lines = [
        "==== oxygen_ros demo summary ====",
        f"task               {task}",
    ]
    if rate:
        lines.append(f"control rate       {rate}")
    lines += [
        f"action chunks      {summary['action_chunks']} in {num(summary['active_span_s'], '.1f')} s: "
        f"{num(summary['action_chunks_per_s'])} chunks/s (H = {num(summary['action_horizon'], 'd')}: "
        f"{num(summary['action_rate_hz'], '.1f')} actions/s), mean inference latency "
        f"{num(summary['inference_latency_mean_s'] and summary['inference_latency_mean_s'] * 1e3, '.0f')} ms",
        f"per cycle (mean)   {phases} [ms] over {summary['cycles_recorded']} cycles"
        + (f"; intra-op threads {threads}" if threads else ""),
        f"speech             {summary['speech_utterances_final']} utterances ended "
        f"({', '.join(f'{k} {v}' for k, v in summary['speech_by_status'].items())}); "
        f"{num(summary['speech_completed_per_10s'], '.1f')} completed per 10 s",
    ]
    spoken = summary.get("subtasks_spoken") or []
    if spoken:
        lines.append(f"subtasks spoken    {len(spoken)} (~/speech_text in order, repeats collapsed):")
        lines += [f"                     “{text}”" for text in spoken[:8]]
        if len(spoken) > 8:
            lines.append(f"                     ... {len(spoken) - 8} more")
    else:
        lines += [f"                     “{text}”" for text in summary["speech_texts"][:5]]
    captions = summary.get("memory_captions")
    lines.append(f"memory entries     {summary['memory_entries']} "
                 f"({num(summary['memory_entries_per_10s'], '.1f')} per 10 s)"
                 + (f"; {len(captions)} captions (in order, repeats collapsed):" if captions else ""))
    captions = captions or summary["memory_texts"]
    lines += [f"                     “{text}”" for text in captions[:5]]
    if len(captions) > 5:
        lines.append(f"                     ... {len(captions) - 5} more")
    lines += [
        f"tokens/s           {num(summary['tokens_per_s_engine'], '.1f')} over engine time, "
        f"{num(summary['tokens_per_s_wall'], '.1f')} over wall time",
        f"deadline misses    {misses}; dropped frames {num(summary['dropped_frames'], 'd')}; "
        f"dropped requests {num(summary['dropped_requests'], 'd')}",
        f"peak KV pool       {pool}",
        f"bag                {sum(summary['topics'].values())} messages on {len(summary['topics'])} topics, "
        f"{num(summary['bag_duration_s'], '.1f')} s; camera frames "
        + ", ".join(f"{topic.split('/')[2] if topic.count('/') > 2 else topic} {n}"
                    for topic, n in summary["camera_frames"].items()),
    ]
    return "\n".join(lines)


def _frame_of(chunks: list[dict], t: float) -> int | None:
    """Seq of the newest action chunk received at or before bag time ``t`` [s]."""
    times = [c["t"] for c in chunks]
    i = bisect.bisect_right(times, t) - 1
    return chunks[i]["seq"] if i >= 0 else None


def plot_timeline(data: RunData, path: Path) -> None:
    """Per-cycle phase times (stacked, ms) and each language request's life across frames."""
    fig, (ax_cycles, ax_requests) = plt.subplots(2, 1, figsize=(12, 7), sharex=True,
                                                 gridspec_kw={"height_ratios": [1, 1.3]})
    if data.cycles:
        seqs = np.array([c["seq"] for c in data.cycles])
        bottom = np.zeros(len(seqs))
        for key, name in _PHASES:
            values = np.array([c[key] for c in data.cycles]) * 1e3
            ax_cycles.bar(seqs, values, bottom=bottom, width=0.9, label=name)
            bottom += values
        misses = seqs[[c["deadline_missed"] for c in data.cycles]]
        if len(misses):
            ax_cycles.plot(misses, np.full(len(misses), bottom.max() * 1.05), "rv", ms=4, label="deadline missed")
        # Head room above the bars and markers for the legend, so it hides none of them.
        ax_cycles.set_ylim(0, max(bottom.max(), 1e-3) * 1.4)
        ax_cycles.legend(loc="upper right", ncols=5, fontsize=8)
    else:
        ax_cycles.text(0.5, 0.5, "no engine cycle records", ha="center", transform=ax_cycles.transAxes)
    ax_cycles.set_ylabel("time per cycle [ms]")
    ax_cycles.set_title("control cycles: encode / prefill / denoise / decode")

    seq_of_stamp = {c["stamp_ns"]: c["seq"] for c in data.chunks}
    requests: dict[str, dict] = {}
    for s in data.speech:
        r = requests.setdefault(s["id"], {"task": s["task"] or "speech", "stamp_ns": s["stamp_ns"], "frames": [],
                                          "end": None, "status": None})
        r["frames"].append(_frame_of(data.chunks, s["t"]))
        if s["final"]:
            r["end"], r["status"] = _frame_of(data.chunks, s["t"]), s["status"]
    for m in data.memory:   # memory entries appear once, when complete
        requests[m["id"]] = {"task": "memory", "stamp_ns": m["stamp_ns"], "frames": [],
                             "end": _frame_of(data.chunks, m["t"]), "status": 1}
    colors = {"speech": "tab:blue", "memory": "tab:green"}
    for row, (rid, r) in enumerate(sorted(requests.items(), key=lambda kv: kv[1]["stamp_ns"])):
        start = seq_of_stamp.get(r["stamp_ns"])
        end = r["end"] if r["end"] is not None else max([f for f in r["frames"] if f is not None], default=start)
        if start is None or end is None:
            continue
        color = colors.get(r["task"], "tab:purple")
        ax_requests.plot([start, end], [row, row], "-", color=color, lw=2, alpha=0.8)
        partial = [f for f in r["frames"] if f is not None]
        ax_requests.plot(partial, [row] * len(partial), ".", color=color, ms=4)
        ax_requests.plot([end], [row], "|" if r["status"] == 1 else "x", color="k", ms=8)
    for task, color in colors.items():
        ax_requests.plot([], [], "-", color=color, label=task)
    ax_requests.legend(loc="upper left", fontsize=8)
    ax_requests.set_ylabel("language request")
    ax_requests.set_xlabel("frame (observation seq of the action chunk)")
    ax_requests.set_title("language requests: trigger frame → final frame (dots: frames that streamed text; "
                          "| completed, x other end)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_contact_sheet(data: RunData, path: Path, rows: int = 6) -> None:
    """Sampled action chunks: the newest frame per camera at the chunk's stamp, and the chunk's actions."""
    cameras = sorted(data.frames)
    # Chunks computed before every camera has a recorded frame (the bag started mid-stream) would
    # show empty panels: sample among the chunks that have a frame of every camera at or before them.
    first_frame = max((min(f[0] for f in frames) for frames in data.frames.values() if frames), default=0)
    shown = [c for c in data.chunks if c["stamp_ns"] >= first_frame] or data.chunks
    picks = [shown[int(i)] for i in np.linspace(0, len(shown) - 1, min(rows, len(shown)))] if shown else []
    ncols = len(cameras) + 1
    fig, axes = plt.subplots(max(1, len(picks)), ncols, figsize=(3.2 * ncols, 2.4 * max(1, len(picks))),
                             squeeze=False)
    for row, chunk in enumerate(picks):
        for col, topic in enumerate(cameras):
            ax = axes[row][col]
            frames = [f for f in data.frames[topic] if f[0] <= chunk["stamp_ns"]]
            if frames:
                stamp, image = frames[-1]
                ax.imshow(image)
                ax.set_title(f"{topic.split('/')[-2]} ({(chunk['stamp_ns'] - stamp) * 1e-9:.2f} s old)", fontsize=8)
            ax.axis("off")
        ax = axes[row][-1]
        actions = chunk["actions"]
        ax.plot(np.arange(actions.shape[0]), actions, lw=0.8)
        ax.set_title(f"chunk seq {chunk['seq']}: {actions.shape[0]}x{actions.shape[1]} actions, "
                     f"{chunk['latency_s'] * 1e3:.0f} ms", fontsize=8)
        ax.tick_params(labelsize=7)
    if not picks:
        axes[0][0].text(0.5, 0.5, "no action chunks", ha="center")
    fig.suptitle("input frames and the action chunk computed from them (x: action step, y: joint targets)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(run_dir: Path | str) -> dict:
    """Read the run, write ``summary.json``, ``timeline.png``, ``contact_sheet.png``; return the summary."""
    run_dir = Path(run_dir)
    data = load_run(run_dir)
    summary = summarize(data)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_timeline(data, run_dir / "timeline.png")
    plot_contact_sheet(data, run_dir / "contact_sheet.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m oxygen_ros.tools.report RUN_DIR``: print the summary and (re)write the plots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a demo run directory (with bag/)")
    args = parser.parse_args(argv)
    try:
        summary = write_report(args.run_dir)
    except FileNotFoundError as error:
        print(f"report: {error}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
