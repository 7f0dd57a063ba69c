"""Native CPU kernels, built from ``csrc/`` on first use, with the torch path as fallback.

``decode_attention`` (``csrc/decode_attention.cpp``) is attention for a few folded queries per K/V
head, as in a language decode step, on fp32 tensors on the CPU: one pass over each row's K for the
scores, ATen's softmax, one pass over its V. With 1-4 queries per K/V head, the torch path's two
``bmm`` calls are tiny GEMMs whose cost is per matrix rather than per byte; on 2 x86 cores the kernel
made the attention of a 30-request decode step (37 MB of K/V) 1.5-2x cheaper.

**One source, one build per instruction set.** The kernel is written once with ATen's portable
vector type ``at::vec::Vectorized<float>``. This module compiles it, with that instruction set's
compiler flags and ATen's ``CPU_CAPABILITY`` defines, into one library per *variant*:

- ``avx512``: x86-64 with AVX-512 (F, BW, VL, DQ) and FMA, 16 floats per vector;
- ``avx2``: x86-64 with AVX2 and FMA, 8 floats per vector;
- ``default``: the compiler's baseline (x86-64: SSE2; other architectures), ATen's generic vector;
- ``neon``: aarch64 (Jetson and other ARM robot computers), ATen's NEON vector, 4 floats.

:func:`variants` lists those this CPU can execute (from torch's own CPU detection,
``torch.backends.cpu.get_cpu_capability``), best first; the models use the first with SIMD
(:func:`active_variant`), unless :func:`select` or the environment variable ``OXYGEN_NATIVE_ISA``
names another (tests and A/B measurements of the AVX2 build on an AVX-512 machine). The generic
``default`` build is not used unless asked for: on an AVX-512 machine it was slower than the torch
path. Only variants that are used are built (the engine builds one). Each registers its own
operator, ``torch.ops.oxygen_ros.decode_attention_<variant>``, so several can be loaded in one
process.

Each variant is compiled with ``torch.utils.cpp_extension.load`` (g++ and ninja;
``scripts/setup_env.sh`` installs ninja and builds the best variant) into ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), once per source, flags, torch and Python version (see
:func:`_build_and_load`): 15-40 s the first time on 2 cores (idle to heavily loaded), well under a
second after. It is
compiled with OpenMP and runs on torch's intra-op threads (``torch.set_num_threads``). Set
``OXYGEN_NATIVE_KERNELS=0`` to never build or use it; which calls it serves, and the switches that
turn it (and the oneDNN-packed weights) off for A/B runs, are in
:mod:`oxygen_ros.models.cpu_fast_paths`. When
the build fails (no compiler, no ninja) or ``OXYGEN_NATIVE_ISA`` names a variant this CPU cannot run,
a warning is logged and callers keep the torch path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

_LOG = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
# OpenMP, so that at::parallel_for in the kernel runs on torch's intra-op threads (torch's wheels
# bring the same libgomp.so.1); without it the loops would run on one thread.
_CFLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
# Per variant: ATen's CPU_CAPABILITY for it and the instruction-set flags: the extensions torch
# requires before it reports that capability (AVX512: F, BW, VL, DQ and FMA; AVX2: AVX2 and FMA), so
# a build is loaded only where its instructions run. "default" and "neon" use the compiler's
# baseline: on aarch64 ATen's Vectorized<float> is NEON there, elsewhere its generic array of 8 floats.
_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "avx512": ("AVX512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma")),
    "avx2": ("AVX2", ("-mavx2", "-mfma")),
    "default": ("DEFAULT", ()),
    "neon": ("DEFAULT", ()),
}
VARIANT_NAMES = tuple(_VARIANTS)
# The variants the models use without being asked (see active_variant).
_AUTOMATIC = ("avx512", "avx2", "neon")
# The key of the state when active_variant() is None.
_NONE = "none"
# Seconds to wait for another process's build of the same kernel before giving up (torch path).
BUILD_WAIT_S = 600.0
_LOCK = threading.Lock()
_STATE: dict[str, dict[str, object]] = {}   # per variant: "loaded": bool, "error": str
_OPS: dict[str, object] = {}                # per loaded variant: its torch.ops operator
_SELECTED: dict[str, str | None] = {"variant": None}


def enabled_by_environment() -> bool:
    """False when ``OXYGEN_NATIVE_KERNELS`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get("OXYGEN_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def variants() -> tuple[str, ...]:
    """The variants this CPU can execute, best first: on x86-64 ``avx512`` (when torch detects
    AVX-512), ``avx2`` (AVX2 and FMA), then ``default``; on aarch64 ``neon``; elsewhere
    ``default``. torch's detection honours its ``ATEN_CPU_CAPABILITY`` cap."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ("neon",)
    if machine not in ("x86_64", "amd64"):
        return ("default",)
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return ("avx512", "avx2", "default")
    if capability.startswith("AVX2"):
        return ("avx2", "default")
    return ("default",)


def select(variant: str | None) -> None:
    """Make the models use ``variant`` in this process (tests, A/B measurements), or, with None,
    ``OXYGEN_NATIVE_ISA`` or the best of :func:`variants` again. Does not build anything.

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANT_NAMES`, or this CPU cannot execute it.
    """
    if variant is not None:
        _check_runnable(variant)
    _SELECTED["variant"] = variant


def active_variant() -> str | None:
    """The variant the models use: :func:`select`'s choice, else ``OXYGEN_NATIVE_ISA`` when set,
    else the best of :func:`variants` that has SIMD (``avx512``, ``avx2``, ``neon``); None on a CPU
    with none of them: there the generic build was not measured faster than the torch path, which
    serves unless ``OXYGEN_NATIVE_ISA=default`` asks for it. May name a variant this CPU cannot run
    (a bad ``OXYGEN_NATIVE_ISA``); :func:`load` then declines it with a warning."""
    chosen = _SELECTED["variant"]
    if chosen is not None:
        return chosen
    forced = os.environ.get("OXYGEN_NATIVE_ISA", "").strip().lower()
    if forced:
        return forced
    return next((name for name in variants() if name in _AUTOMATIC), None)


def _check_runnable(variant: str) -> None:
    if variant not in _VARIANTS:
        raise ValueError(f"native kernel variant must be one of {', '.join(VARIANT_NAMES)}, got {variant!r}")
    if variant not in variants():
        raise ValueError(f"this CPU cannot execute the {variant} build of the native kernels "
                         f"(it can run: {', '.join(variants())})")


def load(variant: str | None = None) -> bool:
    """Build (first time) and load the native kernels of ``variant`` (default: :func:`active_variant`);
    True when ``torch.ops.oxygen_ros`` has them.

    Thread-safe; the outcome is remembered per variant for the process. Never raises: a variant
    this CPU cannot execute is never built (False; ``OXYGEN_NATIVE_ISA`` naming one logs a
    warning); a failed build logs one warning with the reason (see :func:`status`) and returns
    False.
    """
    name = variant or active_variant() or _NONE
    state = _STATE.get(name)
    if state is not None:
        return bool(state["loaded"])
    with _LOCK:
        state = _STATE.get(name)
        if state is not None:
            return bool(state["loaded"])
        if not enabled_by_environment():
            _STATE[name] = {"loaded": False, "error": "disabled by OXYGEN_NATIVE_KERNELS"}
            return False
        if name == _NONE:
            _STATE[name] = {"loaded": False, "error": "this CPU has neither AVX2 nor NEON; the generic build "
                                                      "is used only with OXYGEN_NATIVE_ISA=default"}
            return False
        try:
            _check_runnable(name)
        except ValueError as error:
            _STATE[name] = {"loaded": False, "error": str(error)}
            if variant is None:   # from OXYGEN_NATIVE_ISA: say why the torch path serves
                _LOG.warning("native CPU kernels unavailable, using the torch path: OXYGEN_NATIVE_ISA: %s", error)
            return False
        try:
            started = time.monotonic()
            built = _build_and_load(name)
            op = getattr(torch.ops.oxygen_ros, f"decode_attention_{name}")
            _OPS[name] = op
            _STATE[name] = {"loaded": True, "error": ""}
            if built:
                _LOG.info("built the %s native CPU kernels in %.1f s", name, time.monotonic() - started)
        except Exception as error:  # noqa: BLE001 - any build failure means: use the torch path
            _STATE[name] = {"loaded": False, "error": f"{type(error).__name__}: {str(error).strip()[-500:]}"}
            _LOG.warning("native CPU kernels (%s) unavailable, using the torch path: %s", name,
                         _STATE[name]["error"])
        return bool(_STATE[name]["loaded"])


def build_directory(variant: str | None = None) -> Path:
    """Where ``variant`` (default: :func:`active_variant`, else ``default``) is built and cached:
    ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) /
    ``oxygen_ros_native_<variant>_<hash of source, flags, machine, torch and Python version>``.

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANT_NAMES`.
    """
    name = variant or active_variant() or "default"
    if name not in _VARIANTS:
        raise ValueError(f"native kernel variant must be one of {', '.join(VARIANT_NAMES)}, got {name!r}")
    key = b"\0".join([_SOURCE.read_bytes(), " ".join(_flags(name) + _LDFLAGS).encode(),
                       platform.machine().encode(), torch.__version__.encode(),
                       f"{sys.version_info[0]}.{sys.version_info[1]}".encode()])
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(base) / f"oxygen_ros_native_{name}_{hashlib.sha256(key).hexdigest()[:12]}"


def _flags(variant: str) -> tuple[str, ...]:
    """Compiler flags of ``variant``: the common ones, its instruction set, ATen's capability
    defines and the operator's suffix (``OXYGEN_ISA``)."""
    capability, isa = _VARIANTS[variant]
    defines = [f"-DCPU_CAPABILITY={capability}", f"-DOXYGEN_ISA={variant}"]
    if capability != "DEFAULT":
        defines.append(f"-DCPU_CAPABILITY_{capability}")
    return _CFLAGS + isa + tuple(defines)


def _build_and_load(variant: str) -> bool:
    """Compile (when not cached) and load ``csrc/decode_attention.cpp`` for ``variant``; True when
    it was compiled now.

    The build directory is :func:`build_directory`. The source is compiled from a copy inside it,
    so the build is the same whichever checkout or install space imports this module (ninja's
    build file names the copy's path, not the caller's).

    torch's own build lock (``lock`` in the build directory) stays behind when a build is killed,
    and every later build would wait on it forever. Builds here hold an OS file lock
    (``oxygen.lock``, released when the holder dies, however it dies) for the whole build; the
    holder removes a leftover ``lock``, which can only be stale. Waiting for another process's build
    gives up after :data:`BUILD_WAIT_S` seconds.

    Raises:
        TimeoutError: another process held the build longer than :data:`BUILD_WAIT_S`.
        RuntimeError, OSError, ...: whatever the build or the load raises.
    """
    from torch.utils import cpp_extension

    source = _SOURCE.read_bytes()
    build_dir = build_directory(variant)
    name = build_dir.name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "oxygen.lock", "a+") as lock:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {build_dir / 'oxygen.lock'} for over "
                                       f"{BUILD_WAIT_S:g} s") from None
                time.sleep(0.1)
        try:
            copy = build_dir / _SOURCE.name
            if not copy.exists() or copy.read_bytes() != source:
                partial = build_dir / f"{_SOURCE.name}.{os.getpid()}.tmp"
                partial.write_bytes(source)
                os.replace(partial, copy)
            stale = build_dir / "lock"
            if stale.exists():
                _LOG.info("removing a build lock left by a killed build: %s", stale)
                stale.unlink()
            built = not (build_dir / f"{name}.so").exists()
            # Copies of the flags: torch appends to the lists it is given.
            cpp_extension.load(name=name, sources=[str(copy)], extra_cflags=list(_flags(variant)),
                               extra_ldflags=list(_LDFLAGS), build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
            return built
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def status(variant: str | None = None) -> str:
    """``'loaded'``, ``'not built yet'`` or ``'unavailable (<reason>)'`` for ``variant`` (default:
    :func:`active_variant`)."""
    state = _STATE.get(variant or active_variant() or _NONE)
    if state is None:
        return "not built yet"
    return "loaded" if state["loaded"] else f"unavailable ({state['error']})"


def supports(head_dim: int, queries: int) -> bool:
    """Whether :func:`decode_attention` can serve ``queries`` folded queries per K/V head of
    ``head_dim`` on this machine: ``head_dim`` a multiple of 16, ``queries`` in {1, 2, 4, 8, 16},
    and the kernels of :func:`active_variant` loaded (built on the first call). Whether the models
    use it is decided in :mod:`oxygen_ros.models.cpu_fast_paths` (its switch for A/B runs)."""
    if head_dim % 16 or queries not in (1, 2, 4, 8, 16):
        return False
    return load()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     shared_prefix: int = 0, variant: str | None = None) -> torch.Tensor:
    """Softmax attention of folded queries over each row's keys (the native kernel).

    Args:
        q: fp32 ``[B, kv_heads, N, hd]``, already scaled by ``hd^-0.5``; ``N = group·T`` queries folded
            group-major (query ``n`` is token ``n % T``).
        k, v: fp32 ``[B, L, kv_heads, hd]`` on the CPU, last dimension contiguous (other strides free:
            views of a larger buffer are read in place).
        mask: bool ``[B, T, L]``, True = the token may attend to the key; every row needs a True.
        shared_prefix: P such that keys and values ``[:, :P]`` are the same in every row (forks of
            one prefix); row 0's copy is read for all rows, so it comes from memory once.
        variant: the build to run (default: :func:`active_variant`), e.g. ``"avx2"`` on an AVX-512 CPU.

    Returns:
        fp32 ``[B, kv_heads, N, hd]``.

    Raises:
        RuntimeError: the kernels are not loaded (or ``variant`` cannot run here), or a case
            :func:`supports` rejects, or bad shapes / dtypes / devices, or a row whose mask hides
            every key.
    """
    name = variant or active_variant() or _NONE
    op = _OPS.get(name)
    if op is None:
        if not load(name):
            raise RuntimeError(f"native decode attention ({name}) {status(name)}")
        op = _OPS[name]
    return op(q, k, v, mask, shared_prefix)
