"""The SigLIP vision tower of PaliGemma (π0.5 / π0), without a pooling head.

The module tree and parameter names are those of transformers' ``SiglipVisionModel`` without its
``vision_model.`` level (``embeddings.patch_embedding``, ``embeddings.position_embedding``,
``encoder.layers.<i>.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}``,
``post_layernorm``), which is what :mod:`oxygen_ros.models.checkpoint` maps openpi's, LeRobot's and
transformers' checkpoints onto. The maths is the pre-norm ViT of SigLIP (Zhai et al. 2023, as PaliGemma
uses it): non-overlapping ``patch × patch`` patches through one strided convolution, a learned position
embedding per patch, then per layer ``x + attn(LN1(x))`` and ``x + fc2(gelu_tanh(fc1(LN2(x))))`` with
bidirectional multi-head attention (scale ``head_dim^-0.5``), and a final LayerNorm.

Why not transformers' class: importing it costs ~6 s of CPU per process on the project's 2-core machines
(transformers pulls in its whole modelling stack), paid by every node start; this module is the same
computation in plain torch, op for op (``nn.Linear``, ``nn.LayerNorm``, SDPA, tanh-GELU), so its output equals
the transformers tower's bit for bit on the CPU in fp32 (``test/test_model_siglip.py``; the shipped demo
policy's seeded episode depends on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiglipEmbeddings(nn.Module):
    """Patch embedding (a ``patch``-strided convolution) plus a learned position embedding per patch.

    Args:
        width: hidden size.
        image_size: input side in pixels (a multiple of ``patch_size``).
        patch_size: patch side in pixels.
    """

    def __init__(self, width: int, image_size: int, patch_size: int):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, padding="valid")
        self.num_positions = (image_size // patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, width)
        self.register_buffer("position_ids", torch.arange(self.num_positions)[None, :], persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, 3, S, S]`` → ``[N, (S / patch)², width]`` (patches in row-major order)."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(self.position_ids)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased projections.

    Args:
        width: hidden size; heads: attention heads (``width`` divisible by it).
    """

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"vision width {width} not divisible by {heads} heads")
        self.heads, self.head_dim = heads, width // heads
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.q_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, T, width]`` → ``[N, T, width]``; every token attends to every token of its image."""
        n, t, _ = x.shape
        q, k, v = (proj(x).view(n, t, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
                             .transpose(1, 2).reshape(n, t, -1))


class SiglipMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, width: int, mlp_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    """One pre-norm encoder layer: ``x + attn(LN1(x))``, then ``x + mlp(LN2(x))``."""

    def __init__(self, width: int, mlp_dim: int, heads: int, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = SiglipAttention(width, heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = SiglipMLP(width, mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """The stack of :class:`SiglipLayer` (``layers``)."""

    def __init__(self, layers: int, width: int, mlp_dim: int, heads: int, eps: float):
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(width, mlp_dim, heads, eps) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without a pooling head (PaliGemma's image encoder).

    Args:
        width: hidden size; mlp_dim: MLP hidden size; layers: encoder layers; heads: attention heads.
        image_size, patch_size: input side and patch side in pixels (``image_size`` a multiple of
            ``patch_size``).
        eps: LayerNorm epsilon (1e-6 in PaliGemma).

    Raises:
        ValueError: ``width`` not divisible by ``heads`` or ``image_size`` not a multiple of ``patch_size``.
    """

    def __init__(self, width: int, mlp_dim: int, layers: int, heads: int, image_size: int, patch_size: int,
                 eps: float):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} not a multiple of patch_size {patch_size}")
        self.embeddings = SiglipEmbeddings(width, image_size, patch_size)
        self.encoder = SiglipEncoder(layers, width, mlp_dim, heads, eps)
        self.post_layernorm = nn.LayerNorm(width, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image tokens of ``pixels [N, 3, S, S]`` (float, the model's input range [-1, 1]):
        ``[N, (S / patch)², width]`` in the weights' dtype."""
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))
