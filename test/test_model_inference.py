"""Cached inference (prefill → denoise / decode steps) against the cache-free reference, tiny presets, fp32."""

import pytest
import torch

from oxygen_ros.models import DenseKVCache, load_model
from oxygen_ros.models.reference import reference_actions, reference_generate, reference_logits
from engine_support import tiny_model

CAMERAS = 2


@pytest.fixture(scope="module", params=["pi05_tiny", "pi0_tiny"])
def model(request):
    return load_model(request.param, dtype=torch.float32, seed=1)


@pytest.fixture(scope="module")
def pi05():
    return load_model("pi05_tiny", dtype=torch.float32, seed=2)


@pytest.fixture(scope="module")
def pi05_causal():
    return tiny_model(3, "causal")


def _observation(model, batch, seed, camera_mask=None, prompt_lens=(9, 5)):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand(batch * CAMERAS, 3, 224, 224, generator=gen) * 2 - 1
    images = model.encode_images(pixels).view(batch, CAMERAS, model.config.num_image_tokens, -1)
    cams = torch.ones(batch, CAMERAS, dtype=torch.bool) if camera_mask is None else camera_mask
    length = max(prompt_lens)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=gen)
    token_mask = torch.arange(length)[None, :] < torch.tensor(prompt_lens[:batch])[:, None]
    return images, cams, ids, token_mask


def _unpacked(model, images, cams, ids, token_mask):
    b, c, n, w = images.shape
    embeds = torch.cat((images.reshape(b, c * n, w), model.embed_tokens(ids)), dim=1)
    mask = torch.cat((cams.repeat_interleave(n, dim=1), token_mask), dim=1)
    return embeds, mask


def _prefill(model, images, cams, ids, token_mask):
    embeds, lens, image_lens = model.embed_prefix(images, cams, ids, token_mask)
    kv = DenseKVCache(model.config.vlm_num_layers, embeds.shape[0], model.config.num_kv_heads, model.config.head_dim)
    logits = model.prefill(embeds, kv.begin(lens), model.bidirectional_lens(lens, image_lens))
    kv.commit()
    return kv, logits


def _state(model, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 32, generator=gen) if model.config.variant == "pi0" else None


def test_cached_actions_equal_reference(model):
    cams = torch.tensor([[True, True], [False, True]])
    obs = _observation(model, 2, seed=0, camera_mask=cams)
    kv, _ = _prefill(model, *obs)
    noise = torch.randn(2, model.config.action_horizon, 32, generator=torch.Generator().manual_seed(5))
    state = _state(model, 2, 6)
    cached = model.denoise(kv.begin(None), noise, num_steps=10, state=state)
    reference = reference_actions(model, *_unpacked(model, *obs), noise, num_steps=10, state=state)
    assert cached.shape == (2, model.config.action_horizon, 32) and cached.dtype == torch.float32
    assert (cached - reference).abs().max() < 1e-5
    assert not torch.equal(cached[0], cached[1])


def test_denoise_never_writes_prefix(model):
    obs = _observation(model, 1, seed=1)
    kv, _ = _prefill(model, *obs)
    before = [t.clone() for layer in range(model.config.vlm_num_layers) for t in kv.read(layer)[:2]]
    model.denoise(kv.begin(None), torch.randn(1, 4, 32), num_steps=2, state=_state(model, 1, 0))
    after = [t for layer in range(model.config.vlm_num_layers) for t in kv.read(layer)[:2]]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert torch.equal(kv.cached_lens, torch.tensor([2 * 256 + 9]))


def test_masked_camera_equals_absent_camera(pi05):
    images, _, ids, token_mask = _observation(pi05, 1, seed=2)
    masked = (images, torch.tensor([[True, False]]), ids, token_mask)
    absent = (images[:, :1], torch.tensor([[True]]), ids, token_mask)
    noise = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for obs in (masked, absent):
        kv, logits = _prefill(pi05, *obs)
        results.append((logits, pi05.denoise(kv.begin(None), noise)))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_greedy_text_cached_equals_reference(pi05):
    obs = _observation(pi05, 2, seed=3)
    kv, logits = _prefill(pi05, *obs)
    tokens = [logits.argmax(-1)]
    for _ in range(5):
        logits = pi05.decode_step(tokens[-1], kv.begin(torch.ones(2, dtype=torch.long)))
        kv.commit()
        tokens.append(logits.argmax(-1))
    cached = torch.stack(tokens, dim=1)
    reference = reference_generate(pi05, *_unpacked(pi05, *obs), max_new_tokens=6)
    assert torch.equal(cached, reference)


def test_prefill_logits_and_pooled_hidden(pi05):
    obs = _observation(pi05, 2, seed=4)
    embeds, lens, _ = pi05.embed_prefix(*obs)
    kv = DenseKVCache(pi05.config.vlm_num_layers, 2, pi05.config.num_kv_heads, pi05.config.head_dim)
    logits, pooled = pi05.prefill(embeds, kv.begin(lens), lens, return_hidden=True)
    reference = reference_logits(pi05, *_unpacked(pi05, *obs))
    assert logits.dtype == torch.float32 and logits.shape == (2, pi05.config.vocab_size)
    assert (logits - reference).abs().max() < 1e-4
    assert pooled.shape == (2, pi05.config.vlm_width)
    none_logits, pooled_again = pi05.prefill(embeds, kv.begin(lens), lens, need_logits=False, return_hidden=True)
    assert none_logits is None and torch.allclose(pooled, pooled_again)


def test_batched_decode_step_equals_per_request(pi05):
    obs = _observation(pi05, 2, seed=5, camera_mask=torch.tensor([[True, True], [True, False]]))
    kv, logits = _prefill(pi05, *obs)
    singles = [_prefill(pi05, *(t[b:b + 1] for t in obs)) for b in range(2)]
    token = logits.argmax(-1)
    for _ in range(4):
        batched = pi05.decode_step(token, kv.begin(torch.ones(2, dtype=torch.long)))
        kv.commit()
        for b, (single_kv, _) in enumerate(singles):
            single = pi05.decode_step(token[b:b + 1], single_kv.begin(torch.ones(1, dtype=torch.long)))
            single_kv.commit()
            assert (single[0] - batched[b]).abs().max() < 1e-4
        token = batched.argmax(-1)


def test_causal_prompt_fork_equals_one_shot_prefill(pi05_causal):
    model = pi05_causal
    images, cams, ids, token_mask = _observation(model, 1, seed=6)
    one_shot_kv, one_shot_logits = _prefill(model, images, cams, ids, token_mask)
    image_embeds, image_lens, _ = model.embed_prefix(images, cams, ids[:, :0], token_mask[:, :0])
    fork_kv = DenseKVCache(model.config.vlm_num_layers, 1, model.config.num_kv_heads, model.config.head_dim)
    assert model.prefill(image_embeds, fork_kv.begin(image_lens), image_lens, need_logits=False) is None
    fork_kv.commit()
    prompt_lens = token_mask.sum(1)
    fork_logits = model.prefill(model.embed_tokens(ids), fork_kv.begin(prompt_lens), torch.zeros(1, dtype=torch.long))
    fork_kv.commit()
    assert (fork_logits - one_shot_logits).abs().max() < 1e-4
    for layer in range(model.config.vlm_num_layers):
        for a, b in zip(one_shot_kv.read(layer), fork_kv.read(layer)):
            assert torch.allclose(a, b, atol=1e-5)
    embeds, mask = _unpacked(model, images, cams, ids, token_mask)
    starts = torch.cat((torch.zeros(1, 2 * 256, dtype=torch.bool), token_mask), dim=1)
    reference = reference_logits(model, embeds, mask, prefix_block_start=starts)
    assert (reference - one_shot_logits).abs().max() < 1e-4


def test_bad_inputs_raise(pi05):
    kv = DenseKVCache(pi05.config.vlm_num_layers, 1, pi05.config.num_kv_heads, pi05.config.head_dim)
    with pytest.raises(ValueError, match="bidirectional_lens"):
        pi05.prefill(torch.zeros(1, 3, pi05.config.vlm_width), kv.begin(torch.tensor([3])), torch.tensor([4]))
    with pytest.raises(ValueError, match="state"):
        pi05.denoise(kv.begin(None), torch.zeros(1, 10, 32), state=torch.zeros(1, 32))
    with pytest.raises(ValueError, match="new_lens all 1"):
        pi05.decode_step(torch.tensor([5]), kv.begin(torch.tensor([2])))
    with pytest.raises(ValueError, match="pixels"):
        pi05.encode_images(torch.zeros(1, 3, 100, 100))
    with pytest.raises(ValueError, match="token ids"):
        pi05.embed_tokens(torch.tensor([pi05.config.vocab_size]))
