"""oxygen_fleet_node over real DDS (loopback): three simulated robots in their namespaces on one model and
one engine. Each robot receives its own chunks, computed from its own frames (the chunk's stamp is one of
the frame stamps that robot sent, its observation_seq counts that robot's cycles); one robot's camera
stops without effect on the others; one robot is removed and re-added by service while the others run."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from node_support import jpeg_image, raw_image, tiny_parameters, wait_for

pytestmark = pytest.mark.ros

ROBOTS = ("r1", "r2", "r3")
_IDS = itertools.count(1)
LONG = 300.0     # bounds a hang only: model load and cycles on a loaded 2-core machine


class RobotSide:
    """One simulated robot: camera frames (raw scene, JPEG wrist), joint states and its instruction in its
    namespace, with header stamps of its own (``base_s`` seconds apart from other robots'), and what its
    oxygen_node publishes."""

    def __init__(self, context, namespace: str, base_s: int, publish_hz: float = 10.0):
        from builtin_interfaces.msg import Time
        from oxygen_ros.msg import ActionChunk, Speech
        from rclpy.node import Node
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from std_msgs.msg import String

        self.node = Node("robot_side", context=context, namespace=namespace)
        self.cam0 = self.node.create_publisher(Image, "camera/image_raw", qos_profile_sensor_data)
        self.cam1 = self.node.create_publisher(CompressedImage, "wrist_camera/image_raw/compressed",
                                               qos_profile_sensor_data)
        self.joints = self.node.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.instruction = self.node.create_publisher(String, "instruction", latched)
        self.instruction.publish(String(data=f"robot {namespace} picks the cube"))
        self.chunks: list = []
        self.speech: list = []
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.node.create_subscription(ActionChunk, "oxygen_node/action_chunk", self.chunks.append, reliable)
        self.node.create_subscription(Speech, "oxygen_node/speech", self.speech.append, reliable)
        self.sent: set[tuple[int, int]] = set()
        self.publishing = True
        self._index = 0
        self._base_s = base_s
        self._hz = publish_hz
        self._time = Time
        self._joint_state = JointState
        self.node.create_timer(1.0 / publish_hz, self._publish)

    def _publish(self) -> None:
        if not self.publishing:
            return
        self._index += 1
        ns = self._base_s * 10**9 + round(self._index * 1e9 / self._hz)
        stamp = self._time(sec=ns // 10**9, nanosec=ns % 10**9)
        self.sent.add((stamp.sec, stamp.nanosec))
        self.cam0.publish(raw_image(stamp=stamp))
        self.cam1.publish(jpeg_image(stamp=stamp))
        self.joints.publish(self._joint_state(name=["joint_1", "joint_2", "joint_3", "joint_4", "joint_5",
                                                    "joint_6", "gripper"], position=[0.1] * 7))

    def chunks_after(self, count: int, n: int = 2, timeout: float = LONG) -> bool:
        return wait_for(lambda: len(self.chunks) >= count + n, timeout, 0.05)


@pytest.fixture
def fleet():
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.node.executor import TransitionExecutor
    from oxygen_ros.node.fleet_node import FleetNode

    base = f"/fleet_{os.getpid()}_{next(_IDS)}"
    context = Context()
    rclpy.init(context=context)
    node = FleetNode(context=context, namespace=base,
                     parameter_overrides=[Parameter("robots", value=[f"{base}/{r}" for r in ROBOTS]),
                                          Parameter("kv_budget_mb", value=64)],
                     robot_parameters=lambda robot: tiny_parameters(**{"engine.kv_budget_mb": 16}))
    sides = {r: RobotSide(context, f"{base}/{r}", 1000 * (i + 1)) for i, r in enumerate(ROBOTS)}
    executor = TransitionExecutor(node.runs_long, context=context)
    executor.add_node(node)
    for side in sides.values():
        executor.add_node(side.node)
    stop = threading.Event()

    def spin():
        while not stop.is_set() and rclpy.ok(context=context):
            executor.spin_once(timeout_sec=0.05)

    node.attach(executor)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    yield node, sides, base
    stop.set()
    thread.join(timeout=10.0)
    executor.shutdown(timeout_sec=5.0)
    node.close()
    node.destroy_node()
    for side in sides.values():
        side.node.destroy_node()
    context.try_shutdown()
    context.destroy()


def _own_chunks(side: RobotSide, others: list[RobotSide], start: int = 0, end: int | None = None):
    """Every chunk ``side`` received (``start:end``: one life of its node) carries one of its own frame stamps
    (none of another robot's), and its observation_seq values increase."""
    chunks = side.chunks[start:end]
    stamps = [(c.header.stamp.sec, c.header.stamp.nanosec) for c in chunks]
    assert stamps and all(s in side.sent for s in stamps)
    assert not any(s in other.sent for other in others for s in stamps)
    seqs = [c.observation_seq for c in chunks]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def _call(node, side: RobotSide, service: str, robot: str):
    from oxygen_ros.srv import FleetRobot

    client = side.node.create_client(FleetRobot, f"{node.get_fully_qualified_name()}/{service}")
    assert client.wait_for_service(timeout_sec=30.0)
    future = client.call_async(FleetRobot.Request(robot=robot))
    assert wait_for(future.done, LONG)
    side.node.destroy_client(client)
    return future.result()


def test_three_robots_on_one_engine(fleet):
    node, sides, base = fleet
    # every robot gets its own chunks, from its own frames
    for side in sides.values():
        assert side.chunks_after(0), f"robots served: {node.robots}"
    assert node.server is not None and sorted(node.server.robots) == sorted(f"{base}/{r}" for r in ROBOTS)
    for name, side in sides.items():
        _own_chunks(side, [s for n, s in sides.items() if n != name])
    # r2's cameras stop: its chunks stop, r1 and r3 keep theirs
    sides["r2"].publishing = False
    assert wait_for(lambda: node.robot_node(f"{base}/r2").skip_reasons().get("no_observation", 0) > 0, LONG)
    r2_count = len(sides["r2"].chunks)
    for name in ("r1", "r3"):
        assert sides[name].chunks_after(len(sides[name].chunks))
    assert len(sides["r2"].chunks) <= r2_count + 1      # at most the cycle in flight when it stopped
    sides["r2"].publishing = True
    assert sides["r2"].chunks_after(len(sides["r2"].chunks))
    # r3 removed by service while r1 and r2 run, then added back
    answer = _call(node, sides["r1"], "remove_robot", f"{base}/r3")
    assert answer.success, answer.message
    assert f"{base}/r3" not in node.robots and f"{base}/r3" not in node.server.robots
    assert f"{base}/r3" not in node.server.fleet.core.shares
    removed_at = len(sides["r3"].chunks)
    for name in ("r1", "r2"):
        assert sides[name].chunks_after(len(sides[name].chunks))
    assert len(sides["r3"].chunks) == removed_at
    assert not _call(node, sides["r1"], "remove_robot", f"{base}/r3").success     # not served any more
    answer = _call(node, sides["r1"], "add_robot", f"{base}/r3")
    assert answer.success, answer.message
    assert not _call(node, sides["r1"], "add_robot", f"{base}/r3").success        # already served
    assert sides["r3"].chunks_after(removed_at)
    others = {name: [s for n, s in sides.items() if n != name] for name in sides}
    for name in ("r1", "r2"):
        _own_chunks(sides[name], others[name])
    # r3 before its removal and after: its re-added node counts its own cycles from 0 again
    _own_chunks(sides["r3"], others["r3"], end=removed_at)
    _own_chunks(sides["r3"], others["r3"], start=removed_at)
    assert sides["r3"].chunks[removed_at].observation_seq < sides["r3"].chunks[removed_at - 1].observation_seq
