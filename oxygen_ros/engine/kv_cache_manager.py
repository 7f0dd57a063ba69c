"""Block tables over the :class:`BlockPool`, forks with copy-on-write, and the paged KV view.

A :class:`KVSequence` is one token sequence's KV: a block table (page ids, in order) and a length.
Sequences share pages by reference count: :meth:`KVCacheManager.fork` gives a child the parent's
whole block table; the first append into a page that is still shared copies that page first
(copy-on-write), so forks never see each other's tokens. Releasing a sequence drops its references;
a page is free the moment its last reference ends.

:class:`PagedKVCacheView` implements the models' ``KVCacheView`` protocol
(``oxygen_ros/models/kv_cache.py``) for prefill and denoising: ``attend`` scatters the new tokens into
their pages with one ``index_copy_`` per layer, then gathers every row's tokens with one
``index_select`` over a slot index precomputed from the block tables.

:class:`DecodeKVCacheView` serves batched decode steps. Gathering every request's whole prefix each
step would copy the full batch's KV per step; instead the manager keeps the running batch's rows
gathered in a dense decode workspace between steps (``decode rows``): a row is gathered once when
its sequence joins the batch, and each step writes only the new token into its page and its row.
The workspace is a copy of pool content, bounded by twice the largest batch times the longest
sequence seen (the batch is at most ``max_batch_size``), and holds nothing the pool does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.models.kv_cache import KVLengths


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
        # Decode rows: dense per-layer K/V [rows, length, kv_heads, head_dim]; row r holds the
        # first _row_len[r] tokens of the sequence assigned to it in _rows (the current batch in
        # rows 0..B-1, and sequences that sat out the last steps wherever their rows survived).
        self._decode_k: list[torch.Tensor] = []
        self._decode_v: list[torch.Tensor] = []
        self._rows: dict[KVSequence, int] = {}
        self._row_len: list[int] = []
        # Tokens gathered from the pages into decode rows so far (a sequence joining the batch
        # costs its whole length once; a row that survived costs nothing).
        self.decode_gathered_tokens = 0

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
        self._rows.pop(seq, None)
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

    @property
    def decode_rows(self) -> int:
        """Rows of the decode workspace: below twice the largest decode batch so far."""
        return self._decode_k[0].shape[0] if self._decode_k else 0

    def decode_view(self, seqs: list[KVSequence]) -> tuple["DecodeKVCacheView", list[int]]:
        """A view for one decode step (one new token per sequence) over the decode rows.

        The sequences are given rows ``0..B-1`` of the decode workspace. A sequence keeps its row
        when that row is below B. A sequence whose row lies at B or above (it sat out a step with a
        smaller batch) swaps rows with a row below B that no batch member holds, so the sequence
        held there stays resident too; a sequence with no row takes such a row, and the sequence
        there moves to a free row if there is one, else loses its row. Rows stay with their
        sequences until overwritten or :meth:`free`. Only tokens a row lacks (a sequence that just
        joined, or tokens appended by a prefill since) are gathered from the pages, with one
        ``index_select`` and one ``index_copy_`` per layer for all rows together.

        Args:
            seqs: live sequences, each with a page for its next token (:meth:`prepare_append`).

        Returns:
            ``(view, order)``: the view's row j is ``seqs[order[j]]``.

        Raises:
            ValueError: empty batch, a sequence repeated or freed, or no page for the next token.
        """
        if not seqs or len(set(seqs)) != len(seqs):
            raise ValueError("a decode view needs at least one sequence, each once")
        bs = self.block_size
        for seq in seqs:
            self._check_live(seq)
            if len(seq.block_table) * bs <= seq.num_tokens:
                raise ValueError("sequence pages cannot hold its next token; call prepare_append")
        batch = len(seqs)
        self._ensure_decode_rows(batch, max(seq.num_tokens for seq in seqs) + 1)
        members = set(seqs)
        occupant = {row: seq for seq, row in self._rows.items()}
        targets = iter([row for row in range(batch) if occupant.get(row) not in members])
        spare = iter([row for row in range(batch, self.decode_rows) if row not in occupant])
        for seq in seqs:
            source = self._rows.get(seq)
            if source is not None and source < batch:
                continue
            target = next(targets)
            evicted = occupant.pop(target, None)
            if source is not None:
                # Resident above the batch: swap rows with whatever is at the target.
                self._move_row(source, target, swap=True)
                if evicted is not None:
                    self._rows[evicted] = occupant[source] = source
                else:
                    del occupant[source]
            else:
                if evicted is not None:
                    destination = next(spare, None)
                    if destination is None:
                        del self._rows[evicted]
                    else:
                        self._move_row(target, destination)
                        self._rows[evicted] = occupant[destination] = destination
                self._row_len[target] = 0
            self._rows[seq] = occupant[target] = target
        self._sync_rows(seqs)
        order = sorted(range(batch), key=lambda i: self._rows[seqs[i]])
        return DecodeKVCacheView(self, [seqs[i] for i in order]), order

    def _ensure_decode_rows(self, rows: int, length: int) -> None:
        """Grow the decode workspace to at least ``rows`` x ``length`` tokens, keeping content.

        Rows grow geometrically (at least doubling), so a batch that grows one request per cycle
        reallocates O(log) times, not every cycle; the workspace stays below twice the largest
        batch's rows.
        """
        have_rows, have_len = (self._decode_k[0].shape[:2] if self._decode_k else (0, 0))
        if rows <= have_rows and length <= have_len:
            return
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        # Round lengths up to 4 pages so that sequences growing by one token rarely reallocate.
        quantum = 4 * self.block_size
        new_len = max(have_len, -(-length // quantum) * quantum)
        like = self.pool.k[0]
        shape = (new_rows, new_len, *like.shape[2:])
        for buffers in (self._decode_k, self._decode_v):
            for layer in range(self.pool.num_layers):
                grown = like.new_zeros(shape)
                if buffers and have_rows:
                    grown[:have_rows, :have_len] = buffers[layer]
                if len(buffers) <= layer:
                    buffers.append(grown)
                else:
                    buffers[layer] = grown
        self._row_len.extend([0] * (new_rows - len(self._row_len)))

    def _move_row(self, source: int, target: int, swap: bool = False) -> None:
        """Copy decode row ``source`` (and its length) to row ``target`` in every layer's K and V;
        with ``swap``, exchange the two rows."""
        for buffers in (self._decode_k, self._decode_v):
            for rows in buffers:
                if swap:
                    rows[[source, target]] = rows[[target, source]]
                else:
                    rows[target] = rows[source]
        if swap:
            self._row_len[source], self._row_len[target] = self._row_len[target], self._row_len[source]
        else:
            self._row_len[target] = self._row_len[source]

    def _sync_rows(self, seqs: list[KVSequence]) -> None:
        """Gather, for the decode row of every sequence in ``seqs``, the tokens the sequence has
        and the row lacks."""
        bs = self.block_size
        width = self._decode_k[0].shape[1]
        sources, targets = [], []
        for seq in seqs:
            row = self._rows[seq]
            have = self._row_len[row]
            if have < seq.num_tokens:
                positions = torch.arange(have, seq.num_tokens)
                table = torch.tensor(seq.block_table, dtype=torch.long)
                sources.append(table[positions // bs] * bs + positions % bs)
                targets.append(row * width + positions)
                self._row_len[row] = seq.num_tokens
                self.decode_gathered_tokens += len(positions)
        if not sources:
            return
        device = self.pool.k[0].device
        src, dst = torch.cat(sources).to(device), torch.cat(targets).to(device)
        for pool, rows in ((self.pool.k, self._decode_k), (self.pool.v, self._decode_v)):
            for layer in range(self.pool.num_layers):
                flat = pool[layer].view(-1, *pool[layer].shape[2:])
                rows[layer].view(-1, *flat.shape[1:]).index_copy_(0, dst, flat.index_select(0, src))

    def _tail_shared(self, seq: KVSequence) -> bool:
        """Whether the page the next token lands in exists and is shared with another sequence."""
        tail_index = seq.num_tokens // self.block_size
        return tail_index < len(seq.block_table) and \
            self.pool.ref_count(seq.block_table[tail_index]) > 1

    @staticmethod
    def _check_live(seq: KVSequence) -> None:
        if seq.freed:
            raise ValueError("KV sequence was already freed")


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
        k_out, v_out = self._manager.workspace(layer, slots.shape[0])
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

    Built by :meth:`KVCacheManager.decode_view`: row b of the batch is row b of the decode
    workspace, already holding the sequence's ``cached_lens[b]`` tokens. :meth:`attend` writes the
    new token into its page and into the row (one ``index_copy_`` each per K and V) and returns
    views of the rows, ``[B, max(cached_lens) + 1, kv_heads, head_dim]``: no per-step gather.

    ``shared_prefix_len`` (batches of 2 or more) is the length of the leading pages every sequence
    holds in common (forks of one prefix), capped at the shortest sequence: the rows' first
    ``shared_prefix_len`` tokens are copies of the same pages, so attention can read them once.
    """

    def __init__(self, manager: KVCacheManager, seqs: list[KVSequence]):
        pool, bs = manager.pool, manager.block_size
        self._pool = pool
        self._manager = manager
        self._seqs = seqs
        cached = torch.tensor([seq.num_tokens for seq in seqs], dtype=torch.long)
        self._cached_lens = cached
        self._new_lens = torch.ones_like(cached)
        device = pool.k[0].device
        width = manager._decode_k[0].shape[1]
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
        return (self._manager._decode_k[layer][:rows, :length],
                self._manager._decode_v[layer][:rows, :length], valid.to(self._page_slots.device))

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
        for pool, dense, new in ((self._pool.k, self._manager._decode_k, k),
                                 (self._pool.v, self._manager._decode_v, v)):
            token = new[:, 0].to(pool[layer].dtype)
            pool[layer].view(-1, *token.shape[1:]).index_copy_(0, self._page_slots, token)
            dense[layer].view(-1, *token.shape[1:]).index_copy_(0, self._row_slots, token)
        self._attended.add(layer)
        return (self._manager._decode_k[layer][:rows, :self._length],
                self._manager._decode_v[layer][:rows, :self._length])

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
            self._manager._row_len[row] += 1
        self._committed = True
