"""EngineStatus figures computed from one status window: rates are what was delivered in the period."""
from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.ros


def test_action_rate_is_actions_delivered_per_second_not_capacity():
    from builtin_interfaces.msg import Time

    from oxygen_ros.node.diagnostics import StatusWindow, engine_status_msg

    # 4 chunks of H = 10 in 2 s, each computed in 10 ms: 20 actions/s delivered (capacity would be 1000/s).
    window = StatusWindow(period_s=2.0, chunks=4, frame_latency_sum_s=0.04, action_latency_sum_s=0.04)
    msg = engine_status_msg(window, Time(), horizon=10, dropped_frames=0, pool_used_bytes=0,
                            pool_capacity_bytes=1)
    assert msg.chunk_rate == pytest.approx(2.0)
    assert msg.action_rate == pytest.approx(20.0)
    idle = engine_status_msg(StatusWindow(period_s=1.0), Time(), horizon=10, dropped_frames=0,
                             pool_used_bytes=0, pool_capacity_bytes=1)
    assert idle.action_rate == 0.0 and idle.chunk_rate == 0.0


def test_output_and_time_events_set_the_levels_and_the_status_fields():
    from builtin_interfaces.msg import Time
    from diagnostic_msgs.msg import DiagnosticStatus

    from oxygen_ros.node.diagnostics import StatusTracker, diagnostic_array, engine_status_msg

    tracker = StatusTracker()
    tracker.record_event("expired_trajectories", "observation 3: 2.5 s past")
    with pytest.raises(ValueError, match="unknown event"):
        tracker.record_event("late", "")

    def publish(offsets, qos, new_qos):
        window = tracker.window()
        status = engine_status_msg(window, Time(sec=1), 10, 0, 0, 1, camera_clock_offset=max(offsets.values()),
                                   incompatible_qos=qos)
        array = diagnostic_array("/oxygen_node", "pi05_tiny", "active", status, window, {}, {"base_0_rgb": 0.1},
                                 2.0, camera_offsets=offsets, offset_warn_s=1.0,
                                 qos_events={"publisher /oxygen_node/action_chunk": qos}, new_qos_events=new_qos)
        return status, array.status[0], array.status[1]

    status, engine, inputs = publish({"base_0_rgb": 3.02}, 1, 1)
    assert engine.level == DiagnosticStatus.WARN and "expired_trajectories" in engine.message
    assert inputs.level == DiagnosticStatus.WARN
    assert "incompatible-QoS" in inputs.message and "base_0_rgb +3.020 s" in inputs.message
    assert status.expired_trajectories == 1 and status.camera_clock_offset == pytest.approx(3.02)
    assert status.incompatible_qos == 1 and status.non_finite_actions == 0

    tracker.record_event("non_finite_actions", "observation 4: 70 of 70 values")
    status, engine, inputs = publish({"base_0_rgb": 0.02}, 1, 0)
    assert engine.level == DiagnosticStatus.ERROR and "non-finite" in engine.message
    assert inputs.level == DiagnosticStatus.OK      # nothing new: the levels recover
    assert status.non_finite_actions == 1 and status.expired_trajectories == 1   # totals since activation

    status, engine, inputs = publish({"base_0_rgb": 0.02}, 1, 0)
    # The next period had nothing non-finite: no longer ERROR (WARN here only because it published no chunk).
    assert engine.level != DiagnosticStatus.ERROR and "non-finite" not in engine.message
    assert status.non_finite_actions == 1


def _inputs_status(d):
    return next(s for s in d.status if s.name.endswith(": inputs"))


def _engine_status(d):
    return next(s for s in d.status if s.name.endswith(": engine"))


@pytest.mark.dds
def test_diagnostics_recover_after_a_bad_frame_and_tell_the_truth():
    """Over real DDS: a bad frame makes the inputs status WARN for its period, then OK again while frames
    keep coming; an absent optional camera is OK with a note; paused actions are shown; a deactivated
    node reports OK "inactive" with a real stamp; per-input rates are listed."""
    from diagnostic_msgs.msg import DiagnosticStatus

    from node_support import Harness, publish_until, raw_image, tiny_parameters, wait_for

    h = Harness(tiny_parameters(autostart=False, status_rate_hz=4.0, control_rate_hz=4.0))
    try:
        h.publish_cam1 = False      # the optional wrist camera is absent
        h.stamp_seconds = lambda _index: time.time()     # stamps on the node clock: no clock-offset warning
        assert h.change_state("configure") and h.change_state("activate")
        assert h.chunks_flow(timeout=30.0)

        def latest():
            return list(h.received["diagnostics"])[-1]

        def inputs_ok_with_note():
            inputs = _inputs_status(latest())
            return inputs.level == DiagnosticStatus.OK and "left_wrist_0_rgb" in inputs.message \
                and "optional" in inputs.message

        assert wait_for(inputs_ok_with_note, 20.0), _inputs_status(latest())
        values = {v.key: v.value for v in _inputs_status(latest()).values}
        assert float(values["camera base_0_rgb rate [Hz]"]) > 0.0
        assert float(values["camera left_wrist_0_rgb rate [Hz]"]) == 0.0
        assert float(values["joint_states rate [Hz]"]) > 0.0

        before = h.drops("bad_step")
        # a row needs 96 bytes: dropped as bad_step (resent until counted: the best-effort depth-1 queue may
        # replace one bad frame with the harness's next good one before the node reads it)
        assert publish_until(lambda: h.cam0.publish(raw_image(step=10)), lambda: h.drops("bad_step") > before, 10.0)
        assert wait_for(lambda: any(_inputs_status(d).level == DiagnosticStatus.WARN and "bad_step" in
                                    _inputs_status(d).message for d in list(h.received["diagnostics"])), 10.0)
        warned = h.count("diagnostics")
        # no bad frame since: the level returns to OK (the total stays listed)
        assert wait_for(lambda: h.count("diagnostics") > warned + 1 and inputs_ok_with_note(), 20.0), \
            _inputs_status(latest())
        values = {v.key: v.value for v in _inputs_status(latest()).values}
        assert int(values["dropped bad_step"]) >= 1

        from oxygen_ros.srv import SwitchActions  # noqa: F401  (the built interfaces)
        client = h.robot.create_client(SwitchActions, "oxygen_node/pause_actions")
        assert client.wait_for_service(timeout_sec=10.0)
        future = client.call_async(SwitchActions.Request())
        assert wait_for(future.done, 10.0) and future.result().success
        assert wait_for(lambda: "actions paused" in _engine_status(latest()).message and any(
            v.key == "actions_paused" and v.value == "true" for v in _engine_status(latest()).values), 10.0)

        assert h.change_state("deactivate")
        assert wait_for(lambda: _engine_status(latest()).message.startswith("inactive"), 10.0)
        inactive = latest()
        assert _engine_status(inactive).level == DiagnosticStatus.OK
        assert inactive.header.stamp.sec > 0
        assert h.change_state("cleanup")
    finally:
        h.close()


@pytest.mark.dds
def test_topic_frequency_statuses_follow_each_input():
    """Over real DDS: one ``<topic> topic status`` per input topic in diagnostic_updater's FrequencyStatus
    form, every status with the hardware id; the scene camera's turns WARN when it stops (the joint states'
    stays OK) and OK again when it resumes; the absent optional wrist camera's is OK with a note."""
    from diagnostic_msgs.msg import DiagnosticStatus

    from node_support import Harness, tiny_parameters, wait_for

    h = Harness(tiny_parameters(autostart=False, status_rate_hz=4.0, control_rate_hz=4.0))
    try:
        h.publish_cam1 = False      # the optional wrist camera is absent
        assert h.change_state("configure") and h.change_state("activate")
        scene, wrist, joints = (h.topic(t) + " topic status" for t in
                                ("camera/image_raw", "wrist_camera/image_raw/compressed", "joint_states"))

        def latest(suffix):
            for array in reversed(list(h.received["diagnostics"])):
                for status in array.status:
                    if status.name.endswith(suffix):
                        return status
            return None

        def level(suffix):
            status = latest(suffix)
            return None if status is None else status.level

        assert wait_for(lambda: level(scene) == DiagnosticStatus.OK and level(joints) == DiagnosticStatus.OK,
                        30.0), latest(scene)
        array = list(h.received["diagnostics"])[-1]
        assert {s.name.rsplit(": ", 1)[-1] for s in array.status} >= {"engine", "inputs", scene.rsplit(": ", 1)[-1]}
        assert all(s.hardware_id.startswith("pi05_tiny") for s in array.status), \
            [(s.name, s.hardware_id) for s in array.status]
        values = {v.key: v.value for v in latest(scene).values}
        for key in ("Events in window", "Events since startup", "Duration of window (s)", "Actual frequency (Hz)",
                    "Minimum acceptable frequency (Hz)"):
            assert key in values, values
        assert int(values["Events in window"]) > 0
        assert float(values["Actual frequency (Hz)"]) >= float(values["Minimum acceptable frequency (Hz)"])
        optional = latest(wrist)
        assert optional.level == DiagnosticStatus.OK and "optional" in optional.message, optional
        assert int({v.key: v.value for v in optional.values}["Events in window"]) == 0

        h.publish_cam0 = False      # the scene camera stops
        assert wait_for(lambda: level(scene) == DiagnosticStatus.WARN, 30.0), latest(scene)
        assert "too low" in latest(scene).message or "No events" in latest(scene).message
        assert level(joints) == DiagnosticStatus.OK, latest(joints)
        h.publish_cam0 = True       # and resumes
        assert wait_for(lambda: level(scene) == DiagnosticStatus.OK, 30.0), latest(scene)
        assert latest(scene).message == "Desired frequency met"

        assert h.change_state("deactivate")
        assert wait_for(lambda: latest(scene).message.startswith("inactive"), 10.0), latest(scene)
        assert level(scene) == DiagnosticStatus.OK
        assert h.change_state("cleanup")
    finally:
        h.close()


@pytest.mark.dds
def test_dropped_frames_count_camera_frames_only():
    """Over real DDS: a bad joint state and an empty instruction are counted in ~/status as
    dropped_joint_states and dropped_instructions, not as dropped_frames; a bad camera frame is."""
    from sensor_msgs.msg import JointState
    from std_msgs.msg import String

    from node_support import JOINTS, Harness, publish_until, raw_image, tiny_parameters, wait_for

    h = Harness(tiny_parameters(status_rate_hz=4.0, control_rate_hz=4.0))
    try:
        assert wait_for(lambda: h.node.lifecycle_state == "active", 120.0)
        assert h.chunks_flow(timeout=60.0)
        assert publish_until(lambda: h.joints.publish(JointState(name=JOINTS, position=[float("nan")] * 7)),
                             lambda: h.node.dropped_by_input()["joint_states"] >= 1)
        h.instruction.publish(String(data="   "))
        assert wait_for(lambda: h.node.dropped_by_input()["instructions"] >= 1, 20.0)

        def status_with(condition):
            return wait_for(lambda: any(condition(s) for s in list(h.received["status"])), 20.0)

        assert status_with(lambda s: s.dropped_joint_states >= 1 and s.dropped_instructions >= 1
                           and s.dropped_frames == 0), list(h.received["status"])[-1]
        assert publish_until(lambda: h.cam0.publish(raw_image(step=10)),
                             lambda: h.node.dropped_by_input()["frames"] >= 1)
        assert status_with(lambda s: s.dropped_frames >= 1 and s.dropped_joint_states >= 1
                           and s.dropped_instructions >= 1), list(h.received["status"])[-1]
        latest = list(h.received["status"])[-1]
        assert latest.dropped_frames <= sum(h.node.input_drops().values()) - 2
    finally:
        h.close()


def test_frequency_status_follows_the_diagnostic_updater_conventions():
    """FrequencyStatus on a hand-driven clock: the window is the last ``window_size`` periods, the band is
    widened by the tolerance, the keys are diagnostic_updater's."""
    from diagnostic_msgs.msg import DiagnosticStatus

    from oxygen_ros.node.diagnostics import FrequencyStatus

    now = [0.0]
    frequency = FrequencyStatus(window_size=5, tolerance=0.1, clock=lambda: now[0])

    def period(ticks: int, **bounds):
        for _ in range(ticks):
            frequency.tick()
        now[0] += 1.0
        status = frequency.status("node: /camera topic status", "hw", **bounds)
        return status, {v.key: v.value for v in status.values}

    for _ in range(5):
        status, values = period(10, min_hz=8.0)
    assert status.level == DiagnosticStatus.OK and status.message == "Desired frequency met"
    assert status.name == "node: /camera topic status" and status.hardware_id == "hw"
    assert int(values["Events in window"]) == 50 and int(values["Events since startup"]) == 50
    assert float(values["Duration of window (s)"]) == 5.0 and float(values["Actual frequency (Hz)"]) == 10.0
    assert float(values["Minimum acceptable frequency (Hz)"]) == 7.2
    assert "Maximum acceptable frequency (Hz)" not in values and "Target frequency (Hz)" not in values
    for _ in range(2):      # 10, 10, 10, 1, 1 events in the last five periods: 6.4 Hz < 7.2 Hz
        status, values = period(1, min_hz=8.0)
    assert status.level == DiagnosticStatus.WARN and status.message == "Frequency too low."
    for _ in range(5):
        status, values = period(0, min_hz=8.0)
    assert status.level == DiagnosticStatus.WARN and status.message == "No events recorded."
    status, values = period(0, min_hz=8.0, required=False)
    assert status.level == DiagnosticStatus.OK and "optional" in status.message
    for _ in range(5):
        status, values = period(3, min_hz=2.0, max_hz=2.0)
    assert status.level == DiagnosticStatus.WARN and status.message == "Frequency too high."
    assert float(values["Target frequency (Hz)"]) == 2.0
    assert float(values["Maximum acceptable frequency (Hz)"]) == 2.2
    frequency.clear()       # a new window (activation): the count since startup carries on
    status, values = period(8, min_hz=8.0)
    assert status.level == DiagnosticStatus.OK and int(values["Events in window"]) == 8
    assert float(values["Duration of window (s)"]) == 1.0
    assert int(values["Events since startup"]) == 50 + 2 + 15 + 8
