"""Replay of rosbag2 recordings (MCAP and sqlite3) into a live graph at the recorded rate, with remapping."""
from __future__ import annotations

import contextlib
import sqlite3
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
        writer.flush()  # sqlite3: a commit, visible to another connection before the bag is closed
        with contextlib.closing(sqlite3.connect(next(bag.glob("*.db3")))) as db:
            assert db.execute("SELECT COUNT(*) FROM messages").fetchone() == (5,)

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
    with pytest.raises(ValueError, match="rate must be positive"):
        BagPlayer(tmp_path, rate=0.0, context=ros_context)


def _run(*args: str):
    """Run the installed ``oxygen_ros`` with ``args``; stdout and stderr apart, as text."""
    import os
    import subprocess

    from node_support import oxygen_ros_command

    return subprocess.run(oxygen_ros_command(*args), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def _image(typestore, i: int):
    """A 2x3 rgb8 ``sensor_msgs/Image`` (rosbags) whose stamp and first byte are ``i``."""
    image = typestore.types["sensor_msgs/msg/Image"]
    header = typestore.types["std_msgs/msg/Header"]
    stamp = typestore.types["builtin_interfaces/msg/Time"]
    return image(header=header(stamp=stamp(sec=i, nanosec=0), frame_id="cam"), height=2, width=3,
                 encoding="rgb8", is_bigendian=0, step=9, data=np.full(18, i, dtype=np.uint8))


def test_replay_skips_a_vendor_message_type_and_plays_the_cameras(ros_context, tmp_path):
    """As ``ros2 bag play``: a topic whose type is not installed is skipped with a warning, the rest plays."""
    from rclpy.executors import SingleThreadedExecutor
    from rosbags.typesys import get_types_from_msg
    from sensor_msgs.msg import Image

    from oxygen_ros.tools.bag_recorder import BagWriter
    from oxygen_ros.tools.replay import BagPlayer

    bag = tmp_path / "vendor_bag"
    with BagWriter(bag) as writer:
        typestore = writer.typestore
        # A vendor's message: its definition is in the bag, its Python package is not installed here.
        typestore.register(get_types_from_msg("int32 temperature\nstring note", "acme_gripper_msgs/msg/Status"))
        status = typestore.types["acme_gripper_msgs/msg/Status"]
        writer.add_topic("/gripper/status", "acme_gripper_msgs/msg/Status")
        writer.add_topic("/cam/image_raw", "sensor_msgs/msg/Image")
        for i in range(20):
            stamp_ns = 1_000_000_000 + i * 10_000_000
            writer.write("/gripper/status", typestore.serialize_cdr(status(temperature=i, note="ok"),
                                                                    "acme_gripper_msgs/msg/Status"), stamp_ns)
            writer.write("/cam/image_raw", typestore.serialize_cdr(_image(typestore, i), "sensor_msgs/msg/Image"),
                         stamp_ns + 1)

    probe, received = _probe(ros_context, {"/cam/image_raw": Image})
    player = BagPlayer(bag, context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(probe)
    executor.add_node(player)
    try:
        assert list(player.skipped) == ["/gripper/status"]
        assert "acme_gripper_msgs/msg/Status" in player.skipped["/gripper/status"]
        spin_until(executor, lambda: player.get_subscriptions_info_by_topic("/cam/image_raw") != [], 5.0)
        player.start()
        assert spin_until(executor, lambda: len(received["/cam/image_raw"]) == 20, timeout=30.0), \
            len(received["/cam/image_raw"])
    finally:
        executor.shutdown()
        player.destroy_node()
        probe.destroy_node()
    assert [m.header.stamp.sec for _, m in received["/cam/image_raw"]] == list(range(20))
    assert [bytes(m.data)[0] for _, m in received["/cam/image_raw"]] == list(range(20))

    # The program: exit 0, the cameras played, the vendor topic reported skipped.
    result = _run("replay", str(bag), "--rate", "100")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    assert "/cam/image_raw: 20 messages" in result.stdout
    assert "/gripper/status: skipped, message type acme_gripper_msgs/msg/Status" in result.stdout
    assert "skipping /gripper/status" in result.stderr   # the warning, as ros2 bag play gives it


# ActionChunk as recorded before real-time chunking added its rtc_* fields.
OLD_ACTION_CHUNK = """std_msgs/Header header
string[] action_names
uint32 horizon
uint32 action_dim
float64 dt
float32[] actions
uint64 observation_seq
float64 inference_latency
string model_id
string subtask
"""


@pytest.mark.parametrize("finished", [True, False], ids=["rosbag2", "unfinished mcap"])
def test_replay_upgrades_an_action_chunk_recorded_with_its_earlier_definition(ros_context, tmp_path, finished):
    """An ActionChunk recorded before the rtc_* fields existed plays as the installed type: its fields kept, the
    new ones at their "not set" values (-1, -1, empty), from a finished bag and from an unfinished MCAP alike."""
    from rclpy.executors import SingleThreadedExecutor
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.replay import BagPlayer

    typestore = get_typestore(Stores.ROS2_KILTED)
    typestore.register(get_types_from_msg(OLD_ACTION_CHUNK, "oxygen_ros/msg/ActionChunk"))
    old = typestore.types["oxygen_ros/msg/ActionChunk"]
    header, stamp = typestore.types["std_msgs/msg/Header"], typestore.types["builtin_interfaces/msg/Time"]
    bag = tmp_path / "old_bag"
    with Writer(bag, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
        connection = writer.add_connection("/oxygen/action_chunk", "oxygen_ros/msg/ActionChunk", typestore=typestore)
        for i in range(3):
            chunk = old(header=header(stamp=stamp(sec=i, nanosec=5), frame_id="base"), action_names=["a", "b"],
                        horizon=2, action_dim=2, dt=0.02, actions=np.arange(4, dtype=np.float32) + i,
                        observation_seq=i, inference_latency=0.25, model_id="pi05_demo", subtask="grasp")
            writer.write(connection, 1_000_000_000 + i * 1_000_000, typestore.serialize_cdr(chunk, connection.msgtype))
    if not finished:
        (bag / "metadata.yaml").unlink()
    probe, received = _probe(ros_context, {"/oxygen/action_chunk": ActionChunk})
    player = BagPlayer(bag, rate=10.0, context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(probe)
    executor.add_node(player)
    try:
        assert (player.recovery is None) == finished and not player.skipped
        assert list(player.upgrades) and player.upgrades[next(iter(player.upgrades))].added == \
            ["rtc_delay_steps", "rtc_takeover_index", "rtc_fallback"]
        spin_until(executor, lambda: player.get_subscriptions_info_by_topic("/oxygen/action_chunk") != [], 5.0)
        player.start()
        assert spin_until(executor, lambda: len(received["/oxygen/action_chunk"]) == 3, timeout=30.0), \
            len(received["/oxygen/action_chunk"])
    finally:
        executor.shutdown()
        player.destroy_node()
        probe.destroy_node()
    for i, (_, msg) in enumerate(received["/oxygen/action_chunk"]):
        assert (msg.header.stamp.sec, msg.header.stamp.nanosec, msg.header.frame_id) == (i, 5, "base")
        assert (list(msg.action_names), msg.horizon, msg.action_dim, msg.dt) == (["a", "b"], 2, 2, 0.02)
        assert list(msg.actions) == [float(v + i) for v in range(4)]
        assert (msg.observation_seq, msg.inference_latency, msg.model_id, msg.subtask) == (i, 0.25, "pi05_demo", "grasp")
        assert (msg.rtc_delay_steps, msg.rtc_takeover_index, msg.rtc_fallback) == (-1, -1, "")


@pytest.mark.parametrize("case", ["missing bag", "rate 0", "not a bag"])
def test_replay_error_is_one_line_and_an_exit_status(tmp_path, case):
    """A bag that cannot be played: one error line and status 1; a bad argument: usage, one error line,
    status 2; never a traceback."""
    if case == "missing bag":
        args, status, message = [str(tmp_path / "missing")], 1, f"error: {tmp_path / 'missing'} does not exist"
    elif case == "rate 0":
        args, status, message = [str(tmp_path), "--rate", "0"], 2, "error: argument --rate: must be positive"
    else:
        args, status, message = [str(tmp_path)], 1, f"error: {tmp_path} is not a rosbag2"
    result = _run("replay", *args)
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_unfinished_mcap_is_read_up_to_its_last_complete_chunk(tmp_path):
    """A recording cut anywhere (the file as a crash leaves it): every message of a chunk complete on disk is
    read, nothing of a cut chunk, and a cut inside the file's first bytes reads as empty."""
    from oxygen_ros.tools.bag_reader import UnfinishedMcapReader, open_bag
    from oxygen_ros.tools.bag_recorder import BagWriter

    bag = tmp_path / "bag"
    writer = BagWriter(bag)
    typestore = writer.typestore
    writer.add_topic("/cam/image_raw", "sensor_msgs/msg/Image")
    mcap = next(bag.glob("*.mcap"))
    flushed_sizes = []
    for batch in range(3):
        for i in range(batch * 4, batch * 4 + 4):
            writer.write("/cam/image_raw", typestore.serialize_cdr(_image(typestore, i), "sensor_msgs/msg/Image"),
                         1_000_000_000 + i)
        writer.flush()
        flushed_sizes.append(mcap.stat().st_size)
    full = mcap.read_bytes()
    writer.close()
    assert len(full) == flushed_sizes[-1]

    cut = tmp_path / "cut.mcap"
    # flushed_sizes[k]: the file right after flush k, i.e. 4 (k + 1) messages in complete chunks
    for size, expected in [(0, 0), (5, 0), (flushed_sizes[0] - 1, 0), (flushed_sizes[0] + 30, 4),
                           ((flushed_sizes[0] + flushed_sizes[1]) // 2, 4), (flushed_sizes[1] + 100, 8),
                           (flushed_sizes[2], 12)]:
        cut.write_bytes(full[:size])
        reader = UnfinishedMcapReader([cut])
        stamps = [stamp for _, stamp, _ in reader.messages()]
        assert stamps == [1_000_000_000 + i for i in range(expected)], (size, stamps)
        assert reader.recovery.messages == expected and not reader.recovery.finished
        assert reader.recovery.skipped_bytes <= size
    # The closed bag's file reads whole through its footer, and as a rosbag2 with rosbags.
    reader = UnfinishedMcapReader([mcap])
    assert reader.recovery.messages == 12 and reader.recovery.finished and reader.recovery.skipped_bytes == 0
    assert type(open_bag(bag, typestore)).__name__ == "AnyReader"


@pytest.mark.slow
def test_replay_with_the_node_in_its_process_publishes_action_chunks(tmp_path):
    """``replay --node``: the oxygen node runs in the player's process (the ``oxygen_node`` executable's executor)
    on the replayed camera and joint states and publishes action chunks; the program ends cleanly."""
    import re

    from node_support import JOINTS, REPO_ROOT
    from oxygen_ros.tools.bag_recorder import BagWriter

    bag = tmp_path / "robot_bag"
    with BagWriter(bag) as writer:
        typestore = writer.typestore
        joint_state = typestore.types["sensor_msgs/msg/JointState"]
        header = typestore.types["std_msgs/msg/Header"]
        stamp = typestore.types["builtin_interfaces/msg/Time"]
        writer.add_topic("/camera/image_raw", "sensor_msgs/msg/Image")
        writer.add_topic("/joint_states", "sensor_msgs/msg/JointState")
        for i in range(20):          # 2 s at 10 Hz
            stamp_ns = 1_000_000_000 + i * 100_000_000
            writer.write("/camera/image_raw", typestore.serialize_cdr(_image(typestore, i), "sensor_msgs/msg/Image"),
                         stamp_ns)
            state = joint_state(header=header(stamp=stamp(sec=1, nanosec=i * 100_000_000), frame_id=""),
                                name=list(JOINTS), position=np.linspace(-0.5, 0.5, len(JOINTS)),
                                velocity=np.zeros(0), effort=np.zeros(0))
            writer.write("/joint_states", typestore.serialize_cdr(state, "sensor_msgs/msg/JointState"), stamp_ns + 1)
    result = _run("replay", str(bag), "--loop", "--restamp", "--duration", "25", "--node",
                  "--params-file", str(REPO_ROOT / "config" / "pi05_tiny.yaml"),
                  "--param", "default_instruction:=pick up the cube", "--param", "staleness_limit_s:=2.0")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "cycle_failed" not in output, output[-4000:]
    published = re.search(r"action chunks published by the oxygen node: (\d+)", result.stdout)
    assert published and int(published.group(1)) > 0, output[-4000:]
