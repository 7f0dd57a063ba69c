"""The control rate of a robot's cycles (oxygen_ros/engine/rate.py): fixed, or adaptive to the measured cycle cost;
its line in the demo's summary (oxygen_ros/tools/demo_rate.py, tools/report.py). Hand-made cycle records: no
clock is read, no timing asserted."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from oxygen_ros.engine.config import ActionTaskConfig
from oxygen_ros.engine.metrics import CycleRecord
from oxygen_ros.engine.rate import MIN_ESTIMATE_CYCLES, WARMUP_CYCLES, ControlRate, cycle_cost_s, rate_grid


def _record(seq: int, frame: float, decode: float = 0.0, steps: int = 0, missed: bool = False) -> CycleRecord:
    return CycleRecord(seq=seq, frame_latency_s=frame, action_latency_s=frame - decode, encode_s=0.01,
                       prefill_s=0.02, denoise_s=0.05, decode_s=decode, decode_steps=steps,
                       batch_sizes=[1] * steps, vision_calls=1, images_encoded=1, prefilled_tokens=10,
                       generated_tokens=steps, deadline_missed=missed, pool_used_bytes=0)


def _adaptive(max_hz: float = 4.0, min_hz: float = 1.0, step_hz: float = 0.5, headroom: float = 1.25,
              window: int = 20) -> ControlRate:
    return ControlRate(ActionTaskConfig(control_rate_hz=max_hz, control_rate_mode="adaptive",
                                        control_rate_min_hz=min_hz, control_rate_step_hz=step_hz,
                                        control_rate_headroom=headroom, control_rate_window=window),
                       min_decode_steps=1)


class _Feed:
    """Hands records to a ControlRate with increasing seqs; the warm-up cycles first (cost 0)."""

    def __init__(self, rate: ControlRate):
        self.rate, self.seq = rate, 0
        for _ in range(WARMUP_CYCLES):
            self.cycle(0.0)

    def cycle(self, cost: float, missed: bool = False):
        self.seq += 1
        return self.rate.observe(_record(self.seq, cost, missed=missed))

    def cycles(self, cost: float, n: int) -> list:
        return [change for change in (self.cycle(cost) for _ in range(n)) if change is not None]


def test_the_cost_leaves_out_the_decode_steps_taken_in_the_slack():
    # 300 ms cycle with 5 decode steps of 20 ms: 200 ms without them, plus the one guaranteed step.
    assert cycle_cost_s(_record(0, 0.3, 0.1, 5)) == pytest.approx(0.22)
    assert cycle_cost_s(asdict(_record(0, 0.3, 0.1, 5))) == pytest.approx(0.22)      # the record's dict too
    assert cycle_cost_s(_record(0, 0.3, 0.1, 5), min_decode_steps=0) == pytest.approx(0.2)
    assert cycle_cost_s(_record(0, 0.3, 0.1, 5), min_decode_steps=9) == pytest.approx(0.3)   # no more than taken
    assert cycle_cost_s(_record(0, 0.3)) == pytest.approx(0.3)            # no decode step at all
    for bad in (_record(0, float("nan")), _record(0, 0.1, -0.1, 1)):
        with pytest.raises(ValueError):
            cycle_cost_s(bad)
    with pytest.raises(ValueError):
        cycle_cost_s(_record(0, 0.3), min_decode_steps=-1)


def test_the_grid_runs_from_the_floor_in_steps_and_ends_at_the_most():
    assert rate_grid(1.5, 0.5, 4.0) == (1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
    assert rate_grid(1.0, 0.5, 3.2) == (1.0, 1.5, 2.0, 2.5, 3.0, 3.2)      # the most is always a rate
    assert rate_grid(0.1, 0.1, 0.3) == (0.1, 0.2, 0.3)                       # no 0.30000000000000004 twice
    assert rate_grid(2.0, 1.0, 2.0) == (2.0,)
    for low, step, high in ((0.0, 0.5, 4.0), (3.0, 0.5, 2.0), (1.0, 0.0, 2.0)):
        with pytest.raises(ValueError):
            rate_grid(low, step, high)


def test_a_fixed_rate_never_changes():
    rate = ControlRate(ActionTaskConfig(control_rate_hz=4.0), min_decode_steps=1)
    assert not rate.adaptive and rate.period_s == pytest.approx(0.25) and rate.grid == (4.0,)
    assert rate.describe() == "4 Hz"
    feed = _Feed(rate)
    assert feed.cycles(2.0, 50) == [] and feed.cycle(3.0, missed=True) is None
    assert (rate.hz, rate.change_count) == (4.0, 0)


def test_the_rate_drops_at_once_to_the_fastest_rate_the_p90_cost_fits():
    rate = _adaptive()
    assert rate.hz == 4.0 and rate.period_s == pytest.approx(0.25)     # starts at the most
    assert rate.describe() == "adaptive 1-4 Hz"
    feed = _Feed(rate)
    # Before MIN_ESTIMATE_CYCLES costs there is no p90 (and these cycles made their deadline): no change.
    assert feed.cycles(0.3, MIN_ESTIMATE_CYCLES - 1) == []
    change = feed.cycle(0.3)
    # p90 300 ms x 1.25 = 375 ms: 2.67 Hz would fit, the grid's 2.5 Hz is the fastest that does.
    assert (change.from_hz, change.to_hz, change.reason) == (4.0, 2.5, "cost_over_period")
    assert change.cost_s == pytest.approx(0.3) and change.seq == feed.seq
    assert rate.hz == 2.5 and rate.period_s == pytest.approx(0.4) and rate.change_count == 1
    assert change.describe(1.25) == ("control rate 4 -> 2.5 Hz: p90 cycle cost 300 ms x 1.25 headroom is over "
                                     "the 250 ms period")


def test_a_missed_deadline_drops_the_rate_before_any_estimate():
    rate = _adaptive()
    feed = _Feed(rate)
    change = feed.cycle(0.3, missed=True)          # the first measured cycle
    assert (change.to_hz, change.reason) == (2.5, "deadline_missed")
    assert "missed its deadline" in change.describe(rate.headroom)


def test_a_miss_the_cost_does_not_explain_keeps_the_rate_but_delays_its_rise():
    rate = _adaptive(max_hz=4.0)
    feed = _Feed(rate)
    # 500 ms x 1.25 = 625 ms fits 1.5 Hz (667 ms), not 2 Hz (500 ms)
    assert feed.cycles(0.5, MIN_ESTIMATE_CYCLES)[0].to_hz == 1.5
    assert feed.cycles(0.1, 19) == []
    # A late cycle whose own cost fits (the last decode step overran, or the thread woke late): no drop ...
    assert feed.cycle(0.1, missed=True) is None and rate.hz == 1.5
    # ... but the window since the miss starts again: 19 more cycles are not enough, the 20th is.
    assert feed.cycles(0.1, 19) == []
    assert feed.cycle(0.1).to_hz == 2.0


def test_the_rate_rises_one_step_per_window_of_cheap_cycles_and_never_past_the_most():
    rate = _adaptive(max_hz=4.0, window=20)
    feed = _Feed(rate)
    feed.cycles(0.5, MIN_ESTIMATE_CYCLES)
    assert rate.hz == 1.5
    # The window must first hold 20 cheap costs (p90 of a window with old 500 ms costs stays high).
    changes = feed.cycles(0.1, 20 * 10)
    assert [c.to_hz for c in changes] == [2.0, 2.5, 3.0, 3.5, 4.0]
    assert all(c.reason == "cost_fits_faster" for c in changes)
    gaps = [b.seq - a.seq for a, b in zip(changes, changes[1:])]
    assert gaps == [20] * 4                         # one step per window at one rate
    assert rate.hz == 4.0 and "fits the 333 ms period" in changes[2].describe(rate.headroom)


def test_between_the_two_rules_the_rate_stays():
    # At 3 Hz (333 ms), a 250 ms p90 x 1.25 = 313 ms fits, but not 3.5 Hz (286 ms): no flapping either way.
    rate = _adaptive()
    feed = _Feed(rate)
    feed.cycles(0.25, 200)
    assert rate.hz == 3.0 and rate.change_count == 1


def test_one_stall_in_a_window_moves_nothing_the_p90_ignores_it():
    rate = _adaptive()
    feed = _Feed(rate)
    feed.cycles(0.1, 19)
    assert feed.cycle(2.0) is None and feed.cycles(0.1, 30) == [] and rate.hz == 4.0


def test_at_the_floor_an_overload_stays_at_the_floor():
    rate = _adaptive(min_hz=1.5)
    feed = _Feed(rate)
    assert feed.cycle(5.0, missed=True).to_hz == 1.5
    assert feed.cycles(5.0, 30) == [] and feed.cycle(5.0, missed=True) is None and rate.hz == 1.5


def test_a_bad_record_raises_and_changes_nothing():
    rate = _adaptive()
    feed = _Feed(rate)
    with pytest.raises(ValueError):
        rate.observe(_record(99, float("inf")))
    assert rate.hz == 4.0 and feed.cycles(0.1, 5) == []


def test_the_config_refuses_a_floor_above_the_most_in_adaptive_mode():
    with pytest.raises(ValueError, match="control_rate_min_hz"):
        ActionTaskConfig(control_rate_hz=2.0, control_rate_mode="adaptive", control_rate_min_hz=3.0)
    ActionTaskConfig(control_rate_hz=2.0, control_rate_min_hz=3.0)        # fixed mode: the floor is not used
    with pytest.raises(ValueError, match="control_rate_mode"):
        ActionTaskConfig(control_rate_mode="sometimes")
    with pytest.raises(ValueError, match="control_rate_window"):
        ActionTaskConfig(control_rate_window=1)


def test_the_demo_summary_gives_the_rates_run_with_their_cycles_and_misses():
    from oxygen_ros.tools.demo_rate import cycle_rates, describe_rates, rate_log
    from oxygen_ros.tools.report import RunData, format_summary, summarize

    rate = _adaptive(min_hz=1.5)
    feed = _Feed(rate)
    feed.cycles(0.3, MIN_ESTIMATE_CYCLES)           # -> 2.5 Hz, decided by seq 7
    feed.cycles(0.1, 20)                            # -> 3 Hz, decided by seq 27
    log = rate_log(rate)
    assert (log["mode"], log["max_hz"], log["min_hz"], len(log["changes"])) == ("adaptive", 4.0, 1.5, 2)
    assert [c["seq"] for c in log["changes"]] == [7, 27]
    # A change applies from the cycle after the one that decided it.
    assert cycle_rates(log, [1, 7, 8, 27, 28, 40]) == [4.0, 4.0, 2.5, 2.5, 3.0, 3.0]
    cycles = [asdict(_record(seq, 0.2, missed=seq in (5, 30))) for seq in range(3, 43)]
    assert describe_rates(log, cycles) == ("adaptive 1.5-4 Hz: 2.5 Hz in 20 of 40 cycles (0 late), 3 Hz in 15 "
                                           "(1 late), 4 Hz in 5 (1 late); 2 changes (1 down, 1 up)")
    # Only the changes inside the recorded cycles are counted.
    assert describe_rates(log, cycles[10:]).endswith("1 changes (0 down, 1 up)")
    assert describe_rates(log, []) == "adaptive 1.5-4 Hz: no cycle recorded"
    fixed = rate_log(ControlRate(ActionTaskConfig(control_rate_hz=4.0)))
    assert describe_rates(fixed, cycles) == "4 Hz (fixed): 40 cycles (2 late)"
    assert describe_rates({"chosen_hz": 3}, cycles) == "3 Hz"        # another version's file: its rate alone
    text = format_summary(summarize(RunData(cycles=cycles, control_rate=log)))
    assert "control rate       adaptive 1.5-4 Hz: 2.5 Hz in 20 of 40 cycles (0 late)" in text
    assert "deadline misses    2 of 40 cycles (5.0 %)" in text
    assert "deadline misses    n/a" in format_summary(summarize(RunData(control_rate=log)))


@pytest.mark.ros      # the node's parameters module imports rclpy
def test_an_adaptive_floor_the_chunks_cannot_cover_is_refused_at_configure():
    """A floor whose period is longer than a chunk's span (H x action_dt_s) would leave the robot without
    actions between chunks: the settings are refused with the reason, naming the parameter."""
    from oxygen_ros.node.parameters import settings_from_values

    values = {"joint_names": ["j1", "j2"], "action_dt_s": 0.05, "action_horizon": 10,
              "control_rate_mode": "adaptive", "control_rate_hz": 4.0}
    with pytest.raises(ValueError, match="control_rate_min_hz: 1 Hz .* a chunk spans 0.5 s"):
        settings_from_values({**values, "control_rate_min_hz": 1.0})
    assert settings_from_values({**values, "control_rate_min_hz": 2.5}).engine.action.control_rate_min_hz == 2.5
    settings_from_values({**values, "control_rate_mode": "fixed", "control_rate_min_hz": 1.0})   # floor unused
    # 0 (the default): the lowest 0.5 Hz step above 1 / 0.5 s, 2.5 Hz; at most the rate asked for
    assert settings_from_values(values).engine.action.control_rate_min_hz == 2.5
    assert settings_from_values({**values, "control_rate_hz": 2.0}).engine.action.control_rate_min_hz == 2.0


@pytest.mark.ros      # the node's parameters module imports rclpy
def test_engine_errors_about_action_fields_name_the_node_parameters():
    """The engine calls the action task's fields ``action.<field>``; the node declares them at top level, so its
    refusal names the parameters as ``ros2 param`` knows them (and leaves ``engine.*`` names alone)."""
    from oxygen_ros.node.parameters import node_parameter_names, settings_from_values

    values = {"joint_names": ["j1", "j2"], "action_dt_s": 0.05, "action_horizon": 10,
              "control_rate_mode": "adaptive", "control_rate_hz": 4.0, "control_rate_min_hz": 5.0}
    with pytest.raises(ValueError) as err:
        settings_from_values(values)
    assert str(err.value) == "control_rate_min_hz (5 Hz) must not exceed control_rate_hz (4 Hz) in adaptive mode"
    with pytest.raises(ValueError, match="^num_denoise_steps must be >= 1, got 0$"):
        settings_from_values({**values, "control_rate_min_hz": 0.0, "num_denoise_steps": 0})
    assert node_parameter_names("action.subtask_task x; engine.action.noise_seed; action.noise_seedling") == \
        "subtask_task x; engine.action.noise_seed; action.noise_seedling"


def test_the_automatic_floor_is_the_lowest_step_above_the_chunk_rate():
    from oxygen_ros.engine.rate import automatic_floor_hz

    assert automatic_floor_hz(4.0, 0.5, 1.0) == 1.5       # the demo: 1 s chunks; 1 Hz is not shorter than 1 s
    assert automatic_floor_hz(4.0, 0.5, 1.0000005) == 1.0  # DROID's 15 x 1/15 s, a hair over 1 s
    assert automatic_floor_hz(10.0, 0.5, 0.5) == 2.5
    assert automatic_floor_hz(2.0, 0.5, 0.5) == 2.0       # capped: no room to slow down
    assert automatic_floor_hz(4.0, 0.25, 2.5) == 0.5
    with pytest.raises(ValueError):
        automatic_floor_hz(4.0, 0.5, 0.0)
    # unresolved (no node), 0 means one step
    assert _adaptive(min_hz=0.0).grid[0] == 0.5


@pytest.mark.ros      # an rclpy logger
def test_drops_and_rises_are_logged_through_one_rclpy_logger():
    """rclpy refuses a second severity from one call site ("Logger severity cannot be changed between calls"):
    a drop (warning) and a rise (info) logged one after the other must both go through, again and again."""
    import rclpy.logging

    from oxygen_ros.engine.rate import RateChange
    from oxygen_ros.node.control_cycle import log_rate_change

    logger = rclpy.logging.get_logger("test_control_rate")
    down = RateChange(seq=5, from_hz=4.0, to_hz=2.5, cost_s=0.3, reason="cost_over_period")
    up = RateChange(seq=25, from_hz=2.5, to_hz=3.0, cost_s=0.1, reason="cost_fits_faster")
    for change in (down, up, down, up):
        log_rate_change(logger, change, 1.25)
