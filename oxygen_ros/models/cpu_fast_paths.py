"""The models' CPU fast paths and their process-wide switches, in one place.

Gemma's maths (:mod:`oxygen_ros.models.gemma`) calls the linears and the few-query attention here,
:class:`oxygen_ros.models.vla.VLAModel` the thread rule; what serves each call depends on the
device, dtype, shape and the switches below, never on the values (every path is exact up to fp32
summation order):

* **Linears** (:class:`Linear`, :func:`linear`): a small-row CPU product ``(W @ xᵀ)ᵀ`` for decode
  steps of up to :data:`SMALL_M_ROWS` requests; oneDNN-prepacked weights for fp32 CPU inputs of at
  least :data:`PACKED_MIN_ROWS` rows under ``torch.inference_mode`` (switch:
  :func:`use_packed_weights`); ``F.linear`` elsewhere. Linears that read the same input (Q/K/V,
  gate/up) run as one product (:class:`LinearGroup`; switch: :func:`use_fused_projections`).
* **Threads** (:func:`threads_for`): a denoising loop or decode step of few rows runs on one
  intra-op thread (switch: :func:`use_one_thread_for_small_forwards`).
* **Few-query attention** (:func:`few_query_attention`, a decode step's attention): the native
  decode-attention kernel (:mod:`oxygen_ros.models.native` builds and runs it; switch:
  :func:`use_native_attention`), else the cascade over a prefix shared by all rows
  (:func:`cascade_attention`), else two batched matmuls with an fp32 softmax.

The switches exist for A/B measurements and are all on by default: the benchmarks'
``--torch-kernels`` turns off the native attention and the packed weights, the roofline bench's
``--compare`` (:mod:`oxygen_ros.bench.roofline`) the fused products and the thread rule. ``OXYGEN_NATIVE_KERNELS=0`` keeps the native kernel from being built at all (see
:mod:`oxygen_ros.models.native`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from oxygen_ros.models import native

_LOG = logging.getLogger(__name__)
_NATIVE = {"enabled": True}
_FUSING = {"enabled": True}
_ONE_THREAD = {"enabled": True}


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

    The result is contiguous (row-major ``[..., out]``, as ``F.linear``'s): the product's transpose is
    copied (at most 8 rows, microseconds) rather than returned as a column-major view, which every op
    after it (splitting Q/K/V, RoPE, norms, the next product) would read strided. Measured in the engine's
    decode step on the 2-core AVX2 machine (pi05_tiny, one thread; the two layouts alternating step by
    step in one process, two runs of 12 and 20 rounds): 2 requests 9.8 -> 9.0 and 10.6 -> 8.8 ms,
    4 requests 9.7 -> 9.1 and 11.6 -> 11.0, 8 requests 12.3 -> 12.4 and 14.8 -> 14.3 (docs/benchmarks.md).
    """
    rows = x.numel() // max(1, x.shape[-1])
    if x.device.type != "cpu" or rows > SMALL_M_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
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
# "available": whether this torch has the oneDNN linear ops :class:`Linear` packs weights for (read once at
# import; False too after a packing failure).
_PACKING = {"enabled": True, "available": bool(torch.backends.mkldnn.is_available()) and all(
    hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))}


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
        if torch.compiler.is_compiling():   # the compiler picks (and packs for) its own product
            return F.linear(x, self.weight, self.bias)
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
                and x.dtype == self.weight.dtype == torch.float32 and _PACKING["available"])

    def _packed_weight(self) -> torch.Tensor | None:
        self._packed = _packed_copy(self._packed, (self.weight.data_ptr(), self.weight._version), self.weight)
        return None if self._packed is None else self._packed[1]


def _packed_copy(cached: tuple[tuple, torch.Tensor] | None, key: tuple, weight: torch.Tensor
                 ) -> tuple[tuple, torch.Tensor] | None:
    """``cached`` (a ``(key, packed weight)`` pair) if it was packed from ``weight`` in the state ``key``,
    else ``weight`` newly prepacked for oneDNN; None when packing fails (logged; packing is then off for
    the process, :func:`packed_weights_available`)."""
    if cached is not None and cached[0] == key:
        return cached
    try:
        return key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    except RuntimeError as error:
        _LOG.warning("oneDNN weight packing failed, using F.linear: %s", error)
        _PACKING["available"] = False
        return None


class LinearGroup:
    """Bias-free :class:`Linear` layers that read the same input (Q/K/V, gate/up), computed as one
    product ``x @ [W_1; W_2; ...]ᵀ`` on the CPU under ``torch.inference_mode`` and split per layer.

    One product instead of several reads ``x`` once and pays the per-call cost (MKL or oneDNN
    dispatch, thread fork/join) once: per Gemma layer 4 calls instead of 7. The concatenated weight
    is a copy, made on first use (prepacked for oneDNN like :class:`Linear`'s from
    :data:`PACKED_MIN_ROWS` fp32 rows) and remade when a weight changes; it costs one more copy of
    those weights in memory. Elsewhere (grad mode, other devices, :func:`use_fused_projections`
    off) each layer runs on its own. Each output element is the same dot product either way; the
    values agree up to fp32 summation order.

    Args:
        layers: :class:`Linear` layers without bias, of the same ``in_features``.

    Raises:
        ValueError: a layer with a bias, or different ``in_features``.
    """

    def __init__(self, *layers: Linear):
        if any(layer.bias is not None for layer in layers) or len({layer.in_features for layer in layers}) != 1:
            raise ValueError("LinearGroup takes bias-free linears of one input width")
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self._weight: tuple[tuple, torch.Tensor] | None = None
        self._packed: tuple[tuple, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output for ``x [..., in]``: ``[..., out_i]`` (views of one product when fused)."""
        if torch.compiler.is_compiling():
            # Traced by torch.compile: one product with the concatenated weight, which the compiler's
            # constant folding (freezing) computes once.
            weight = torch.cat([layer.weight for layer in self.layers])
            return list(F.linear(x, weight).split(self.sizes, dim=-1))
        if not (_FUSING["enabled"] and torch.is_inference_mode_enabled() and x.device.type == "cpu"):
            return [layer(x) for layer in self.layers]
        rows = x.numel() // max(1, x.shape[-1])
        key = tuple((layer.weight.data_ptr(), layer.weight._version) for layer in self.layers)
        weight = self._fused(key)
        out = None
        if rows >= PACKED_MIN_ROWS and self.layers[0]._packable(x):
            packed = self._packed_weight(key, weight)
            if packed is not None:
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), packed, None, "none", [], "")
        if out is None:
            out = linear(x, weight)
        return list(out.reshape(*x.shape[:-1], sum(self.sizes)).split(self.sizes, dim=-1))

    def _fused(self, key: tuple) -> torch.Tensor:
        if self._weight is None or self._weight[0] != key:
            self._weight = (key, torch.cat([layer.weight.detach() for layer in self.layers]))
            self._packed = None
        return self._weight[1]

    def _packed_weight(self, key: tuple, weight: torch.Tensor) -> torch.Tensor | None:
        self._packed = _packed_copy(self._packed, key, weight)
        return None if self._packed is None else self._packed[1]


def use_fused_projections(enabled: bool) -> None:
    """Turn :class:`LinearGroup`'s fused products on or off for this process (A/B measurements).
    Raises TypeError on a non-bool."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _FUSING["enabled"] = enabled


def fused_projections_in_use() -> bool:
    """The setting of :func:`use_fused_projections` (True by default)."""
    return bool(_FUSING["enabled"])


# Token rows per layer up to which a CPU forward (a denoising loop, a decode step) runs on one
# intra-op thread (see :func:`threads_for`).
ONE_THREAD_MAX_ROWS = 32


def use_one_thread_for_small_forwards(enabled: bool) -> None:
    """Turn :func:`threads_for`'s one-thread rule on or off for this process (A/B measurements).
    Raises TypeError on a non-bool."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _ONE_THREAD["enabled"] = enabled


def one_thread_for_small_forwards_in_use() -> bool:
    """The setting of :func:`use_one_thread_for_small_forwards` (True by default)."""
    return bool(_ONE_THREAD["enabled"])


@contextlib.contextmanager
def fixed_threads(threads: int) -> Iterator[None]:
    """Within the block torch runs ``threads`` intra-op threads (process-wide); the count is restored
    afterwards. Raises ValueError for ``threads`` < 1."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def threads_for(rows: int, device: torch.device) -> Iterator[None]:
    """Within the block, torch runs on one intra-op thread when a forward on the CPU has at most
    :data:`ONE_THREAD_MAX_ROWS` token rows per layer (the rule is on, the process has more than one
    thread); the setting is restored afterwards.

    Every parallel op ends at a barrier that waits for all of torch's threads. The ops of a
    denoising loop (10 action rows) or a decode step do microseconds of work each, so on an idle
    machine the fork/join is a large share of them, and on a loaded one (more runnable threads than
    cores, e.g. a robot computer running its other nodes) a barrier waits for a descheduled thread
    for a scheduler time slice, per op. Measured on 2 shared cores at load 11-14 (π0.5-tiny,
    780-token prefix): the denoising loop took 1.8 s on 2 threads and 96 ms on 1; a 30-request decode
    step 560 ms and 79 ms. ``torch.set_num_threads`` is process-wide: other torch work running
    concurrently in the process runs on one thread meanwhile.
    """
    threads = torch.get_num_threads()
    if not (_ONE_THREAD["enabled"] and threads > 1 and rows <= ONE_THREAD_MAX_ROWS and device.type == "cpu"):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def use_native_attention(enabled: bool) -> None:
    """Turn the native decode attention on or off for this process (A/B measurements); off,
    :func:`native_attention_supports` answers False and :func:`few_query_attention` takes the torch
    paths. Does not build anything. Raises TypeError on a non-bool."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _NATIVE["enabled"] = enabled


def native_attention_in_use() -> bool:
    """The setting of :func:`use_native_attention` (True by default)."""
    return bool(_NATIVE["enabled"])


def native_attention_supports(head_dim: int, queries: int) -> bool:
    """Whether the native decode attention serves ``queries`` folded queries per K/V head of
    ``head_dim`` here: switched on (:func:`use_native_attention`), a shape the kernel takes
    (``head_dim`` a multiple of 16, ``queries`` in {1, 2, 4, 8, 16}) and the kernels of
    :func:`oxygen_ros.models.native.active_variant` loaded (built on the first call)."""
    return bool(_NATIVE["enabled"]) and native.supports(head_dim, queries)


# Folded queries per K/V head up to which :func:`oxygen_ros.models.gemma.attention` hands the
# attention to :func:`few_query_attention` instead of SDPA.
FEW_QUERIES = 16
# Few-query score matmuls: up to this many (row, K/V head) pairs, ``Q @ Kᵀ`` (Kᵀ a transposed
# view); above it ``(K @ Qᵀ)ᵀ``. Measured with MKL on 2 x86 cores (decode rows of ~650 tokens,
# head_dim 64): Q-left is 1.3-1.6x faster while the batch's K fits in cache (<= 6 rows), K-left
# 1.2-1.4x faster from DRAM (>= 12 rows). Both are exact; only speed differs.
Q_LEFT_MAX_BATCH = 8



def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, shared_prefix: int,
                        t: int) -> torch.Tensor:
    """Attention of at most :data:`FEW_QUERIES` scaled, folded queries per K/V head (a decode step).

    Args:
        q: queries already scaled by ``hd^-0.5``, ``[B, kv_heads, N, hd]``, ``N = group·t`` folded
            group-major (query ``n`` is token ``n % t``).
        k, v: ``[B, L, kv_heads, hd]`` (strided views are read in place).
        mask: the :class:`oxygen_ros.models.gemma.AttentionMask` of a bool ``[B, t, L]`` mask.
        shared_prefix: P such that ``k[:, :P]``, ``v[:, :P]`` are the same in every row and visible
            to every query; 0 = none.
        t: query tokens per row.

    Returns:
        ``[B, kv_heads, N, hd]`` in q's dtype.

    Paths: fp32 on a CPU with the native kernel (:func:`_native_decode`) runs
    :func:`oxygen_ros.models.native.decode_attention` (one pass over each row's K and V, a shared
    prefix read from row 0 for every row); elsewhere, with P > 0 and B > 1, :func:`cascade_attention`
    (the prefix attended once for the queries of all rows); else two batched matmuls with an fp32
    softmax between them, which run faster than SDPA's kernel on the CPU for so few queries.
    """
    b, kv_heads, n, hd = q.shape
    length = k.shape[1]
    group = n // t
    if _native_decode(q, k, v, n):
        return native.decode_attention(q, k, v, mask.mask, shared_prefix if b > 1 else 0)
    if shared_prefix > 0 and b > 1:
        return cascade_attention(q, k, v, mask.mask, shared_prefix, t)
    # 3-D bmm reads strided K/V (e.g. views of the decode rows) in place; 4-D matmul would copy.
    flat_k = k.transpose(1, 2).reshape(b * kv_heads, length, hd)
    flat_v = v.transpose(1, 2).reshape(b * kv_heads, length, hd)
    flat_q = q.reshape(b * kv_heads, n, hd)
    if b * kv_heads <= Q_LEFT_MAX_BATCH:
        scores = torch.bmm(flat_q, flat_k.transpose(1, 2))
    else:
        scores = torch.bmm(flat_k, flat_q.transpose(1, 2)).transpose(1, 2)
    m = mask.folded(group).expand(b, kv_heads, n, length)
    scores = scores.float().masked_fill(~m.reshape(b * kv_heads, n, length), float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), flat_v)
    return out.view(b, kv_heads, n, hd)


def _native_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: int) -> bool:
    """Whether :func:`few_query_attention` hands its case to :func:`native.decode_attention`: under
    ``torch.inference_mode`` (the models' inference entry points; the kernel has no backward and no
    forward-mode derivative, and inference mode records neither), fp32 on a CPU the kernel
    supports (see :func:`native_attention_supports`), K/V with a contiguous last dim."""
    return (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled() and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and k.stride(-1) == 1 and v.stride(-1) == 1
            and native_attention_supports(q.shape[-1], queries))


def cascade_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
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
    ``K[:P]`` of row 0); each row's tail ``[P:L]`` is a batched matmul as in :func:`few_query_attention`. Both
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
