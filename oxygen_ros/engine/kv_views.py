"""The models' ``KVCacheView`` (``oxygen_ros/models/kv_cache.py``) over the engine's paged KV.

:class:`PagedKVCacheView` serves prefill and denoising: ``attend`` scatters the new tokens into their
pages with one ``index_copy_`` per layer, then gathers every row's tokens with one ``index_select``
over a slot index precomputed from the block tables, into reusable :class:`GatherBuffers`.

:class:`DecodeKVCacheView` serves batched decode steps over the :class:`DecodeRows` workspace: the
new token goes into its page and its row, and attention reads the rows (no per-step gather).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.decode_rows import DecodeRows
from oxygen_ros.models.kv_cache import DecodeStepTensors, KVLengths

if TYPE_CHECKING:
    from oxygen_ros.engine.kv_cache_manager import KVSequence


def check_live(seq: KVSequence) -> None:
    """Raise ValueError when ``seq`` was freed (a freed sequence must not be used)."""
    if seq.freed:
        raise ValueError("KV sequence was already freed")


class GatherBuffers:
    """Grow-only K and V gather buffers per layer: reads reuse them instead of allocating (and
    page-faulting) fresh multi-MiB tensors every forward.

    Args:
        pool: the pool whose page shape the buffers take.
    """

    def __init__(self, pool: BlockPool):
        self._pool = pool
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * pool.num_layers

    def get(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of ``layer`` with at least ``rows`` token rows (``[rows, num_kv_heads,
        head_dim]`` views). Their content is overwritten by the next read of the same layer through
        any view that shares these buffers."""
        current = self._buffers[layer]
        if current is None or current[0].shape[0] < rows:
            shape = (max(rows, 1), *self._pool.k[layer].shape[2:])
            like = self._pool.k[layer]
            current = (like.new_empty(shape), like.new_empty(shape))
            self._buffers[layer] = current
        return current[0][:rows], current[1][:rows]


class PagedKVCacheView(KVLengths):
    """The models' ``KVCacheView`` over paged storage for a batch of B sequences (prefill, denoise).

    Rows may have different lengths (ragged batch). :meth:`read` returns row b's cached tokens
    left-packed and padded to ``Lc = max(cached_lens)`` (``valid`` False beyond ``cached_lens[b]``);
    :meth:`attend` first stores the new tokens in their pages, then returns row b's cached and new
    tokens ``[:cached_lens[b] + new_lens[b]]``, padded to their maximum. Slot indices are built once
    per view, so each is one ``index_select`` per K and V into the manager's reusable buffers: the
    tensors returned are valid until the next read or attend of the same layer through the same
    manager (the model uses them within its forward; denoising reads every layer once, before its
    loop).

    Raises (construction):
        ValueError: lengths do not match the batch, a sequence was freed, or its pages cannot hold
            ``cached_len + new_len`` tokens (``prepare_append`` missing).
    """

    def __init__(self, pool: BlockPool, buffers: GatherBuffers, seqs: list[KVSequence],
                 new_lens: list[int] | None = None):
        if not seqs:
            raise ValueError("a KV view needs at least one sequence")
        bs = pool.block_size
        self._pool = pool
        self._buffers = buffers
        self._seqs = seqs
        self._read_only = new_lens is None
        new = [0] * len(seqs) if new_lens is None else list(new_lens)
        if len(new) != len(seqs):
            raise ValueError(f"{len(new)} new lengths for {len(seqs)} sequences")
        for seq, n in zip(seqs, new):
            check_live(seq)
            if len(seq.block_table) * bs < seq.num_tokens + n:
                raise ValueError("sequence pages cannot hold its new tokens; call prepare_append")
        cached = [seq.num_tokens for seq in seqs]
        self._cached_lens = torch.tensor(cached, dtype=torch.long)
        self._new_lens = torch.tensor(new, dtype=torch.long)
        device = pool.k[0].device
        max_blocks = max(1, max(len(seq.block_table) for seq in seqs))
        table = torch.zeros((len(seqs), max_blocks), dtype=torch.long)
        for row, seq in enumerate(seqs):
            table[row, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.long)

        def slots(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
            """Flat slots of tokens ``[:lens[b]]`` of each row (padding reads slot 0) and validity."""
            width = int(lens.max())
            positions = torch.arange(width)
            valid = positions[None, :] < lens[:, None]
            flat = table[:, torch.clamp(positions // bs, max=max_blocks - 1)] * bs + positions % bs
            return torch.where(valid, flat, 0).reshape(-1).to(device), valid, width

        self._read_slots, valid, self._lc = slots(self._cached_lens)
        self._valid = valid.to(device)
        self._max_new = max(new)
        if self._max_new > 0:
            self._attend_slots, _, self._la = slots(self._cached_lens + self._new_lens)
            steps = torch.arange(self._max_new)
            write_mask = steps[None, :] < self._new_lens[:, None]
            pos = self._cached_lens[:, None] + steps[None, :]
            rows = torch.arange(len(seqs))[:, None].expand_as(pos)
            written = table[rows, torch.clamp(pos // bs, max=max_blocks - 1)] * bs + pos % bs
            self._write_slots = written[write_mask].to(device)
            self._write_all = bool(write_mask.all())
            self._write_src = write_mask.reshape(-1).nonzero().squeeze(1).to(device)
        self._written: set[int] = set()

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached ``(k, v, valid)`` of ``layer``: ``[B, Lc, kv_heads, head_dim]`` x2, bool ``[B, Lc]``."""
        k, v = self._gather(layer, self._read_slots, self._lc)
        return k, v, self._valid

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store rows' new tokens ``[:new_lens[b]]`` of k, v ``[B, T, kv_heads, head_dim]`` in their
        pages and return every row's cached + new tokens, ``[B, max(cached + new), kv_heads, hd]``.

        Raises:
            RuntimeError: the view is read-only.
            ValueError: T < max(new_lens) or the batch size differs.
        """
        if self._read_only:
            raise RuntimeError("attend() on a read-only KV view (denoising never writes the prefix)")
        if k.shape[0] != len(self._seqs) or k.shape[1] < self._max_new or k.shape != v.shape:
            raise ValueError(f"attend of k {tuple(k.shape)} / v {tuple(v.shape)} for "
                             f"{len(self._seqs)} rows with up to {self._max_new} new tokens")
        self._written.add(layer)
        if self._max_new == 0:
            return self._gather(layer, self._read_slots, self._lc)
        k_pool, v_pool = self._pool.k[layer], self._pool.v[layer]
        k = k[:, :self._max_new].reshape(-1, *k.shape[2:])
        v = v[:, :self._max_new].reshape(-1, *v.shape[2:])
        if not self._write_all:
            k, v = k.index_select(0, self._write_src), v.index_select(0, self._write_src)
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, self._write_slots, k.to(k_pool.dtype))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, self._write_slots, v.to(v_pool.dtype))
        return self._gather(layer, self._attend_slots, self._la)

    def _gather(self, layer: int, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_pool, v_pool = self._pool.k[layer], self._pool.v[layer]
        shape = (len(self._seqs), width, *k_pool.shape[2:])
        k_out, v_out = self._buffers.get(layer, slots.shape[0])
        torch.index_select(k_pool.view(-1, *k_pool.shape[2:]), 0, slots, out=k_out)
        torch.index_select(v_pool.view(-1, *v_pool.shape[2:]), 0, slots, out=v_out)
        return k_out.view(shape), v_out.view(shape)

    def commit(self) -> None:
        """End the forward: each sequence now holds its new tokens.

        Raises:
            RuntimeError: some layer was not attended during a forward that appends tokens.
        """
        if self._read_only:
            return
        if len(self._written) != self._pool.num_layers:
            raise RuntimeError(f"commit() after {len(self._written)} of {self._pool.num_layers} "
                               "layers attended")
        for seq, n in zip(self._seqs, self._new_lens.tolist()):
            seq.num_tokens += n
        self._read_only = True


class DecodeKVCacheView(KVLengths):
    """The models' ``KVCacheView`` for one decode step over the manager's decode rows.

    Built by ``KVCacheManager.decode_view``: row b of the batch is row b of the
    :class:`DecodeRows` workspace, already holding the sequence's ``cached_lens[b]`` tokens. :meth:`attend` writes the
    new token into its page and into the row (one ``index_copy_`` each per K and V) and returns
    views of the rows, ``[B, max(cached_lens) + 1, kv_heads, head_dim]``: no per-step gather.

    ``shared_prefix_len`` (batches of 2 or more) is the length of the leading pages every sequence
    holds in common (forks of one prefix), capped at the shortest sequence: the rows' first
    ``shared_prefix_len`` tokens are copies of the same pages, so attention can read them once.
    """

    def __init__(self, pool: BlockPool, rows: DecodeRows, seqs: list[KVSequence]):
        bs = pool.block_size
        self._pool = pool
        self._rows = rows
        self._seqs = seqs
        cached = torch.tensor([seq.num_tokens for seq in seqs], dtype=torch.long)
        self._cached_lens = cached
        self._new_lens = torch.ones_like(cached)
        device = pool.k[0].device
        width = rows.width
        tail = torch.tensor([seq.block_table[seq.num_tokens // bs] for seq in seqs], dtype=torch.long)
        self._page_slots = (tail * bs + cached % bs).to(device)
        self._row_slots = (torch.arange(len(seqs)) * width + cached).to(device)
        self._length = int(cached.max()) + 1
        if len(seqs) > 1:
            common = 0
            for pages in zip(*(seq.block_table for seq in seqs)):
                if pages.count(pages[0]) != len(pages):
                    break
                common += 1
            self._shared_prefix_len = min(common * bs, int(cached.min()))
        self._attended: set[int] = set()
        self._committed = False

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached ``(k, v, valid)`` of ``layer``: views ``[B, Lc, kv_heads, hd]``, bool ``[B, Lc]``."""
        length = self._length - 1
        valid = torch.arange(length)[None, :] < self._cached_lens[:, None]
        rows = len(self._seqs)
        return (self._rows.k(layer)[:rows, :length], self._rows.v(layer)[:rows, :length],
                valid.to(self._page_slots.device))

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new token ``k, v [B, 1, kv_heads, hd]`` in its page and its decode row; return
        the rows ``[B, max(cached_lens) + 1, kv_heads, hd]`` (views of the workspace).

        Raises:
            RuntimeError: the step was already committed.
            ValueError: k or v is not ``[B, 1, ...]``.
        """
        if self._committed:
            raise RuntimeError("attend() after commit(): a decode view serves one step")
        if k.shape[:2] != (len(self._seqs), 1) or k.shape != v.shape:
            raise ValueError(f"decode attend needs k, v [{len(self._seqs)}, 1, ...], got "
                             f"{tuple(k.shape)} / {tuple(v.shape)}")
        rows = len(self._seqs)
        for pool, dense, new in ((self._pool.k, self._rows.k(layer), k),
                                 (self._pool.v, self._rows.v(layer), v)):
            token = new[:, 0].to(pool[layer].dtype)
            # The page and the row get the same token: the row stays a copy of pool content.
            pool[layer].view(-1, *token.shape[1:]).index_copy_(0, self._page_slots, token)
            dense.view(-1, *token.shape[1:]).index_copy_(0, self._row_slots, token)
        self._attended.add(layer)
        return (self._rows.k(layer)[:rows, :self._length], self._rows.v(layer)[:rows, :self._length])

    def step_tensors(self, rows: int) -> DecodeStepTensors:
        """The step's slots and storage for a forward outside :meth:`attend` that writes every layer
        itself (a replayed decode graph padded to ``rows`` >= B rows): the workspace is grown to at
        least ``rows`` rows (its width and content kept) and every layer counts as attended.

        Raises:
            RuntimeError: the step was already committed.
            ValueError: ``rows`` below the batch.
        """
        if self._committed:
            raise RuntimeError("step_tensors() after commit(): a decode view serves one step")
        if rows < len(self._seqs):
            raise ValueError(f"{rows} rows for a batch of {len(self._seqs)}")
        self._rows.reserve_rows(rows)
        self._attended.update(range(self._pool.num_layers))
        layers = range(self._pool.num_layers)
        return DecodeStepTensors(page_slots=self._page_slots, row_slots=self._row_slots,
                                 rows_k=[self._rows.k(i) for i in layers], rows_v=[self._rows.v(i) for i in layers],
                                 pool_k=list(self._pool.k), pool_v=list(self._pool.v))

    def commit(self) -> None:
        """End the step: each sequence (and its decode row) holds its new token.

        Raises:
            RuntimeError: some layer was not attended.
        """
        if self._committed:
            return
        if len(self._attended) != self._pool.num_layers:
            raise RuntimeError(f"commit() after {len(self._attended)} of {self._pool.num_layers} "
                               "layers attended")
        for row, seq in enumerate(self._seqs):
            seq.num_tokens += 1
            self._rows.advance(row)
        self._committed = True
