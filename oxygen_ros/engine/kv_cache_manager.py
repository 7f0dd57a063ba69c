"""Block tables over the :class:`BlockPool`, forks with copy-on-write, and the paged KV view.

A :class:`KVSequence` is one token sequence's KV: a block table (page ids, in order) and a length.
Sequences share pages by reference count: :meth:`KVCacheManager.fork` gives a child the parent's
whole block table; the first append into a page that is still shared copies that page first
(copy-on-write), so forks never see each other's tokens. Releasing a sequence drops its references;
a page is free the moment its last reference ends.

:class:`PagedKVCacheView` implements the models' ``KVCacheView`` protocol
(``oxygen_ros/models/kv_cache.py``) for a batch of sequences: reads gather every row's pages with one
``index_select`` per layer over a precomputed slot index, writes scatter with one ``index_copy_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oxygen_ros.engine.block_pool import BlockPool


@dataclass(eq=False)
class KVSequence:
    """One sequence's pages: ``block_table[i]`` holds tokens ``[i*block_size, (i+1)*block_size)``.

    Attributes:
        block_table: page ids in token order; ``len(block_table) * block_size >= num_tokens``.
        num_tokens: tokens stored (the sequence's ``cached_len``).
        freed: True after :meth:`KVCacheManager.free`; a freed sequence must not be used.
    """

    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False


class KVCacheManager:
    """Creates, forks, grows and frees :class:`KVSequence` objects over one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        # Grow-only gather buffers per layer (K and V): reads reuse them instead of allocating
        # (and page-faulting) fresh multi-MiB tensors every decode step.
        self._workspace: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * pool.num_layers

    def workspace(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather buffers of ``layer`` with at least ``rows`` token rows
        (``[rows, num_kv_heads, head_dim]`` views). Their content is overwritten by the next read of
        the same layer through any view of this manager."""
        current = self._workspace[layer]
        if current is None or current[0].shape[0] < rows:
            shape = (max(rows, 1), *self.pool.k[layer].shape[2:])
            like = self.pool.k[layer]
            current = (like.new_empty(shape), like.new_empty(shape))
            self._workspace[layer] = current
        return current[0][:rows], current[1][:rows]

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def new_sequence(self) -> KVSequence:
        """An empty sequence holding no pages."""
        return KVSequence()

    def fork(self, parent: KVSequence) -> KVSequence:
        """A child that shares every page of ``parent`` (one more reference each).

        Raises:
            ValueError: the parent was freed.
        """
        self._check_live(parent)
        self.pool.incref(parent.block_table)
        return KVSequence(list(parent.block_table), parent.num_tokens)

    def append_blocks_needed(self, seq: KVSequence, num_new: int) -> int:
        """Pages :meth:`prepare_append` would allocate (new pages plus a copy-on-write copy)."""
        needed = self.blocks_for(seq.num_tokens + num_new) - len(seq.block_table)
        return needed + int(num_new > 0 and self._tail_shared(seq))

    def prepare_append(self, seq: KVSequence, num_new: int) -> None:
        """Make room for ``num_new`` more tokens: private tail page, enough pages.

        Allocation is all-or-nothing, so on failure ``seq`` is unchanged.

        Raises:
            BlockPoolExhausted: the pool cannot supply the pages.
            ValueError: the sequence was freed or num_new < 0.
        """
        self._check_live(seq)
        if num_new < 0:
            raise ValueError(f"num_new must be >= 0, got {num_new}")
        if num_new == 0:
            return
        copy = self._tail_shared(seq)
        grow = self.blocks_for(seq.num_tokens + num_new) - len(seq.block_table)
        new_blocks = self.pool.allocate(grow + int(copy))
        if copy:
            tail_index = seq.num_tokens // self.block_size
            old, private = seq.block_table[tail_index], new_blocks.pop()
            self.pool.copy_block(old, private, seq.num_tokens % self.block_size)
            self.pool.release([old])
            seq.block_table[tail_index] = private
        seq.block_table.extend(new_blocks)

    def free(self, seq: KVSequence) -> None:
        """Drop the sequence's references; pages no one else holds return to the pool at once."""
        self._check_live(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_tokens = 0
        seq.freed = True

    def view(self, seqs: list[KVSequence], new_lens: list[int] | None = None) -> "PagedKVCacheView":
        """A ``KVCacheView`` over ``seqs``; ``new_lens`` None = read-only (denoising).

        The caller must have called :meth:`prepare_append` for every appended token, and calls
        :meth:`PagedKVCacheView.commit` after the forward.
        """
        return PagedKVCacheView(self, seqs, new_lens)

    def _tail_shared(self, seq: KVSequence) -> bool:
        """Whether the page the next token lands in exists and is shared with another sequence."""
        tail_index = seq.num_tokens // self.block_size
        return tail_index < len(seq.block_table) and \
            self.pool.ref_count(seq.block_table[tail_index]) > 1

    @staticmethod
    def _check_live(seq: KVSequence) -> None:
        if seq.freed:
            raise ValueError("KV sequence was already freed")


class PagedKVCacheView:
    """The models' ``KVCacheView`` over paged storage for a batch of B sequences.

    Rows may have different cached lengths (ragged batch): row b's cached tokens are read from its
    block table, left-packed, and padded to ``Lc = max(cached_lens)`` with ``valid`` False beyond
    ``cached_lens[b]``. The slot index is built once per view, so each layer's read is one
    ``index_select`` per K and V into the manager's reusable buffers: the tensors a read returns
    are valid until the next read of the same layer through the same manager (the model uses them
    within its forward; denoising reads every layer once, before its loop).

    Raises (construction):
        ValueError: lengths do not match the batch, a sequence was freed, or its pages cannot hold
            ``cached_len + new_len`` tokens (``prepare_append`` missing).
    """

    def __init__(self, manager: KVCacheManager, seqs: list[KVSequence],
                 new_lens: list[int] | None = None):
        if not seqs:
            raise ValueError("a KV view needs at least one sequence")
        pool, bs = manager.pool, manager.block_size
        self._pool = pool
        self._manager = manager
        self._seqs = seqs
        self._read_only = new_lens is None
        new = [0] * len(seqs) if new_lens is None else list(new_lens)
        if len(new) != len(seqs):
            raise ValueError(f"{len(new)} new lengths for {len(seqs)} sequences")
        for seq, n in zip(seqs, new):
            KVCacheManager._check_live(seq)
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
        # Flat slot of token t in row b: table[b, t // bs] * bs + t % bs (padding reads slot 0).
        lc = max(cached)
        positions = torch.arange(lc)
        self._valid = positions[None, :] < self._cached_lens[:, None]
        read_slots = table[:, positions // bs] * bs + positions % bs
        self._read_slots = torch.where(self._valid, read_slots, 0).reshape(-1).to(device)
        self._valid = self._valid.to(device)
        self._lc = lc
        max_new = max(new)
        self._max_new = max_new
        if max_new > 0:
            steps = torch.arange(max_new)
            write_mask = steps[None, :] < self._new_lens[:, None]
            pos = self._cached_lens[:, None] + steps[None, :]
            rows = torch.arange(len(seqs))[:, None].expand_as(pos)
            slots = table[rows, torch.clamp(pos // bs, max=max_blocks - 1)] * bs + pos % bs
            self._write_slots = slots[write_mask].to(device)
            self._write_all = bool(write_mask.all())
            self._write_src = write_mask.reshape(-1).nonzero().squeeze(1).to(device)
        self._written: set[int] = set()

    @property
    def cached_lens(self) -> torch.Tensor:
        """int64 ``[B]``: tokens already cached per sequence before this forward."""
        return self._cached_lens

    @property
    def new_lens(self) -> torch.Tensor:
        """int64 ``[B]``: tokens this forward appends per sequence."""
        return self._new_lens

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached ``(k, v, valid)`` of ``layer``: ``[B, Lc, kv_heads, head_dim]`` x2, bool ``[B, Lc]``."""
        k_pool, v_pool = self._pool.k[layer], self._pool.v[layer]
        shape = (len(self._seqs), self._lc, *k_pool.shape[2:])
        k_out, v_out = self._manager.workspace(layer, self._read_slots.shape[0])
        torch.index_select(k_pool.view(-1, *k_pool.shape[2:]), 0, self._read_slots, out=k_out)
        torch.index_select(v_pool.view(-1, *v_pool.shape[2:]), 0, self._read_slots, out=v_out)
        return k_out.view(shape), v_out.view(shape), self._valid

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows' new tokens ``[:new_lens[b]]`` of k, v ``[B, T, kv_heads, head_dim]``.

        Raises:
            RuntimeError: the view is read-only.
            ValueError: T < max(new_lens) or the batch size differs.
        """
        if self._read_only:
            raise RuntimeError("write() on a read-only KV view (denoising never writes the prefix)")
        if k.shape[0] != len(self._seqs) or k.shape[1] < self._max_new or k.shape != v.shape:
            raise ValueError(f"write of k {tuple(k.shape)} / v {tuple(v.shape)} for "
                             f"{len(self._seqs)} rows with up to {self._max_new} new tokens")
        if self._max_new == 0:
            self._written.add(layer)
            return
        k_pool, v_pool = self._pool.k[layer], self._pool.v[layer]
        k = k[:, :self._max_new].reshape(-1, *k.shape[2:])
        v = v[:, :self._max_new].reshape(-1, *v.shape[2:])
        if not self._write_all:
            k, v = k.index_select(0, self._write_src), v.index_select(0, self._write_src)
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, self._write_slots, k.to(k_pool.dtype))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, self._write_slots, v.to(v_pool.dtype))
        self._written.add(layer)

    def commit(self) -> None:
        """End the forward: each sequence now holds its new tokens.

        Raises:
            RuntimeError: some layer was not written during a forward that appends tokens.
        """
        if self._read_only:
            return
        if len(self._written) != self._pool.num_layers:
            raise RuntimeError(f"commit() after {len(self._written)} of {self._pool.num_layers} "
                               "layers written")
        for seq, n in zip(self._seqs, self._new_lens.tolist()):
            seq.num_tokens += n
        self._read_only = True
