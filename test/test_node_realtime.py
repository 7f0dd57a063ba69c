"""Real-time chunking through the node over real DDS: with rtc.enabled the node reports each published chunk's
inference delay (observation stamp -> chunk out, node clock) to the engine, and after the first chunk and the
delay estimate's warm-up every chunk is guided toward the one in flight. No wall-clock assertions: the test
counts chunks and fallback reasons only."""
from __future__ import annotations

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


def test_the_node_guides_chunks_once_it_has_measured_the_delay():
    from std_msgs.msg import String

    # a chunk of the tiny preset's 10 actions spans 2 s at 0.2 s per action: longer than a cycle, even loaded
    h = Harness(tiny_parameters(**{"rtc.enabled": True, "rtc.warmup_cycles": 1, "action_dt_s": 0.2,
                                   "rtc.execution_horizon": 10}))
    try:
        h.instruction.publish(String(data="stack the blocks"))
        assert wait_for(lambda: h.node.lifecycle_state == "active", 120.0), "autostart did not reach active"
        assert h.chunks_flow(timeout=60.0, n=6)
        engine = h.node.engine
        assert engine.config.rtc.enabled and engine.config.rtc.action_dt_s == 0.2
        counts = engine.rtc_counts
        # plain only for the first chunk and while the delay estimate warms up (the caller's first delay is
        # ignored, so the second chunk has none yet); never for a reason that would mean lost state
        assert counts.get("no_chunk") == 1 and counts.get("delay_unknown", 0) <= 2, counts
        assert set(counts) <= {"no_chunk", "delay_unknown", "expired", "delay_clipped"}, counts
        guided = engine.metrics_records.cycles
        assert len(guided) > sum(counts.get(k, 0) for k in ("no_chunk", "delay_unknown", "expired"))
    finally:
        h.close()


def _seams(chunks: list, receipts: list[float], at_takeover: bool) -> list[float]:
    """Per pair of consecutive chunks: the largest jump of the command when the robot switches from the old chunk
    to the new one, ``|new[i] - old[i + k]|`` (``k``: the old chunk's actions started by the new observation,
    both indices inside the chunks). ``i``: with ``at_takeover`` the new chunk's take-over action d (guided chunks
    only; the robot
    keeps the old chunk until then, as ``trajectory_stamp_policy: takeover`` asks the controller to), else the
    action due at receipt, ``ceil((receipt - new stamp) / dt)`` (a robot indexing by time)."""
    import math

    import numpy as np

    def stamp(m) -> float:
        return m.header.stamp.sec + m.header.stamp.nanosec * 1e-9

    seams = []
    for (old, new), received in zip(zip(chunks, chunks[1:]), receipts[1:]):
        if at_takeover and new.rtc_delay_steps < 0:
            continue        # a plain chunk (the first ones, while the delay is measured): no take-over
        i = new.rtc_delay_steps if at_takeover else max(0, math.ceil((received - stamp(new)) / new.dt - 1e-6))
        k = math.floor((stamp(new) - stamp(old)) / new.dt + 1e-9)
        a_new = np.asarray(new.actions).reshape(new.horizon, new.action_dim)
        a_old = np.asarray(old.actions).reshape(old.horizon, old.action_dim)
        if 0 <= i < new.horizon and i + k < old.horizon:
            seams.append(float(np.abs(a_new[i] - a_old[i + k]).max()))
    return seams


def _run(rtc: bool) -> tuple[list, list[float], list]:
    """Chunks and their wall-clock receipt times from a node whose inference delay spans control steps (the tiny
    preset's 10 actions of 0.4 s, a chunk every 0.5 s or more, a delivery margin of 0.2 s on top of the measured delay);
    wall-clock observation stamps, so the measured delay is the real one."""
    import time

    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk

    h = Harness(tiny_parameters(**{"rtc.enabled": rtc, "rtc.warmup_cycles": 1, "rtc.delivery_margin_s": 0.2,
                                   "rtc.execution_horizon": 10, "rtc.max_guidance_weight": 5.0,
                                   "action_dt_s": 0.4, "control_rate_hz": 2.0, "staleness_limit_s": 5.0,
                                   "speech.enabled": False, "memory.enabled": False,
                                   "trajectory_stamp_policy": "takeover"}))
    h.stamp_seconds = lambda _: time.time()
    received: list[tuple] = []      # (chunk, wall-clock receipt time) in order of receipt
    h.robot.create_subscription(ActionChunk, "oxygen_node/action_chunk",
                                lambda msg: received.append((msg, time.time())), 10)
    try:
        h.instruction.publish(String(data="stack the blocks"))
        assert wait_for(lambda: h.node.lifecycle_state == "active", 120.0), "autostart did not reach active"
        assert wait_for(lambda: len(received) >= 10, 60.0), len(received)
        chunks = list(received)
        assert wait_for(lambda: h.count("trajectory") >= len(chunks), 30.0)
        return [m for m, _ in chunks], [t for _, t in chunks], list(h.received["trajectory"])
    finally:
        h.close()


def test_seams_with_rtc_stay_below_a_bound_that_plain_chunks_exceed():
    """The seam a robot makes when it switches to each new chunk: with RTC at the published take-over, where the new
    chunk was guided to continue the chunk in flight, so the jump is a fraction of the plain chunks' switched on
    receipt (random weights: consecutive plain chunks are independent draws). A chunk that arrives after its
    take-over (a delay above the estimate on a loaded machine) is not what this measures: the take-over is."""
    import math

    import numpy as np

    on_chunks, on_receipts, trajectories = _run(rtc=True)
    guided = [m for m in on_chunks if m.rtc_delay_steps >= 0]
    assert len(guided) >= 5, [(m.rtc_delay_steps, m.rtc_fallback) for m in on_chunks]
    for old, new in zip(on_chunks, on_chunks[1:]):
        if new.rtc_delay_steps >= 0:     # the published take-over: the old chunk's action d steps after the new stamp
            elapsed = (new.header.stamp.sec - old.header.stamp.sec) + (new.header.stamp.nanosec - old.header.stamp.nanosec) * 1e-9
            k = math.floor(elapsed / new.dt + 1e-9)      # actions of the old chunk started by the new observation
            assert new.rtc_takeover_index == k + new.rtc_delay_steps and new.rtc_fallback == ""
    # trajectory_stamp_policy takeover: a guided chunk's JointTrajectory starts at its action d, stamped at its
    # time (observation + d * dt); a plain one (the first ones) is stamped with the observation, from action 0
    by_stamp = {(t.header.stamp.sec, t.header.stamp.nanosec): t for t in trajectories}
    for chunk in on_chunks:
        d = max(chunk.rtc_delay_steps, 0)
        nanoseconds = chunk.header.stamp.sec * 10**9 + chunk.header.stamp.nanosec + round(d * chunk.dt * 1e9)
        trajectory = by_stamp[(nanoseconds // 10**9, nanoseconds % 10**9)]
        actions = np.asarray(chunk.actions).reshape(chunk.horizon, chunk.action_dim)
        assert len(trajectory.points) == chunk.horizon - d
        columns = [list(chunk.action_names).index(name) for name in trajectory.joint_names]
        assert np.allclose(trajectory.points[0].positions, actions[d, columns], atol=1e-6)
        assert trajectory.points[0].time_from_start.nanosec == round(chunk.dt * 1e9)
    off_chunks, off_receipts, _ = _run(rtc=False)
    assert all(m.rtc_delay_steps == -1 and m.rtc_takeover_index == -1 and m.rtc_fallback == "" for m in off_chunks)
    on = _seams(on_chunks, on_receipts, at_takeover=True)
    off = _seams(off_chunks, off_receipts, at_takeover=False)
    assert len(on) >= 4 and len(off) >= 4, (len(on), len(off), [(m.rtc_delay_steps, m.rtc_fallback) for m in on_chunks])
    bound = 0.75    # the plain chunks' actions are O(1) apart (independent draws of random weights)
    print(f"seam median with RTC {np.median(on):.4f}, without {np.median(off):.4f}")
    assert np.median(on) < bound < np.median(off), (on, off)


def test_under_simulated_time_the_delay_is_counted_in_simulated_steps():
    """use_sim_time, with a simulator's clock running at a twentieth of real-time speed: each guided chunk's delay d
    counts simulated control steps. The node's measured delays (observation stamp -> chunk out, node clock) are at most
    the simulated time from each observation to the chunk's receipt here, so d is bounded by that time's steps;
    counting the wall clock instead would give about twenty times as many. Frames are stamped by the node at their
    simulated receipt time (zero stamps)."""
    import math
    import time

    from builtin_interfaces.msg import Time
    from rosgraph_msgs.msg import Clock
    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk

    speed, sim_start_s, dt = 0.05, 500.0, 0.02     # a chunk of 10 actions spans 0.2 s simulated = 4 s of wall time
    started = time.monotonic()

    def sim_now() -> float:
        return sim_start_s + speed * (time.monotonic() - started)

    h = Harness(tiny_parameters(use_sim_time=True, **{
        "rtc.enabled": True, "rtc.warmup_cycles": 1, "rtc.delivery_margin_s": 0.0, "rtc.execution_horizon": 10,
        "action_dt_s": dt, "control_rate_hz": 2.0, "speech.enabled": False, "memory.enabled": False}))
    clock = h.robot.create_publisher(Clock, "/clock", 10)

    def tick():
        nanoseconds = round(sim_now() * 1e9)
        clock.publish(Clock(clock=Time(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)))

    h.robot.create_timer(0.01, tick)
    h.zero_stamps = True
    received: list[tuple] = []      # (chunk, simulated time at receipt)
    h.robot.create_subscription(ActionChunk, "oxygen_node/action_chunk", lambda m: received.append((m, sim_now())), 10)
    try:
        h.instruction.publish(String(data="stack the blocks"))
        assert wait_for(lambda: h.node.lifecycle_state == "active", 120.0), "autostart did not reach active"
        assert wait_for(lambda: sum(m.rtc_delay_steps >= 0 for m, _ in list(received)) >= 5, 120.0), \
            [(m.rtc_delay_steps, m.rtc_fallback) for m, _ in received]
        chunks = list(received)
    finally:
        h.close()
    bound_s = 0.0       # the largest simulated observation -> receipt time so far: bounds every measured delay
    for chunk, receipt in chunks:
        stamp = chunk.header.stamp.sec + chunk.header.stamp.nanosec * 1e-9
        assert sim_start_s <= stamp <= receipt, (stamp, receipt)
        bound_s = max(bound_s, receipt - stamp)
        if chunk.rtc_delay_steps >= 0:
            assert chunk.rtc_delay_steps <= math.ceil(bound_s / dt), (chunk.rtc_delay_steps, bound_s)
