"""The CPU fast paths: the native decode attention (oxygen_ros/models/native.py,
csrc/decode_attention.cpp) and the oneDNN-prepacked weights of cpu_fast_paths.Linear.

The kernel tests run every build of the kernel that this CPU can execute (native.variants(): on an
AVX-512 machine the avx512, avx2 and generic builds, on an AVX2 machine avx2 and generic, on aarch64
neon), so CI on either x86 family exercises the AVX2 build. They skip only where the kernels are
turned off (OXYGEN_NATIVE_KERNELS=0); a build that fails on a CPU with a build fails them. The
fallback tests run everywhere.
"""

import logging
import os
import platform
import subprocess
import sys

import pytest
import torch

from oxygen_ros.models import native
from oxygen_ros.models.config import get_preset
from oxygen_ros.models import cpu_fast_paths
from oxygen_ros.models.cpu_fast_paths import Linear, linear
from oxygen_ros.models.gemma import AttentionMask, attention
from oxygen_ros.models.kv_cache import DenseKVCache
from oxygen_ros.models.vla import VLAModel
from test_model_cascade import naive_attention   # the fp64 reference attention

VARIANTS = native.variants()
needs_kernel = pytest.mark.skipif(not native.enabled_by_environment(),
                                  reason="native kernels turned off by OXYGEN_NATIVE_KERNELS")


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Each build this CPU can execute, built and selected for the models (gemma.attention) for the
    test; the automatic choice is restored afterwards."""
    assert native.load(request.param), native.status(request.param)
    native.select(request.param)
    try:
        yield request.param
    finally:
        native.select(None)


def _case(batch, tokens, heads, kv_heads, hd, length, seed):
    """Random q and strided K/V views (rows of a longer buffer, as the decode workspace hands them
    out) with ragged key lengths and some holes; key 0 always visible."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, hd, generator=g)
    k = torch.randn(batch, length + 7, kv_heads, hd, generator=g)[:, :length]
    v = torch.randn(batch, length + 7, kv_heads, hd, generator=g)[:, :length]
    lens = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, None, :] < lens[:, None, None]).expand(batch, tokens, length).clone()
    mask &= torch.rand(batch, tokens, length, generator=g) < 0.9
    mask[..., 0] = True
    return q, k, v, mask


def _direct(q, k, v, mask, variant, shared_prefix=0):
    """native.decode_attention of ``variant`` on gemma.attention's [B, T, heads, hd] layout."""
    b, t, heads, hd = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    folded = q.view(b, t, kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, hd)
    out = native.decode_attention(folded * hd ** -0.5, k, v, mask, shared_prefix, variant=variant)
    return out.view(b, kv_heads, group, t, hd).permute(0, 3, 1, 2, 4).reshape(b, t, heads * hd)


@needs_kernel
def test_this_cpu_has_a_simd_build_of_the_kernel_and_it_loads():
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        capability = torch.backends.cpu.get_cpu_capability()
        expected = "avx512" if capability.startswith("AVX512") else "avx2" if capability.startswith("AVX2") else None
        assert VARIANTS[-1] == "default" and VARIANTS[0] == (expected or "default")
    elif machine in ("aarch64", "arm64"):
        expected = "neon"
        assert VARIANTS == ("neon",)
    else:
        expected = None
    if "OXYGEN_NATIVE_ISA" not in os.environ:
        assert native.active_variant() == expected
    if native.active_variant() is not None:
        assert native.load() and native.status() == "loaded"
        assert native.supports(64, 4)
    else:   # no SIMD build for this CPU: the torch path serves, and says why
        assert not cpu_fast_paths.native_attention_supports(64, 4) and "neither AVX2 nor NEON" in native.status()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,tokens,hd", [
    (4, 1, 1, 64),    # pi05_tiny's decode step: 4 folded queries per K/V head
    (8, 1, 1, 256),   # full-size pi0.5 / pi0: 8 queries, head_dim 256
    (8, 2, 1, 32),    # several K/V heads
    (1, 1, 1, 16),    # one query, one 16-float chunk
    (2, 1, 1, 128),   # two queries
    (4, 1, 2, 64),    # two tokens per row (8 folded queries)
    (4, 1, 4, 48),    # 16 folded queries, head_dim not a power of two
])
def test_every_build_matches_the_fp64_reference(heads, kv_heads, tokens, hd):
    for batch, length, seed in ((1, 5, 0), (3, 97, 1), (30, 601, 2)):   # 5 keys: shorter than a vector
        q, k, v, mask = _case(batch, tokens, heads, kv_heads, hd, length, seed)
        reference = naive_attention(q, k, v, mask)
        for name in VARIANTS:
            assert native.load(name), native.status(name)
            native.select(name)
            try:
                assert native.supports(hd, heads // kv_heads * tokens)
                with torch.inference_mode():
                    out = attention(q, k, v, AttentionMask(mask))
                    # The models' path ran this build: the same bits as calling it directly.
                    assert torch.equal(out, _direct(q, k, v, mask, name)), name
            finally:
                native.select(None)
            torch.testing.assert_close(out.double(), reference, atol=2e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@needs_kernel
def test_native_attention_agrees_with_the_torch_path_and_rows_are_independent(variant):
    q, k, v, mask = _case(12, 1, 4, 1, 64, 300, 3)
    with torch.inference_mode():
        fast = attention(q, k, v, mask)
        cpu_fast_paths.use_native_attention(False)
        try:
            assert not cpu_fast_paths.native_attention_supports(64, 4)
            plain = attention(q, k, v, mask)
        finally:
            cpu_fast_paths.use_native_attention(True)
        torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
        # A row's result does not depend on the other rows of the batch (same padded length): the
        # same bits alone, first, last or among others.
        others = _case(5, 1, 4, 1, 64, 300, 4)
        for row in (0, 5, 11):
            alone = attention(*(x[row:row + 1] for x in (q, k, v, mask)))
            assert torch.equal(alone[0], fast[row])
            mixed = [torch.cat([x[row:row + 1], y]) for x, y in zip((q, k, v, mask), others)]
            assert torch.equal(attention(*mixed)[0], fast[row])
            mixed = [torch.cat([y, x[row:row + 1]]) for x, y in zip((q, k, v, mask), others)]
            assert torch.equal(attention(*mixed)[-1], fast[row])


@needs_kernel
def test_native_attention_reads_a_shared_prefix_once_with_the_same_result(variant):
    q, k, v, mask = _case(9, 1, 4, 1, 64, 200, 5)
    prefix = 131                                   # not a multiple of any vector width
    k[:, :prefix], v[:, :prefix] = k[:1, :prefix], v[:1, :prefix]
    mask[:, :, :prefix] = True
    with torch.inference_mode():
        shared = attention(q, k, v, mask, shared_prefix=prefix)
        torch.testing.assert_close(shared.double(), naive_attention(q, k, v, mask), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(shared, attention(q, k, v, mask), atol=1e-6, rtol=1e-6)
        # Rows other than 0 really read row 0's prefix: with their own copy scrambled, same result.
        k2, v2 = k.clone(), v.clone()
        k2[1:, :prefix], v2[1:, :prefix] = torch.randn_like(k2[1:, :prefix]), torch.randn_like(v2[1:, :prefix])
        assert torch.equal(attention(q, k2, v2, mask, shared_prefix=prefix), shared)
    with pytest.raises(RuntimeError, match="shared_prefix"):
        native.decode_attention(torch.randn(9, 1, 4, 64), k, v, mask, shared_prefix=201, variant=variant)


@needs_kernel
def test_native_attention_rejects_bad_input_with_clear_errors(variant):
    q = torch.randn(2, 1, 4, 64)
    k = v = torch.randn(2, 10, 1, 64)
    ones = torch.ones(2, 1, 10, dtype=torch.bool)
    hidden = torch.zeros(2, 1, 10, dtype=torch.bool)
    hidden[0, 0, 3] = True
    with pytest.raises(RuntimeError, match="hides every key"):
        native.decode_attention(q, k, v, hidden, variant=variant)
    with pytest.raises(RuntimeError, match="float32"):
        native.decode_attention(q.double(), k, v, ones, variant=variant)
    for queries in (3, 6, 12):
        with pytest.raises(RuntimeError, match="1, 2, 4, 8 or 16"):
            native.decode_attention(torch.randn(2, 1, queries, 64), k, v, ones, variant=variant)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.decode_attention(torch.randn(2, 1, 4, 40), torch.randn(2, 10, 1, 40), torch.randn(2, 10, 1, 40),
                                ones, variant=variant)
    with pytest.raises(RuntimeError, match="k must be"):
        native.decode_attention(q, torch.randn(2, 10, 1, 32), torch.randn(2, 10, 1, 32), ones, variant=variant)


@needs_kernel
def test_a_build_this_cpu_cannot_execute_is_refused_and_never_built():
    foreign = next(name for name in native.VARIANT_NAMES if name not in VARIANTS)   # neon on x86, ...
    with pytest.raises(ValueError, match="cannot execute"):
        native.select(foreign)
    with pytest.raises(ValueError, match="one of"):
        native.select("avx9")
    existed = native.build_directory(foreign).exists()   # (another machine may share this cache)
    assert not native.load(foreign) and "cannot execute" in native.status(foreign)
    assert native.build_directory(foreign).exists() == existed
    with pytest.raises(RuntimeError, match="cannot execute"):
        native.decode_attention(torch.randn(1, 1, 4, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64),
                                torch.ones(1, 1, 3, dtype=torch.bool), variant=foreign)


@needs_kernel
@pytest.mark.parametrize("isa", [name for name in VARIANTS if name != "default"][-1:])
def test_oxygen_native_isa_forces_a_build_for_the_models(isa, monkeypatch):
    """OXYGEN_NATIVE_ISA=avx2 on an AVX-512 (or AVX2) machine: the models run the AVX2 build."""
    monkeypatch.setenv("OXYGEN_NATIVE_ISA", isa)
    assert native.active_variant() == isa and native.supports(64, 4) and native.status() == "loaded"
    q, k, v, mask = _case(7, 1, 4, 1, 64, 150, 9)
    with torch.inference_mode():
        out = attention(q, k, v, mask)
    assert torch.equal(out, _direct(q, k, v, mask, isa))
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_oxygen_native_isa_naming_a_build_this_cpu_cannot_run_keeps_the_torch_path(monkeypatch, caplog):
    q, k, v, mask = _case(7, 1, 4, 1, 64, 150, 10)
    foreign = next(name for name in native.VARIANT_NAMES if name not in VARIANTS)   # neon on x86, ...
    for isa in ("avx9", foreign):
        monkeypatch.setenv("OXYGEN_NATIVE_ISA", isa)
        with caplog.at_level(logging.WARNING, logger="oxygen_ros.models.native"):
            assert native.active_variant() == isa and not native.supports(64, 4)
        assert native.status().startswith("unavailable")
        with torch.inference_mode():
            out = attention(q, k, v, mask)          # the torch path serves, correctly
        torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask), atol=2e-5, rtol=1e-5)
    # A name no other test uses, so its (once per process) warning is logged here.
    assert any("using the torch path: OXYGEN_NATIVE_ISA" in r.getMessage() and "avx9" in r.getMessage()
               for r in caplog.records)


def test_oxygen_native_kernels_0_builds_and_uses_nothing(tmp_path):
    """A fresh process with OXYGEN_NATIVE_KERNELS=0: no build (an empty extensions directory), the
    torch path serves the models' decode attention, and the status says why."""
    code = ("import torch\n"
            "from oxygen_ros.models import native\n"
            "from oxygen_ros.models.gemma import attention\n"
            "q, k, v = torch.randn(2, 1, 4, 64), torch.randn(2, 9, 1, 64), torch.randn(2, 9, 1, 64)\n"
            "with torch.inference_mode():\n"
            "    attention(q, k, v, torch.ones(2, 1, 9, dtype=torch.bool))\n"
            "print(native.supports(64, 4), native.load(), native.status())\n")
    env = dict(os.environ, OXYGEN_NATIVE_KERNELS="0", TORCH_EXTENSIONS_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == \
        "False False unavailable (disabled by OXYGEN_NATIVE_KERNELS)"
    assert list(tmp_path.iterdir()) == []


@needs_kernel
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's forward AD
def test_outside_inference_mode_the_torch_paths_keep_both_kinds_of_derivative():
    import torch.autograd.forward_ad as fwAD

    q, k, v, mask = _case(3, 1, 4, 1, 64, 50, 6)
    q.requires_grad_(True)
    k = k.clone().requires_grad_(True)
    attention(q, k, v, mask).sum().backward()                       # reverse mode
    assert q.grad is not None and k.grad is not None and float(q.grad.abs().sum()) > 0
    with fwAD.dual_level():                                         # forward mode
        dual = fwAD.make_dual(q.detach(), torch.ones_like(q))
        assert fwAD.unpack_dual(attention(dual, k.detach(), v, mask)).tangent is not None
    layer = Linear(32, 16, bias=True)                               # a frozen weight, a trainable bias
    layer.weight.requires_grad_(False)
    layer(torch.randn(30, 32)).sum().backward()
    assert layer.bias.grad is not None and torch.all(layer.bias.grad == 30)


@needs_kernel
def test_a_build_lock_left_by_a_killed_build_does_not_block_loading():
    """torch's own lock file outlives a killed build; a new process must clear it and load."""
    variant = native.active_variant() or VARIANTS[0]
    assert native.load(variant), native.status(variant)
    build_dir = native.build_directory(variant)
    assert (build_dir / "decode_attention.cpp").exists()        # compiled from the copy there ...
    assert str(build_dir / "decode_attention.cpp") in (build_dir / "build.ninja").read_text()
    (build_dir / "lock").write_text("")                          # ... so a stale torch lock is found here
    code = f"from oxygen_ros.models import native; native.load({variant!r}); print(native.status({variant!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "loaded", result.stderr
    assert not (build_dir / "lock").exists()


def test_supports_declines_what_the_kernel_cannot_serve():
    assert not native.supports(60, 4)        # head_dim not a multiple of 16
    assert not native.supports(64, 3)        # 3 folded queries
    cpu_fast_paths.use_native_attention(False)
    try:
        assert not cpu_fast_paths.native_attention_supports(64, 4)
    finally:
        cpu_fast_paths.use_native_attention(True)
    with pytest.raises(TypeError):
        cpu_fast_paths.use_native_attention("no")


def test_decode_step_logits_are_the_same_with_and_without_the_native_kernel():
    torch.manual_seed(0)
    model = VLAModel(get_preset("pi05_tiny"))
    cfg = model.config
    embeds = torch.randn(3, 40, cfg.vlm_width)
    lens = torch.tensor([40, 31, 17])
    results = []
    for use in (True, False):
        cpu_fast_paths.use_native_attention(use)
        try:
            kv = DenseKVCache(cfg.vlm_num_layers, 3, cfg.num_kv_heads, cfg.head_dim)
            model.prefill(embeds, kv.begin(lens), lens, need_logits=False)
            kv.commit()
            steps = []
            for token in ([5, 6, 7], [1, 2, 3]):
                ones = torch.ones(3, dtype=torch.long)
                steps.append(model.decode_step(torch.tensor(token), kv.begin(ones)))
                kv.commit()
            results.append(torch.stack(steps))
        finally:
            cpu_fast_paths.use_native_attention(True)
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-5)


needs_packing = pytest.mark.skipif(not cpu_fast_paths.packed_weights_available(), reason="no oneDNN linear ops in this torch")


@needs_packing
def test_packed_linear_matches_f_linear_and_follows_weight_changes():
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True)
    with torch.inference_mode():
        x = torch.randn(cpu_fast_paths.PACKED_MIN_ROWS - 1, 96)   # below the threshold: F.linear, nothing packed
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert layer._packed is None
        for rows in (cpu_fast_paths.PACKED_MIN_ROWS, 30, 571):
            x = torch.randn(rows, 96)
            out = layer(x)
            assert layer._packed is not None            # the packed path served it
            torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       atol=1e-5, rtol=1e-5)
        batched = torch.randn(3, 7, 96)                 # leading dims kept
        assert layer(batched).shape == (3, 7, 40)
    # A new weight (a checkpoint load) is packed again, not served from the stale copy.
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96))
    with torch.inference_mode():
        x = torch.randn(30, 96)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)


def test_linear_keeps_autograd_and_the_switch_turns_packing_off():
    torch.manual_seed(1)
    layer = Linear(32, 16, bias=False)
    x = torch.randn(30, 32, requires_grad=True)
    layer(x).sum().backward()                           # grad mode: F.linear, gradients flow
    assert x.grad is not None and layer.weight.grad is not None
    cpu_fast_paths.use_packed_weights(False)
    try:
        with torch.inference_mode():
            x = torch.randn(30, 32)
            assert torch.equal(layer(x), linear(x, layer.weight))
    finally:
        cpu_fast_paths.use_packed_weights(True)
    with pytest.raises(TypeError):
        cpu_fast_paths.use_packed_weights(1)
