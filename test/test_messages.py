"""The package build is real: generated messages serialise, cross real DDS, and install where ROS looks."""
from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest

from conftest import spin_until

pytestmark = pytest.mark.ros

MESSAGE_NAMES = ["ActionChunk", "Speech", "MemoryEntry", "EngineStatus"]


def _message_class(name: str):
    from oxygen_ros import msg

    return getattr(msg, name)


def _filled(name: str):
    """An instance of ``oxygen_ros/msg/<name>`` with every field set to a non-default value."""
    from builtin_interfaces.msg import Time
    from std_msgs.msg import Header

    cls = _message_class(name)
    message = cls()
    for index, (field, ros_type) in enumerate(cls.get_fields_and_field_types().items(), start=1):
        if ros_type == "std_msgs/Header":
            value = Header(stamp=Time(sec=1_700_000_000 + index, nanosec=123_456_789), frame_id="base_link")
        elif ros_type == "geometry_msgs/PoseStamped":
            from geometry_msgs.msg import Point, Pose, PoseStamped, Quaternion

            value = PoseStamped(header=Header(stamp=Time(sec=1_700_000_000 + index, nanosec=5), frame_id="map"),
                                pose=Pose(position=Point(x=1.0, y=-2.0, z=0.5),
                                          orientation=Quaternion(x=0.0, y=0.0, z=0.6, w=0.8)))
        elif ros_type == "sequence<string>":
            value = [f"{field}_{i}" for i in range(3)]
        elif ros_type == "sequence<float>":
            value = [0.25 * i - 1.0 for i in range(12)]
        elif ros_type == "string":
            value = f"{field} ünïcødé {index}"
        elif ros_type == "boolean":
            value = True
        elif ros_type in ("float", "double"):
            value = 1.5 + index
        elif ros_type in ("uint8", "uint32", "uint64"):
            value = index + 2
        elif ros_type in ("int32", "int64"):
            value = -(index + 2)
        else:
            raise AssertionError(f"{name}.{field}: no test value for type {ros_type}")
        setattr(message, field, value)
    return message


def _assert_equal(name: str, got, want) -> None:
    for field in type(want).get_fields_and_field_types():
        a, b = getattr(got, field), getattr(want, field)
        if hasattr(b, "__len__") and not isinstance(b, str):
            assert len(a) == len(b), f"{name}.{field}"
            for x, y in zip(a, b):
                assert x == y or (isinstance(y, float) and math.isclose(x, y, rel_tol=1e-6)), f"{name}.{field}"
        else:
            assert a == b, f"{name}.{field}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_message_serialises_and_deserialises_with_all_fields_set(name):
    from rclpy.serialization import deserialize_message, serialize_message

    message = _filled(name)
    data = serialize_message(message)
    assert isinstance(data, bytes) and len(data) > 0
    _assert_equal(name, deserialize_message(data, _message_class(name)), message)


def test_message_fields_document_units_and_speech_status_constants():
    from oxygen_ros.msg import Speech

    share = _share_dir()
    for name in MESSAGE_NAMES:
        lines = [line for line in (share / "msg" / f"{name}.msg").read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        undocumented = [line for line in lines if "#" not in line]
        assert not undocumented, f"{name}.msg fields without a comment: {undocumented}"
    assert {Speech.STATUS_IN_PROGRESS, Speech.STATUS_COMPLETED, Speech.STATUS_CANCELLED,
            Speech.STATUS_DROPPED} == {0, 1, 2, 3}


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_message_round_trips_through_rclpy_publisher_and_subscriber(name, ros_context):
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import QoSDurabilityPolicy, QoSProfile, QoSReliabilityPolicy

    qos = QoSProfile(depth=5, reliability=QoSReliabilityPolicy.RELIABLE,
                     durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
    node = Node(f"roundtrip_{name.lower()}", context=ros_context)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(node)
    received = []
    try:
        cls = _message_class(name)
        topic = f"/test_roundtrip/{name.lower()}"
        publisher = node.create_publisher(cls, topic, qos)
        node.create_subscription(cls, topic, received.append, qos)
        message = _filled(name)
        assert spin_until(executor, lambda: publisher.get_subscription_count() > 0, timeout=10.0)
        publisher.publish(message)
        assert spin_until(executor, lambda: len(received) > 0, timeout=10.0), "no message arrived over DDS"
        _assert_equal(name, received[0], message)
    finally:
        executor.shutdown()
        node.destroy_node()


def _share_dir() -> Path:
    from ament_index_python.packages import get_package_share_directory

    return Path(get_package_share_directory("oxygen_ros"))


def test_installed_files_are_where_ros2_run_and_ros2_launch_look():
    from ament_index_python.packages import get_package_prefix

    prefix = Path(get_package_prefix("oxygen_ros"))
    marker = prefix / "share" / "ament_index" / "resource_index" / "packages" / "oxygen_ros"
    assert marker.exists(), "ament index marker missing: `ros2 run/launch` would not find the package"
    executable = prefix / "lib" / "oxygen_ros" / "oxygen_node"
    assert executable.exists() and os.stat(executable).st_mode & stat.S_IXUSR, f"{executable} is not executable"
    share = _share_dir()
    assert (share / "package.xml").exists()
    assert (share / "launch" / "oxygen.launch.py").exists()
    assert sorted(p.name for p in (share / "config").glob("*.yaml")), "no parameter files installed"
    for name in MESSAGE_NAMES:
        assert (share / "msg" / f"{name}.msg").exists()


def test_project_modules_import_beside_the_generated_messages():
    import oxygen_ros
    from oxygen_ros import msg
    from oxygen_ros.models import kv_cache

    package_dir = Path(oxygen_ros.__file__).parent
    assert Path(msg.__file__).parent.parent == package_dir
    assert Path(kv_cache.__file__).parent.parent == package_dir
