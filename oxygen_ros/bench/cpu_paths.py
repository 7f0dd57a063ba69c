"""Which CPU paths serve the decode attention and the linears, for the benchmarks' A/B switch
(``--torch-kernels``) and their headers."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from oxygen_ros.models import cpu_fast_paths, native
from oxygen_ros.models.config import VLAConfig


@contextlib.contextmanager
def cpu_kernel_choice(torch_kernels: bool) -> Iterator[None]:
    """Within the block, the CPU decode attention and linears take the plain torch / MKL paths
    (``torch_kernels``) or the native kernel and oneDNN-packed weights; restored afterwards."""
    saved = cpu_fast_paths.native_attention_in_use(), cpu_fast_paths.packed_weights_in_use()
    cpu_fast_paths.use_native_attention(not torch_kernels)
    cpu_fast_paths.use_packed_weights(not torch_kernels)
    try:
        yield
    finally:
        cpu_fast_paths.use_native_attention(saved[0])
        cpu_fast_paths.use_packed_weights(saved[1])


def cpu_kernels(device: str | torch.device, config: VLAConfig, torch_kernels: bool) -> str | None:
    """What serves the decode attention and the linears of a ``config`` model on ``device`` when it
    is the CPU (None on other devices); builds the native kernel if it is not yet built."""
    if torch.device(device).type != "cpu":
        return None
    if torch_kernels:
        return "torch paths (--torch-kernels)"
    group = config.num_heads // config.num_kv_heads
    attention = (f"native decode attention ({native.active_variant()})"
                 if cpu_fast_paths.native_attention_supports(config.head_dim, group) else f"torch decode attention (native {native.status()})")
    linears = "oneDNN-packed weights" if cpu_fast_paths.packed_weights_available() else "MKL linears (no oneDNN ops)"
    return f"{attention}, {linears}"
