"""Roofline figures of the model's phases: how far each runs from what this machine can do.

Run ``python -m oxygen_ros.bench.roofline`` (defaults: π0.5-tiny, fp32, CPU, 3 cameras, a 12-token
prompt: a 780-token prefix). Per phase it reports the arithmetic done (FLOP), the bytes moved, the
achieved rates, and both as a share of the machine's ceilings, measured in the same run:

* **GEMM ceiling** (FLOP/s): the faster of two routes for the product of two ``--gemm-n`` square fp32
  matrices (``2n³`` FLOP), the two the model's linears take: ``torch.mm`` (MKL) and oneDNN with the
  weight prepacked (:class:`oxygen_ros.models.cpu_fast_paths.Linear`'s route for 16 or more rows, where
  available). On 2 Zen 4 cores the prepacked route ran ~30 % faster than ``torch.mm`` at n = 2048, and
  the prefill's own prepacked products ran faster than ``torch.mm``'s ceiling: a ceiling from
  ``torch.mm`` alone understated what the machine does;
* **stream ceiling** (B/s): a sum over (read) and a copy of (read + write) a ``--stream-mib`` fp32
  tensor, far larger than the last-level cache; the faster of the two is the ceiling.

Phases (the engine's per-frame work at N language requests, k = 1):

* ``vision``: SigLIP + projector over the cameras of one observation (one call);
* ``prefill``: the VLM over the whole prefix (images + prompt, one bidirectional block), K/V written;
* ``denoise``: the S-step Euler loop of the action expert over the cached prefix;
* ``decode x1`` / ``decode xN``: one language decode step of 1 and of N requests, each row
  holding its own copy of the prefix (N rows of K/V read), over the engine's paged KV pool and decode rows
  as the engine runs it (the token is written in place, never a copy of the cache);
* ``frame``: vision, prefill, denoise and a decode step of N rows back to back (the model's part
  of an engine frame at N, k = 1).

``--compare``: every phase also runs with the fast paths added for these figures switched off
(:func:`earlier_paths`: Q/K/V and gate/up as separate products, every forward on all threads), as
``<phase> [before]`` rows interleaved with the others in the same rounds. ``--compiled``: the denoising loop
and the frame also run with the denoising step compiled (:mod:`oxygen_ros.models.cpu_compile`), as
``denoise [compiled]`` / ``frame [compiled]`` rows in the same rounds; the compile runs before them.

Every measurement is a median over ``--rounds`` rounds after one warm-up round; in each round the
ceilings and every phase take one turn, so load from other processes slows them alike and the
percentages stay comparable. The percentages, not the milliseconds, are the figures to compare
between runs on a shared machine. The load average is printed before and after.

Counting (:func:`count_phases`, analytic from the config; no profiler):

* FLOP: ``2·m·k·n`` for every matmul (Q/K/V/O projections, MLP, SigLIP patch embedding as a
  matmul over 14x14x3 patches, projector, action in/out projections, the time MLP and the
  adaRMSNorm modulations, the LM head) and ``4·T·L·head_dim`` per query head for attention
  (``Q·Kᵀ`` and ``P·V`` over every key the mask lets a query see, T queries, L keys). Norms,
  softmax, activations, RoPE and residual adds are not counted (a few % of the FLOP at these dims).
* Bytes: the traffic of a forward that keeps nothing in cache between forwards: each weight read
  once per forward (once per Euler step for the denoising loop), the K/V read by attention and
  written by the new tokens, and each counted matmul's and attention's activations read once and
  written once (attention scores are not counted: a fused kernel keeps them on chip).

Compute- or bandwidth-bound: a phase whose arithmetic intensity (FLOP per byte) is above the
machine balance (GEMM ceiling / stream ceiling) is compute-bound, its attainable rate the GEMM
ceiling; below, bandwidth-bound, attainable ``intensity x stream ceiling``. ``%att`` is the
achieved rate over the attainable one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from oxygen_ros.bench.cpu_paths import cpu_kernel_choice, cpu_kernels
from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.kv_cache_manager import KVCacheManager
from oxygen_ros.engine.model_runner import ModelRunner, PrefillRow
from oxygen_ros.models import PRESETS, DenseKVCache, VLAConfig, cpu_fast_paths, get_preset, load_model, native
from oxygen_ros.models.rtc import RTCGuidance, prefix_weights

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass
class PhaseCount:
    """The analytic work of one phase.

    Attributes:
        name: the phase.
        flop: floating-point operations (a multiply-add is 2).
        weight_bytes, kv_bytes, activation_bytes: the traffic of the counting rules in the module
            docstring, in bytes.
        terms: FLOP per counted term (``'q/k/v/o'``, ``'mlp'``, ``'attention'``, ...).
    """

    name: str
    flop: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    activation_bytes: float = 0.0
    terms: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def bytes(self) -> float:
        """All counted traffic, bytes."""
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte."""
        return self.flop / self.bytes if self.bytes else float("inf")

    def matmul(self, term: str, m: int, k: int, n: int, elem: int, bias: bool = False,
               weight_reads: int = 1) -> None:
        """Count ``[m, k] @ [k, n]`` with a weight of ``k·n`` (+ ``n`` bias) elements read
        ``weight_reads`` times, activations ``m·k`` read and ``m·n`` written; ``elem`` bytes each."""
        self._add(term, 2.0 * m * k * n)
        self.weight_bytes += weight_reads * (k * n + (n if bias else 0)) * elem
        self.activation_bytes += (m * k + m * n) * elem

    def attention(self, term: str, heads: int, queries: int, keys: int, head_dim: int, kv_heads: int,
                  elem: int, batch: int = 1) -> None:
        """Count ``batch`` rows of ``queries`` queries per head over ``keys`` keys: ``4·q·L·hd`` FLOP
        per head; q read and output written (activations); each row's K and V read once (K/V)."""
        self._add(term, 4.0 * batch * heads * queries * keys * head_dim)
        self.activation_bytes += 2 * batch * queries * heads * head_dim * elem
        self.kv_bytes += 2 * batch * keys * kv_heads * head_dim * elem

    def add(self, other: "PhaseCount") -> None:
        """Add ``other``'s counts (a composite phase)."""
        self.flop += other.flop
        self.weight_bytes += other.weight_bytes
        self.kv_bytes += other.kv_bytes
        self.activation_bytes += other.activation_bytes
        for term, flop in other.terms.items():
            self.terms[term] = self.terms.get(term, 0.0) + flop

    def _add(self, term: str, flop: float) -> None:
        self.flop += flop
        self.terms[term] = self.terms.get(term, 0.0) + flop


def _gemma_layer(count: PhaseCount, tokens: int, width: int, mlp: int, c: VLAConfig, elem: int,
                 reads: int = 1) -> None:
    """The projections and GeGLU MLP of one Gemma layer over ``tokens`` rows (no bias)."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for out in (q_dim, kv_dim, kv_dim):
        count.matmul("q/k/v/o", tokens, width, out, elem, weight_reads=reads)
    count.matmul("q/k/v/o", tokens, q_dim, width, elem, weight_reads=reads)
    count.matmul("mlp", tokens, width, mlp, elem, weight_reads=reads)
    count.matmul("mlp", tokens, width, mlp, elem, weight_reads=reads)
    count.matmul("mlp", tokens, mlp, width, elem, weight_reads=reads)


def count_vision(c: VLAConfig, cameras: int, elem: int) -> PhaseCount:
    """SigLIP (patch embedding, ``vision_num_layers`` layers with biased projections and a 2-layer
    MLP, attention within each image) and the projector, for ``cameras`` images."""
    count = PhaseCount("vision")
    per_image = c.num_image_tokens
    tokens = cameras * per_image
    w, head_dim = c.vision_width, c.vision_width // c.vision_num_heads
    count.matmul("patch embedding", tokens, 3 * c.patch_size ** 2, w, elem, bias=True)
    count.activation_bytes += cameras * 3 * c.image_size ** 2 * elem - tokens * 3 * c.patch_size ** 2 * elem
    for _ in range(c.vision_num_layers):
        for _ in range(4):
            count.matmul("q/k/v/o", tokens, w, w, elem, bias=True)
        count.matmul("mlp", tokens, w, c.vision_mlp_dim, elem, bias=True)
        count.matmul("mlp", tokens, c.vision_mlp_dim, w, elem, bias=True)
        # Full heads per image (no grouped K/V): K and V of every image read once.
        count.attention("attention", c.vision_num_heads, per_image, per_image, head_dim, c.vision_num_heads,
                        elem, batch=cameras)
    count.matmul("projector", tokens, w, c.vlm_width, elem, bias=True)
    return count


def count_prefill(c: VLAConfig, prefix: int, elem: int) -> PhaseCount:
    """The VLM over ``prefix`` new tokens of one bidirectional block (every token sees every
    other), writing their K/V; no LM head (the action prompt needs no logits)."""
    count = PhaseCount("prefill")
    for _ in range(c.vlm_num_layers):
        _gemma_layer(count, prefix, c.vlm_width, c.vlm_mlp_dim, c, elem)
        count.attention("attention", c.num_heads, prefix, prefix, c.head_dim, c.num_kv_heads, elem)
        count.kv_bytes += 2 * prefix * c.num_kv_heads * c.head_dim * elem      # new K/V written
    return count


def count_denoise(c: VLAConfig, prefix: int, steps: int, elem: int) -> PhaseCount:
    """The Euler loop: per step the action projections and every expert layer over the horizon's
    tokens, attending to the prefix and to each other (expert weights and prefix K/V read once per
    step); once per call the time MLP and every adaRMSNorm modulation for the S steps (π0.5)."""
    count = PhaseCount("denoise")
    horizon, we = c.action_horizon, c.expert_width
    if c.variant == "pi05":
        count.matmul("time conditioning", steps, we, we, elem, bias=True)
        count.matmul("time conditioning", steps, we, we, elem, bias=True)
        for _ in range(2 * c.vlm_num_layers + 1):
            count.matmul("time conditioning", steps, we, 3 * we, elem, bias=True)
    keys = prefix + horizon + (c.variant == "pi0")
    for _ in range(steps):
        count.matmul("action in/out", horizon, c.action_dim, we, elem, bias=True)
        if c.variant == "pi0":
            count.matmul("action in/out", horizon, 2 * we, we, elem, bias=True)
            count.matmul("action in/out", horizon, we, we, elem, bias=True)
        for _ in range(c.vlm_num_layers):
            _gemma_layer(count, horizon, we, c.expert_mlp_dim, c, elem)
            count.attention("attention", c.num_heads, horizon, keys, c.head_dim, c.num_kv_heads, elem)
        count.matmul("action in/out", horizon, we, c.action_dim, elem, bias=True)
    return count


def count_decode(c: VLAConfig, batch: int, prefix: int, elem: int) -> PhaseCount:
    """One decode step of ``batch`` requests, each over its own ``prefix`` cached tokens plus the
    new one: the VLM layers, each row's K/V read and the new K/V written, the tied LM head."""
    count = PhaseCount(f"decode x{batch}")
    for _ in range(c.vlm_num_layers):
        _gemma_layer(count, batch, c.vlm_width, c.vlm_mlp_dim, c, elem)
        count.attention("attention", c.num_heads, 1, prefix + 1, c.head_dim, c.num_kv_heads, elem, batch=batch)
        count.kv_bytes += 2 * batch * c.num_kv_heads * c.head_dim * elem
    count.matmul("lm head", batch, c.vlm_width, c.vocab_size, elem)
    count.activation_bytes += batch * c.vlm_width * elem                           # embedding rows
    return count


def count_phases(c: VLAConfig, cameras: int, prompt_len: int, steps: int, batch: int,
                 dtype: str = "float32") -> list[PhaseCount]:
    """The counts of every phase of the module docstring, in order: vision, prefill, denoise,
    decode x1, decode x``batch``, frame. The prefix is ``cameras · num_image_tokens + prompt_len``.

    Raises:
        ValueError: a count below 1 or an unknown dtype.
    """
    if min(cameras, prompt_len, steps, batch) < 1:
        raise ValueError("cameras, prompt_len, steps and batch must be >= 1")
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {sorted(_BYTES)}, got {dtype!r}")
    elem = _BYTES[dtype]
    prefix = cameras * c.num_image_tokens + prompt_len
    phases = [count_vision(c, cameras, elem), count_prefill(c, prefix, elem), count_denoise(c, prefix, steps, elem),
              count_decode(c, 1, prefix, elem), count_decode(c, batch, prefix, elem)]
    frame = PhaseCount("frame")
    for phase in (phases[0], phases[1], phases[2], phases[4]):
        frame.add(phase)
    return phases + [frame]


def gemm_ceiling_fns(n: int) -> dict[str, tuple[Callable[[], object], float]]:
    """The product of two random fp32 ``n x n`` matrices by each route, with its FLOP: ``mm``
    (``torch.mm`` into a preallocated output) and, where this torch has oneDNN's linear ops, ``packed``
    (the second matrix prepacked once, as :class:`oxygen_ros.models.cpu_fast_paths.Linear` packs its
    weights; run under ``torch.inference_mode``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    fns = {"mm": ((lambda: torch.mm(a, b, out=out)), 2.0 * n ** 3)}
    if cpu_fast_paths.packed_weights_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), n)

        def run_packed():
            with torch.inference_mode():
                return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

        fns["packed"] = (run_packed, 2.0 * n ** 3)
    return fns


def stream_ceiling_fns(mib: float) -> dict[str, tuple[Callable[[], object], float]]:
    """``read`` (a sum over) and ``copy`` (into a second buffer) of an fp32 tensor of ``mib`` MiB,
    each with the bytes it moves."""
    count = int(mib * 2 ** 20) // 4
    src, dst = torch.ones(count), torch.empty(count)
    return {"read": (lambda: src.sum(), 4.0 * count), "copy": (lambda: dst.copy_(src), 8.0 * count)}


def _machine() -> dict[str, object]:
    model = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in (platform.processor(), platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith(("flags", "Features")) and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                                     "avx512_vnni", "amx_tile", "asimd", "sve") if f in have]
    except OSError:
        pass
    env = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                               "DNNL_MAX_CPU_ISA", "OXYGEN_NATIVE_ISA") if name in os.environ}
    return {"cpu": model, "flags": flags, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "isa_env": env,
            "torch": torch.__version__, "python": platform.python_version()}


def build_phases(preset: str | VLAConfig, cameras: int, prompt_len: int, steps: int, batch: int,
                 compiled: bool = False, guided: bool = False) -> dict[str, Callable[[], object]]:
    """Random-weight fp32 CPU model and inputs; a callable per phase of :func:`count_phases`, and with
    ``compiled`` also ``denoise [compiled]`` and ``frame [compiled]``: the same with the denoising step
    compiled (:meth:`oxygen_ros.models.vla.VLAModel.enable_cpu_compile`; compiled here, before any
    timing, and switched off for the other phases). With ``guided`` also ``denoise [guided]`` (and
    ``denoise [guided, compiled]``): the loop guided by real-time chunking toward a random chunk in flight, a
    delay of H/5 actions and weights reaching 0 at 3H/4 (the demo's 10 and 38 of 50), β = 10."""
    model = load_model(preset, dtype="float32", device="cpu")
    c, dev = model.config, model.device
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(cameras, 3, c.image_size, c.image_size, generator=gen) * 2 - 1
    ids = torch.randint(3, c.vocab_size, (1, prompt_len), generator=gen)
    noise = torch.randn(1, c.action_horizon, c.action_dim, generator=gen)
    state = torch.zeros(1, c.action_dim) if c.variant == "pi0" else None
    cams, prompt = torch.ones(1, cameras, dtype=torch.bool), torch.ones(1, prompt_len, dtype=torch.bool)

    def vision():
        return model.encode_images(pixels)[None]

    embeds, lens, _ = model.embed_prefix(vision(), cams, ids, prompt)

    def prefill(x=embeds, n=lens):
        kv = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim, model.dtype, dev)
        model.prefill(x, kv.begin(n), n, need_logits=False)
        kv.commit()
        return kv

    prefix_kv = prefill()

    def denoise(kv=prefix_kv):
        return model.denoise(kv.begin(None), noise, num_steps=steps, state=state)

    def decoder(rows: int):
        # As the engine decodes: paged KV and its decode rows (engine/kv_cache_manager.py), each row its own
        # copy of the prefix (a cross-frame batch); no per-step copy of the cache.
        n = int(lens[0])
        per_token = BlockPool.token_bytes(c.vlm_num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        pool = BlockPool(c.vlm_num_layers, c.num_kv_heads, c.head_dim, 16, rows * (n + 32) * per_token,
                         dtype=model.dtype, device=dev)
        manager = KVCacheManager(pool)
        runner = ModelRunner(model, None, manager, cuda_graphs=False)
        seqs = [manager.new_sequence() for _ in range(rows)]
        for seq in seqs:
            manager.reserve([seq], [n])
            runner.prefill([PrefillRow(seq, embeds[0, :n], n)], logits=False)
            manager.prepare_append(seq, 1)
        tokens = torch.full((rows,), 5, dtype=torch.long, device=dev)

        def step():
            # Not committed: every call decodes at the same position, so the rows do not grow.
            view, _ = manager.decode_view(seqs)
            return model.decode_step(tokens, view)
        return step

    decode_one, decode_batch = decoder(1), decoder(batch)

    def frame():
        x, n, _ = model.embed_prefix(vision(), cams, ids, prompt)
        denoise(prefill(x, n))
        return decode_batch()

    fns = {"vision": vision, "prefill": prefill, "denoise": denoise, "decode x1": decode_one,
           f"decode x{batch}": decode_batch, "frame": frame}
    if guided:
        horizon = c.action_horizon
        guidance = RTCGuidance(torch.randn(1, horizon, c.action_dim, generator=gen),
                               prefix_weights(horizon // 5, (3 * horizon) // 4, horizon, "linear")[None], 10.0)

        def denoise_guided(kv=prefix_kv):
            return model.denoise(kv.begin(None), noise, num_steps=steps, state=state, guidance=guidance)

        fns["denoise [guided]"] = denoise_guided
    if compiled:
        model.enable_cpu_compile(True)
        denoise()   # the compiles, outside the timed rounds
        if guided:
            denoise_guided()
        compiled_step, model._cpu_compile = model._cpu_compile, None

        def with_compiled(fn: Callable[[], object]) -> Callable[[], object]:
            def run_compiled():
                model._cpu_compile = compiled_step
                try:
                    return fn()
                finally:
                    model._cpu_compile = None
            return run_compiled

        fns["denoise [compiled]"] = with_compiled(denoise)
        fns["frame [compiled]"] = with_compiled(frame)
        if guided:
            fns["denoise [guided, compiled]"] = with_compiled(denoise_guided)
        fns["compile seconds"] = compiled_step.compile_seconds
    return fns


@contextlib.contextmanager
def earlier_paths() -> Iterator[None]:
    """Within the block, the models run without the fast paths these figures led to: no fused
    projections (:func:`oxygen_ros.models.cpu_fast_paths.use_fused_projections`) and no one-thread
    rule (:func:`oxygen_ros.models.cpu_fast_paths.use_one_thread_for_small_forwards`); restored
    afterwards."""
    saved = cpu_fast_paths.fused_projections_in_use(), cpu_fast_paths.one_thread_for_small_forwards_in_use()
    cpu_fast_paths.use_fused_projections(False)
    cpu_fast_paths.use_one_thread_for_small_forwards(False)
    try:
        yield
    finally:
        cpu_fast_paths.use_fused_projections(saved[0])
        cpu_fast_paths.use_one_thread_for_small_forwards(saved[1])


def _before(fn: Callable[[], object]) -> Callable[[], object]:
    def run_before():
        with earlier_paths():
            return fn()
    return run_before


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each callable over ``rounds`` rounds after a warm-up round; every callable
    takes one turn per round, in order."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds + 1):
        for name, fn in fns.items():
            elapsed = _timed(fn)
            if round_:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(preset: str, cameras: int, prompt_len: int, steps: int, batch: int, rounds: int, gemm_n: int,
        stream_mib: float, torch_kernels: bool = False, compare: bool = False, compiled: bool = False,
        guided: bool = False) -> dict:
    """Ceilings and phases measured interleaved; the result dict that :func:`format_table` prints
    and ``--out`` stores. Rates in FLOP/s and B/s, times in seconds. The guided loops (``guided``) are timed
    only (``timed_only``): their backward's work is not counted."""
    config = get_preset(preset)
    load_before = os.getloadavg()
    with cpu_kernel_choice(torch_kernels):
        paths = cpu_kernels("cpu", config, torch_kernels)
        phases = build_phases(preset, cameras, prompt_len, steps, batch, compiled, guided)
        compile_seconds = phases.pop("compile seconds", {})
        gemms = gemm_ceiling_fns(gemm_n)
        streams = stream_ceiling_fns(stream_mib)
        fns = {**{f"ceiling gemm {k}": v[0] for k, v in gemms.items()},
               **{f"ceiling {k}": v[0] for k, v in streams.items()}}
        for name, fn in phases.items():
            fns[name] = fn
            if compare and not name.endswith("[compiled]") and "[guided" not in name:
                fns[f"{name} [before]"] = _before(fn)
        times = measure(fns, rounds)
    gemm_rates = {k: v[1] / times[f"ceiling gemm {k}"] for k, v in gemms.items()}
    gemm_rate = max(gemm_rates.values())
    stream_rates = {k: v[1] / times[f"ceiling {k}"] for k, v in streams.items()}
    stream_rate = max(stream_rates.values())
    balance = gemm_rate / stream_rate
    rows = []
    for count, label in ((count, label) for count in count_phases(config, cameras, prompt_len, steps, batch)
                         for label in (count.name, f"{count.name} [before]", f"{count.name} [compiled]")
                         if label in times):
        seconds = times[label]
        flops, bps = count.flop / seconds, count.bytes / seconds
        compute_bound = count.intensity >= balance
        attainable = gemm_rate if compute_bound else count.intensity * stream_rate
        rows.append({"phase": label, "flop": count.flop, "bytes": count.bytes,
                     "weight_bytes": count.weight_bytes, "kv_bytes": count.kv_bytes,
                     "activation_bytes": count.activation_bytes, "terms": count.terms,
                     "intensity": count.intensity, "seconds": seconds, "flop_per_s": flops, "bytes_per_s": bps,
                     "pct_gemm": 100 * flops / gemm_rate, "pct_stream": 100 * bps / stream_rate,
                     "bound": "compute" if compute_bound else "bandwidth",
                     "pct_attainable": 100 * flops / attainable})
    return {"preset": preset, "dtype": "float32", "cameras": cameras, "prompt_len": prompt_len,
            "prefix": cameras * config.num_image_tokens + prompt_len, "steps": steps, "batch": batch,
            "rounds": rounds, "paths": paths, "native_variant": native.active_variant() if not torch_kernels else None,
            "machine": _machine(), "load_before": load_before, "load_after": os.getloadavg(),
            "compile_seconds": {f"batch {b}, horizon {h}": t for (b, h), t in compile_seconds.items()},
            "ceilings": {"gemm_n": gemm_n, "gemm_flop_per_s": gemm_rate, "gemm_flop_per_s_by_route": gemm_rates,
                         "stream_mib": stream_mib,
                         "stream_bytes_per_s": stream_rates, "balance_flop_per_byte": balance},
            "phases": rows,
            "timed_only": {name: times[name] for name in fns if "[guided" in name}}


def format_table(result: dict) -> str:
    """The human-readable table of a :func:`run` result."""
    m, ceil = result["machine"], result["ceilings"]
    load = lambda avg: "/".join(f"{x:.2f}" for x in avg)  # noqa: E731
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, flags {' '.join(m['flags'])}, "
        f"ATen {m['aten_capability']}{', env ' + str(m['isa_env']) if m['isa_env'] else ''}, torch {m['torch']}",
        f"load average (1/5/15 min) before {load(result['load_before'])}, after {load(result['load_after'])}",
        f"{result['preset']} fp32, {result['cameras']} cameras, prefix {result['prefix']} tokens, S={result['steps']}, "
        f"batch {result['batch']}, {result['rounds']} rounds; {result['paths']}"
        + "".join(f"; denoising step compiled for {k} in {v:.1f} s" for k, v in result.get("compile_seconds", {}).items()),
        f"ceilings: GEMM {ceil['gemm_flop_per_s'] / 1e9:.1f} GFLOP/s (n={ceil['gemm_n']}, the faster of "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in ceil["gemm_flop_per_s_by_route"].items())
        + "), stream "
        + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in ceil["stream_bytes_per_s"].items())
        + f" ({ceil['stream_mib']:g} MiB); balance {ceil['balance_flop_per_byte']:.1f} FLOP/B",
        f"{'phase':<21}{'ms':>9}{'GFLOP':>9}{'MB':>9}{'FLOP/B':>8}{'GFLOP/s':>9}{'%GEMM':>7}{'GB/s':>7}"
        f"{'%stream':>8}  {'bound':<10}{'%att':>6}",
    ]
    for r in result["phases"]:
        lines.append(f"{r['phase']:<21}{r['seconds'] * 1e3:>9.2f}{r['flop'] / 1e9:>9.3f}{r['bytes'] / 1e6:>9.1f}"
                     f"{r['intensity']:>8.1f}{r['flop_per_s'] / 1e9:>9.1f}{r['pct_gemm']:>7.1f}"
                     f"{r['bytes_per_s'] / 1e9:>7.1f}{r['pct_stream']:>8.1f}  {r['bound']:<10}"
                     f"{r['pct_attainable']:>6.1f}")
    for name, seconds in result.get("timed_only", {}).items():
        lines.append(f"{name:<21}{seconds * 1e3:>9.2f}  (timed only: the backward's work is not counted)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.roofline", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pi05_tiny", choices=sorted(PRESETS))
    parser.add_argument("--cameras", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=12, help="prompt tokens (3 cameras + 12 = 780)")
    parser.add_argument("--num-denoise-steps", type=int, default=10, help="Euler steps S (the node parameter num_denoise_steps)")
    parser.add_argument("--batch", type=int, default=30, help="requests of the batched decode step (N)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--gemm-n", type=int, default=2048, help="side of the ceiling GEMM")
    parser.add_argument("--stream-mib", type=float, default=256.0, help="size of the streamed tensor")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="no native decode attention and no oneDNN-packed weights (plain torch / MKL)")
    parser.add_argument("--compare", action="store_true",
                        help="also run every phase without the fused projections and the one-thread rule")
    parser.add_argument("--compiled", action="store_true",
                        help="also run the denoising loop and the frame with the denoising step compiled "
                             "(torch.compile; the engine's cpu_compile), interleaved with the eager ones")
    parser.add_argument("--guided", action="store_true",
                        help="also time the denoising loop guided by real-time chunking (and, with --compiled, its "
                             "compiled graph)")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if min(args.cameras, args.prompt_len, args.num_denoise_steps, args.batch, args.rounds, args.gemm_n) < 1 \
            or args.stream_mib <= 0:
        parser.error("--cameras, --prompt-len, --num-denoise-steps, --batch, --rounds, --gemm-n and --stream-mib must be positive")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.preset, args.cameras, args.prompt_len, args.num_denoise_steps, args.batch, args.rounds, args.gemm_n,
                 args.stream_mib, args.torch_kernels, args.compare, args.compiled, args.guided)
    print(format_table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
