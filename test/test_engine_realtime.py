"""Real-time chunking in the engine (oxygen_ros/engine/realtime.py): the delay estimate, the plan of one chunk by
hand, and cycles of Engine and Fleet whose chunks are guided toward the chunk in flight. No wall-clock
assertions: delays are given (fixed, or reported through observe_delay)."""

import math

import pytest
import torch

from oxygen_ros.engine import Engine
from oxygen_ros.engine.config import RTCConfig
from oxygen_ros.engine.fleet import Fleet
from oxygen_ros.engine.realtime import ChunkInFlight, DelayEstimator, plan_guidance
from oxygen_ros.models.rtc import prefix_weights
from engine_support import ByteIO, engine_config, observation, tiny_model

DT = 0.02     # one action per 20 ms; engine_support's observations are 0.1 s apart: 5 actions


def test_the_delay_estimate_ignores_the_warm_up_and_counts_control_steps():
    config = RTCConfig(enabled=True, action_dt_s=DT, warmup_cycles=2, delay_window=3)
    delays = DelayEstimator(config)
    delays.observe_own(0.05)
    assert delays.steps() is None                      # still warming up
    for own in (0.05, 0.03):
        delays.observe_own(own)
    assert delays.delay_s == 0.03 and delays.steps() == 2   # 30 ms / 20 ms, rounded up
    for spike in (5.0, 4.0):                           # the caller's first delays: cold start, ignored
        delays.observe(spike)
    assert delays.steps() is None       # from the caller's first on only the caller's count: none past its warm-up
    for delay in (0.10, 0.12, 0.11):
        delays.observe(delay)
    assert delays.delay_s == pytest.approx(0.12) and delays.steps() == 6
    for delay in (0.01, 0.01, 0.01):                   # the window's maximum follows the recent ones
        delays.observe(delay)
    assert delays.steps() == 1
    margin = DelayEstimator(RTCConfig(enabled=True, action_dt_s=DT, warmup_cycles=0, delivery_margin_s=0.015))
    margin.observe(0.12)
    assert margin.steps() == math.ceil((0.12 + 0.015) / DT)
    assert DelayEstimator(RTCConfig(enabled=True, action_dt_s=DT, delay_mode="fixed", fixed_delay_steps=4)).steps() == 4
    with pytest.raises(ValueError):
        delays.observe(-0.1)
    with pytest.raises(ValueError, match="action_dt_s"):
        RTCConfig(enabled=True)


def test_the_plan_of_one_chunk_by_hand():
    """A chunk in flight of 10 actions from stamp 1.0: at stamp 1.1 five have started; with d = 3 and s = 6 the
    new chunk's action i is guided toward the old one's 5 + i (weights 1, 1, 1, then (s - i) / (s - d + 1) = 0.75,
    0.5, and 0 from i = 5 where the old chunk has ended, though the decay would give 0.25), and it takes over at the old chunk's action 8."""
    config = RTCConfig(enabled=True, action_dt_s=DT, delay_mode="fixed", fixed_delay_steps=3, execution_horizon=6)
    old = torch.arange(10 * 2, dtype=torch.float32).view(10, 2)
    delays = DelayEstimator(config)
    plan = plan_guidance(config, ChunkInFlight(old, 1.0, 7), delays, 1.1, 10, 2)
    assert (plan.delay_steps, plan.takeover_index, plan.fallback, plan.clipped) == (3, 8, "", False)
    assert torch.equal(plan.target[:5], old[5:]) and plan.target[5:].eq(0).all()
    assert torch.allclose(plan.weights, torch.tensor([1, 1, 1, 0.75, 0.5, 0, 0, 0, 0, 0.0]))
    assert torch.equal(plan.weights[:5], prefix_weights(3, 6, 10, "linear")[:5])
    # nothing to continue: no chunk, an observation older than the chunk, a chunk fully executed, no delay yet
    assert plan_guidance(config, None, delays, 1.1, 10, 2).fallback == "no_chunk"
    assert plan_guidance(config, ChunkInFlight(old, 1.0, 7), delays, 0.9, 10, 2).fallback == "stale_stamp"
    assert plan_guidance(config, ChunkInFlight(old, 1.0, 7), delays, 1.0 + 10 * DT, 10, 2).fallback == "expired"
    auto = RTCConfig(enabled=True, action_dt_s=DT)
    assert plan_guidance(auto, ChunkInFlight(old, 1.0, 7), DelayEstimator(auto), 1.1, 10, 2).fallback == "delay_unknown"
    late = RTCConfig(enabled=True, action_dt_s=DT, delay_mode="fixed", fixed_delay_steps=8, execution_horizon=4)
    clipped = plan_guidance(late, ChunkInFlight(old, 1.0, 7), DelayEstimator(late), 1.0, 10, 2)
    assert clipped.clipped and clipped.weights.tolist() == [1.0] * 4 + [0.0] * 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(3)


def _rtc(**overrides):
    return dict({"enabled": True, "action_dt_s": DT, "delay_mode": "fixed", "fixed_delay_steps": 2,
                 "execution_horizon": 6, "max_guidance_weight": 10.0}, **overrides)


def test_each_chunk_continues_the_one_in_flight(model):
    """Cycle 1 has nothing to continue (plain, counted); every later chunk is guided: its first d = 2 actions
    come close to the actions of the chunk in flight it takes over (5 of them started by its observation),
    much closer than the plain chunk of the same observation; a warm-up neither reads nor keeps a chunk."""
    guided = Engine(model, ByteIO(model.config), engine_config("unified", [], rtc=_rtc()))
    plain = Engine(model, ByteIO(model.config), engine_config("unified", []))
    guided.warm_up(observation(0))
    previous = None
    for seq in range(1, 5):
        chunk = guided.run_cycle(observation(seq)).action
        reference = plain.run_cycle(observation(seq)).action
        if previous is None:
            assert (chunk.rtc_fallback, chunk.rtc_delay_steps, chunk.rtc_takeover_index) == ("no_chunk", -1, -1)
            assert (chunk.actions == reference.actions).all()      # nothing to guide toward: plain
        else:
            assert (chunk.rtc_fallback, chunk.rtc_delay_steps, chunk.rtc_takeover_index) == ("", 2, 7)
            frozen = torch.from_numpy(previous.actions[5:7])
            guided_error = (torch.from_numpy(chunk.actions[:2]) - frozen).abs().max()
            plain_error = (torch.from_numpy(reference.actions[:2]) - frozen).abs().max()
            assert guided_error < 0.2 * plain_error, (guided_error, plain_error)
        previous = chunk
    assert guided.rtc_counts == {"no_chunk": 1}
    assert plain.rtc_counts == {}


def test_a_fleet_guides_each_robot_toward_its_own_chunk(model):
    """Robot "rtc" runs real-time chunking, robot "off" does not, in one batch: each chunk equals the one its
    robot gets alone on an engine of its own."""
    fleet = Fleet(model, engine_config("unified", [], kv_budget_mb=24))
    fleet.add_robot("rtc", ByteIO(model.config), engine_config("unified", [], rtc=_rtc(fixed_delay_steps=3)))
    fleet.add_robot("off", ByteIO(model.config), engine_config("unified", []))
    alone = {"rtc": Engine(model, ByteIO(model.config), engine_config("unified", [], rtc=_rtc(fixed_delay_steps=3))),
             "off": Engine(model, ByteIO(model.config), engine_config("unified", []))}
    for seq in range(1, 4):
        result = fleet.run_cycle({"rtc": observation(seq), "off": observation(seq + 20)})
        for robot, obs in (("rtc", observation(seq)), ("off", observation(seq + 20))):
            own = alone[robot].run_cycle(obs).action
            chunk = result.cycles[robot].action
            assert (chunk.rtc_delay_steps, chunk.rtc_fallback) == (own.rtc_delay_steps, own.rtc_fallback)
            assert abs(chunk.actions - own.actions).max() < 1e-4
    assert fleet.robot("rtc").rtc_counts == {"no_chunk": 1} and result.cycles["rtc"].action.rtc_delay_steps == 3
    assert result.cycles["off"].action.rtc_delay_steps == -1


def test_measured_delays_from_the_caller_set_d(model):
    """auto delay mode: the caller's measured delays (observe_delay, after the warm-up ones) set d."""
    engine = Engine(model, ByteIO(model.config), engine_config("unified", [], rtc=_rtc(delay_mode="auto",
                                                                                       warmup_cycles=1)))
    engine.run_cycle(observation(1))
    for delay in (3.0, 0.07):            # the first is a cold start: ignored
        engine.observe_delay(delay)
    chunk = engine.run_cycle(observation(2)).action
    assert (chunk.rtc_delay_steps, chunk.rtc_takeover_index) == (4, 9)      # ceil(70 ms / 20 ms) = 4, 5 + 4


def test_a_pause_starts_afresh_and_a_new_instruction_keeps_the_guidance(model):
    """After ``flush`` (the node's deactivation: the robot stopped executing) the next chunk has nothing to continue
    (``no_chunk``, plain); a new instruction does not stop the guidance (the frozen actions execute whatever the
    new task is), so its first chunk is guided toward the chunk in flight."""
    engine = Engine(model, ByteIO(model.config), engine_config("unified", [], rtc=_rtc()))
    assert engine.run_cycle(observation(1)).action.rtc_fallback == "no_chunk"
    assert engine.run_cycle(observation(2)).action.rtc_delay_steps == 2
    engine.flush()
    after_pause = engine.run_cycle(observation(3)).action
    assert (after_pause.rtc_fallback, after_pause.rtc_delay_steps, after_pause.rtc_takeover_index) == ("no_chunk", -1, -1)
    new_task = engine.run_cycle(observation(4, instruction="put the cube in the bowl")).action
    assert (new_task.rtc_fallback, new_task.rtc_delay_steps, new_task.rtc_takeover_index) == ("", 2, 7)
    assert engine.rtc_counts == {"no_chunk": 2}
