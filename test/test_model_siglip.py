"""The project's SigLIP vision tower computes what transformers' SiglipVisionModel computes, with the same
parameter names, and the runtime packages no longer import transformers (its import costs seconds of CPU
per process: every node start paid it)."""

import subprocess
import sys

import pytest
import torch

from oxygen_ros.models import get_preset
from oxygen_ros.models.siglip import SiglipVisionTower


def _pair(preset: str, seed: int = 0):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    c = get_preset(preset)
    theirs = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=c.vision_width, intermediate_size=c.vision_mlp_dim, num_hidden_layers=c.vision_num_layers,
        num_attention_heads=c.vision_num_heads, image_size=c.image_size, patch_size=c.patch_size,
        layer_norm_eps=c.vision_eps, hidden_act="gelu_pytorch_tanh", vision_use_head=False)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():       # transformers initialises norms to 1 and biases to 0: randomise everything
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    ours = SiglipVisionTower(c.vision_width, c.vision_mlp_dim, c.vision_num_layers, c.vision_num_heads,
                             c.image_size, c.patch_size, c.vision_eps).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)     # same names, nothing missing or left over
    pixels = torch.rand(3, 3, c.image_size, c.image_size, generator=g) * 2 - 1
    return theirs, ours, pixels


@pytest.mark.parametrize("preset", ["pi05_tiny", "pi05_demo"])
def test_the_tower_matches_transformers_siglip_vision_model(preset):
    theirs, ours, pixels = _pair(preset)
    with torch.no_grad():
        expected = theirs(pixel_values=pixels).last_hidden_state
        out = ours(pixels)
    assert out.shape == (3, get_preset(preset).num_image_tokens, get_preset(preset).vision_width)
    assert torch.equal(out, expected)           # op for op the same computation: bit for bit
    with torch.inference_mode():                # the engine's mode
        assert torch.equal(ours(pixels), expected)


def test_the_tower_matches_in_bfloat16():
    theirs, ours, pixels = _pair("pi05_tiny", seed=1)
    theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
    with torch.no_grad():
        expected = theirs(pixel_values=pixels.to(torch.bfloat16)).last_hidden_state.float()
        out = ours(pixels).float()      # the tower casts its input to its weights' dtype
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        SiglipVisionTower(32, 64, 1, 2, image_size=30, patch_size=14, eps=1e-6)
    with pytest.raises(ValueError, match="divisible"):
        SiglipVisionTower(30, 64, 1, 4, image_size=28, patch_size=14, eps=1e-6)


def test_models_engine_and_node_import_without_transformers():
    code = ("import sys, oxygen_ros.models, oxygen_ros.engine, oxygen_ros.node.oxygen_node; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
