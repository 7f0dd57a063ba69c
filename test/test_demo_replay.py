"""Replay of rosbag2 recordings (MCAP and sqlite3) into a live graph at the recorded rate, with remapping."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import spin_until

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

BAG = "bags/real_frames_mcap"


def _probe(context, topics: dict[str, type], latched: set[str] = frozenset()):
    """A node that stores (arrival time [s], message) per topic."""
    from rclpy.node import Node
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

    node = Node("probe", context=context)
    received: dict[str, list] = {topic: [] for topic in topics}
    for topic, cls in topics.items():
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL if topic in latched
                         else DurabilityPolicy.VOLATILE)
        node.create_subscription(cls, topic, lambda msg, t=topic: received[t].append((time.monotonic(), msg)),
                                 qos)
    return node, received


def test_replay_real_mcap_at_recorded_rate_with_remap(ros_context, shared_data):
    from rclpy.executors import SingleThreadedExecutor
    from rosbags.highlevel import AnyReader
    from sensor_msgs.msg import CompressedImage, Image, JointState
    from std_msgs.msg import String

    from oxygen_ros.tools.bag_recorder import project_typestore
    from oxygen_ros.tools.replay import BagPlayer, parse_remaps

    bag = shared_data / BAG
    remap = parse_remaps(["/cam_high/image_raw:=/robot/camera/image_raw", "/instruction:=/robot/instruction"])
    probe, received = _probe(ros_context, {
        "/robot/camera/image_raw": Image, "/robot/instruction": String, "/joint_states": JointState,
        "/camera/color/image_raw/compressed": CompressedImage}, latched={"/robot/instruction"})
    player = BagPlayer(bag, remap=remap, context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(probe)
    executor.add_node(player)
    try:
        spin_until(executor, lambda: player.get_subscriptions_info_by_topic("/joint_states") != [], 5.0)
        spin_until(executor, lambda: False, timeout=0.5)  # let the other subscriptions match too
        player.start()
        assert spin_until(executor, player.finished.is_set, timeout=20.0)
        assert spin_until(executor, lambda: len(received["/joint_states"]) == 10
                          and len(received["/camera/color/image_raw/compressed"]) == 6, timeout=5.0)
    finally:
        executor.shutdown()
        player.destroy_node()
        probe.destroy_node()

    assert [m.data for _, m in received["/robot/instruction"]] == ["stack the green block on the yellow block"]
    assert len(received["/robot/camera/image_raw"]) == 2 and player.published["/robot/camera/image_raw"] == 2
    # The recorded rate is kept: 6 JPEGs recorded 0.2 s apart arrive about 1 s apart (loose floor only).
    jpeg_times = [t for t, _ in received["/camera/color/image_raw/compressed"]]
    span = jpeg_times[-1] - jpeg_times[0]
    print(f"6 JPEGs recorded over 1.00 s replayed over {span:.3f} s")
    assert span >= 0.6  # as fast as possible would take milliseconds
    # Byte for byte what was recorded.
    with AnyReader([bag], default_typestore=project_typestore()) as reader:
        recorded = [reader.deserialize(raw, c.msgtype) for c, _, raw in
                    reader.messages(connections=[c for c in reader.connections if c.topic == "/cam_high/image_raw"])]
    for (_, got), want in zip(received["/robot/camera/image_raw"], recorded):
        assert (got.height, got.width, got.encoding, got.step) == (want.height, want.width, want.encoding, want.step)
        assert got.header.stamp.sec == want.header.stamp.sec
        np.testing.assert_array_equal(np.frombuffer(bytes(got.data), np.uint8), want.data)


def test_replay_sqlite3_bag_with_restamp(ros_context, tmp_path):
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import JointState

    from oxygen_ros.tools.bag_recorder import BagWriter
    from oxygen_ros.tools.replay import BagPlayer

    bag = tmp_path / "sqlite_bag"
    with BagWriter(bag, storage="sqlite3") as writer:
        typestore = writer.typestore
        joint_state = typestore.types["sensor_msgs/msg/JointState"]
        header = typestore.types["std_msgs/msg/Header"]
        stamp = typestore.types["builtin_interfaces/msg/Time"]
        writer.add_topic("/joint_states", "sensor_msgs/msg/JointState")
        for i in range(5):
            msg = joint_state(header=header(stamp=stamp(sec=100, nanosec=i), frame_id=""), name=["j"],
                              position=np.array([float(i)]), velocity=np.array([], dtype=np.float64),
                              effort=np.array([], dtype=np.float64))
            writer.write("/joint_states", typestore.serialize_cdr(msg, "sensor_msgs/msg/JointState"),
                         1_000_000_000 + i * 50_000_000)
    assert list(bag.glob("*.db3"))

    probe, received = _probe(ros_context, {"/replayed/joints": JointState})
    player = BagPlayer(bag, remap={"/joint_states": "/replayed/joints"}, restamp=True, context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(probe)
    executor.add_node(player)
    try:
        spin_until(executor, lambda: player.get_subscriptions_info_by_topic("/replayed/joints") != [], 5.0)
        before = player.get_clock().now().nanoseconds
        player.start()
        assert spin_until(executor, lambda: len(received["/replayed/joints"]) == 5, timeout=10.0)
    finally:
        executor.shutdown()
        player.destroy_node()
        probe.destroy_node()
    messages = [m for _, m in received["/replayed/joints"]]
    assert [m.position[0] for m in messages] == [0.0, 1.0, 2.0, 3.0, 4.0]
    stamps = [m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec for m in messages]
    assert all(s >= before for s in stamps) and stamps == sorted(stamps)


def test_replay_rejects_bad_arguments(ros_context, tmp_path):
    from oxygen_ros.tools.replay import BagPlayer, parse_remaps

    with pytest.raises(ValueError):
        parse_remaps(["/a=/b"])
    with pytest.raises(FileNotFoundError):
        BagPlayer(tmp_path / "missing", context=ros_context)
