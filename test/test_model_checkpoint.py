"""Checkpoint layouts, save/load round trips, key errors and parity with transformers' own π0."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.models import DenseKVCache, get_preset, load_model
from oxygen_ros.models.checkpoint import CheckpointError, save_checkpoint
from oxygen_ros.models.gemma import AdaRMSNorm, RMSNorm


def _run(model, seed=0, cams=2, prompt_len=7):
    """Prefill logits and a denoised action chunk for a fixed random observation."""
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    pixels = torch.rand(cams, 3, 224, 224, generator=gen) * 2 - 1
    images = model.encode_images(pixels)[None]
    ids = torch.randint(3, c.vocab_size - 1, (1, prompt_len), generator=gen)
    embeds, lens, image_lens = model.embed_prefix(images, torch.ones(1, cams, dtype=torch.bool), ids,
                                                  torch.ones(1, prompt_len, dtype=torch.bool))
    kv = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim)
    logits = model.prefill(embeds, kv.begin(lens), model.bidirectional_lens(lens, image_lens))
    kv.commit()
    noise = torch.randn(1, c.action_horizon, 32, generator=gen)
    state = torch.randn(1, 32, generator=gen) if c.variant == "pi0" else None
    return logits, model.denoise(kv.begin(None), noise, num_steps=3, state=state)


@pytest.fixture(scope="module")
def pi05():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def test_seeded_random_init_is_deterministic():
    a, b = load_model("pi0_tiny", seed=3), load_model("pi0_tiny", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.projector.weight, load_model("pi0_tiny", seed=4).projector.weight)


def test_an_inference_model_holds_no_trainable_parameter_and_a_training_one_does(tmp_path):
    """load_model builds an inference model: no parameter requires a gradient, from random weights or a
    checkpoint (so real-time chunking's compiled backward computes no weight gradient); trainable=True
    gives every parameter a gradient after a backward pass."""
    frozen = load_model("pi05_tiny", seed=3)
    save_checkpoint(frozen, tmp_path / "ckpt", "openpi")
    for model in (frozen, load_model("pi05_tiny", tmp_path / "ckpt")):
        assert not any(p.requires_grad for p in model.parameters()) and not model.training
    trainable = load_model("pi05_tiny", seed=3, trainable=True)
    c = trainable.config
    ids = torch.randint(3, c.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    trainable.token_embedding(ids).sum().backward()
    assert trainable.token_embedding.weight.grad is not None
    assert all(p.requires_grad for p in trainable.parameters())


def test_save_load_round_trip_and_layouts_agree(pi05, tmp_path):
    expected = _run(pi05)
    outputs = {}
    for layout in ("openpi", "lerobot", "lerobot_flat_vision"):
        save_checkpoint(pi05, tmp_path / layout, layout)
        outputs[layout] = _run(load_model("pi05_tiny", tmp_path / layout, dtype=torch.float32))
    openpi_keys = load_file(tmp_path / "openpi" / "model.safetensors").keys()
    assert "paligemma_with_expert.paligemma.lm_head.weight" in openpi_keys
    assert not any("embed_tokens" in k for k in openpi_keys)
    assert any(".vision_tower.vision_model." in k for k in openpi_keys)
    flat_keys = load_file(tmp_path / "lerobot_flat_vision" / "model.safetensors").keys()
    assert all(k.startswith("model.") for k in flat_keys) and not any("vision_model" in k for k in flat_keys)
    for logits, actions in outputs.values():
        assert torch.equal(logits, expected[0]) and torch.equal(actions, expected[1])


def test_missing_and_unexpected_keys_are_listed(pi05, tmp_path):
    save_checkpoint(pi05, tmp_path, "openpi")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["time_mlp_in.weight"]
    tensors["paligemma_with_expert.gemma_expert.model.layers.0.extra.weight"] = torch.zeros(2)
    tensors["action_out_proj.bias"] = torch.zeros(5)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_model("pi05_tiny", tmp_path)
    message = str(info.value)
    assert "missing keys ['time_mlp_in.weight']" in message
    assert "unexpected keys ['paligemma_with_expert.gemma_expert.model.layers.0.extra.weight']" in message
    assert "action_out_proj.bias: checkpoint (5,) vs model (32,)" in message
    with pytest.raises(FileNotFoundError):
        load_model("pi05_tiny", tmp_path / "nowhere")


@pytest.mark.parametrize("keep, expected", [
    (lambda size: size - 1000, "truncated: {size} bytes on disk, its header declares {full}"),
    (lambda size: 4, "fewer than the format's 8-byte header length"),
    (lambda size: 100, "its first 8 bytes declare a"),
])
def test_truncated_safetensors_names_the_file_and_the_fault(pi05, tmp_path, keep, expected):
    """A ``model.safetensors`` cut short (an interrupted download or copy) fails with the file's path and
    what is wrong with it, not the library's message alone (issue 38, item 10)."""
    save_checkpoint(pi05, tmp_path, "openpi")
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    size = keep(len(data))
    path.write_bytes(data[:size])
    with pytest.raises(CheckpointError) as info:
        load_model("pi05_tiny", tmp_path)
    message = str(info.value)
    assert str(path) in message, message
    assert expected.format(size=size, full=len(data)) in message, message


def test_corrupt_safetensors_header_is_named(pi05, tmp_path):
    save_checkpoint(pi05, tmp_path, "openpi")
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\x00\xff\x00\xff"       # the JSON header's first bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt: its .*-byte header") as info:
        load_model("pi05_tiny", tmp_path)
    assert str(path) in str(info.value)


def test_bf16_load_keeps_norms_fp32(pi05, tmp_path):
    save_checkpoint(pi05, tmp_path, "lerobot")
    model = load_model("pi05_tiny", tmp_path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert model.vision_tower.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    norms = [p for m in model.modules() if isinstance(m, (RMSNorm, AdaRMSNorm)) for p in m.parameters()]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    logits, actions = _run(model)
    assert logits.dtype == torch.float32 and torch.isfinite(actions).all()


def _hf_pi0(tmp_path):
    from transformers import PI0Config, PI0ForConditionalGeneration

    torch.manual_seed(0)
    config = PI0Config(
        vlm_config={"text_config": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                    "vocab_size": 300},
                    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "patch_size": 14, "image_size": 224,
                                      "vision_use_head": False},
                    "projection_dim": 64, "image_token_id": 299},
        dit_config={"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 32},
        chunk_size=5)
    model = PI0ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers zero-initialises norms and biases: randomise everything
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path)
    ours = get_preset("pi0_tiny").replace(
        name="pi0_hf_tiny", vision_width=32, vision_num_layers=2, vision_num_heads=2, vision_mlp_dim=64,
        vlm_width=64, vlm_mlp_dim=128, vlm_num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
        expert_width=32, expert_mlp_dim=64, vocab_size=300, action_horizon=5)
    return model, ours


def test_pi0_matches_transformers_pi0(tmp_path):
    hf, config = _hf_pi0(tmp_path)
    ours = load_model(config, tmp_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    batch, cams, text = 2, 2, 6
    pixels = torch.rand(batch, cams, 3, 224, 224, generator=gen) * 2 - 1
    ids = torch.randint(3, 299, (batch, text), generator=gen)
    text_mask = torch.ones(batch, text, dtype=torch.bool)
    text_mask[1, 4:] = False
    state = torch.randn(batch, 32, generator=gen)
    noise = torch.randn(batch, 5, 32, generator=gen)
    image_ids = torch.full((batch, cams * 256), 299)
    with torch.no_grad():
        expected = hf.sample_actions(
            state=state, input_ids=torch.cat((image_ids, ids), 1), pixel_values=pixels, noise=noise,
            attention_mask=torch.cat((torch.ones_like(image_ids), text_mask.long()), 1),
            pixel_attention_mask=torch.ones(batch, cams, dtype=torch.bool), num_steps=10)
    images = ours.encode_images(pixels.flatten(0, 1)).view(batch, cams, 256, -1)
    embeds, lens, _ = ours.embed_prefix(images, torch.ones(batch, cams, dtype=torch.bool), ids, text_mask)
    kv = DenseKVCache(2, batch, 1, 32)
    ours.prefill(embeds, kv.begin(lens), lens, need_logits=False)
    kv.commit()
    actions = ours.denoise(kv.begin(None), noise, num_steps=10, state=state)
    assert (actions - expected).abs().max() < 1e-4
    assert (expected[0] - expected[1]).abs().max() > 1e-2
