"""The fused projections (cpu_fast_paths.LinearGroup) and the mask-free SDPA of an all-visible
attention: the same values as the unfused paths, and the switches and guards around them."""

import pytest
import torch

from oxygen_ros.models import cpu_fast_paths
from oxygen_ros.models.cpu_fast_paths import Linear, LinearGroup
from oxygen_ros.models.gemma import AttentionMask, attention
from test_model_cascade import naive_attention   # the fp64 reference attention


def _layers(*outs, width=48):
    torch.manual_seed(0)
    return [Linear(width, out, bias=False) for out in outs]


def test_a_group_computes_what_its_layers_compute_at_every_row_count():
    layers = _layers(64, 16, 16)
    group = LinearGroup(*layers)
    with torch.inference_mode():
        for shape in ((1, 1, 48), (10, 1, 48), (1, 10, 48), (cpu_fast_paths.PACKED_MIN_ROWS, 48), (2, 300, 48)):
            x = torch.randn(shape)
            outs = group(x)
            assert [o.shape[-1] for o in outs] == [64, 16, 16]
            for out, layer in zip(outs, layers):
                assert out.shape == (*shape[:-1], layer.out_features)
                torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
        assert group._weight is not None                      # the fused copy served them


def test_a_group_follows_weight_changes_and_the_switch():
    layers = _layers(32, 8)
    group = LinearGroup(*layers)
    with torch.inference_mode():
        group(torch.randn(20, 48))
    with torch.no_grad():
        layers[1].weight.copy_(torch.randn(8, 48))             # a checkpoint load
    with torch.inference_mode():
        for rows in (3, 20):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(group(x)[1], x @ layers[1].weight.T, atol=1e-5, rtol=1e-5)
        cpu_fast_paths.use_fused_projections(False)
        try:
            assert not cpu_fast_paths.fused_projections_in_use()
            x = torch.randn(20, 48)
            assert all(torch.equal(a, layer(x)) for a, layer in zip(group(x), layers))
        finally:
            cpu_fast_paths.use_fused_projections(True)
    with pytest.raises(TypeError):
        cpu_fast_paths.use_fused_projections("yes")


def test_outside_inference_mode_a_group_runs_its_layers_and_keeps_gradients():
    layers = _layers(32, 8)
    group = LinearGroup(*layers)
    x = torch.randn(20, 48, requires_grad=True)
    a, b = group(x)
    (a.sum() + b.sum()).backward()
    assert x.grad is not None and all(layer.weight.grad is not None for layer in layers)
    assert group._weight is None                              # nothing fused, nothing copied


def test_a_group_refuses_biased_or_mismatched_layers():
    with pytest.raises(ValueError):
        LinearGroup(Linear(8, 4, bias=True), Linear(8, 4, bias=False))
    with pytest.raises(ValueError):
        LinearGroup(Linear(8, 4, bias=False), Linear(6, 4, bias=False))


def test_an_all_visible_mask_runs_sdpa_unmasked_with_the_same_values():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 40, 4, 64), torch.randn(1, 40, 1, 64), torch.randn(1, 40, 1, 64)
    full = torch.ones(1, 40, 40, dtype=torch.bool)
    wrapped = AttentionMask(full)
    assert wrapped.all_visible()
    out = attention(q, k, v, wrapped)
    assert wrapped._additive == {}                            # no additive mask was built
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, full), atol=2e-5, rtol=1e-5)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None]
    partial = AttentionMask(causal)
    assert not partial.all_visible()
    torch.testing.assert_close(attention(q, k, v, partial).double(), naive_attention(q, k, v, causal),
                               atol=2e-5, rtol=1e-5)


def test_small_cpu_forwards_run_on_one_thread_and_the_setting_is_restored():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    try:
        for rows, expected in ((10, 1), (cpu_fast_paths.ONE_THREAD_MAX_ROWS, 1),
                               (cpu_fast_paths.ONE_THREAD_MAX_ROWS + 1, 2)):
            with cpu_fast_paths.threads_for(rows, torch.device("cpu")):
                seen.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
            assert seen[-1] == expected, rows
        cpu_fast_paths.use_one_thread_for_small_forwards(False)
        try:
            with cpu_fast_paths.threads_for(1, torch.device("cpu")):
                assert torch.get_num_threads() == 2
        finally:
            cpu_fast_paths.use_one_thread_for_small_forwards(True)
        with pytest.raises(RuntimeError):                     # restored even when the block raises
            with cpu_fast_paths.threads_for(1, torch.device("cpu")):
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        with pytest.raises(TypeError):
            cpu_fast_paths.use_one_thread_for_small_forwards(0)
    finally:
        torch.set_num_threads(saved)


def test_the_small_row_product_gives_f_linear_values_in_row_major_layout():
    """Up to SMALL_M_ROWS rows the CPU product is computed as (W @ xᵀ)ᵀ; its result is the row-major tensor
    F.linear gives (not a column-major view the next ops would read strided), with and without a bias."""
    weight, bias = torch.randn(24, 40), torch.randn(24)
    for rows in (1, 2, 3, cpu_fast_paths.SMALL_M_ROWS, cpu_fast_paths.SMALL_M_ROWS + 1):
        x = torch.randn(rows, 1, 40)
        for b in (None, bias):
            out = cpu_fast_paths.linear(x, weight, b)
            assert out.shape == (rows, 1, 24) and out.is_contiguous(), (rows, out.stride())
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)
