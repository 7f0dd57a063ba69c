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
tokens of two experts (MoT), or over cached keys and values.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from oxygen_ros.models import native


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


# Rows up to which :func:`linear` computes ``(W @ xᵀ)ᵀ`` on the CPU instead of ``x @ Wᵀ``.
SMALL_M_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ (+ bias)`` for ``x [..., in]``, ``weight [out, in]`` -> ``[..., out]``.

    On the CPU with at most :data:`SMALL_M_ROWS` rows (decode steps of up to 8 requests) it is
    computed as ``(weight @ xᵀ)ᵀ``. Measured with MKL on 2 x86 cores with the weights streamed from
    DRAM, as in a decode step that reads every weight once: ``x @ Wᵀ`` costs 1.3-1.5x more for 2-4
    rows than for 1 (the weight is streamed about once per row), ``W @ xᵀ`` stays within 10 % of
    the 1-row cost; whole decode steps of 2-8 requests ran 5-25 % faster, of 12-16 no faster, and
    the denoising loop (10 rows, weights hot in cache) slower, hence the limit of 8. The values
    agree up to fp32 summation order. Elsewhere (more rows, GPUs) it is ``F.linear``.
    """
    rows = x.numel() // max(1, x.shape[-1])
    if x.device.type != "cpu" or rows > SMALL_M_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


# Row count for which the prepacked copies of :class:`Linear` weights are laid out (oneDNN picks the
# blocking for it; other row counts run on the same copy). Measured on 2 x86 cores (fp32, the
# pi05_tiny layer shapes): packed for 32 rows, a set of projections took 0.5-0.6x of ``F.linear``'s
# (MKL) time at 9-64 rows and 0.7x at 571 (a prefill); packed for 1 row, no gain above 9 rows.
PACK_ROWS_HINT = 32
# Fewest rows for which :class:`Linear` uses the packed copy. Each oneDNN call costs about 20 us
# more than MKL's, which small products with their weights hot in cache do not win back: the
# denoising loop (10 action rows on the expert, 280 products per frame) took 23-24 ms with MKL and
# 29-30 ms packed; a 30-request decode step (weights streamed from memory) got 0.5-1 ms cheaper.
PACKED_MIN_ROWS = 16
_PACKING = {"enabled": True, "available": None}
_LOG = logging.getLogger(__name__)


def use_packed_weights(enabled: bool) -> None:
    """Turn the prepacked CPU weights of :class:`Linear` on or off for this process (A/B
    measurements). Raises TypeError on a non-bool."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _PACKING["enabled"] = enabled


def packed_weights_in_use() -> bool:
    """The setting of :func:`use_packed_weights` (True by default)."""
    return bool(_PACKING["enabled"])


def packed_weights_available() -> bool:
    """Whether this torch has the oneDNN linear ops :class:`Linear` packs weights for (False too
    after a packing failure)."""
    if _PACKING["available"] is None:
        ops = torch.ops.mkldnn
        _PACKING["available"] = bool(torch.backends.mkldnn.is_available()) and all(
            hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))
    return bool(_PACKING["available"])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) whose forward is :func:`linear`, except
    for fp32 inputs of at least :data:`PACKED_MIN_ROWS` rows on the CPU under ``torch.inference_mode``
    (prefill, decode steps of 16 or more requests): those use a copy of the weight prepacked for
    oneDNN (``torch.ops.mkldnn``, the kernels torch's own compiler emits for frozen CPU linears),
    made on first use and remade when the weight changes. It costs one more copy of the weight
    in memory; :func:`use_packed_weights` turns it off. Values agree with ``F.linear`` up to fp32
    summation order."""

    _packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if rows >= PACKED_MIN_ROWS and self._packable(x):
            packed = self._packed_weight()
            if packed is not None:
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), packed, self.bias,
                                                         "none", [], "")
                return out.reshape(*x.shape[:-1], self.out_features)
        return linear(x, self.weight, self.bias)

    def _packable(self, x: torch.Tensor) -> bool:
        # Only under inference mode: the oneDNN op has no derivative of either mode.
        return (_PACKING["enabled"] and torch.is_inference_mode_enabled() and x.device.type == "cpu"
                and x.dtype == self.weight.dtype == torch.float32 and packed_weights_available())

    def _packed_weight(self) -> torch.Tensor | None:
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._packed[0] != key:
            try:
                self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT))
            except RuntimeError as error:
                _LOG.warning("oneDNN weight packing failed, using F.linear: %s", error)
                _PACKING["available"] = False
                return None
        return self._packed[1]


class GemmaAttentionProjections(nn.Module):
    """Q/K/V/O projections (no bias): q ``W→heads·hd``, k/v ``W→kv_heads·hd``, o ``heads·hd→W``."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = Linear(num_heads * head_dim, width, bias=False)


class GeGLU(nn.Module):
    """Gemma MLP ``down(gelu_tanh(gate(x)) · up(x))``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(width, hidden, bias=False)
        self.up_proj = Linear(width, hidden, bias=False)
        self.down_proj = Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


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
        q = a.q_proj(h).view(b, t, a.num_heads, a.head_dim)
        k = a.k_proj(h).view(b, t, a.num_kv_heads, a.head_dim)
        v = a.v_proj(h).view(b, t, a.num_kv_heads, a.head_dim)
        return q, k, v, gate

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


# Folded queries per K/V head up to which :func:`attention` uses plain matmuls instead of SDPA.
FEW_QUERIES = 16
# Few-query score matmuls: up to this many (row, K/V head) pairs, ``Q @ Kᵀ`` (Kᵀ a transposed
# view); above it ``(K @ Qᵀ)ᵀ``. Measured with MKL on 2 x86 cores (decode rows of ~650 tokens,
# head_dim 64): Q-left is 1.3-1.6x faster while the batch's K fits in cache (<= 6 rows), K-left
# 1.2-1.4x faster from DRAM (>= 12 rows). Both are exact; only speed differs.
Q_LEFT_MAX_BATCH = 8


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
    batched matmul against ``heads/kv_heads · T`` queries. With at most :data:`FEW_QUERIES` folded
    queries (a decode step) two batched matmuls with an fp32 softmax between them run faster than
    SDPA's kernel on CPU; otherwise SDPA with an additive mask (its softmax accumulates in fp32).
    Both are exact. In the few-queries case, fp32 on a CPU with AVX-512, AVX2 or NEON runs the
    native kernel instead (:func:`oxygen_ros.models.native.decode_attention`: one pass over each
    row's K and V, a shared prefix read from row 0 for every row; the build for the running CPU,
    :func:`oxygen_ros.models.native.active_variant`); elsewhere, with ``shared_prefix`` P > 0 and
    B > 1, the prefix is attended once for the queries of all rows (cascade attention,
    :func:`_cascade_attention`).
    """
    if not isinstance(mask, AttentionMask):
        mask = AttentionMask(mask)
    b, t, heads, hd = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q = q.view(b, t, kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, hd)
    few = group * t <= FEW_QUERIES
    if few and _native_decode(q, k, v, group * t):
        out = native.decode_attention(q * hd ** -0.5, k, v, mask.mask, shared_prefix if b > 1 else 0)
    elif few and shared_prefix > 0 and b > 1:
        out = _cascade_attention(q * hd ** -0.5, k, v, mask.mask, shared_prefix, t)
    elif few:
        # 3-D bmm reads strided K/V (e.g. views of the decode rows) in place; 4-D matmul would copy.
        flat_k = k.transpose(1, 2).reshape(b * kv_heads, length, hd)
        flat_v = v.transpose(1, 2).reshape(b * kv_heads, length, hd)
        flat_q = (q * hd ** -0.5).reshape(b * kv_heads, group * t, hd)
        if b * kv_heads <= Q_LEFT_MAX_BATCH:
            scores = torch.bmm(flat_q, flat_k.transpose(1, 2))
        else:
            scores = torch.bmm(flat_k, flat_q.transpose(1, 2)).transpose(1, 2)
        m = mask.folded(group).expand(b, kv_heads, group * t, length)
        scores = scores.float().masked_fill(~m.reshape(b * kv_heads, group * t, length), float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), flat_v)
    else:
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask.additive(group, q.dtype))
    return out.view(b, kv_heads, group, t, hd).permute(0, 3, 1, 2, 4).reshape(b, t, heads * hd)


def _native_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: int) -> bool:
    """Whether :func:`attention` hands a few-queries case to :func:`native.decode_attention`: under
    ``torch.inference_mode`` (the models' inference entry points; the kernel has no backward and no
    forward-mode derivative, and inference mode records neither), fp32 on a CPU the kernel
    supports (see :func:`native.supports`), K/V with a contiguous last dim."""
    return (torch.is_inference_mode_enabled() and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and k.stride(-1) == 1 and v.stride(-1) == 1
            and native.supports(q.shape[-1], queries))


def _cascade_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       prefix: int, t: int) -> torch.Tensor:
    """Attention of scaled folded queries over a prefix shared by all rows plus each row's tail.

    Args:
        q: scaled queries ``[B, kv_heads, N, hd]``, ``N = group·t`` (group-major).
        k, v: ``[B, L, kv_heads, hd]``; ``[:, :prefix]`` is the same in every row.
        mask: bool ``[B, t, L]``; every query sees all of ``[:prefix]``.
        prefix: P, ``0 < P < L``.
        t: query tokens per row.

    Returns:
        ``[B, kv_heads, N, hd]`` in q's dtype.

    The prefix scores of all rows' queries are one matmul per K/V head (``B·N`` queries against
    ``K[:P]`` of row 0); each row's tail ``[P:L]`` is a batched matmul as in :func:`attention`. Both
    parts are exponentiated against their joint fp32 maximum and normalised by their joint sum, so
    the result is the softmax over all L keys.
    """
    b, kv_heads, n, hd = q.shape
    length = k.shape[1]
    tail = length - prefix
    # Prefix: [kv, B·N, hd] @ [kv, hd, P] -> fp32 scores [kv, B·N, P].
    k_pre, v_pre = k[0, :prefix].transpose(0, 1), v[0, :prefix].transpose(0, 1)
    q_all = q.transpose(0, 1).reshape(kv_heads, b * n, hd)
    s_pre = torch.bmm(q_all, k_pre.transpose(1, 2)).float()
    # Tail: [B·kv, N, hd] @ [B·kv, hd, tail] -> fp32 scores [B·kv, N, tail], masked.
    k_tail = k[:, prefix:].transpose(1, 2).reshape(b * kv_heads, tail, hd)
    v_tail = v[:, prefix:].transpose(1, 2).reshape(b * kv_heads, tail, hd)
    s_tail = torch.bmm(q.reshape(b * kv_heads, n, hd), k_tail.transpose(1, 2)).float()
    hidden = ~mask[:, :, prefix:]                                      # [B, t, tail]
    s_tail.view(b, kv_heads, n // t, t, tail).masked_fill_(hidden[:, None, None], float("-inf"))
    # Joint maximum per query, in the tail layout [B·kv, N] and the prefix layout [kv, B·N].
    top = torch.maximum(s_tail.amax(dim=2),
                        s_pre.amax(dim=2).view(kv_heads, b, n).transpose(0, 1).reshape(b * kv_heads, n))
    top_pre = top.view(b, kv_heads, n).transpose(0, 1).reshape(kv_heads, b * n)
    e_pre, e_tail = s_pre.sub_(top_pre[..., None]).exp_(), s_tail.sub_(top[..., None]).exp_()
    total = e_tail.sum(dim=2) + e_pre.sum(dim=2).view(kv_heads, b, n).transpose(0, 1).reshape(b * kv_heads, n)
    out_pre = torch.bmm(e_pre.to(v.dtype), v_pre).float()               # [kv, B·N, hd]
    out_tail = torch.bmm(e_tail.to(v.dtype), v_tail).float()            # [B·kv, N, hd]
    out = out_tail.add_(out_pre.view(kv_heads, b, n, hd).transpose(0, 1).reshape(b * kv_heads, n, hd))
    return out.div_(total[..., None]).to(q.dtype).view(b, kv_heads, n, hd)
