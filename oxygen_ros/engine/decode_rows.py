"""The decode-row workspace: the running batch's KV gathered densely between decode steps.

Gathering every request's whole prefix each decode step would copy the full batch's KV per step.
Instead the running batch's rows stay gathered in a dense per-layer workspace (``decode rows``): a
row is gathered from the pages once when its sequence joins the batch, and each step writes only the
new token into its page and its row (:class:`~oxygen_ros.engine.kv_views.DecodeKVCacheView`).

Invariant: the workspace is a copy of pool content. It holds nothing the pool does not (a row holds
the first ``row_len`` tokens of its sequence, whose pages stay authoritative), and it is bounded by
twice the largest batch times the longest sequence seen (the batch is at most ``max_batch_size``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oxygen_ros.engine.block_pool import BlockPool

if TYPE_CHECKING:
    from oxygen_ros.engine.kv_cache_manager import KVSequence


class DecodeRows:
    """Dense per-layer K/V ``[rows, length, kv_heads, head_dim]`` over one :class:`BlockPool`.

    Row r holds the first :meth:`row_len` tokens of the sequence assigned to it (the current batch in
    rows ``0..B-1``, and sequences that sat out the last steps wherever their rows survived).

    Args:
        pool: the pool whose pages the rows copy.
    """

    def __init__(self, pool: BlockPool):
        self._pool = pool
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._rows: dict[KVSequence, int] = {}
        self._row_len: list[int] = []
        # Tokens gathered from the pages into rows so far (a sequence joining the batch costs its
        # whole length once; a row that survived costs nothing).
        self.gathered_tokens = 0

    @property
    def num_rows(self) -> int:
        """Rows of the workspace: below twice the largest decode batch so far."""
        return self._k[0].shape[0] if self._k else 0

    @property
    def width(self) -> int:
        """Tokens per row (the workspace's length)."""
        return self._k[0].shape[1] if self._k else 0

    def k(self, layer: int) -> torch.Tensor:
        """Keys of ``layer``, ``[rows, width, kv_heads, head_dim]``."""
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        """Values of ``layer``, ``[rows, width, kv_heads, head_dim]``."""
        return self._v[layer]

    def advance(self, row: int) -> None:
        """Row ``row`` now holds one more token (a decode step wrote it into the row and its page)."""
        self._row_len[row] += 1

    def forget(self, seq: KVSequence) -> None:
        """Give up ``seq``'s row (its sequence is freed); the row's content is overwritten later."""
        self._rows.pop(seq, None)

    def assign(self, seqs: list[KVSequence]) -> list[int]:
        """Give ``seqs`` rows ``0..B-1`` and gather the tokens each row lacks; returns ``order``:
        row j holds ``seqs[order[j]]``.

        A sequence keeps its row when that row is below B. A sequence whose row lies at B or above
        (it sat out a step with a smaller batch) swaps rows with a row below B that no batch member
        holds, so the sequence held there stays resident too; a sequence with no row takes such a
        row, and the sequence there moves to a free row if there is one, else loses its row. Only
        tokens a row lacks (a sequence that just joined, or tokens appended by a prefill since) are
        gathered from the pages, with one ``index_select`` and one ``index_copy_`` per layer for all
        rows together.

        The caller checked that ``seqs`` are distinct, live and have a page for their next token.
        """
        batch = len(seqs)
        self._ensure(batch, max(seq.num_tokens for seq in seqs) + 1)
        members = set(seqs)
        occupant = {row: seq for seq, row in self._rows.items()}
        targets = iter([row for row in range(batch) if occupant.get(row) not in members])
        spare = iter([row for row in range(batch, self.num_rows) if row not in occupant])
        for seq in seqs:
            source = self._rows.get(seq)
            if source is not None and source < batch:
                continue
            target = next(targets)
            evicted = occupant.pop(target, None)
            if source is not None:
                # Resident above the batch: swap rows with whatever is at the target.
                self._move(source, target, swap=True)
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
                        self._move(target, destination)
                        self._rows[evicted] = occupant[destination] = destination
                self._row_len[target] = 0
            self._rows[seq] = occupant[target] = target
        self._sync(seqs)
        return sorted(range(batch), key=lambda i: self._rows[seqs[i]])

    def reserve_rows(self, rows: int) -> None:
        """At least ``rows`` rows, the width and every row's content kept (a decode step padded to a
        batch bucket reads rows beyond its batch)."""
        if self._k:
            self._ensure(rows, self.width)

    def _ensure(self, rows: int, length: int) -> None:
        """Grow the workspace to at least ``rows`` x ``length`` tokens, keeping content.

        Rows grow geometrically (at least doubling), so a batch that grows one request per cycle
        reallocates O(log) times, not every cycle; the workspace stays below twice the largest
        batch's rows.
        """
        have_rows, have_len = (self._k[0].shape[:2] if self._k else (0, 0))
        if rows <= have_rows and length <= have_len:
            return
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        # Round lengths up to 4 pages so that sequences growing by one token rarely reallocate.
        quantum = 4 * self._pool.block_size
        new_len = max(have_len, -(-length // quantum) * quantum)
        like = self._pool.k[0]
        shape = (new_rows, new_len, *like.shape[2:])
        for buffers in (self._k, self._v):
            for layer in range(self._pool.num_layers):
                grown = like.new_zeros(shape)
                if buffers and have_rows:
                    grown[:have_rows, :have_len] = buffers[layer]
                if len(buffers) <= layer:
                    buffers.append(grown)
                else:
                    buffers[layer] = grown
        self._row_len.extend([0] * (new_rows - len(self._row_len)))

    def _move(self, source: int, target: int, swap: bool = False) -> None:
        """Copy row ``source`` (and its length) to row ``target`` in every layer's K and V; with
        ``swap``, exchange the two rows."""
        for buffers in (self._k, self._v):
            for rows in buffers:
                if swap:
                    rows[[source, target]] = rows[[target, source]]
                else:
                    rows[target] = rows[source]
        if swap:
            self._row_len[source], self._row_len[target] = self._row_len[target], self._row_len[source]
        else:
            self._row_len[target] = self._row_len[source]

    def _sync(self, seqs: list[KVSequence]) -> None:
        """Gather, for the row of every sequence in ``seqs``, the tokens the sequence has and the
        row lacks."""
        bs = self._pool.block_size
        width = self.width
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
                self.gathered_tokens += len(positions)
        if not sources:
            return
        device = self._pool.k[0].device
        src, dst = torch.cat(sources).to(device), torch.cat(targets).to(device)
        for pool, rows in ((self._pool.k, self._k), (self._pool.v, self._v)):
            for layer in range(self._pool.num_layers):
                flat = pool[layer].view(-1, *pool[layer].shape[2:])
                rows[layer].view(-1, *flat.shape[1:]).index_copy_(0, dst, flat.index_select(0, src))
