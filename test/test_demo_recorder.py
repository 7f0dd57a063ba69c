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
