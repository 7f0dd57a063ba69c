"""use_sim_time: stamps, staleness and latency never mix simulated time with wall time."""
from __future__ import annotations

import time

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

SIM_START_S = 500.0   # simulated time, far from both the wall clock and the harness's frame stamps


@pytest.fixture(scope="module")
def sim_harness():
    from builtin_interfaces.msg import Time
    from rosgraph_msgs.msg import Clock
    from std_msgs.msg import String

    h = Harness(tiny_parameters(use_sim_time=True, control_rate_hz=4.0))
    clock_pub = h.robot.create_publisher(Clock, "/clock", 10)
    started = time.monotonic()

    def tick():   # a simulator's clock, advancing at real-time speed from SIM_START_S
        nanoseconds = round((SIM_START_S + time.monotonic() - started) * 1e9)
        clock_pub.publish(Clock(clock=Time(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)))

    h.robot.create_timer(0.01, tick)
    h.instruction.publish(String(data="pick up the red cube"))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    assert h.chunks_flow(timeout=30.0)
    yield h
    h.close()


def _seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def test_chunks_carry_the_frame_stamps_and_a_compute_latency(sim_harness):
    start = sim_harness.count("chunk")
    assert wait_for(lambda: sim_harness.count("chunk") >= start + 4, 20.0)
    for chunk in sim_harness.received["chunk"][start:]:
        assert (chunk.header.stamp.sec, chunk.header.stamp.nanosec) in sim_harness.sent_stamps
        # Compute time, never "wall now - simulated stamp" (that would be ~1.8e9 s).
        assert 0.0 < chunk.inference_latency < 60.0


def test_zero_stamped_frames_are_stamped_with_the_simulated_receipt_time(sim_harness):
    sim_harness.zero_stamps = True
    try:
        start = sim_harness.count("chunk")
        assert wait_for(lambda: sim_harness.count("chunk") >= start + 6, 20.0)
        stamps = [_seconds(c.header.stamp) for c in sim_harness.received["chunk"][-3:]]
    finally:
        sim_harness.zero_stamps = False
    wall = time.time()
    for stamp in stamps:
        assert SIM_START_S <= stamp < SIM_START_S + 600.0, f"stamp {stamp} is not on the simulated clock"
        assert abs(stamp - wall) > 1e6
