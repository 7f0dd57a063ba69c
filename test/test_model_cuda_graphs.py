"""CUDA-graph replay of the vision tower and the denoising loop (oxygen_ros.models.cuda_graphs).

The padding the graphs rely on (a prefix padded with masked tokens up to its bucket) is checked on
the CPU; capture and replay against the eager path need a CUDA device and skip without one.
"""

import pytest
import torch

from oxygen_ros.models import DenseKVCache, load_model
from oxygen_ros.models.cuda_graphs import GraphCache, round_up

CUDA = torch.cuda.is_available()


def _prefixed(model, prompt_len: int, seed: int, device="cpu"):
    """A committed 1-row prefix cache of 2 cameras + ``prompt_len`` tokens, noise and π0's state."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(2, 3, 224, 224, generator=gen) * 2 - 1).to(device)
    images = model.encode_images(pixels)[None]
    ids = torch.randint(3, c.vocab_size, (1, prompt_len), generator=gen).to(device)
    ones = torch.ones(1, prompt_len, dtype=torch.bool, device=device)
    embeds, lens, image_lens = model.embed_prefix(images, torch.ones(1, 2, dtype=torch.bool, device=device),
                                                  ids, ones)
    kv = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim, model.dtype, device)
    model.prefill(embeds, kv.begin(lens), model.bidirectional_lens(lens, image_lens), need_logits=False)
    kv.commit()
    noise = torch.randn(1, c.action_horizon, c.action_dim, generator=gen).to(device)
    state = torch.randn(1, c.action_dim, generator=gen).to(device) if c.variant == "pi0" else None
    return kv, noise, state


@pytest.mark.parametrize("preset", ["pi05_tiny", "pi0_tiny"])
def test_masked_padding_leaves_the_actions_unchanged(preset):
    model = load_model(preset, dtype=torch.float32, seed=4)
    kv, noise, state = _prefixed(model, 7, seed=5)
    view = kv.begin(None)
    layers = model.config.vlm_num_layers
    k = [view.read(i)[0] for i in range(layers)]
    v = [view.read(i)[1] for i in range(layers)]
    valid = view.read(0)[2]
    pad = round_up(valid.shape[1], 64) - valid.shape[1] + 64

    def padded(x, fill):
        return torch.cat((x, torch.full((1, pad, *x.shape[2:]), fill, dtype=x.dtype)), dim=1)

    with torch.inference_mode():
        plain = model._denoise_loop(k, v, valid, view.cached_lens, noise, 10, state)
        # Finite garbage in the padded keys and values must get exactly zero weight.
        padded_out = model._denoise_loop([padded(x, 3.0) for x in k], [padded(x, -2.0) for x in v],
                                         padded(valid, False), view.cached_lens, noise, 10, state)
    assert torch.allclose(plain, padded_out, atol=1e-5, rtol=0)
    assert torch.allclose(plain, model.denoise(view, noise, state=state), atol=1e-6, rtol=0)


def test_graph_cache_rejects_bad_sizes_and_rounds_buckets():
    with pytest.raises(ValueError):
        GraphCache(max_graphs=0)
    model = load_model("pi05_tiny", dtype=torch.float32, seed=4)
    for bad in ({"prefix_bucket": 0}, {"prefix_bucket": 1.5}, {"max_graphs": 0}, {"enabled": "no"},
                {"enabled": False, "max_graphs": 0}):
        with pytest.raises(ValueError):
            model.enable_cuda_graphs(**bad)
    assert model.cuda_graphs is None
    assert [round_up(n, 64) for n in (1, 64, 65, 600)] == [64, 64, 128, 640]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("preset", ["pi05_tiny", "pi0_tiny"])
def test_graphs_replay_what_the_eager_path_computes(preset):
    model = load_model(preset, dtype=torch.float32, seed=6, device="cuda")
    # Two prompts of different lengths that fall in one 64-token bucket share a graph.
    cases = [_prefixed(model, n, seed=7 + n, device="cuda") for n in (9, 20)]
    eager = [model.denoise(kv.begin(None), noise, state=state) for kv, noise, state in cases]
    pixels = torch.rand(2, 3, 224, 224, device="cuda") * 2 - 1
    images = model.encode_images(pixels)
    model.enable_cuda_graphs(prefix_bucket=64)
    graphed = [model.denoise(kv.begin(None), noise, state=state) for kv, noise, state in cases]
    again = model.denoise(cases[0][0].begin(None), cases[0][1], state=cases[0][2])
    for expected, got in zip(eager, graphed):
        assert torch.allclose(expected, got, atol=1e-4, rtol=0)
    assert torch.equal(graphed[0], again)       # outputs are copies, not the graph's buffer
    assert torch.allclose(images, model.encode_images(pixels), atol=1e-4, rtol=0)
    assert torch.allclose(images, model.encode_images(pixels), atol=1e-4, rtol=0)
    cache = model.cuda_graphs
    assert cache.captures == 2 and len(cache) == 2      # one denoise bucket, one vision shape
    assert cache.replays == 5
    model.enable_cuda_graphs(False)
    assert model.cuda_graphs is None
