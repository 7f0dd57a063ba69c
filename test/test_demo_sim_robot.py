"""The demo's simulated ALOHA robot: rendered cameras and joint states out, action chunks executed."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import spin_until

pytestmark = pytest.mark.ros


def test_sim_robot_publishes_cameras_and_joints_and_executes_chunks(ros_context):
    pytest.importorskip("gym_aloha")
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import qos_profile_sensor_data
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.sim_robot import CAMERAS, SimRobot

    robot = SimRobot(context=ros_context, parameter_overrides=[])
    probe = Node("probe", context=ros_context)
    images: dict[str, Image] = {}
    joints: list[JointState] = []
    for camera in CAMERAS:
        probe.create_subscription(Image, f"/cameras/{camera}/image_raw",
                                  lambda msg, c=camera: images.__setitem__(c, msg), qos_profile_sensor_data)
    probe.create_subscription(JointState, "/joint_states", joints.append, 10)
    outcomes: list[dict] = []
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    probe.create_subscription(String, "/task_outcome", lambda msg: outcomes.append(json.loads(msg.data)), latched)
    chunk_pub = probe.create_publisher(ActionChunk, "/oxygen_node/action_chunk", 10)
    executor = MultiThreadedExecutor(num_threads=2, context=ros_context)
    executor.add_node(robot)
    executor.add_node(probe)
    try:
        assert spin_until(executor, lambda: len(images) == 3 and len(joints) > 5, timeout=20.0)
        for camera, image in images.items():
            assert (image.height, image.width, image.encoding, image.step) == (240, 320, "rgb8", 960)
            pixels = np.frombuffer(bytes(image.data), dtype=np.uint8)
            assert pixels.size == 240 * 960 and pixels.std() > 5.0, camera  # a real scene, not a blank
        state = joints[-1]
        assert len(state.name) == 14 and len(state.position) == 14 and state.name[0] == "left_arm_waist"
        start_waist = state.position[0]

        # Hold the left waist at +0.4 rad for the whole chunk (10 actions of 0.1 s), everything else as is.
        target = np.array(state.position)
        target[0] = 0.4
        chunk = ActionChunk(action_names=list(state.name), horizon=10, action_dim=14, dt=0.1,
                            actions=np.tile(target, 10).astype(np.float32).tolist(), observation_seq=1)
        chunk.header.stamp = robot.get_clock().now().to_msg()
        chunk_pub.publish(chunk)
        assert spin_until(executor, lambda: abs(joints[-1].position[0] - 0.4) < 0.1, timeout=10.0), \
            f"left waist went from {start_waist:.3f} to {joints[-1].position[0]:.3f} rad, target 0.4"
        assert robot.chunks_received >= 1 and robot.chunks_rejected == 0

        # A chunk the robot cannot execute is counted and ignored.
        chunk_pub.publish(ActionChunk(horizon=2, action_dim=7, dt=0.1, actions=[0.0] * 14))
        assert spin_until(executor, lambda: robot.chunks_rejected == 1, timeout=5.0)

        # The task's outcome so far, scored after the cube settled: nothing touched it at the start pose.
        assert spin_until(executor, lambda: outcomes and outcomes[-1]["steps"] > 0, timeout=10.0), outcomes
        last = outcomes[-1]
        assert last["seed"] == 0 and last["sim_time_s"] >= 0.2
        assert {k: last[k] for k in ("reached", "grasped", "lifted", "transferred")} == \
            dict.fromkeys(("reached", "grasped", "lifted", "transferred"), False)
    finally:
        executor.shutdown()
        robot.destroy_node()
        probe.destroy_node()


def test_outcome_tracker_keeps_phases_reached_and_transferred_only_when_it_holds():
    pytest.importorskip("gym_aloha")
    from oxygen_ros.demo_task import SceneState
    from oxygen_ros.tools.sim_robot import OutcomeTracker

    def state(z, right=0, left=0, on_table=True, distance=0.2):
        return SceneState(cube=np.array([0.1, 0.5, z]), right_fingers=right, left_fingers=left,
                          on_table=on_table, right_distance=distance)

    tracker = OutcomeTracker(seed=7, settle_s=0.2)
    assert not tracker.update(state(0.05, right=2, distance=0.0), 0.1)      # still settling: ignored
    assert tracker.steps == 0 and not any(tracker.outcome().values())
    assert not tracker.update(state(0.02), 0.2)                             # rest height 0.02 m
    assert tracker.update(state(0.02, distance=0.01), 0.22)                 # reached
    assert tracker.update(state(0.02, right=2, distance=0.01), 0.24)        # grasped
    assert tracker.update(state(0.08, right=2, on_table=False, distance=0.01), 0.26)   # lifted
    assert tracker.update(state(0.08, left=2, on_table=False), 0.28)        # transferred
    assert tracker.outcome() == dict(reached=True, grasped=True, lifted=True, transferred=True)
    assert tracker.update(state(0.02), 0.30)                                # dropped: no longer transferred
    message = json.loads(tracker.to_json())
    assert message["transferred"] is False and message["lifted"] is True and message["seed"] == 7
    assert message["steps"] == 6 and message["now"] == dict.fromkeys(message["now"], False)


def test_wild_actions_keep_the_physics_stable():
    """Targets jumping between the control-range extremes every 20 ms (what random weights send) are
    rate-limited: the state stays finite and the scene never needs a reset."""
    pytest.importorskip("gym_aloha")
    from oxygen_ros.tools.sim_robot import AlohaScene

    scene = AlohaScene(width=64, height=48)
    try:
        rng = np.random.default_rng(0)
        for i in range(300):
            scene.set_action(rng.choice([-10.0, 10.0], size=14))
            assert scene.step(0.02)
        position, velocity = scene.joint_state()
        assert np.all(np.isfinite(position)) and np.all(np.isfinite(velocity))
        assert scene.resets == 0
    finally:
        scene.close()


def test_instability_resets_the_scene_and_shutdown_ends_the_threads_quietly(ros_context, tmp_path, monkeypatch):
    """A blown-up state is reset (counted, warned in the ROS log, no MUJOCO_LOG.TXT in the working
    directory); shutting the context down while the camera and physics threads run raises nothing."""
    pytest.importorskip("gym_aloha")
    import threading
    import time

    from oxygen_ros.tools.sim_robot import SimRobot

    monkeypatch.chdir(tmp_path)
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    robot = SimRobot(context=ros_context, parameter_overrides=[
        __import__("rclpy.parameter", fromlist=["Parameter"]).Parameter("camera_rate_hz", value=20.0)])
    try:
        with robot.scene._lock:
            robot.scene.data.qvel[:] = 1e20
        deadline = time.monotonic() + 10.0
        while robot.scene.resets == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert robot.scene.resets >= 1
        position, _ = robot.scene.joint_state()
        assert np.all(np.isfinite(position))
        assert not (tmp_path / "MUJOCO_LOG.TXT").exists()
        time.sleep(0.3)                     # cameras publishing at 20 Hz
        ros_context.try_shutdown()          # as SIGINT / SIGTERM do, before destroy_node
        time.sleep(0.3)
    finally:
        robot.destroy_node()
    assert not errors, errors
    assert all(not thread.is_alive() for thread in robot._threads)


def test_temporal_ensemble_parameter_averages_overlapping_chunks(ros_context):
    """``temporal_ensemble_m`` turns on ACT's temporal ensembling of the chunks received (off by default: the
    newest chunk wins); a non-finite chunk is rejected and counted; a bad value fails the robot's start."""
    pytest.importorskip("gym_aloha")
    import math

    from rclpy.parameter import Parameter

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.sim_robot import SimRobot

    def chunk(stamp_s: float, value: float) -> ActionChunk:
        msg = ActionChunk(horizon=50, action_dim=14, dt=0.02, actions=[value] * 700)
        msg.header.stamp.sec, msg.header.stamp.nanosec = int(stamp_s), round((stamp_s % 1) * 1e9)
        return msg

    for m, expected in ((0.0, 1.0), (0.01, math.exp(-0.1) / (1 + math.exp(-0.1)))):
        robot = SimRobot(context=ros_context, parameter_overrides=[
            Parameter("temporal_ensemble_m", value=m), Parameter("width", value=64), Parameter("height", value=48)])
        try:
            robot._on_chunk(chunk(100.0, 0.0))
            robot._on_chunk(chunk(100.2, 1.0))        # 10 control steps later; both cover 100.505 s
            np.testing.assert_allclose(robot._current_action(100.505), np.full(14, expected), atol=1e-12)
            bad = chunk(100.4, 0.0)
            bad.actions = [float("nan")] * 700
            robot._on_chunk(bad)
            assert robot.chunks_received == 2 and robot.chunks_rejected == 1
        finally:
            robot.destroy_node()
    with pytest.raises(ValueError, match="temporal_ensemble_max_chunks"):
        SimRobot(context=ros_context, parameter_overrides=[Parameter("temporal_ensemble_max_chunks", value=0)])


def test_cameras_parameter_renders_and_publishes_only_the_cameras_named(ros_context):
    """``cameras`` (default all three) selects the cameras rendered round robin and published: a
    top-camera-only policy gets the whole render budget on its one camera; unknown or repeated names fail the
    robot's start."""
    pytest.importorskip("gym_aloha")
    import time

    from rclpy.parameter import Parameter

    from oxygen_ros.tools.sim_robot import CAMERAS, SimRobot

    robot = SimRobot(context=ros_context, parameter_overrides=[
        Parameter("cameras", value=["top"]), Parameter("camera_rate_hz", value=20.0),
        Parameter("width", value=64), Parameter("height", value=48)])
    try:
        assert robot.cameras == ("top",)
        assert [name for name, _ in robot.get_publisher_names_and_types_by_node("aloha_sim", "/")
                if name.startswith("/cameras/")] == ["/cameras/top/image_raw"]
        deadline = time.monotonic() + 30.0
        while robot.images_published["top"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert robot.images_published == {"top": robot.images_published["top"]}
        assert robot.images_published["top"] >= 3
    finally:
        robot.destroy_node()
    default = SimRobot(context=ros_context, parameter_overrides=[Parameter("width", value=64),
                                                                   Parameter("height", value=48)])
    try:
        assert default.cameras == CAMERAS
    finally:
        default.destroy_node()
    for cameras in (["front"], ["top", "top"]):
        with pytest.raises(ValueError, match="cameras"):
            SimRobot(context=ros_context, parameter_overrides=[Parameter("cameras", value=cameras)])
