"""Paged KV storage with a fixed byte budget: per-layer page tensors, a free list, reference counts.

The pool is storage only (no policy): the KV-cache manager decides who holds which page and the
scheduler decides who may allocate (the split of vLLM v1's ``block_pool.py`` / ``kv_cache_manager.py``).

Invariants (checked by the property tests):
    * a page is either free (reference count 0, in the free list exactly once) or in use
      (reference count >= 1, not in the free list);
    * reference counts never go negative: releasing a free page raises;
    * allocation is all-or-nothing: when fewer pages are free than asked, nothing is taken and
      :class:`BlockPoolExhausted` is raised.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockPoolExhausted(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class BlockPool:
    """``num_blocks`` pages of ``block_size`` tokens for every layer's K and V.

    Storage per layer: ``k[layer]`` and ``v[layer]`` of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``num_blocks`` is the largest count whose
    bytes (``2 * num_layers * block_size * num_kv_heads * head_dim * itemsize`` per page) fit in
    ``budget_bytes``.

    Args:
        num_layers, num_kv_heads, head_dim: K/V layout of the model's VLM.
        block_size: tokens per page.
        budget_bytes: fixed byte budget for all pages.
        dtype, device: storage dtype and device.

    Raises:
        ValueError: the budget cannot hold a single page, or a size is not positive.
    """

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one token's K and V take over all layers: ``2 * num_layers * num_kv_heads * head_dim *
        itemsize`` (a page holds ``block_size`` of them)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 budget_bytes: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if min(num_layers, num_kv_heads, head_dim, block_size) < 1:
            raise ValueError("num_layers, num_kv_heads, head_dim and block_size must be >= 1")
        self.block_size = block_size
        self.bytes_per_block = block_size * self.token_bytes(num_layers, num_kv_heads, head_dim, dtype)
        self.num_blocks = budget_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"KV budget {budget_bytes} B is below one page ({self.bytes_per_block} B)")
        shape = (self.num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._ref_counts = [0] * self.num_blocks
        self._free: deque[int] = deque(range(self.num_blocks))
        self.peak_used_blocks = 0

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_block

    @property
    def peak_used_bytes(self) -> int:
        return self.peak_used_blocks * self.bytes_per_block

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with reference count 1.

        Raises:
            BlockPoolExhausted: fewer than ``n`` pages are free (nothing is taken).
            ValueError: n < 0.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise BlockPoolExhausted(f"asked for {n} pages, {len(self._free)} of "
                                     f"{self.num_blocks} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            self._ref_counts[block] = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add one reference to each page (sharing). Raises ``ValueError`` for a free page."""
        for block in blocks:
            if self._ref_counts[block] < 1:
                raise ValueError(f"page {block} is free; it cannot be shared")
        for block in blocks:
            self._ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each page; a page whose count reaches 0 is free at once.

        Raises:
            ValueError: a page is already free (its reference count would go negative).
        """
        for block in blocks:
            if self._ref_counts[block] < 1:
                raise ValueError(f"page {block} released while free")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens of page ``src`` into page ``dst`` in every layer."""
        for k, v in zip(self.k, self.v):
            k[dst, :num_tokens] = k[src, :num_tokens]
            v[dst, :num_tokens] = v[src, :num_tokens]
