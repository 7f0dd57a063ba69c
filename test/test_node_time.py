"""Time that stops, starts, goes backwards or runs behind, over real DDS with a simulated ``/clock`` that
the test publishes itself: nothing is computed before the clock starts, from a frame received "in the
future" of a reset clock, or from frozen inputs under a paused clock; a looped bag's restarting stamps
keep the time triggers firing; outputs that end in the past are counted and fall back or are withheld.

One node serves the module; the tests run in order and each leaves action chunks flowing.
"""
from __future__ import annotations

import threading
import time

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


class SimClock:
    """A simulator's ``/clock``: not started, running at real-time speed from a given time, paused, or
    reset to another time."""

    def __init__(self, node):
        from rosgraph_msgs.msg import Clock

        self._publisher = node.create_publisher(Clock, "/clock", 10)
        self._lock = threading.Lock()
        self._base: float | None = None
        self._since = 0.0
        self._paused = False
        node.create_timer(0.01, self._tick)

    def run_from(self, seconds: float) -> None:
        with self._lock:
            self._base, self._since, self._paused = seconds, time.monotonic(), False

    def pause(self) -> None:
        with self._lock:
            self._base, self._paused = self._now(), True

    def resume(self) -> None:
        self.run_from(self.now())

    def now(self) -> float:
        with self._lock:
            return self._now()

    def _now(self) -> float:
        return self._base if self._paused else self._base + time.monotonic() - self._since

    def _tick(self) -> None:
        from builtin_interfaces.msg import Time
        from rosgraph_msgs.msg import Clock

        with self._lock:
            if self._base is None:
                return
            nanoseconds = round(self._now() * 1e9)
        self._publisher.publish(Clock(clock=Time(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)))


@pytest.fixture(scope="module")
def timed():
    from std_msgs.msg import String

    h = Harness(tiny_parameters(**{
        "use_sim_time": True, "control_rate_hz": 4.0, "memory.enabled": False,
        "speech.trigger.every_s": 1.0, "speech.trigger.on_new_instruction": False,
        "trajectory_stamp_policy": "observation"}))
    clock = SimClock(h.robot)
    h.instruction.publish(String(data="pick up the red cube"))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 90.0), "autostart did not reach active"
    yield h, clock
    h.close()


def _seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def _skips(h, reason: str) -> int:
    return h.node.skip_reasons().get(reason, 0)


def test_nothing_runs_before_the_first_clock_message(timed):
    h, clock = timed
    # use_sim_time and no /clock: the node clock reads 0, so no input has a measurable age.
    assert wait_for(lambda: _skips(h, "clock_not_started") >= 3, 60.0), h.node.skip_reasons()
    assert wait_for(lambda: h.drops("clock_not_started") > 0, 30.0)
    assert h.count("chunk") == 0 and h.count("trajectory") == 0
    clock.run_from(101.0)
    assert h.chunks_flow(timeout=60.0)


def test_a_clock_reset_never_reuses_frames_received_before_it(timed):
    h, clock = timed
    assert h.chunks_flow(timeout=60.0)
    jumps = h.node.output_events()["clock_jumps"]
    h.publish_cam0 = h.publish_cam1 = False     # the bag restarts: no frame for a while
    try:
        time.sleep(0.3)
        clock.run_from(10.0)                     # /clock jumps back from ~101 s to 10 s
        assert wait_for(lambda: h.node.output_events()["clock_jumps"] == jumps + 1, 30.0)
        at_jump, skipped = h.count("chunk"), h.node.skipped_cycles()
        # The last frame, received "at 101 s", is 91 s in the future of the node clock: stale, never used.
        assert wait_for(lambda: h.node.skipped_cycles() >= skipped + 4, 60.0)
        assert h.count("chunk") <= at_jump + 1  # at most a cycle already in flight
    finally:
        h.publish_cam0 = h.publish_cam1 = True
    assert h.chunks_flow(timeout=60.0)
    assert h.node.output_events()["clock_jumps"] == jumps + 1   # detected once, counted once


def test_a_paused_clock_computes_nothing_from_frozen_inputs(timed):
    h, clock = timed
    assert h.chunks_flow(timeout=60.0)
    h.publish_cam0 = h.publish_cam1 = h.publish_joints = False
    try:
        time.sleep(0.3)
        clock.pause()
        at_pause = h.count("chunk")
        paused = _skips(h, "clock_paused")
        # No time passes on the node clock, so the last frame never ages past the staleness limit; with no
        # new input either, a chunk would be computed again and again from the same frozen frame.
        assert wait_for(lambda: _skips(h, "clock_paused") >= paused + 4, 60.0), h.node.skip_reasons()
        assert h.count("chunk") <= at_pause + 2   # the cycles already past the check when it paused
    finally:
        h.publish_cam0 = h.publish_cam1 = h.publish_joints = True
        clock.resume()
    assert h.chunks_flow(timeout=60.0)


def test_a_looped_bag_keeps_time_triggers_firing(timed):
    h, clock = timed
    first_frame = h._frame_index + 1

    def looped(frame: int) -> float:   # a 3 s bag at 10 Hz stamped from 3000 s, looped, not restamped
        return 3000.0 + ((frame - first_frame) % 30) * 0.1

    def finals() -> int:
        # Every speech request ends with one final Speech (completed, dropped, cancelled ...) stamped with
        # its observation, so finals count the requests the every_s trigger started.
        return sum(1 for s in list(h.received["speech"]) if s.final and 3000.0 <= _seconds(s.header.stamp) < 3003.0)

    stamp_jumps = h.node.output_events()["stamp_jumps"]
    h.stamp_seconds = looped
    try:
        # speech.trigger.every_s = 1.0: one pass starts at most 4 requests. Without a restart the trigger
        # would wait for the stamps to pass the ~3002 s it last fired at: nothing after the first pass.
        assert wait_for(lambda: finals() >= 9, 120.0), \
            [(_seconds(s.header.stamp), s.status) for s in h.received["speech"][-10:] if s.final]
        assert h.node.output_events()["stamp_jumps"] >= stamp_jumps + 2
    finally:
        h.stamp_seconds = None
    assert h.chunks_flow(timeout=60.0)


def test_outputs_ending_in_the_past_fall_back_or_are_withheld(timed):
    from rclpy.parameter import Parameter

    h, clock = timed
    h.stamp_seconds = lambda frame: clock.now() - 3.0   # camera stamps 3 s behind the node clock
    try:
        events = h.node.output_events
        expired = events()["expired_trajectories"]
        assert wait_for(lambda: events()["expired_trajectories"] >= expired + 3, 60.0)
        start = h.count("trajectory")
        assert wait_for(lambda: h.count("trajectory") >= start + 3, 60.0)
        # Observation-stamped, each would end ~2.5 s in the past (H * dt = 0.5 s): sent with stamp 0.
        assert all(_seconds(t.header.stamp) == 0.0 for t in h.received["trajectory"][start + 1:])
        assert events()["expired_chunks"] > 0 and h.chunks_flow(timeout=60.0)
        assert wait_for(lambda: h.count("status") > 0 and h.received["status"][-1].expired_trajectories > 0, 30.0)
        status = h.received["status"][-1]
        assert 2.5 < status.camera_clock_offset < 60.0    # 3 s plus transport latency
        assert status.expired_trajectories <= events()["expired_trajectories"]

        assert h.node.set_parameters([Parameter("expired_output_policy", value="withhold")])[0].successful
        time.sleep(0.5)
        chunks, trajectories = h.count("chunk"), h.count("trajectory")
        withheld = events()["expired_trajectories"]
        assert wait_for(lambda: events()["expired_trajectories"] >= withheld + 4, 60.0)
        assert h.count("chunk") <= chunks + 1 and h.count("trajectory") <= trajectories + 1
        refused = h.node.set_parameters([Parameter("expired_output_policy", value="sometimes")])[0]
        assert not refused.successful and "expired_output_policy" in refused.reason
    finally:
        h.node.set_parameters([Parameter("expired_output_policy", value="fallback")])
        h.stamp_seconds = None
    assert h.chunks_flow(timeout=60.0)


def test_the_expiry_margin_counts_outputs_that_would_arrive_too_late(timed):
    from rclpy.parameter import Parameter

    h, _ = timed
    events = h.node.output_events
    assert h.chunks_flow(timeout=60.0)
    # On-time stamps: a margin longer than any chunk (H * dt = 0.5 s) leaves no chunk enough time.
    expired = events()["expired_chunks"]
    assert h.node.set_parameters([Parameter("expired_output_margin_s", value=1e6)])[0].successful
    try:
        assert wait_for(lambda: events()["expired_chunks"] >= expired + 3, 60.0)
        start = h.count("trajectory")
        assert wait_for(lambda: h.count("trajectory") >= start + 2, 60.0)
        assert all(_seconds(t.header.stamp) == 0.0 for t in h.received["trajectory"][start + 1:])   # fallback
        assert not h.node.set_parameters([Parameter("expired_output_margin_s", value=-1.0)])[0].successful
    finally:
        h.node.set_parameters([Parameter("expired_output_margin_s", value=0.0)])
    assert h.chunks_flow(timeout=60.0)
