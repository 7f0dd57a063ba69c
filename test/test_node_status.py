"""EngineStatus figures computed from one status window: rates are what was delivered in the period."""
from __future__ import annotations

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
