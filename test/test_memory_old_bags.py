"""Bags recorded before MemoryEntry carried a robot and a pose still replay: the bag's stored definition differs
from the installed one, and each message is re-encoded (bag_reader.Upgrade: the new fields zero / empty, so
has_pose false)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import spin_until

pytestmark = pytest.mark.ros

TOPIC = "/oxygen_node/memory"
MSGTYPE = "oxygen_ros/msg/MemoryEntry"
# msg/MemoryEntry.msg before the pose (commit a94c3ff), as recorded bags store it
OLD_DEFINITION = """\
std_msgs/Header header
string entry_id
string text
float32[] embedding
string[] camera_names
string instruction
"""


def _old_bag(path, n=3, finished=True):
    from rosbags.typesys import Stores, get_typestore, get_types_from_msg

    from oxygen_ros.tools.bag_recorder import BagWriter

    typestore = get_typestore(Stores.ROS2_KILTED)
    typestore.register(get_types_from_msg(OLD_DEFINITION, MSGTYPE))
    Entry, Header, Time = (typestore.types[t] for t in (MSGTYPE, "std_msgs/msg/Header", "builtin_interfaces/msg/Time"))
    writer = BagWriter(path, typestore=typestore)
    writer.add_topic(TOPIC, MSGTYPE)
    for i in range(n):
        old = Entry(header=Header(stamp=Time(sec=100 + i, nanosec=5), frame_id=""), entry_id=f"s-{i}",
                    text=f"a red cube {i}", embedding=np.arange(4, dtype=np.float32) + i,
                    camera_names=["base_0_rgb"], instruction="pick it up")
        writer.write(TOPIC, typestore.serialize_cdr(old, MSGTYPE), (100 + i) * 10**9)
    if finished:
        writer.close()
    else:
        writer.flush()
    return writer


def _check(msg, i):
    assert (msg.entry_id, msg.text, msg.instruction) == (f"s-{i}", f"a red cube {i}", "pick it up")
    assert list(msg.embedding) == [float(v + i) for v in range(4)] and list(msg.camera_names) == ["base_0_rgb"]
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (100 + i, 5)
    assert not msg.has_pose and msg.robot == "" and msg.pose.header.frame_id == ""


def test_old_memory_entries_are_re_encoded_from_the_recorded_definition(tmp_path):
    from oxygen_ros.msg import MemoryEntry
    from rclpy.serialization import deserialize_message

    from oxygen_ros.tools.bag_reader import Upgrade, open_bag
    from oxygen_ros.tools.bag_recorder import project_typestore

    _old_bag(tmp_path / "old")
    mcap = next((tmp_path / "old").glob("*.mcap"))
    installed = project_typestore()
    # the finished bag (AnyReader) and its file alone (the reader of unfinished recordings)
    for source in (tmp_path / "old", mcap):
        reader = open_bag(source, installed)
        try:
            [connection] = reader.connections
            assert Upgrade.needed(MSGTYPE, reader.typestore, installed)
            upgrade = Upgrade(MSGTYPE, reader.typestore, installed)
            assert set(upgrade.added) == {"robot", "has_pose", "pose"} and upgrade.dropped == []
            messages = list(reader.messages(connections=[connection]))
            assert len(messages) == 3
            for i, (_, _, raw) in enumerate(messages):
                _check(deserialize_message(upgrade(raw), MemoryEntry), i)
        finally:
            reader.close()


def test_a_bag_of_the_installed_definition_needs_no_upgrade(tmp_path):
    from oxygen_ros.tools.bag_reader import Upgrade, open_bag
    from oxygen_ros.tools.bag_recorder import BagWriter, project_typestore

    installed = project_typestore()
    with BagWriter(tmp_path / "new") as writer:
        writer.add_topic(TOPIC, MSGTYPE)
        writer.write(TOPIC, installed.serialize_cdr(installed.types[MSGTYPE](
            **{name: getattr(_installed_entry(installed), name) for name, _ in installed.fielddefs[MSGTYPE][1]}),
            MSGTYPE), 10**9)
    reader = open_bag(tmp_path / "new", installed)
    try:
        assert not Upgrade.needed(MSGTYPE, reader.typestore, installed)
    finally:
        reader.close()


def _installed_entry(typestore):
    """An installed-definition MemoryEntry (rosbags object) with a pose."""
    t = typestore.types
    time = t["builtin_interfaces/msg/Time"](sec=1, nanosec=0)
    header = t["std_msgs/msg/Header"](stamp=time, frame_id="map")
    pose = t["geometry_msgs/msg/PoseStamped"](header=header, pose=t["geometry_msgs/msg/Pose"](
        position=t["geometry_msgs/msg/Point"](x=1.0, y=2.0, z=0.0),
        orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0)))
    return t[MSGTYPE](header=header, entry_id="n-0", text="now with a pose", embedding=np.zeros(2, np.float32),
                      camera_names=[], instruction="", robot="r1", has_pose=True, pose=pose)


@pytest.mark.dds
def test_replay_publishes_old_memory_entries_as_the_installed_type(tmp_path, ros_context):
    from oxygen_ros.msg import MemoryEntry
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from oxygen_ros.tools.replay import BagPlayer

    _old_bag(tmp_path / "old")
    probe = Node("probe", context=ros_context)
    received = []
    probe.create_subscription(MemoryEntry, "/replayed/memory", received.append,
                              QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    player = BagPlayer(tmp_path / "old", remap={TOPIC: "/replayed/memory"}, rate=20.0, context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(probe)
    executor.add_node(player)
    try:
        assert list(player.upgrades) == [c.id for c in player._connections]
        assert spin_until(executor, lambda: player.get_subscriptions_info_by_topic("/replayed/memory") != [], 5.0)
        player.start()
        assert spin_until(executor, lambda: len(received) == 3, 10.0), len(received)
        for i, msg in enumerate(received):
            _check(msg, i)
    finally:
        executor.shutdown()
        player.destroy_node()
        probe.destroy_node()
