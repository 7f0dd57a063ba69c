"""Native CPU kernels, built from ``csrc/`` on first use, with the torch path as fallback.

``decode_attention`` (``csrc/decode_attention.cpp``) is attention for a few folded queries per K/V
head, as in a language decode step, on fp32 tensors on an x86-64 CPU with AVX-512: one pass over each
row's K for the scores, ATen's softmax, one pass over its V. Other CPUs (aarch64, x86 without
AVX-512) keep the torch path. With 1-4 queries per K/V head, the torch path's two ``bmm``
calls are tiny GEMMs whose cost is per matrix rather than per byte; on 2 x86 cores the kernel made
the attention of a 30-request decode step (37 MB of K/V) 1.5-2x cheaper.

The source is compiled with ``torch.utils.cpp_extension.load`` (g++ and ninja; ``scripts/setup_env.sh``
installs ninja and builds it) into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
once per source, flags, torch and Python version (see :func:`_build_and_load`): 10-20 s the first
time on 2 idle cores (about a minute on a loaded machine), well under a second after. It is
compiled with OpenMP and runs on torch's intra-op threads (``torch.set_num_threads``). Set
``OXYGEN_NATIVE_KERNELS=0`` to never build or use it (the oneDNN-packed weights of
:class:`oxygen_ros.models.gemma.Linear` have their own switch, ``gemma.use_packed_weights``). When
the build fails (no compiler, no ninja), a warning is logged and callers keep the torch path.
"""

from __future__ import annotations

import fcntl
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
# Seconds to wait for another process's build of the same kernel before giving up (torch path).
BUILD_WAIT_S = 600.0
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}   # "loaded": bool, "error": str
_USE = {"enabled": True}


def use(enabled: bool) -> None:
    """Turn the use of the native kernels on or off for this process (A/B measurements); off,
    :func:`supports` answers False and callers take the torch path. Does not build anything."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _USE["enabled"] = enabled


def in_use() -> bool:
    """The setting of :func:`use` (True by default)."""
    return bool(_USE["enabled"])


def enabled_by_environment() -> bool:
    """False when ``OXYGEN_NATIVE_KERNELS`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get("OXYGEN_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> bool:
    """Build (first time) and load the native kernels; True when ``torch.ops.oxygen_ros`` has them.

    Thread-safe; the outcome is remembered for the process. Never raises: a CPU without AVX-512
    returns False without building; a failed build logs one warning with the reason (see
    :func:`status`) and returns False.
    """
    if "loaded" in _STATE:
        return bool(_STATE["loaded"])
    with _LOCK:
        if "loaded" in _STATE:
            return bool(_STATE["loaded"])
        if not enabled_by_environment():
            _STATE.update(loaded=False, error="disabled by OXYGEN_NATIVE_KERNELS")
            return False
        if not _cpu_has_avx512():   # nothing to build: the kernel needs x86-64 with AVX-512
            _STATE.update(loaded=False, error="this CPU has no AVX-512 (x86-64)")
            return False
        try:
            _build_and_load()
            _STATE.update(loaded=hasattr(torch.ops.oxygen_ros, "decode_attention"), error="")
        except Exception as error:  # noqa: BLE001 - any build failure means: use the torch path
            _STATE.update(loaded=False, error=f"{type(error).__name__}: {str(error).strip()[-500:]}")
            _LOG.warning("native CPU kernels unavailable, using the torch path: %s", _STATE["error"])
        return bool(_STATE["loaded"])


def build_directory() -> Path:
    """Where the kernel is built and cached: ``$TORCH_EXTENSIONS_DIR`` (default
    ``~/.cache/torch_extensions``) / ``oxygen_ros_native_<hash of source, flags, torch and Python
    version>``."""
    key = b"\0".join([_SOURCE.read_bytes(), " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
                       f"{sys.version_info[0]}.{sys.version_info[1]}".encode()])
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(base) / f"oxygen_ros_native_{hashlib.sha256(key).hexdigest()[:12]}"


def _build_and_load() -> None:
    """Compile (when not cached) and load ``csrc/decode_attention.cpp``.

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
    build_dir = build_directory()
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
            # Copies of the flags: torch appends to the lists it is given.
            cpp_extension.load(name=name, sources=[str(copy)], extra_cflags=list(_CFLAGS),
                               extra_ldflags=list(_LDFLAGS), build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def status() -> str:
    """``'loaded'``, ``'not built yet'`` or ``'unavailable (<reason>)'``."""
    if "loaded" not in _STATE:
        return "not built yet"
    return "loaded" if _STATE["loaded"] else f"unavailable ({_STATE['error']})"


def supports(head_dim: int, queries: int) -> bool:
    """Whether :func:`decode_attention` can serve ``queries`` folded queries per K/V head of
    ``head_dim`` on this machine: an x86-64 CPU with AVX-512 (as torch detects it), ``head_dim`` a
    multiple of 16, ``queries`` in {1, 2, 4, 8, 16}, not turned off by :func:`use`, and the kernels
    loaded (built on the first call)."""
    if not _USE["enabled"] or head_dim % 16 or queries not in (1, 2, 4, 8, 16):
        return False
    return load()


def _cpu_has_avx512() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and \
        torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     shared_prefix: int = 0) -> torch.Tensor:
    """Softmax attention of folded queries over each row's keys (the native kernel).

    Args:
        q: fp32 ``[B, kv_heads, N, hd]``, already scaled by ``hd^-0.5``; ``N = group·T`` queries folded
            group-major (query ``n`` is token ``n % T``).
        k, v: fp32 ``[B, L, kv_heads, hd]`` on the CPU, last dimension contiguous (other strides free:
            views of a larger buffer are read in place).
        mask: bool ``[B, T, L]``, True = the token may attend to the key; every row needs a True.
        shared_prefix: P such that keys and values ``[:, :P]`` are the same in every row (forks of
            one prefix); row 0's copy is read for all rows, so it comes from memory once.

    Returns:
        fp32 ``[B, kv_heads, N, hd]``.

    Raises:
        RuntimeError: the kernels are not loaded, or a case :func:`supports` rejects, or bad shapes /
            dtypes / devices, or a row whose mask hides every key.
    """
    if not load():
        raise RuntimeError(f"native decode attention {status()}")
    return torch.ops.oxygen_ros.decode_attention(q, k, v, mask, shared_prefix)
