"""CUDA-graph capture and replay of fixed-shape model calls (the denoising loop, the vision tower).

Eager PyTorch launches every kernel from Python: on a fast GPU a call made of thousands of small
kernels (π0.5's 10-step denoising loop runs ~9,000) is bound by the launches, not by the work.
A CUDA graph records the kernels of one call once and replays them with a single launch
(``torch.cuda.CUDAGraph``; the technique vLLM and SGLang use for decode steps). A graph replays
fixed shapes and fixed addresses, so each captured call owns static input buffers: a replay copies
the new inputs into them and runs the recorded kernels; its output tensor is overwritten by the
next replay of the same graph.

Shapes that vary per call (the prefix length of a denoise) are padded up to a bucket by the caller
so that a handful of graphs serve every call. Capture failures (an operation a graph cannot record)
are not fatal: the key is remembered and served eagerly from then on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)


class CapturedCall:
    """One CUDA graph of ``fn(*inputs)`` over static copies of ``inputs``.

    Args:
        fn: tensor function of the inputs returning one tensor; it must not synchronise with the
            host (``.item()``, ``.tolist()``, data-dependent Python branches) or allocate host memory.
        inputs: example CUDA tensors; their clones become the static input buffers (``inputs``).
        pool: memory-pool handle shared by the graphs of one cache (``torch.cuda.graph_pool_handle``).
        warmup: eager calls on a side stream before capture (lazy initialisation, autotuning).

    Raises:
        RuntimeError: capture failed (the caller falls back to eager execution).
    """

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], pool,
                 warmup: int = 2):
        self.inputs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream(device=self.inputs[0].device)
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*self.inputs)

    def replay(self) -> torch.Tensor:
        """Run the recorded kernels on the current contents of :attr:`inputs`; returns the static
        output (valid until the next replay of this graph)."""
        self.graph.replay()
        return self.output


class GraphCache:
    """Captured calls by key, least recently used evicted beyond ``max_graphs``.

    Args:
        max_graphs: most graphs kept (each holds its static buffers and intermediate memory in the
            cache's shared pool).
    """

    def __init__(self, max_graphs: int = 16):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, CapturedCall] = OrderedDict()
        self._failed: set[Hashable] = set()
        self._pool = None
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: Hashable, fn: Callable[..., torch.Tensor],
            inputs: Sequence[torch.Tensor]) -> CapturedCall | None:
        """The graph for ``key``, captured now from ``fn`` and example ``inputs`` if new; None when
        capturing ``key`` failed (now or before): the caller runs ``fn`` eagerly."""
        if key in self._failed:
            return None
        call = self._graphs.get(key)
        if call is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            return call
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            call = CapturedCall(fn, inputs, self._pool)
        except RuntimeError as error:
            log.warning("CUDA graph capture of %r failed, running it eagerly: %s", key, error)
            self._failed.add(key)
            return None
        self.captures += 1
        self.replays += 1
        self._graphs[key] = call
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return call


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n`` (bucket sizes for padded graph inputs)."""
    return -(-n // multiple) * multiple
