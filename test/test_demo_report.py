"""The report's command line on bad input, and reading a run whose recorder was killed (no metadata.yaml)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ros


def test_missing_run_directory_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "oxygen_ros.tools.report", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "missing" in proc.stderr


def test_bag_without_metadata_is_read_from_its_mcap(tmp_path):
    from rclpy.serialization import serialize_message

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.bag_recorder import BagWriter
    from oxygen_ros.tools.report import load_run

    bag = tmp_path / "bag"
    with BagWriter(bag) as writer:
        writer.add_topic("/oxygen_node/action_chunk", "oxygen_ros/msg/ActionChunk")
        for i in range(5):
            msg = ActionChunk(horizon=2, action_dim=3, actions=[float(i)] * 6, observation_seq=i)
            writer.write("/oxygen_node/action_chunk", serialize_message(msg), 10**9 * (i + 1))
    (bag / "metadata.yaml").unlink()                  # as after a SIGKILL
    (mcap,) = bag.glob("*.mcap")
    mcap.write_bytes(mcap.read_bytes()[:-200])        # and no complete summary section
    data = load_run(tmp_path)
    assert [c["seq"] for c in data.chunks] == [0, 1, 2, 3, 4]
    assert data.topics == {"/oxygen_node/action_chunk": 5}


def test_summary_shows_the_task_outcome_the_subtasks_spoken_and_captions(tmp_path):
    import json

    from rclpy.serialization import serialize_message
    from std_msgs.msg import String

    from oxygen_ros.msg import MemoryEntry
    from oxygen_ros.tools.bag_recorder import BagWriter
    from oxygen_ros.tools.report import format_summary, load_run, summarize

    bag = tmp_path / "bag"
    spoken = ["move the right arm to the cube", "grasp the cube", "grasp the cube", " ", "lift the cube",
              "grasp the cube"]
    outcomes = [dict(seed=1000, sim_time_s=1.0, steps=40, reached=True, grasped=False, lifted=False,
                     transferred=False),
                dict(seed=1000, sim_time_s=3.5, steps=165, reached=True, grasped=True, lifted=False,
                     transferred=False)]
    with BagWriter(bag) as writer:
        writer.add_topic("/task_outcome", "std_msgs/msg/String")
        writer.add_topic("/instruction", "std_msgs/msg/String")
        writer.add_topic("/oxygen_node/speech_text", "std_msgs/msg/String")
        writer.add_topic("/oxygen_node/memory", "oxygen_ros/msg/MemoryEntry")
        writer.write("/instruction", serialize_message(String(data="transfer the cube")), 10**9)
        for i, text in enumerate(spoken):
            writer.write("/oxygen_node/speech_text", serialize_message(String(data=text)), 10**9 * (i + 2))
        for i, outcome in enumerate(outcomes):
            writer.write("/task_outcome", serialize_message(String(data=json.dumps(outcome))), 10**9 * (3 * i + 2))
        writer.write("/task_outcome", serialize_message(String(data="not json")), 10**9 * 9)   # ignored
        for i, text in enumerate(["the cube is on the right of the table"] * 2 + ["the right gripper holds the cube"]):
            writer.write("/oxygen_node/memory", serialize_message(MemoryEntry(entry_id=str(i), text=text)),
                         10**9 * (i + 2))
    summary = summarize(load_run(tmp_path))
    assert summary["task_outcome"] == outcomes[-1]
    assert summary["subtasks_spoken"] == ["move the right arm to the cube", "grasp the cube", "lift the cube",
                                          "grasp the cube"]
    assert summary["memory_captions"] == ["the cube is on the right of the table", "the right gripper holds the cube"]
    text = format_summary(summary)
    print(text)
    assert "task               reached ✓ grasped ✓ lifted ✗ transferred ✗" in text
    assert "“grasp the cube”" in text and "“the right gripper holds the cube”" in text
    # Three entries, two captions: the summary says the list is collapsed, so the counts do not look at odds.
    assert "memory entries     3 " in text and "; 2 captions (in order, repeats collapsed):" in text


def test_summary_counts_the_cycles_per_intra_op_thread_count():
    from dataclasses import asdict

    from oxygen_ros.engine.metrics import CycleRecord
    from oxygen_ros.tools.report import RunData, format_summary, summarize

    def cycle(seq, threads):
        return asdict(CycleRecord(seq=seq, frame_latency_s=0.1, action_latency_s=0.08, encode_s=0.01, prefill_s=0.02,
                                  denoise_s=0.05, decode_s=0.01, decode_steps=1, batch_sizes=[1], vision_calls=1,
                                  images_encoded=1, prefilled_tokens=10, generated_tokens=1, deadline_missed=False,
                                  pool_used_bytes=0, intra_op_threads=threads))

    summary = summarize(RunData(cycles=[cycle(0, 2), cycle(1, 1), cycle(2, 1)]))
    assert summary["intra_op_threads_cycles"] == {"1": 2, "2": 1}
    assert "over 3 cycles; intra-op threads 1 (2 cycles), 2 (1 cycles)" in format_summary(summary)
    older = [{k: v for k, v in c.items() if k != "intra_op_threads"} for c in (cycle(0, 1), cycle(1, 1))]
    assert "intra-op threads" not in format_summary(summarize(RunData(cycles=older)))   # records of an older engine


def test_summary_without_an_outcome_says_so(tmp_path):
    from oxygen_ros.tools.report import format_summary, summarize, RunData

    text = format_summary(summarize(RunData()))
    assert "task               n/a (no /task_outcome in the bag)" in text
    # A bag with no chunk and no engine status: every figure it lacks reads n/a, never Python's None.
    assert "None" not in text
    assert "(H = n/a:" in text and "deadline misses    n/a; dropped frames n/a; dropped requests n/a" in text


def test_speech_status_names_follow_the_message_definition():
    """The report reads bags without the generated classes, so its status numbers must match Speech.msg."""
    from oxygen_ros.msg import Speech
    from oxygen_ros.tools.report import SPEECH_STATUS_NAMES

    assert SPEECH_STATUS_NAMES == {Speech.STATUS_IN_PROGRESS: "in progress", Speech.STATUS_COMPLETED: "completed",
                                   Speech.STATUS_CANCELLED: "cancelled", Speech.STATUS_DROPPED: "dropped"}
