"""Gemma building blocks for the Mixture-of-Transformers VLA: RMSNorm, adaRMSNorm, RoPE, attention.

Formulas (docs/models.md, "Gemma formulas"; Gemma and openpi reference implementations):

* RMSNorm, computed in fp32: ``y = x · rsqrt(mean(x²) + eps) · (1 + w)``.
* adaRMSNorm (π0.5 action expert): a Dense ``cond → 3·width`` gives ``scale, shift, gate`` (that order);
  ``y = x · rsqrt(mean(x²) + eps) · (1 + scale) + shift``; the sublayer's residual is ``x + gate · f(y)``.
* RoPE with base θ, half-split rotation: ``x · cos + rotate_half(x) · sin`` with frequencies
  ``θ^(-2i/head_dim)``.
* Attention scale ``head_dim^-0.5``; multi-query / grouped K/V heads.
* GeGLU MLP: ``down(gelu_tanh(gate(x)) · up(x))``.

A :class:`GemmaLayer` exposes the two halves of a decoder layer (:meth:`GemmaLayer.project_qkv` before
attention and :meth:`GemmaLayer.finish` after it) so that the caller can run one attention over the
tokens of two experts (MoT), or over cached keys and values. Its linears (:class:`Linear`) and its
decode-step attention take the CPU fast paths of :mod:`oxygen_ros.models.cpu_fast_paths`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxygen_ros.models import cpu_fast_paths
from oxygen_ros.models.cpu_fast_paths import Linear, LinearGroup


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``x · rsqrt(mean(x², -1) + eps)`` of any float ``x [..., D]``."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm ``y = normalize(x) · (1 + weight)`` (fp32 math, output in x's dtype).

    :meth:`forward` takes and ignores ``modulation`` and returns ``(y, None)`` so it is
    interchangeable with :class:`AdaRMSNorm`.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, modulation: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype), None


class AdaRMSNorm(nn.Module):
    """π0.5 adaptive RMSNorm; ``dense`` maps the time condition to ``scale, shift, gate``.

    :meth:`modulation` turns a condition ``[..., cond_dim]`` into ``[..., 3·dim]`` (fp32); it depends on
    the denoising time only, so the sampler computes it once per step for all tokens. :meth:`forward`
    takes ``x [B, T, dim]`` and a modulation broadcastable to ``[B, T, 3·dim]``, returns ``(y, gate)``.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: torch.Tensor) -> torch.Tensor:
        return self.dense(cond.to(self.dense.weight.dtype)).float()

    def forward(self, x: torch.Tensor, modulation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if modulation is None:
            raise ValueError("AdaRMSNorm needs the time-conditioning modulation")
        scale, shift, gate = modulation.chunk(3, dim=-1)
        y = rms_normalize(x, self.eps) * (1.0 + scale) + shift
        return y.to(x.dtype), gate.to(x.dtype)


class GemmaAttentionProjections(nn.Module):
    """Q/K/V/O projections (no bias): q ``W→heads·hd``, k/v ``W→kv_heads·hd``, o ``heads·hd→W``."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = Linear(num_heads * head_dim, width, bias=False)
        # Q, K and V read the same input: one product where the CPU fast paths allow.
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)


class GeGLU(nn.Module):
    """Gemma MLP ``down(gelu_tanh(gate(x)) · up(x))``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(width, hidden, bias=False)
        self.up_proj = Linear(width, hidden, bias=False)
        self.down_proj = Linear(hidden, width, bias=False)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaLayer(nn.Module):
    """One pre-norm Gemma decoder layer, split around its attention.

    Args:
        width, mlp_dim: residual width and GeGLU hidden size.
        num_heads, num_kv_heads, head_dim: attention layout.
        eps: RMSNorm epsilon.
        cond_dim: None for plain RMSNorm; the time-condition width for adaRMSNorm (π0.5 expert).
    """

    def __init__(self, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, cond_dim: int | None = None):
        super().__init__()
        self.self_attn = GemmaAttentionProjections(width, num_heads, num_kv_heads, head_dim)
        self.mlp = GeGLU(width, mlp_dim)
        if cond_dim is None:
            self.input_layernorm = RMSNorm(width, eps)
            self.post_attention_layernorm = RMSNorm(width, eps)
        else:
            self.input_layernorm = AdaRMSNorm(width, cond_dim, eps)
            self.post_attention_layernorm = AdaRMSNorm(width, cond_dim, eps)

    def project_qkv(self, x: torch.Tensor, modulation: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Pre-attention half: ``x [B, T, W]`` → q ``[B, T, heads, hd]``, k, v ``[B, T, kv_heads, hd]``
        (before RoPE) and the attention residual gate (None without adaRMSNorm)."""
        h, gate = self.input_layernorm(x, modulation)
        a = self.self_attn
        b, t = x.shape[:2]
        q, k, v = a.qkv(h)
        return (q.view(b, t, a.num_heads, a.head_dim), k.view(b, t, a.num_kv_heads, a.head_dim),
                v.view(b, t, a.num_kv_heads, a.head_dim), gate)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, attn_gate: torch.Tensor | None,
               modulation: torch.Tensor | None = None) -> torch.Tensor:
        """Post-attention half: ``attn [B, T, heads·hd]`` → o_proj, (gated) residual, MLP block."""
        out = self.self_attn.o_proj(attn)
        x = x + (out if attn_gate is None else attn_gate * out)
        h, gate = self.post_attention_layernorm(x, modulation)
        out = self.mlp(h)
        return x + (out if gate is None else gate * out)


class GemmaStack(nn.Module):
    """``layers`` (a ModuleList of :class:`GemmaLayer`) and the final ``norm``."""

    def __init__(self, num_layers: int, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, cond_dim: int | None = None):
        super().__init__()
        self.layers = nn.ModuleList(
            GemmaLayer(width, mlp_dim, num_heads, num_kv_heads, head_dim, eps, cond_dim) for _ in range(num_layers))
        self.norm = RMSNorm(width, eps) if cond_dim is None else AdaRMSNorm(width, cond_dim, eps)


def rope_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """fp32 ``[head_dim/2]`` RoPE frequencies ``θ^(-2i/head_dim)``."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, T, 1, head_dim]`` in ``dtype`` for int64 ``positions [B, T]`` (angles in fp32)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of ``x [B, T, heads, hd]`` with cos/sin ``[B, T, 1, hd]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class AttentionMask:
    """A bool attention mask ``[B, T, L]`` (True = the query may attend to the key) and the layouts
    :func:`attention` derives from it, built on first use and reused by every layer of a forward.

    Every layer of a forward attends under the same mask, so converting it per call (folding it
    for the query groups, SDPA turning a bool mask into an additive one) would repeat the same work
    once per layer; on 2 CPU cores that was ~1 ms of a 4.5 ms prefill attention (574 tokens).
    Wrap the mask once per forward and pass the wrapper to :func:`attention`.

    Args:
        mask: bool ``[B, T, L]``.
    """

    def __init__(self, mask: torch.Tensor):
        if mask.dim() != 3 or mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool [B, T, L], got {mask.dtype} {tuple(mask.shape)}")
        self.mask = mask
        self._folded: dict[int, torch.Tensor] = {}
        self._additive: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._all_visible: bool | None = None

    def all_visible(self) -> bool:
        """True when every query may attend to every key (checked once), so :func:`attention` can
        run SDPA without a mask. On the CPU only: elsewhere False without looking, as the check
        would synchronise with the device (and cannot run inside a CUDA graph capture); False under
        ``torch.compile`` too (a data-dependent branch)."""
        if torch.compiler.is_compiling():   # a data-dependent branch: the compiled graph keeps the mask
            return False
        if self._all_visible is None:
            self._all_visible = self.mask.device.type == "cpu" and bool(self.mask.all())
        return self._all_visible

    def folded(self, group: int) -> torch.Tensor:
        """bool ``[B, 1, group·T, L]``: the mask of each query token repeated for the ``group``
        query heads folded into the query length (group-major, as :func:`attention` folds them)."""
        if group not in self._folded:
            b, t, length = self.mask.shape
            self._folded[group] = self.mask[:, None].expand(b, group, t, length).reshape(b, 1, group * t, length)
        return self._folded[group]

    def additive(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``dtype`` ``[B, 1, group·T, L]``: 0 where :meth:`folded` is True, -inf elsewhere (the
        form SDPA would otherwise build from the bool mask at every call)."""
        key = (group, dtype)
        if key not in self._additive:
            folded = self.folded(group)
            self._additive[key] = torch.zeros(folded.shape, dtype=dtype, device=folded.device).masked_fill_(
                ~folded, float("-inf"))
        return self._additive[key]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | AttentionMask,
              shared_prefix: int = 0) -> torch.Tensor:
    """Masked multi-query / grouped-query attention with scale ``head_dim^-0.5``.

    Args:
        q: ``[B, T, heads, hd]``.
        k, v: ``[B, L, kv_heads, hd]``; ``heads`` is a multiple of ``kv_heads``.
        mask: bool ``[B, T, L]``, True = query may attend to key, or an :class:`AttentionMask` of
            one (reused by the layers of a forward). Every row needs at least one True.
        shared_prefix: P such that ``k[:, :P]`` and ``v[:, :P]`` are the same in every row and every
            query may attend to all of them (a shared prefix in a decode step); 0 = none.

    Returns:
        ``[B, T, heads·hd]`` in q's dtype.

    The query heads that share a K/V head are folded into the query length, so each K/V head is one
    batched matmul against ``heads/kv_heads · T`` queries. With at most
    :data:`oxygen_ros.models.cpu_fast_paths.FEW_QUERIES` folded queries (a decode step)
    :func:`oxygen_ros.models.cpu_fast_paths.few_query_attention` serves it (native kernel, cascade
    over a shared prefix, or two batched matmuls); otherwise SDPA with an additive mask, or none
    when every key is visible (its softmax accumulates in fp32). All are exact.
    """
    if not isinstance(mask, AttentionMask):
        mask = AttentionMask(mask)
    b, t, heads, hd = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    q = q.view(b, t, kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, hd)
    if group * t <= cpu_fast_paths.FEW_QUERIES:
        out = cpu_fast_paths.few_query_attention(q * hd ** -0.5, k, v, mask, shared_prefix, t)
    else:
        # A prefix prefill (one bidirectional block, no padding) sees every key: no mask to build
        # (9.7 MB for 780 tokens) and read in every layer.
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=None if mask.all_visible() else mask.additive(group, q.dtype))
    return out.view(b, kv_heads, group, t, hd).permute(0, 3, 1, 2, 4).reshape(b, t, heads * hd)
