"""OxygenNode end to end over loopback DDS (tiny preset, CPU): outputs, rates, stamps, and bad inputs.

One node (autostart) serves the whole module; every bad-input test checks that the input is counted as
a drop (or reported) and that action chunks keep flowing afterwards.
"""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from oxygen_ros.engine.detokenizer import is_speakable
from node_support import Harness, jpeg_image, publish_until, raw_image, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

CONTROL_RATE_HZ = 4.0


@pytest.fixture(scope="module")
def harness():
    h = Harness(tiny_parameters(**{
        "control_rate_hz": CONTROL_RATE_HZ, "memory.trigger.every_s": 1.0,
        "camera_reliability": ["best_effort", "reliable"], "speech.trigger.every_s": 2.0}))
    from std_msgs.msg import String

    h.instruction.publish(String(data="pick up the red cube"))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    assert h.chunks_flow(timeout=20.0)
    yield h
    h.close()


def test_action_chunks_at_the_configured_rate_stamped_with_the_observation(harness):
    start_count, start = harness.count("chunk"), time.monotonic()
    assert wait_for(lambda: harness.count("chunk") >= start_count + 12, 15.0)
    rate = (harness.count("chunk") - start_count) / (time.monotonic() - start)
    print(f"measured action-chunk rate {rate:.2f} Hz (configured {CONTROL_RATE_HZ} Hz)")
    # The control timer paces the chunks: never faster than configured (a slow or busy machine
    # may deliver fewer; that is reported on ~/status, not a test failure).
    times = harness.received_times["chunk"][start_count:]
    assert len(times) >= 12
    assert (times[-1] - times[0]) / (len(times) - 1) >= 0.8 / CONTROL_RATE_HZ
    chunks = harness.received["chunk"][start_count:]
    for chunk in chunks:
        assert (chunk.header.stamp.sec, chunk.header.stamp.nanosec) in harness.sent_stamps
        assert chunk.horizon == 10 and chunk.action_dim == 7 and len(chunk.actions) == 70
        assert chunk.header.frame_id == "base_link" and chunk.model_id.startswith("pi05_tiny")
        assert chunk.dt == pytest.approx(0.05) and 0.0 < chunk.inference_latency < 60.0
        assert list(chunk.action_names) == ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6",
                                            "gripper"]
        assert np.all(np.isfinite(chunk.actions))
    seqs = [c.observation_seq for c in chunks]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_joint_trajectory_matches_the_chunk(harness):
    assert wait_for(lambda: harness.count("trajectory") >= 1)
    trajectory = harness.received["trajectory"][-1]
    assert list(trajectory.joint_names) == ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6"]
    assert trajectory.header.stamp.sec == 0 and trajectory.header.stamp.nanosec == 0   # policy "now"
    assert len(trajectory.points) == 10
    for i, point in enumerate(trajectory.points):
        assert point.time_from_start.sec + point.time_from_start.nanosec * 1e-9 == pytest.approx((i + 1) * 0.05)
        assert len(point.positions) == 6


def test_speech_streams_partials_then_one_final(harness):
    assert wait_for(lambda: any(s.final and s.status == s.STATUS_COMPLETED for s in harness.received["speech"]),
                    20.0)
    by_utterance: dict[str, list] = {}
    for speech in list(harness.received["speech"]):
        by_utterance.setdefault(speech.utterance_id, []).append(speech)
    completed = [msgs for msgs in by_utterance.values() if msgs[-1].final and msgs[-1].status == 1]
    assert completed
    for msgs in completed:
        assert [m.sequence for m in msgs] == list(range(len(msgs)))
        assert all(not m.final and m.status == m.STATUS_IN_PROGRESS for m in msgs[:-1])
        assert len({(m.header.stamp.sec, m.header.stamp.nanosec) for m in msgs}) == 1
        assert (msgs[0].header.stamp.sec, msgs[0].header.stamp.nanosec) in harness.sent_stamps
        assert msgs[-1].task == "speech" and msgs[-1].instruction
        texts = [m.text for m in msgs]      # append-only: each partial a prefix of the next and the final
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_speech_text_carries_only_speakable_text_and_counts_the_rest(harness):
    # Random weights mostly say whitespace: such utterances still end with a final Speech, but
    # ~/speech_text (for TTS) gets only text a speech engine can say; the others are counted.
    def completed():
        return [s for s in list(harness.received["speech"]) if s.final and s.status == s.STATUS_COMPLETED]

    assert wait_for(lambda: len(completed()) >= 3, 30.0)
    finals = completed()
    speakable = Counter(s.text.strip() for s in finals if is_speakable(s.text))   # sent stripped
    unspeakable = sum(not is_speakable(s.text) for s in finals)
    print(f"{len(finals)} completed utterances, {unspeakable} without speakable text: "
          f"{[s.text for s in finals][:5]}")
    assert wait_for(lambda: not speakable - Counter(m.data for m in harness.received["speech_text"])
                    and harness.node.speech_text_withheld() >= unspeakable)
    assert all(is_speakable(m.data) for m in list(harness.received["speech_text"]))
    assert wait_for(lambda: any(v.key == "speech_text_withheld" and int(v.value) >= unspeakable
                                for status in harness.received["diagnostics"][-1].status
                                for v in status.values), 5.0)


def test_memory_entries_carry_an_embedding_and_the_cameras(harness):
    def complete(m) -> bool:    # best-effort and reliable camera both in the prefix
        return len(m.embedding) > 0 and set(m.camera_names) == {"base_0_rgb", "left_wrist_0_rgb"}

    assert wait_for(lambda: any(complete(m) for m in harness.received["memory"]), 40.0), \
        [(len(m.embedding), list(m.camera_names)) for m in harness.received["memory"]]
    entry = [m for m in harness.received["memory"] if complete(m)][-1]
    assert len(entry.embedding) == 256    # the tiny VLM's width
    assert (entry.header.stamp.sec, entry.header.stamp.nanosec) in harness.sent_stamps
    assert entry.instruction


def test_status_and_diagnostics(harness):
    assert wait_for(lambda: harness.count("status") >= 2 and harness.count("diagnostics") >= 2)
    status = harness.received["status"][-1]
    print(f"status: chunk rate {status.chunk_rate:.2f} Hz, cycle latency {status.cycle_latency_mean * 1e3:.0f} ms, "
          f"{status.tokens_per_second:.1f} tokens/s, KV peak {status.kv_pool_peak_bytes} B")
    assert status.frames > 0 and status.kv_pool_capacity_bytes > 0
    names = [s.name for s in harness.received["diagnostics"][-1].status]
    assert any(name.endswith("engine") for name in names) and any(name.endswith("inputs") for name in names)


def test_a_yuv422_yuy2_camera_produces_action_chunks(harness):
    # usb_cam's YUYV default on the required scene camera. The wrist camera pauses (its frames carry the
    # same stamps), so a chunk stamped like a YUYV frame was computed from that frame.
    drops_before = harness.node.input_drops()
    start = harness.count("chunk")
    harness.publish_cam1 = False
    harness.cam0_encoding = "yuv422_yuy2"
    try:
        def from_yuyv() -> bool:
            sent = harness.cam0_stamps.get("yuv422_yuy2", set())
            return any((c.header.stamp.sec, c.header.stamp.nanosec) in sent for c in harness.received["chunk"][start:])

        assert wait_for(from_yuyv, 20.0)
        assert harness.node.input_drops() == drops_before
    finally:
        harness.cam0_encoding = "rgb8"
        harness.publish_cam1 = True
    assert harness.chunks_flow()


@pytest.mark.parametrize("reason, message", [
    ("unsupported_encoding", lambda: raw_image(encoding="16UC1", step=64)),   # depth on an RGB slot
    ("unsupported_encoding", lambda: raw_image(encoding="32FC1", step=128)),
    ("bad_data_length", lambda: raw_image(data=bytes(100))),
    ("zero_size", lambda: raw_image(height=0, width=0, data=b"")),
    ("bad_step", lambda: raw_image(step=10, data=bytes(240))),
])
def test_bad_raw_image_is_counted_and_the_node_keeps_running(harness, reason, message):
    before = harness.drops(reason)
    assert publish_until(lambda: harness.cam0.publish(message()), lambda: harness.drops(reason) > before)
    assert harness.chunks_flow()


def test_corrupt_jpeg_is_counted(harness):
    before = harness.drops("corrupt_compressed")
    good = jpeg_image()
    garbage = bytes(good.data[:2]) + bytes(np.random.default_rng(3).integers(0, 256, 500, dtype=np.uint8))
    assert publish_until(lambda: harness.cam1.publish(type(good)(format="jpeg", data=garbage)),
                         lambda: harness.drops("corrupt_compressed") > before)
    assert harness.chunks_flow()


def _qos_events(harness, endpoint: str) -> int:
    return harness.node.qos_events().get(endpoint, 0)


@pytest.mark.parametrize("msg_type, topic", [
    ("CompressedImage", "wrist_camera/image_raw/compressed"),   # the wrist camera subscription is reliable
    ("String", "instruction"),                                  # the instruction subscriptions are reliable
])
def test_incompatible_subscription_qos_is_counted_and_reported(harness, msg_type, topic):
    from rclpy.event_handler import PublisherEventCallbacks
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage
    from std_msgs.msg import String

    endpoint = f"subscription {harness.topic(topic)}"
    before = _qos_events(harness, endpoint)
    # Best effort: cannot reach the node. No event handlers of its own: it is destroyed from this thread
    # while the executor spins, and rclpy's default handlers would still be in the executor's wait set.
    publisher = harness.robot.create_publisher({"CompressedImage": CompressedImage, "String": String}[msg_type],
                                               topic, qos_profile_sensor_data,
                                               event_callbacks=PublisherEventCallbacks(use_default_callbacks=False))
    try:
        assert wait_for(lambda: _qos_events(harness, endpoint) > before, 20.0), harness.node.qos_events()
        assert wait_for(lambda: harness.count("status") > 0 and harness.received["status"][-1].incompatible_qos > 0,
                        20.0)
        assert wait_for(lambda: any(v.key == f"incompatible QoS {endpoint}"
                                    for d in list(harness.received["diagnostics"]) for v in d.status[1].values), 20.0)
    finally:
        harness.robot.destroy_publisher(publisher)
    assert harness.chunks_flow()


def test_incompatible_publisher_qos_is_counted(harness):
    from oxygen_ros.msg import ActionChunk
    from rclpy.event_handler import SubscriptionEventCallbacks
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

    # A controller asking for transient-local chunks: the node's volatile publisher cannot serve it.
    endpoint = f"publisher {harness.topic('oxygen_node/action_chunk')}"
    before = _qos_events(harness, endpoint)
    subscription = harness.robot.create_subscription(ActionChunk, "oxygen_node/action_chunk", lambda msg: None,
                                                     QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                                                durability=DurabilityPolicy.TRANSIENT_LOCAL),
                                                     event_callbacks=SubscriptionEventCallbacks(
                                                         use_default_callbacks=False))
    try:
        assert wait_for(lambda: _qos_events(harness, endpoint) > before, 20.0), harness.node.qos_events()
    finally:
        harness.robot.destroy_subscription(subscription)
    assert harness.chunks_flow()


def test_an_instruction_from_a_volatile_publisher_arrives(harness):
    from std_msgs.msg import String

    # create_publisher(String, "instruction", 10): reliable and volatile, the usual way.
    endpoint = f"subscription {harness.topic('instruction')}"
    before = _qos_events(harness, endpoint)
    publisher = harness.robot.create_publisher(String, "instruction", 10)
    text = "put the cube in the bowl"
    try:
        # The instruction reaches the outputs (every Speech, including the finals of dropped requests,
        # and every MemoryEntry carries the instruction of its observation).
        assert publish_until(lambda: publisher.publish(String(data=text)),
                             lambda: any(m.instruction == text for m in list(harness.received["memory"])
                                         + list(harness.received["speech"])), timeout=60.0, interval=2.0)
        assert _qos_events(harness, endpoint) == before   # nothing incompatible in the usual case
    finally:
        harness.robot.destroy_publisher(publisher)
        harness.instruction.publish(String(data="pick up the red cube"))
    assert harness.chunks_flow()


def test_overlong_instruction_is_dropped(harness):
    from std_msgs.msg import String

    before = harness.drops("instruction_too_long")
    harness.instruction.publish(String(data="x" * 5000))
    assert wait_for(lambda: harness.drops("instruction_too_long") > before, 5.0)
    assert harness.chunks_flow()


def test_non_ascii_instruction_is_used(harness):
    from std_msgs.msg import String

    text = "prends le cube rouge — 拿起红色方块 🤖"
    harness.instruction.publish(String(data=text))
    assert wait_for(lambda: any(s.instruction == text for s in harness.received["speech"]), 20.0)
    assert harness.chunks_flow()
    harness.instruction.publish(String(data="pick up the red cube"))


@pytest.mark.parametrize("reason, names, positions", [
    ("joint_state_nan", None, [float("nan")] * 7),
    ("joint_state_missing_joint", ["joint_1", "joint_2"], [0.0, 0.0]),
])
def test_bad_joint_state_is_counted(harness, reason, names, positions):
    from sensor_msgs.msg import JointState

    from node_support import JOINTS

    before = harness.drops(reason)
    assert publish_until(lambda: harness.joints.publish(JointState(name=names or JOINTS, position=positions)),
                         lambda: harness.drops(reason) > before)
    assert harness.chunks_flow()


def test_no_camera_for_two_seconds_skips_cycles_then_recovers(harness):
    skipped = harness.node.skipped_cycles()
    harness.publish_cam0 = harness.publish_cam1 = False
    try:
        time.sleep(0.6)    # the staleness limit (0.5 s) passes
        during = harness.count("chunk")
        time.sleep(2.0)
        assert harness.count("chunk") <= during + 1    # at most a cycle already in flight
        assert harness.node.skipped_cycles() > skipped
        assert harness.node.lifecycle_state == "active"
        assert wait_for(lambda: any(d.status[0].level == d.status[0].WARN
                                    for d in harness.received["diagnostics"][-2:]), 3.0)
    finally:
        harness.publish_cam0 = harness.publish_cam1 = True
    assert harness.chunks_flow()


def test_zero_stamp_frames_are_stamped_with_receipt_time(harness):
    harness.zero_stamps = True
    try:
        start = harness.count("chunk")
        assert wait_for(lambda: harness.count("chunk") >= start + 3)
        stamp = harness.received["chunk"][-1].header.stamp
        assert stamp.sec > 1_000_000    # the node clock (wall time here), never 0
    finally:
        harness.zero_stamps = False
