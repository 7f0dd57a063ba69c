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
