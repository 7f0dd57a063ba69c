"""The demo's control rate from the cycle cost measured at start (oxygen_ros/tools/demo_rate.py), and its
line in the summary (oxygen_ros/tools/report.py). Pure functions of cycle records: no timing asserted."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from oxygen_ros.engine.metrics import CycleRecord
from oxygen_ros.tools import demo_rate
from oxygen_ros.tools.demo_rate import RateChoice, choose_rate, cycle_cost_s, deadline_misses, measured_costs


def _record(seq: int, frame: float, decode: float = 0.0, steps: int = 0, missed: bool = False) -> dict:
    return asdict(CycleRecord(seq=seq, frame_latency_s=frame, action_latency_s=frame - decode, encode_s=0.01,
                              prefill_s=0.02, denoise_s=0.05, decode_s=decode, decode_steps=steps,
                              batch_sizes=[1] * steps, vision_calls=1, images_encoded=1, prefilled_tokens=10,
                              generated_tokens=steps, deadline_missed=missed, pool_used_bytes=0))


def test_the_cost_leaves_out_the_decode_steps_taken_in_the_slack():
    # 300 ms cycle with 5 decode steps of 20 ms: 200 ms without them, plus the one guaranteed step.
    assert cycle_cost_s(_record(0, 0.3, 0.1, 5)) == pytest.approx(0.22)
    assert cycle_cost_s(_record(0, 0.3, 0.1, 5), min_decode_steps=0) == pytest.approx(0.2)
    assert cycle_cost_s(_record(0, 0.3, 0.1, 5), min_decode_steps=9) == pytest.approx(0.3)   # no more steps than taken
    assert cycle_cost_s(_record(0, 0.3)) == pytest.approx(0.3)            # no decode step at all
    for bad in (_record(0, float("nan")), _record(0, 0.1, -0.1, 1)):
        with pytest.raises(ValueError):
            cycle_cost_s(bad)
    with pytest.raises(ValueError):
        cycle_cost_s(_record(0, 0.3), min_decode_steps=-1)


def test_the_rate_is_the_highest_step_whose_period_covers_the_cost_with_headroom():
    # 200 ms x 1.25 = 250 ms: exactly 4 Hz, kept despite floating point.
    assert choose_rate([0.2] * 8, 4.0, headroom=1.25).chosen_hz == 4.0
    # 300 ms x 1.25 = 375 ms: 2.67 Hz fits, rounded down to 2.5.
    choice = choose_rate([0.3] * 8, 4.0, headroom=1.25)
    assert (choice.chosen_hz, choice.calibrated, choice.cycles) == (2.5, True, 8)
    assert choice.cost_s == pytest.approx(0.3)
    assert choose_rate([0.3] * 8, 4.0, headroom=1.25, step_hz=0.25).chosen_hz == 2.5
    assert choose_rate([0.3] * 8, 4.0, headroom=1.0).chosen_hz == 3.0
    assert choose_rate([0.3] * 8, 4.0).chosen_hz == 2.0            # the default headroom, 1.5: 450 ms
    # Never above the configured rate, however cheap the cycle.
    assert choose_rate([0.01] * 8, 4.0).chosen_hz == 4.0
    assert choose_rate([0.0] * 3, 2.0).chosen_hz == 2.0
    # Too slow for any step: the lowest step (or the configured rate below it).
    assert choose_rate([3.0] * 8, 4.0).chosen_hz == demo_rate.STEP_HZ
    assert choose_rate([3.0] * 8, 0.2).chosen_hz == 0.2


def test_a_high_quantile_sets_the_rate_not_the_mean_nor_one_outlier():
    costs = [0.1] * 16 + [0.5] * 4                  # a fifth of the cycles prefill a language prompt too
    assert choose_rate(costs, 10.0, headroom=1.25).chosen_hz == 1.5        # p90 = 0.5 s -> 1.6 Hz -> 1.5
    assert choose_rate(costs, 10.0, quantile=0.5, headroom=1.25).chosen_hz == 8.0
    assert choose_rate([0.1] * 19 + [2.0], 4.0, headroom=1.25).chosen_hz == 4.0     # p90 ignores a single stall


@pytest.mark.parametrize("kwargs", [dict(costs_s=[]), dict(costs_s=[-0.1]), dict(costs_s=[float("inf")]),
                                    dict(costs_s=[0.1], configured_hz=0.0), dict(costs_s=[0.1], step_hz=0.0),
                                    dict(costs_s=[0.1], headroom=0.9), dict(costs_s=[0.1], quantile=0.0),
                                    dict(costs_s=[0.1], quantile=1.5)])
def test_bad_calibration_inputs_raise(kwargs):
    with pytest.raises(ValueError):
        choose_rate(**{"configured_hz": 4.0, **kwargs})


def test_measured_costs_skip_the_first_cycles_in_seq_order_and_misses_count():
    records = [_record(seq, 0.1 * seq, missed=seq % 2 == 0) for seq in (4, 1, 3, 2, 5)]
    assert measured_costs(records, skip=2) == pytest.approx([0.3, 0.4, 0.5])
    assert measured_costs(records, skip=0)[0] == pytest.approx(0.1)
    assert deadline_misses(records) == (2, 5)
    assert deadline_misses([]) == (0, 0)


def test_the_summary_shows_the_rate_chosen_and_the_misses_with_their_share():
    from oxygen_ros.tools.report import RunData, format_summary, summarize

    choice = choose_rate([0.3] * 8, 4.0, headroom=1.25)
    cycles = [_record(seq, 0.3, missed=seq in (3, 7)) for seq in range(40)]
    text = format_summary(summarize(RunData(cycles=cycles, control_rate=choice.as_dict())))
    assert "control rate       2.5 Hz (chosen from 8 calibration cycles: p90 cost 300 ms x 1.25 headroom; " \
           "asked 4 Hz)" in text
    assert "deadline misses    2 of 40 cycles (5.0 %)" in text
    off = RateChoice(4.0, 4.0, calibrated=False)
    text = format_summary(summarize(RunData(control_rate=off.as_dict())))
    assert "control rate       4 Hz (as configured; no calibration)" in text
    assert "deadline misses    None" in text                  # no cycles, no status: the counter's n/a
    # A control_rate.json of another version still gives its rate.
    assert "control rate       3 Hz" in format_summary(summarize(RunData(control_rate={"chosen_hz": 3})))
