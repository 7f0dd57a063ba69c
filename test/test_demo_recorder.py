"""The demo's recorder: topics published over real DDS land in a rosbag2 MCAP that rosbags reads back."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import spin_until

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


def test_recorder_writes_every_topic_readable_field_for_field(ros_context, tmp_path):
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from rosbags.highlevel import AnyReader
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.bag_recorder import BagRecorder, project_typestore

    talker = Node("talker", context=ros_context)
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
    instruction_pub = talker.create_publisher(String, "/instruction", latched)
    image_pub = talker.create_publisher(Image, "/cam/image_raw", qos_profile_sensor_data)
    chunk_pub = talker.create_publisher(ActionChunk, "/oxygen/action_chunk", 10)
    # Published before the recorder exists: transient local must still bring it into the bag.
    instruction_pub.publish(String(data="fold the towel"))

    bag = tmp_path / "bag"
    recorder = BagRecorder(bag, exclude=r"^/rosout$|^/parameter_events$", context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(talker)
    executor.add_node(recorder)

    wanted = {"/instruction", "/cam/image_raw", "/oxygen/action_chunk"}
    assert spin_until(executor, lambda: wanted <= set(recorder.recorded_topics), timeout=10.0)
    # Give the new subscriptions time to match the publishers before publishing.
    spin_until(executor, lambda: image_pub.get_subscription_count() > 0
               and chunk_pub.get_subscription_count() > 0, timeout=5.0)

    image = Image(height=2, width=3, encoding="rgb8", step=9, data=bytes(range(18)))
    image.header.frame_id = "cam"
    chunk = ActionChunk(action_names=["a", "b"], horizon=2, action_dim=2, dt=0.02,
                        actions=[0.5, -1.0, 2.0, 3.25], observation_seq=7, inference_latency=0.125,
                        model_id="pi05_tiny")
    chunk.header.stamp.sec = 12
    for _ in range(3):
        image_pub.publish(image)
        chunk_pub.publish(chunk)
        spin_until(executor, lambda: False, timeout=0.1)
    assert spin_until(executor, lambda: recorder.message_counts.get("/oxygen/action_chunk", 0) >= 3
                      and recorder.message_counts.get("/instruction", 0) >= 1
                      and recorder.message_counts.get("/cam/image_raw", 0) >= 1, timeout=10.0)
    recorder.destroy_node()
    talker.destroy_node()
    executor.shutdown()

    assert (bag / "metadata.yaml").is_file() and list(bag.glob("*.mcap"))
    seen: dict[str, list] = {}
    with AnyReader([bag], default_typestore=project_typestore()) as reader:
        for connection, _, raw in reader.messages():
            seen.setdefault(connection.topic, []).append(reader.deserialize(raw, connection.msgtype))
        assert {c.topic for c in reader.connections} == wanted
    assert seen["/instruction"][0].data == "fold the towel"
    got_image = seen["/cam/image_raw"][0]
    assert (got_image.height, got_image.width, got_image.encoding, got_image.step) == (2, 3, "rgb8", 9)
    assert got_image.header.frame_id == "cam"
    np.testing.assert_array_equal(got_image.data, np.arange(18, dtype=np.uint8))
    got = seen["/oxygen/action_chunk"][0]
    assert list(got.action_names) == ["a", "b"]
    assert (got.horizon, got.action_dim, got.dt, got.observation_seq) == (2, 2, 0.02, 7)
    assert got.header.stamp.sec == 12 and got.inference_latency == 0.125 and got.model_id == "pi05_tiny"
    np.testing.assert_array_equal(got.actions, np.array([0.5, -1.0, 2.0, 3.25], dtype=np.float32))


def test_killed_recorder_bag_replays_up_to_its_last_flush(ros_context, tmp_path):
    """`oxygen_ros record` SIGKILLed: every message flushed before the kill is replayed, with a report of the
    recovery. Small messages (the node's own outputs) never fill rosbags' 1 MiB chunk, so only the periodic
    flush can bring them to disk before the recorder ends."""
    import os
    import signal
    import subprocess

    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from node_support import oxygen_ros_command, wait_for
    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.bag_reader import UnfinishedMcapReader
    from oxygen_ros.tools.replay import BagPlayer

    flush_period_s = 0.5
    topic = "/crash_test/action_chunk"
    bag = tmp_path / "bag"
    log = (tmp_path / "recorder.log").open("w")
    recorder = subprocess.Popen(oxygen_ros_command("record", "-o", str(bag), "--topics", topic,
                                                   "--flush-period", str(flush_period_s)),
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    talker = Node("talker", context=ros_context)
    publisher = talker.create_publisher(ActionChunk, topic,
                                        QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(talker)

    def on_disk() -> int:
        """Messages readable from the unclosed bag now."""
        files = sorted(bag.glob("*.mcap"))
        return UnfinishedMcapReader(files).recovery.messages if files else 0

    published = 0

    def publish(count: int) -> None:
        nonlocal published
        for _ in range(count):
            publisher.publish(ActionChunk(observation_seq=published, model_id="crash", action_names=["a"],
                                          horizon=1, action_dim=1, actions=[float(published)]))
            published += 1

    try:
        assert spin_until(executor, lambda: publisher.get_subscription_count() > 0, timeout=120.0), \
            "the recorder never subscribed"
        # Two flush boundaries seen on disk: each batch is complete in the file well within many periods.
        publish(20)
        assert wait_for(lambda: on_disk() >= 20, timeout=120 * flush_period_s, interval=flush_period_s), \
            f"{on_disk()} of 20 messages on disk: the recorder does not flush"
        publish(20)
        assert wait_for(lambda: on_disk() >= 40, timeout=120 * flush_period_s, interval=flush_period_s), \
            f"{on_disk()} of 40 messages on disk"
        flushed = 40
        publish(5)  # maybe flushed, maybe lost with the kill
        recorder.send_signal(signal.SIGKILL)
        recorder.wait(timeout=30)
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.wait()
        log.close()
        executor.shutdown()
        talker.destroy_node()
    assert not (bag / "metadata.yaml").exists()

    # The product's replay, as a user runs it: recovers and says so.
    replay = subprocess.run(oxygen_ros_command("replay", str(bag), "--rate", "100"), capture_output=True,
                            text=True, timeout=300, env=dict(os.environ))
    output = replay.stdout + replay.stderr
    print(output)
    assert replay.returncode == 0, output
    assert "Traceback" not in output
    played = int(output.split(f"{topic}: ")[1].split(" messages")[0])
    assert flushed <= played <= published
    assert f"recovered {played} messages" in output

    # What replay publishes over DDS is the recorded messages, in order, from the first.
    probe = Node("probe", context=ros_context)
    received = []
    probe.create_subscription(ActionChunk, topic, received.append,
                              QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    player = BagPlayer(bag, context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(probe)
    executor.add_node(player)
    try:
        assert spin_until(executor, lambda: player.get_subscriptions_info_by_topic(topic) != [], 10.0)
        player.start()
        assert spin_until(executor, lambda: len(received) >= played, timeout=60.0), len(received)
    finally:
        executor.shutdown()
        player.destroy_node()
        probe.destroy_node()
    assert player.recovery is not None and not player.recovery.finished
    assert [m.observation_seq for m in received] == list(range(played))
