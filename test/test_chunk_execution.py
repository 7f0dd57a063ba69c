"""Robot-side chunk execution (oxygen_ros/tools/chunk_execution.py): off, the newest chunk wins exactly as
sim_robot and evaluate executed chunks before; on, ACT's temporal ensemble over the chunks covering t."""
from __future__ import annotations

import math

import numpy as np
import pytest

from oxygen_ros.tools.chunk_execution import ChunkExecutor

DT = 0.02


def _old_sim_robot_action(kept, t):
    """sim_robot's executor before this module: the newest stamp kept, index floor((t - stamp) / dt) clamped."""
    stamp, dt, actions = kept
    return actions[int(np.clip((t - stamp) // dt, 0, len(actions) - 1))]


def _old_lockstep_action(kept, t):
    """evaluate's lockstep executor before this module: index round((t - stamp) / dt) clamped."""
    stamp, dt, actions = kept
    return actions[int(np.clip(round((t - stamp) / dt), 0, len(actions) - 1))]


@pytest.mark.parametrize("rule, old", [("floor", _old_sim_robot_action), ("round", _old_lockstep_action)])
def test_off_is_bit_identical_to_the_newest_chunk_wins_executor(rule, old):
    rng = np.random.default_rng(3)
    executor = ChunkExecutor(index_rule=rule)
    assert not executor.ensembling and executor.action_at(5.0) is None
    kept = None
    # Chunks arriving out of order (a late one with an older stamp is ignored, an equal stamp replaces),
    # of different horizons and dts; queried before their stamp, inside them and after they ran out.
    for stamp in (10.0, 10.2, 10.1, 10.2, 10.4, 9.0, 11.3):
        horizon, dt = int(rng.integers(1, 60)), float(rng.choice([DT, 0.1, 0.0333]))
        actions = rng.normal(size=(horizon, 14))
        taken = executor.add(stamp, dt, actions)
        assert taken == (kept is None or stamp >= kept[0])
        if taken:
            kept = (stamp, dt, actions)
        for t in np.concatenate([rng.uniform(8.0, 13.0, 40), kept[0] + dt * np.arange(-2, horizon + 3)]):
            got = executor.action_at(t)
            assert got.dtype == np.float64 and np.array_equal(got, old(kept, t)), (stamp, t)
    assert len(executor.chunks) == 1
    executor.clear()
    assert executor.action_at(11.0) is None


def test_two_constant_chunks_average_with_acts_weights():
    m = 0.01
    executor = ChunkExecutor(ensemble_m=m)
    assert executor.add(0.0, DT, np.zeros((50, 3)))          # covers [0, 1.0)
    assert executor.add(0.2, DT, np.ones((50, 3)))           # 10 steps later: covers [0.2, 1.2)
    # Before the second chunk's stamp only the first covers t.
    np.testing.assert_array_equal(executor.action_at(0.19), np.zeros(3))
    # Both cover 0.505 s (mid-step: floor's index is not at the mercy of 0.02's binary rounding): ACT's w_i = exp(-m i), i = 0 the oldest, i = 10 control steps for the second chunk.
    w_old, w_new = 1.0, math.exp(-m * 10)
    expected = w_new / (w_old + w_new)                       # = 0.47502...
    np.testing.assert_allclose(executor.action_at(0.505), np.full(3, expected), rtol=0, atol=1e-12)
    assert expected == pytest.approx(0.4750208125)
    weights = executor.weights_at(0.505)
    assert [(c.stamp, i) for c, i, _ in weights] == [(0.0, 25), (0.2, 15)]
    assert sum(w for _, _, w in weights) == pytest.approx(1.0)
    # The first chunk ran out at 1.0 s: from then on the second alone.
    np.testing.assert_array_equal(executor.action_at(1.005), np.ones(3))
    # No chunk covers 5 s: the newest chunk's last action is held, as without ensembling.
    np.testing.assert_array_equal(executor.action_at(5.0), np.ones(3))
    # A negative m weighs the newer prediction more.
    newer = ChunkExecutor(ensemble_m=-m)
    newer.add(0.0, DT, np.zeros((50, 3)))
    newer.add(0.2, DT, np.ones((50, 3)))
    assert newer.action_at(0.505)[0] == pytest.approx(1.0 / (1.0 + math.exp(-m * 10)))


def test_a_chunk_that_does_not_cover_t_contributes_nothing():
    executor = ChunkExecutor(ensemble_m=0.01)
    executor.add(0.0, DT, np.full((10, 2), 7.0))     # covers [0, 0.2): over by 0.3
    executor.add(0.3, DT, np.full((50, 2), 1.0))
    executor.add(0.4, DT, np.full((50, 2), 2.0))
    executor.add(0.9, DT, np.full((50, 2), 100.0))   # stamped after t = 0.5
    got = executor.action_at(0.5)
    w1, w2 = 1.0, math.exp(-0.01 * 5)               # 0.4 s is 5 steps after 0.3 s
    np.testing.assert_allclose(got, np.full(2, (w1 * 1.0 + w2 * 2.0) / (w1 + w2)), atol=1e-12)
    assert [c.stamp for c, _, _ in executor.weights_at(0.5)] == [0.3, 0.4]


def test_chunks_every_step_get_exactly_acts_weights():
    """ACT queries every step: the predictions for a step are weighted exp(-m i) by their rank from the oldest."""
    m, horizon = 0.05, 8
    executor = ChunkExecutor(ensemble_m=m, max_chunks=horizon, index_rule="round")
    rng = np.random.default_rng(0)
    chunks = [rng.normal(size=(horizon, 4)) for _ in range(20)]
    for k, actions in enumerate(chunks):
        executor.add(k * DT, DT, actions)
        t = k * DT
        covering = [j for j in range(k + 1) if k - j < horizon]          # chunks j with a prediction for step k
        weights = np.exp(-m * np.arange(len(covering)))
        weights /= weights.sum()
        expected = sum(w * chunks[j][k - j] for w, j in zip(weights, covering))
        np.testing.assert_allclose(executor.action_at(t), expected, rtol=0, atol=1e-12)
        assert len(executor.chunks) == min(k + 1, horizon)


def test_max_chunks_keeps_the_latest_stamps():
    executor = ChunkExecutor(ensemble_m=0.01, max_chunks=2)
    for stamp in (0.0, 0.1, 0.2):
        assert executor.add(stamp, DT, np.full((50, 1), stamp))
    assert [c.stamp for c in executor.chunks] == [0.1, 0.2]
    assert not executor.add(0.05, DT, np.zeros((50, 1)))      # older than all kept: not kept
    assert executor.add(0.15, DT, np.zeros((50, 1)))          # between: kept, 0.1 dropped
    assert [c.stamp for c in executor.chunks] == [0.15, 0.2]


def test_bad_input_is_rejected():
    executor = ChunkExecutor(ensemble_m=0.01)
    for actions in ([[1.0, float("nan")]], [[float("inf")]], np.zeros(5), np.zeros((0, 3)), np.zeros((2, 0)),
                    np.zeros((2, 3, 1)), [["a"]]):
        with pytest.raises(ValueError):
            executor.add(0.0, DT, actions)
    for stamp, dt in ((float("nan"), DT), (0.0, 0.0), (0.0, -DT), (0.0, float("inf"))):
        with pytest.raises(ValueError):
            executor.add(stamp, dt, np.zeros((2, 3)))
    assert executor.chunks == ()
    executor.add(0.0, DT, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="dimension"):
        executor.add(0.1, DT, np.zeros((2, 4)))
    with pytest.raises(ValueError, match="finite"):
        executor.action_at(float("nan"))
    for kwargs in ({"ensemble_m": float("nan")}, {"max_chunks": 0}, {"max_chunks": 1.5}, {"index_rule": "ceil"}):
        with pytest.raises(ValueError):
            ChunkExecutor(**kwargs)
    # Off, the non-finite check holds too: nothing non-finite is ever executed.
    with pytest.raises(ValueError, match="non-finite"):
        ChunkExecutor().add(0.0, DT, [[float("nan")]])


def test_returned_action_is_a_copy():
    executor = ChunkExecutor()
    source = np.zeros((3, 2))
    executor.add(0.0, DT, source)
    source[:] = 5.0                                  # the caller's array changes: the kept chunk does not
    action = executor.action_at(0.0)
    action[:] = 9.0                                  # nor does changing what was returned
    np.testing.assert_array_equal(executor.action_at(0.0), np.zeros(2))


def test_seam_is_the_switch_jump_of_position_and_velocity_and_keeps_nothing():
    # old chunk: a ramp 0, 0.1, 0.2, ... (5 rad/s at dt 0.02); new chunk from t = 0.1 (5 actions later):
    # the same ramp shifted up by 0.3 with twice the slope
    dt = 0.02
    old = np.arange(20, dtype=np.float64)[:, None] * 0.1
    new = 0.3 + 0.5 + np.arange(20, dtype=np.float64)[:, None] * 0.2
    executor = ChunkExecutor(index_rule="round")
    assert executor.seam(0.1, 0.1, dt, new) is None            # nothing in flight: no switch
    executor.add(0.0, dt, old)
    # switch at t = 0.14: new action 2 (0.8 + 0.4 = 1.2) against old action 7 (0.7)
    position, velocity = executor.seam(0.14, 0.1, dt, new)
    assert position == pytest.approx([0.5]) and velocity == pytest.approx([(0.2 - 0.1) / dt])
    assert executor.action_at(0.14) == pytest.approx([0.7])    # the new chunk was not kept
    # a continuation of the old chunk makes no seam
    position, velocity = executor.seam(0.14, 0.1, dt, old[5:])
    assert position == pytest.approx([0.0]) and velocity == pytest.approx([0.0])
    # an older chunk than the kept one would not be kept (newest wins): no seam
    assert executor.seam(0.14, -0.1, dt, new) is None
