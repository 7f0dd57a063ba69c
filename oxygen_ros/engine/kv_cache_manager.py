"""KV sequences over the :class:`BlockPool`: block tables, forks with copy-on-write, the one owner of pages.

A :class:`KVSequence` is one token sequence's KV: a block table (page ids, in order) and a length.
Sequences share pages by reference count: :meth:`KVCacheManager.fork` gives a child the parent's
whole block table; the first append into a page that is still shared copies that page first
(copy-on-write), so forks never see each other's tokens. Releasing a sequence drops its references;
a page is free the moment its last reference ends.

The manager is the one owner of pages: every page is taken (:meth:`KVCacheManager.reserve`,
:meth:`KVCacheManager.prepare_append`, :meth:`KVCacheManager.fork`) and given back
(:meth:`KVCacheManager.free`) through it; the scheduler decides who may take them, the model runner
only reads and writes them through the views it hands out (``oxygen_ros/engine/kv_views.py``), and
the decode-row workspace (``oxygen_ros/engine/decode_rows.py``) only copies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from oxygen_ros.engine.block_pool import BlockPool, BlockPoolExhausted
from oxygen_ros.engine.decode_rows import DecodeRows
from oxygen_ros.engine.kv_views import DecodeKVCacheView, GatherBuffers, PagedKVCacheView, check_live


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
        self._gather = GatherBuffers(pool)
        self._rows = DecodeRows(pool)

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

    def reserve(self, seqs: list[KVSequence], num_new: list[int]) -> None:
        """:meth:`prepare_append` for several sequences at once, all or nothing: the pages for
        ``num_new[i]`` more tokens of every ``seqs[i]`` (what a batched prefill appends).

        Raises:
            BlockPoolExhausted: the pool cannot supply them all (nothing is allocated then).
        """
        needed = sum(self.append_blocks_needed(seq, n) for seq, n in zip(seqs, num_new))
        if needed > self.pool.num_free:
            raise BlockPoolExhausted(f"prefill needs {needed} pages, {self.pool.num_free} free")
        for seq, n in zip(seqs, num_new):
            self.prepare_append(seq, n)

    def free(self, seq: KVSequence) -> None:
        """Drop the sequence's references; pages no one else holds return to the pool at once.
        The only place pages are given back (the scheduler frees a request's sequence when the
        request ends, the prefix tree its nodes' at the end of a cycle)."""
        self._check_live(seq)
        self._rows.forget(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_tokens = 0
        seq.freed = True

    def view(self, seqs: list[KVSequence], new_lens: list[int] | None = None) -> "PagedKVCacheView":
        """A ``KVCacheView`` over ``seqs``; ``new_lens`` None = read-only (denoising).

        The caller must have called :meth:`prepare_append` for every appended token, and calls
        :meth:`PagedKVCacheView.commit` after the forward.
        """
        return PagedKVCacheView(self.pool, self._gather, seqs, new_lens)

    @property
    def decode_rows(self) -> int:
        """Rows of the decode workspace: below twice the largest decode batch so far."""
        return self._rows.num_rows

    @property
    def decode_gathered_tokens(self) -> int:
        """Tokens gathered from the pages into decode rows so far (a sequence joining the batch
        costs its whole length once; a row that survived costs nothing)."""
        return self._rows.gathered_tokens

    def decode_view(self, seqs: list[KVSequence]) -> tuple["DecodeKVCacheView", list[int]]:
        """A view for one decode step (one new token per sequence) over the decode rows.

        The sequences are given rows ``0..B-1`` of the decode workspace (:meth:`DecodeRows.assign`);
        rows stay with their sequences until overwritten or :meth:`free`.

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
        order = self._rows.assign(seqs)
        return DecodeKVCacheView(self.pool, self._rows, [seqs[i] for i in order]), order

    def _tail_shared(self, seq: KVSequence) -> bool:
        """Whether the page the next token lands in exists and is shared with another sequence."""
        tail_index = seq.num_tokens // self.block_size
        return tail_index < len(seq.block_table) and \
            self.pool.ref_count(seq.block_table[tail_index]) > 1

    @staticmethod
    def _check_live(seq: KVSequence) -> None:
        check_live(seq)
