"""The KV-cache storage interface between the models and the engine.

The model computes keys and values; where they live is not its business. Every cached forward
(prefill, denoise, decode step) receives a :class:`KVCacheView`: a batch of B sequences, each with
some tokens already cached (``cached_lens[b]``, possibly 0) and, for prefill and decode, some new
tokens to append (``new_lens[b]``). In each layer the model hands the new tokens' K/V to
:meth:`KVCacheView.attend`, which stores them and returns the keys and values attention runs over
(cached tokens followed by the new ones, per row); a read-only forward (denoising) uses
:meth:`KVCacheView.read`.

Two implementations exist: :class:`DenseKVCache` here (contiguous tensors, for the model's own tests
and the cache-free/reference comparisons) and the engine's paged pool (block tables, reference
counts), which implements the same protocol over shared pages and keeps the rows of a running
decode batch gathered between steps, so a decode step copies only the new token.

Shapes: K and V are ``[B, T, num_kv_heads, head_dim]``; masks are bool ``[B, T]`` with True = valid.
Tokens of a sequence are left-packed: the valid tokens of sequence b are ``[:cached_lens[b]]`` in the
cached tensors and ``[:new_lens[b]]`` in the new tensors; anything beyond is padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCacheView(Protocol):
    """A batch of sequences' K/V storage as one forward pass sees it."""

    @property
    def cached_lens(self) -> torch.Tensor:
        """int64 ``[B]``: tokens already cached per sequence before this forward."""

    @property
    def new_lens(self) -> torch.Tensor:
        """int64 ``[B]``: tokens this forward appends per sequence (0 for a read-only view)."""

    @property
    def shared_prefix_len(self) -> int:
        """P: the keys and values :meth:`attend` returns hold the same tokens at ``[:P]`` in every
        row (a prefix all rows share), so attention may compute that part once; 0 = no promise."""

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the cached ``(k, v, valid)`` of ``layer``.

        k, v: ``[B, Lc, num_kv_heads, head_dim]`` with ``Lc = max(cached_lens)`` (0 allowed);
        valid: bool ``[B, Lc]``. Never includes tokens written during the current forward.
        """

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens of ``layer`` and return the keys and values to attend over.

        Args:
            layer: VLM layer index; every layer is attended exactly once per forward.
            k, v: new tokens ``[B, T, num_kv_heads, head_dim]``, T >= max(new_lens); only
                ``[:new_lens[b]]`` of row b is stored.

        Returns:
            ``(keys, values)`` ``[B, L, num_kv_heads, head_dim]`` with ``L >= max(cached_lens +
            new_lens)``: row b holds its cached tokens at ``[:cached_lens[b]]`` followed by its new
            tokens at ``[cached_lens[b] : cached_lens[b] + new_lens[b]]``; later entries are padding
            the caller masks. Valid until the next ``attend`` of the same layer on the same storage.

        Raises:
            RuntimeError: the view is read-only.
        """


@dataclass
class DecodeStepTensors:
    """Where one decode step's new tokens go, for a forward that writes them itself (a decode step
    replayed from a graph) instead of through :meth:`KVCacheView.attend`.

    Attributes:
        page_slots: int64 ``[B]``, each row's flat slot in the pool (``pool_k[i].view(-1, kv_heads, hd)``).
        row_slots: int64 ``[B]``, each row's flat slot in the dense rows (``rows_k[i].view(-1, kv_heads, hd)``).
        rows_k, rows_v: per layer the dense rows ``[N, W, kv_heads, hd]``, N >= the padded batch; row b
            holds its sequence's ``cached_lens[b]`` tokens, the rest finite (zeros or older tokens).
        pool_k, pool_v: per layer the paged storage.
    """

    page_slots: torch.Tensor
    row_slots: torch.Tensor
    rows_k: list[torch.Tensor]
    rows_v: list[torch.Tensor]
    pool_k: list[torch.Tensor]
    pool_v: list[torch.Tensor]


class KVLengths:
    """The per-sequence lengths every :class:`KVCacheView` implementation keeps.

    Subclasses set ``_cached_lens`` and ``_new_lens`` (int64 ``[B]``) and may set ``_shared_prefix_len``
    (default 0); this provides the protocol's ``cached_lens``, ``new_lens`` and ``shared_prefix_len``.
    """

    _cached_lens: torch.Tensor
    _new_lens: torch.Tensor
    _shared_prefix_len: int = 0

    @property
    def shared_prefix_len(self) -> int:
        """P: every row's first P attended keys/values are the same tokens (0 = no promise)."""
        return self._shared_prefix_len

    @property
    def cached_lens(self) -> torch.Tensor:
        """int64 ``[B]``: tokens already cached per sequence before this forward."""
        return self._cached_lens

    @property
    def new_lens(self) -> torch.Tensor:
        """int64 ``[B]``: tokens this forward appends per sequence (0 for a read-only view)."""
        return self._new_lens


class DenseKVCache(KVLengths):
    """Contiguous per-layer KV storage for a fixed batch; implements :class:`KVCacheView`.

    Each call of :meth:`begin` starts a forward that appends ``new_lens`` tokens per sequence;
    :meth:`commit` ends it and makes those tokens part of the cache. Used by the models' tests and
    single-process tools; the engine uses its paged pool instead.

    Args:
        num_layers: decoder depth.
        batch_size: B.
        num_kv_heads, head_dim: K/V head layout.
        dtype, device: storage dtype and device.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self._num_layers = num_layers
        self._shape = (batch_size, 0, num_kv_heads, head_dim)
        self._k = [torch.zeros(self._shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.zeros(self._shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._cached_lens = torch.zeros(batch_size, dtype=torch.long)
        self._new_lens = torch.zeros(batch_size, dtype=torch.long)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._read_only = True

    def begin(self, new_lens: torch.Tensor | None = None) -> "DenseKVCache":
        """Start a forward appending ``new_lens`` (int64 ``[B]``) tokens; None = read-only."""
        self._read_only = new_lens is None
        self._new_lens = (torch.zeros_like(self._cached_lens) if new_lens is None
                          else new_lens.to(torch.long).cpu())
        self._pending = {}
        return self

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        length = self._k[layer].shape[1]
        valid = torch.arange(length)[None, :] < self._cached_lens[:, None]
        return self._k[layer], self._v[layer], valid.to(self._k[layer].device)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._read_only:
            raise RuntimeError("attend() on a read-only KV view (denoising never writes the prefix)")
        self._pending[layer] = (k, v)
        return self._joined(self._k[layer], k), self._joined(self._v[layer], v)

    def _joined(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``[B, Lc + T, ...]``: the cached rows with each row's new tokens placed right after them."""
        b, t = new.shape[:2]
        out = torch.cat((old.to(new.dtype), new.new_zeros(new.shape)), dim=1)
        steps = torch.arange(t)
        keep = steps[None, :] < self._new_lens[:, None]
        rows = torch.arange(b)[:, None].expand(b, t)
        cols = self._cached_lens[:, None] + steps[None, :]
        out[rows[keep].to(out.device), cols[keep].to(out.device)] = new[keep.to(new.device)]
        return out

    def commit(self) -> None:
        """Append the tokens attended since :meth:`begin` (every layer must have been attended)."""
        if self._read_only:
            return
        if len(self._pending) != self._num_layers:
            raise RuntimeError(f"commit() after {len(self._pending)} of {self._num_layers} layers written")
        new_total = self._cached_lens + self._new_lens
        length = int(new_total.max()) if len(new_total) else 0
        for layer, (k_new, v_new) in self._pending.items():
            self._k[layer] = self._append(self._k[layer], k_new, length)
            self._v[layer] = self._append(self._v[layer], v_new, length)
        self._cached_lens = new_total
        self._pending = {}
        self._read_only = True

    def _append(self, old: torch.Tensor, new: torch.Tensor, length: int) -> torch.Tensor:
        out = old.new_zeros((old.shape[0], length, *old.shape[2:]))
        for b in range(old.shape[0]):
            c, n = int(self._cached_lens[b]), int(self._new_lens[b])
            out[b, :c] = old[b, :c]
            out[b, c:c + n] = new[b, :n].to(old.dtype)
        return out
