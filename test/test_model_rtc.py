"""Real-time chunking's guidance (oxygen_ros/models/rtc.py, VLAModel.denoise(guidance=...)) against
hand-checkable vectors: the prefix weights, the clipped guidance weight, one guided Euler velocity, and the
guided denoising of the tiny presets (β = 0 is plain denoising bit for bit; strong guidance holds the frozen
actions to the chunk in flight; batched rows with their own delays equal their one-row results)."""

import math

import pytest
import torch

from oxygen_ros.models import load_model
from oxygen_ros.models.rtc import RTCGuidance, guidance_weight, guided_velocity, prefix_weights
from test_model_inference import _observation, _prefill, _state


def test_prefix_weights_by_hand():
    # d = 5, s = 10, H = 20: ones, then (s - i) / (s - d + 1) = 5/6 ... 1/6, then zeros
    linear = prefix_weights(5, 10, 20, "linear")
    assert torch.allclose(linear, torch.tensor([1.0] * 5 + [5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6] + [0.0] * 10))
    # the paper's exponential decay: c (e^c - 1) / (e - 1) of the same c
    exp = prefix_weights(5, 10, 20, "exp")
    c = torch.tensor([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6], dtype=torch.float64)
    assert torch.allclose(exp[5:10], (c * torch.expm1(c) / (math.e - 1)).float())
    assert exp[:5].eq(1).all() and exp[10:].eq(0).all()
    # LeRobot's ZEROS (a hard prefix of d) and ONES (1 up to s)
    assert torch.equal(prefix_weights(5, 10, 20, "zeros"), torch.tensor([1.0] * 5 + [0.0] * 15))
    assert torch.equal(prefix_weights(5, 10, 20, "ones"), torch.tensor([1.0] * 10 + [0.0] * 10))
    assert torch.equal(prefix_weights(12, 10, 20, "zeros"), torch.tensor([1.0] * 10 + [0.0] * 10))
    # a delay past the execution horizon freezes up to s only; s past H is clipped to H
    assert torch.equal(prefix_weights(12, 10, 20, "linear"), torch.tensor([1.0] * 10 + [0.0] * 10))
    assert torch.equal(prefix_weights(3, 50, 4, "linear")[:3], torch.ones(3))
    assert prefix_weights(0, 0, 4).eq(0).all()
    for bad in ((-1, 4, 8, "exp"), (1, 4, 0, "exp"), (1, 4, 8, "cosine")):
        with pytest.raises(ValueError):
            prefix_weights(*bad)


def test_guidance_weight_by_hand():
    assert guidance_weight(0.5, 10.0) == pytest.approx(2.0)           # (0.25 + 0.25) / 0.25
    assert guidance_weight(0.9, 100.0) == pytest.approx(0.82 / 0.09)   # (0.81 + 0.01) / (0.9 · 0.1)
    assert guidance_weight(0.9, 5.0) == 5.0                            # clipped at β
    assert guidance_weight(1.0, 5.0) == 5.0 and guidance_weight(0.0, 5.0) == 5.0
    assert guidance_weight(0.5, 0.0) == 0.0


def test_guided_velocity_by_hand():
    """v(x) = 0.5 x at x = 1, t = 0.5, target 0.1, weights 1, 0 from index 2: the clean estimate is
    x - t v = 0.75, its Jacobian 1 - 0.5 t = 0.75, the error 0.1 - 0.75 = -0.65, the guidance weight 2:
    v - 2 · 0.75 · (-0.65) = 1.475 where guided, 0.5 elsewhere."""
    x = torch.ones(1, 4, 1)
    guidance = RTCGuidance(torch.full((1, 4, 1), 0.1), torch.tensor([[1.0, 1.0, 0.0, 0.0]]), 10.0)
    out = guided_velocity(lambda z: 0.5 * z, x, 0.5, guidance_weight(0.5, 10.0), guidance.target, guidance.weights)
    assert torch.allclose(out.flatten(), torch.tensor([1.475, 1.475, 0.5, 0.5]))
    off = RTCGuidance(guidance.target, guidance.weights, 0.0)
    unguided = guided_velocity(lambda z: 0.5 * z, x, 0.5, guidance_weight(0.5, off.max_guidance_weight), off.target,
                               off.weights)
    assert torch.equal(unguided, 0.5 * x)


@pytest.fixture(scope="module", params=["pi05_tiny", "pi0_tiny"])
def setup(request):
    model = load_model(request.param, dtype=torch.float32, seed=1)
    kv, _ = _prefill(model, *_observation(model, 2, seed=0))
    horizon = model.config.action_horizon
    noise = torch.randn(2, horizon, 32, generator=torch.Generator().manual_seed(5))
    state = _state(model, 2, 6)
    # the chunk in flight: the same prefix denoised from other noise (a chunk the model could make)
    in_flight = model.denoise(kv.begin(None), torch.randn(2, horizon, 32, generator=torch.Generator().manual_seed(9)),
                              num_steps=10, state=state)
    return model, kv, noise, state, in_flight


def test_zero_guidance_is_plain_denoising_bit_for_bit(setup):
    model, kv, noise, state, in_flight = setup
    plain = model.denoise(kv.begin(None), noise, num_steps=10, state=state)
    weights = torch.ones(2, model.config.action_horizon)
    for guidance in (RTCGuidance(in_flight, weights, 0.0), RTCGuidance(in_flight, torch.zeros_like(weights), 10.0)):
        assert torch.equal(model.denoise(kv.begin(None), noise, num_steps=10, state=state, guidance=guidance), plain)
    with pytest.raises(ValueError, match="RTC guidance"):
        model.denoise(kv.begin(None), noise, num_steps=10, state=state,
                      guidance=RTCGuidance(in_flight[:1], weights[:1], 10.0))


def test_guidance_holds_the_frozen_actions_to_the_chunk_in_flight(setup):
    """With d = 4 frozen actions and β = 10 (the paper's default clip is 5-10) the new chunk's first d actions
    come within 0.15 of the chunk in flight (measured on these presets: 0.04-0.06), where plain denoising from
    the same noise is 4-5 away; past the execution horizon s = 8 the chunk stays the plain one's within 0.25."""
    model, kv, noise, state, in_flight = setup
    horizon = model.config.action_horizon
    d, s = 4, 8
    plain = model.denoise(kv.begin(None), noise, num_steps=10, state=state)
    weights = prefix_weights(d, s, horizon, "exp").expand(2, horizon)
    guided = model.denoise(kv.begin(None), noise, num_steps=10, state=state,
                           guidance=RTCGuidance(in_flight, weights, 10.0))
    assert (plain[:, :d] - in_flight[:, :d]).abs().max() > 1.0
    assert (guided[:, :d] - in_flight[:, :d]).abs().max() < 0.15
    assert (guided[:, s:] - plain[:, s:]).abs().max() < 0.25
    assert torch.isfinite(guided).all()


def test_batched_rows_with_their_own_delays_equal_their_one_row_results(setup):
    """Row 0 frozen for 2 actions, row 1 for 6, each toward its own chunk: the batch equals each row run alone
    (the rows' prefixes differ; attention is per row)."""
    model, kv, noise, state, in_flight = setup
    horizon = model.config.action_horizon
    weights = torch.stack([prefix_weights(2, 8, horizon, "linear"), prefix_weights(6, 8, horizon, "linear")])
    batched = model.denoise(kv.begin(None), noise, num_steps=10, state=state,
                            guidance=RTCGuidance(in_flight, weights, 5.0))
    for row in range(2):
        kv_row, _ = _prefill(model, *[t[row:row + 1] for t in _observation(model, 2, seed=0)])
        alone = model.denoise(kv_row.begin(None), noise[row:row + 1], num_steps=10,
                              state=None if state is None else state[row:row + 1],
                              guidance=RTCGuidance(in_flight[row:row + 1], weights[row:row + 1], 5.0))
        assert (alone[0] - batched[row]).abs().max() < 1e-4
