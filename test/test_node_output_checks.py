"""The rules behind the node's output and time checks, on their own (no DDS): joint limits from parameters
and from a URDF, expiry, clock and stamp jumps, inputs received in the future."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from oxygen_ros.node.output_checks import (JointLimits, all_finite, expired_by, limits_from_parameters,
                                           limits_from_urdf)
from oxygen_ros.node.time_checks import ClockWatch, StampWatch, clock_started

NAMES = ("shoulder", "elbow", "wrist", "gripper")

URDF = """<?xml version="1.0"?>
<robot name="arm">
  <link name="base"/><link name="l1"/><link name="l2"/><link name="l3"/>
  <joint name="shoulder" type="revolute"><parent link="base"/><child link="l1"/>
    <limit lower="-1.5" upper="1.5" effort="10" velocity="1"/></joint>
  <joint name="elbow" type="prismatic"><parent link="l1"/><child link="l2"/>
    <limit upper="0.3" effort="10" velocity="1"/></joint>
  <joint name="wrist" type="continuous"><parent link="l2"/><child link="l3"/>
    <limit effort="10" velocity="1"/></joint>
  <transmission name="t"><joint name="gripper"><hardwareInterface>x</hardwareInterface></joint></transmission>
</robot>"""


def test_limits_from_urdf_read_revolute_and_prismatic_joints_only():
    limits, unlimited = limits_from_urdf(URDF, NAMES)
    np.testing.assert_array_equal(limits.lower, [-1.5, 0.0, -math.inf, -math.inf])   # URDF default lower = 0
    np.testing.assert_array_equal(limits.upper, [1.5, 0.3, math.inf, math.inf])
    assert unlimited == ["wrist", "gripper"]   # continuous; only named inside <transmission>
    assert limits.limited == 2 and limits.source == "robot_description"


@pytest.mark.parametrize("urdf, match", [
    ("<robot", "not valid XML"),
    ("<model/>", "expected <robot>"),
    ('<robot><joint name="shoulder" type="revolute"><limit lower="a" upper="1"/></joint></robot>', "non-numeric"),
    ('<robot><joint name="shoulder" type="revolute"><limit lower="2" upper="1"/></joint></robot>', "lower > upper"),
])
def test_bad_urdf_is_a_clear_error(urdf, match):
    with pytest.raises(ValueError, match=match):
        limits_from_urdf(urdf, NAMES)


def test_limits_clamp_and_count_values_outside():
    limits = limits_from_parameters([-1.0, -math.inf, 0.0, 0.0], [1.0, 2.0, 0.0, math.inf], NAMES)
    actions = np.array([[2.0, -5.0, 0.5, 9.0], [0.0, 3.0, 0.0, -1.0]], np.float32)
    assert limits.violations(actions) == 4
    clamped = limits.clamp(actions)
    np.testing.assert_array_equal(clamped, [[1.0, -5.0, 0.0, 9.0], [0.0, 2.0, 0.0, 0.0]])
    assert clamped.dtype == np.float32 and limits.violations(clamped) == 0
    tight = limits_from_parameters([-0.05] * 4, [0.05] * 4, NAMES)    # not exact in float32
    clamped = tight.clamp(actions)
    assert tight.violations(clamped) == 0
    moved = np.abs(clamped[np.abs(actions) > 0.05].astype(np.float64))
    assert np.all(moved <= 0.05) and np.all(moved > 0.0499999)


def test_limit_parameters_are_checked():
    assert limits_from_parameters([], [], NAMES) is None
    with pytest.raises(ValueError, match="joint_limits.lower"):
        limits_from_parameters([0.0], [1.0], NAMES)
    with pytest.raises(ValueError, match="lower > upper at dimensions \\[1\\]"):
        limits_from_parameters([0.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], NAMES)
    with pytest.raises(ValueError, match="NaN"):
        JointLimits(np.array([math.nan]), np.array([1.0]), "parameters")


def test_finite_check_and_expiry():
    assert all_finite(np.zeros((10, 7))) and not all_finite(np.array([0.0, math.inf]))
    assert not all_finite(np.array([[math.nan]], np.float32))
    # ActionChunk, H = 10, dt = 0.05: the last action is due at stamp + 0.45 s.
    assert expired_by(100.0, 0.45, 100.4) is None
    assert expired_by(100.0, 0.45, 103.0) == pytest.approx(2.55)
    assert expired_by(100.0, 0.5, 100.5) is None    # due exactly now: not past


def test_clock_watch_reports_each_backwards_jump_once():
    readings = iter([5.0, 101.0, 101.5, 10.0, 10.1, 10.1, 3.0])
    jumps = []
    watch = ClockWatch(lambda: (None, next(readings)), lambda a, b: jumps.append((a, b)))
    for _ in range(7):
        watch.now()
    assert jumps == [(101.5, 10.0), (10.1, 3.0)]
    assert not clock_started(0.0) and clock_started(1e-9)


def test_clock_watch_never_reports_a_jump_between_threads_reading_in_turn():
    ticks = iter(range(10**6))
    jumps = []
    watch = ClockWatch(lambda: (None, float(next(ticks))), lambda a, b: jumps.append((a, b)))
    threads = [threading.Thread(target=lambda: [watch.now() for _ in range(2000)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert jumps == []


def test_stamp_watch_detects_a_restart_per_camera_and_keeps_the_clock_offset():
    watch = StampWatch()
    assert watch.observe("base", 100.0, 103.1) is None
    assert watch.observe("wrist", 50.0, 103.2) is None     # another camera's time base is its own
    assert watch.observe("base", 100.1, 103.2) is None
    assert watch.observe("base", 2.0, 103.3) == pytest.approx(100.1)
    assert watch.offsets()["base"] == pytest.approx(101.3)
    assert watch.largest_offset() == pytest.approx(101.3)
    watch.clear()
    assert watch.largest_offset() is None and watch.observe("base", 1.0, 2.0) is None


@pytest.mark.ros
def test_inputs_received_in_the_future_are_stale():
    from builtin_interfaces.msg import Time

    from oxygen_ros.node.inputs import Frame, InputStore
    from oxygen_ros.node.parameters import CameraSettings

    cameras = (CameraSettings("cam", "base_0_rgb", "raw", "best_effort", True),
               CameraSettings("wrist", "left_wrist_0_rgb", "raw", "best_effort", False))
    store = InputStore(cameras, ("j",), "go")
    image = np.zeros((4, 4, 3), np.uint8)
    store.store_frame("base_0_rgb", Frame(image, Time(sec=100), 101.0))
    store.store_frame("left_wrist_0_rgb", Frame(image, Time(sec=100), 101.0))
    store.store_joint_state(np.zeros(1, np.float32), 101.0)
    assert store.receipts == 3
    ready = store.observation(lambda: 101.2, 0.5, 0)
    assert not isinstance(ready, str) and ready.camera_slots == ("base_0_rgb", "left_wrist_0_rgb")
    # The node clock jumped back to 10 s: a frame received "at 101 s" has no age on the new time base.
    reason = store.observation(lambda: 10.0, 0.5, 1)
    assert isinstance(reason, str) and "base_0_rgb" in reason and "future" in reason
    store.store_frame("base_0_rgb", Frame(image, Time(sec=9), 10.0))
    reason = store.observation(lambda: 10.1, 0.5, 2)        # the optional wrist camera is masked ...
    assert isinstance(reason, str) and "joint state" in reason and "future" in reason   # ... the state is not usable
    store.store_joint_state(np.zeros(1, np.float32), 10.0)
    ready = store.observation(lambda: 10.1, 0.5, 3)
    assert not isinstance(ready, str) and ready.camera_slots == ("base_0_rgb",)
