"""CUDA-graph capture and replay of fixed-shape model calls (the denoising loop, the vision tower).

Eager PyTorch launches every kernel from Python: on a fast GPU a call made of thousands of small
kernels (π0.5's 10-step denoising loop runs ~9,000) is bound by the launches, not by the work.
A CUDA graph records the kernels of one call once and replays them with a single launch
(``torch.cuda.CUDAGraph``; the technique vLLM and SGLang use for decode steps). A graph replays
fixed shapes and fixed addresses, so each captured call owns static input buffers: a replay copies
the new inputs into them and runs the recorded kernels; its output tensor is overwritten by the
next replay of the same graph.

Shapes that vary per call (the prefix length and the batch of a denoise) are padded up to a bucket
by the caller (:func:`round_up`, :func:`batch_bucket`) so that a handful of graphs serve every call.
Capture failures (an operation a graph cannot record) are not fatal: the key is remembered and
served eagerly from then on.

Everything but the capture and the replay themselves is device-independent: a :class:`GraphCache`
takes a backend, :class:`CUDAGraphs` (capture and replay on a CUDA device) or :class:`DirectCalls`
(the same static input buffers, static output and bookkeeping, with the function called directly at
each replay, on any device). With ``DirectCalls`` the model's graph path (buckets, padding, buffers,
cache keys, eviction, replay selection) runs on the CPU, so it is tested where no GPU is.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Hashable, Protocol, Sequence

import torch

log = logging.getLogger(__name__)


class Replayable(Protocol):
    """One captured call: static input buffers and a replay that returns the static output."""

    inputs: list[torch.Tensor]

    def replay(self) -> torch.Tensor:
        """Run the call on the current contents of :attr:`inputs`; the returned tensor is the call's
        static output, overwritten by the next replay."""


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


class DirectCall:
    """:class:`CapturedCall`'s contract without a graph: ``fn`` is called on the static buffers at
    each replay and its result copied into a static output tensor (allocated at the first replay).

    The static buffers and output behave as a graph's do (a replay reads only :attr:`inputs`; the
    output is overwritten by the next replay), so a caller that forgot to copy its inputs in or its
    output out fails the same way on the CPU as on a GPU.

    Args:
        fn: tensor function of the inputs returning one tensor.
        inputs: example tensors (any device); their clones become the static input buffers.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]):
        self.inputs = [x.clone() for x in inputs]
        self._fn = fn
        self.output: torch.Tensor | None = None

    def replay(self) -> torch.Tensor:
        """``fn(*inputs)`` copied into the static output, which is returned.

        Raises:
            RuntimeError: ``fn`` returned another shape or dtype than at the first replay (a graph
                cannot change its output either).
        """
        result = self._fn(*self.inputs)
        if self.output is None:
            self.output = torch.empty_like(result)
        elif result.shape != self.output.shape or result.dtype != self.output.dtype:
            raise RuntimeError(f"direct call returned {tuple(result.shape)} {result.dtype}, captured "
                               f"{tuple(self.output.shape)} {self.output.dtype}")
        self.output.copy_(result)
        return self.output


class CUDAGraphs:
    """Backend that captures CUDA graphs (one memory pool shared by the graphs of a cache)."""

    name = "cuda"

    def __init__(self):
        self._pool = None

    def serves(self, device: torch.device) -> bool:
        """True when calls on ``device`` can be captured (a CUDA device)."""
        return device.type == "cuda"

    def capture(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> CapturedCall:
        """Capture ``fn(*inputs)``; raises RuntimeError when the graph cannot record it."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return CapturedCall(fn, inputs, self._pool)


class DirectCalls:
    """Backend that replays by calling the function directly (:class:`DirectCall`), on any device."""

    name = "direct"

    def serves(self, device: torch.device) -> bool:
        """Always True: a direct call runs wherever its tensors are."""
        return True

    def capture(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> DirectCall:
        """The static buffers of ``fn(*inputs)``; ``fn`` first runs at the first replay."""
        return DirectCall(fn, inputs)


BACKENDS = {"cuda": CUDAGraphs, "direct": DirectCalls}


class GraphCache:
    """Captured calls by key, least recently used evicted beyond ``max_graphs``.

    Args:
        max_graphs: most graphs kept (each holds its static buffers and intermediate memory in the
            cache's shared pool).
        backend: ``"cuda"`` (:class:`CUDAGraphs`) or ``"direct"`` (:class:`DirectCalls`).

    Raises:
        ValueError: ``max_graphs`` below 1 or an unknown backend.

    Counters: ``captures`` (calls captured), ``replays`` (calls served from the cache, the capturing
    call included), ``evictions`` (graphs dropped beyond ``max_graphs``), ``failures`` (keys whose
    capture failed, served eagerly since).
    """

    def __init__(self, max_graphs: int = 16, backend: str = "cuda"):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.max_graphs = max_graphs
        self.backend = BACKENDS[backend]()
        self._graphs: OrderedDict[Hashable, Replayable] = OrderedDict()
        self._failed: set[Hashable] = set()
        self.captures = 0
        self.replays = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def failures(self) -> int:
        """Keys whose capture failed (each is run eagerly from then on)."""
        return len(self._failed)

    def keys(self) -> list[Hashable]:
        """Keys of the graphs held, least recently used first."""
        return list(self._graphs)

    def serves(self, device: torch.device) -> bool:
        """True when the backend replays calls on ``device`` (CUDA graphs: a CUDA device only)."""
        return self.backend.serves(device)

    def discard(self, predicate: Callable[[Hashable], bool]) -> int:
        """Drop the graphs whose key satisfies ``predicate`` (e.g. captured on storage since replaced);
        returns how many (counted in ``evictions``)."""
        stale = [key for key in self._graphs if predicate(key)]
        for key in stale:
            del self._graphs[key]
        self.evictions += len(stale)
        return len(stale)

    def get(self, key: Hashable, fn: Callable[..., torch.Tensor],
            inputs: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]]) -> Replayable | None:
        """The graph for ``key``, captured now from ``fn`` and example ``inputs`` if new; None when
        capturing ``key`` failed (now or before): the caller runs ``fn`` eagerly. ``inputs`` may be a
        function that makes them, called only when a capture happens."""
        if key in self._failed:
            return None
        call = self._graphs.get(key)
        if call is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            return call
        try:
            call = self.backend.capture(fn, inputs() if callable(inputs) else inputs)
        except RuntimeError as error:
            log.warning("CUDA graph capture of %r failed, running it eagerly: %s", key, error)
            self._failed.add(key)
            return None
        self.captures += 1
        self.replays += 1
        self._graphs[key] = call
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.evictions += 1
        return call


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n`` (bucket sizes for padded graph inputs)."""
    return -(-n // multiple) * multiple


def batch_bucket(n: int) -> int:
    """The batch a call of ``n`` rows is padded to: 1, 2, 4, 8, then multiples of 8 (vLLM's
    decode-graph sizes), so a fleet of any size up to 8k robots needs at most k + 3 graphs.

    Raises:
        ValueError: ``n`` below 1.
    """
    if n < 1:
        raise ValueError(f"a batch needs at least 1 row, got {n}")
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return round_up(n, 8)
