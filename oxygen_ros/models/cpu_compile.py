"""The denoising loop's Euler step compiled for the CPU by ``torch.compile`` (inductor's C++ code generation).

The denoising loop runs the action expert over a few action tokens ten times per chunk: hundreds of
small tensor ops per step, each a dispatch of microseconds, for products of 10-50 rows. Eager PyTorch
spends most of that time between the arithmetic. ``torch.compile`` of one step's velocity
(:meth:`oxygen_ros.models.vla.VLAModel._velocity`) with inductor's weight freezing fuses the
elementwise ops (norms, RoPE, GELU, gated residuals, the mask) into a few generated C++ loops called from a C++
wrapper, and folds the concatenated Q/K/V and gate/up weights once; the products stay MKL's and the
attention ATen's flash kernel (figures: docs/benchmarks.md, "Compiled denoising steps").

One graph serves every prefix length: the prefix dimension is marked dynamic, so a new prompt length
does not recompile; a new batch size or horizon does (a few seconds with inductor's on-disk cache
warm, 10-25 s cold on 2 cores). The compile runs on the first call of a shape, so
:meth:`oxygen_ros.models.vla.VLAModel.warm_cpu_compile` lets the engine do it at construction,
outside the control loop. Inductor's cache lives in ``TORCHINDUCTOR_CACHE_DIR``, by default set here to
``~/.cache/oxygen_ros/inductor`` (:data:`DEFAULT_CACHE_DIR`; an existing setting is kept).

Thread count: inductor writes the intra-op thread count in force at compile time into its generated
loops, so a shape is compiled under the same :func:`oxygen_ros.models.cpu_fast_paths.threads_for` rule
that runs it. If a compile fails (no C++ compiler, an unsupported op), the failure is logged once and
the model runs that step eagerly from then on: same numbers up to fp32 summation order.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

_LOG = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "oxygen_ros" / "inductor"
# torch.compile's recompile limit per function is process-wide (8 by default); every model instance and
# batch size / horizon is one compile of the same function, so a process holding several models needs
# more before dynamo falls back to eager for good.
RECOMPILE_LIMIT = 64
# Inductor options: weights frozen into the graph (constant folding of the concatenated Q/K/V and gate/up
# weights) and a C++ wrapper around the generated kernels instead of a Python one (fewer microseconds per
# call; measured 1.61x vs 1.49x over eager on pi05_tiny, interleaved, docs/benchmarks.md). Both graphs are
# inference graphs (the guided one takes its vector-Jacobian product inside, under no_grad), so both freeze.
_OPTIONS = {"freezing": True, "cpp_wrapper": True}


def cache_dir() -> Path:
    """Where inductor keeps its compiled code: ``$TORCHINDUCTOR_CACHE_DIR``, set to
    :data:`DEFAULT_CACHE_DIR` by :class:`CompiledVelocity` unless the user chose another (see
    :func:`use_default_cache_dir`)."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or DEFAULT_CACHE_DIR)


def use_default_cache_dir() -> None:
    """Point inductor's cache at :data:`DEFAULT_CACHE_DIR` unless the user set ``$TORCHINDUCTOR_CACHE_DIR``.

    Importing inductor (transformers does, long before a model is built) already sets the variable to torch's
    own default, a directory under the system's temporary directory that a reboot may empty — so a value equal
    to torch's default counts as unset. Inductor reads the variable at each use, so setting it here, before the
    first compile, is enough."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        torch_default = os.path.abspath(default_cache_dir())
    except (ImportError, AttributeError):   # another torch: only an unset variable is ours to set
        torch_default = None
    if current is None or os.path.abspath(current) == torch_default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(DEFAULT_CACHE_DIR)


class CompiledVelocity:
    """A model's compiled Euler-step velocity and its bookkeeping: one graph for plain steps (inference
    mode) and one for steps guided by real-time chunking (``guided``: the velocity with its vector-Jacobian
    product, :meth:`oxygen_ros.models.vla.VLAModel._guided_velocity`, traced whole under ``no_grad``), both
    with the weights frozen into the graph.

    Inductor writes the intra-op thread count into the generated loops, so a graph is one per thread count
    too (dynamo guards on it). A shape is compiled at its first call for the count then in force; for another
    count it is compiled only while :attr:`warming` (``VLAModel.warm_cpu_compile`` compiles the count in force
    and one thread, the two the engine's automatic count moves between on a 2-core machine). A known shape at a
    count never compiled runs eagerly (counted in :attr:`eager_calls`): a compile takes seconds and must not
    land inside a control cycle.

    Attributes:
        compile_seconds: per shape ``(batch, horizon)``, the seconds its plain graphs took to compile (every
            thread count together).
        guided_compile_seconds: the same for the guided graphs.
        compiled_threads: per ``(guided, batch, horizon)``, the thread counts compiled.
        eager_calls: steps run eagerly because their thread count had no graph.
        warming: True while compiling ahead (new thread counts of known shapes compile then).
        failed: the error text when the plain compile failed (plain steps then run eagerly), else None.
        guided_failed: the same for the guided graph (guided steps then run eagerly).
    """

    def __init__(self) -> None:
        use_default_cache_dir()
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        self._compiled: dict[bool, Callable] = {}
        self.compile_seconds: dict[tuple[int, int], float] = {}
        self.guided_compile_seconds: dict[tuple[int, int], float] = {}
        self.compiled_threads: dict[tuple[bool, int, int], set[int]] = {}
        self.eager_calls = 0
        self.warming = False
        self.failed: str | None = None
        self.guided_failed: str | None = None

    def velocity(self, model, guided: bool = False) -> Callable:
        """A callable with :meth:`oxygen_ros.models.vla.VLAModel._velocity`'s signature and results that
        runs the compiled graph (the method itself after a failed compile); ``guided``: the same for
        :meth:`oxygen_ros.models.vla.VLAModel._guided_velocity` (real-time chunking's guided step)."""
        eager = model._guided_velocity if guided else model._velocity
        if (self.guided_failed if guided else self.failed) is not None:
            return eager
        seconds = self.guided_compile_seconds if guided else self.compile_seconds
        what = "guided denoising step" if guided else "denoising step"

        def call(x, cond, keys, values, mask, cos, sin, *guidance):
            # The prefix length may change from call to call: one graph for all of them.
            for tensor in (*keys, *values):
                torch._dynamo.mark_dynamic(tensor, 1)
            torch._dynamo.mark_dynamic(mask, 2)
            if not guided and torch.is_inference_mode_enabled() and not x.is_inference():
                # The noise of the first step comes from outside inference mode, the later steps' x
                # from inside: one kind of tensor, so that both take the same graph.
                x = x.clone()
            shape = (x.shape[0], x.shape[1])
            threads = torch.get_num_threads()
            compiled_threads = self.compiled_threads.setdefault((guided, *shape), set())
            if threads in compiled_threads:
                return self._compiled[guided](x, cond, keys, values, mask, cos, sin, *guidance)
            if compiled_threads and not self.warming:
                # A graph for another thread count exists: compiling this one would stall a control cycle.
                if self.eager_calls == 0:
                    _LOG.info("the %s has no graph for %d intra-op threads (compiled for %s): running it eagerly",
                              what, threads, sorted(compiled_threads))
                self.eager_calls += 1
                return eager(x, cond, keys, values, mask, cos, sin, *guidance)
            start = time.perf_counter()
            try:
                if guided not in self._compiled:
                    self._compiled[guided] = torch.compile(eager, dynamic=False, fullgraph=True, options=_OPTIONS)
                out = self._compiled[guided](x, cond, keys, values, mask, cos, sin, *guidance)
            except Exception as error:  # noqa: BLE001 - any compiler failure: log once, run eagerly
                text = f"{type(error).__name__}: {error}".splitlines()[0]
                if guided:
                    self.guided_failed = text
                else:
                    self.failed = text
                _LOG.warning("compiling the %s failed, running it eagerly: %s", what, text)
                return eager(x, cond, keys, values, mask, cos, sin, *guidance)
            elapsed = time.perf_counter() - start
            seconds[shape] = seconds.get(shape, 0.0) + elapsed
            compiled_threads.add(threads)
            _LOG.info("compiled the %s for batch %d, horizon %d, %d intra-op threads in %.1f s (cache %s)",
                      what, shape[0], shape[1], threads, elapsed, cache_dir())
            return out

        return call
