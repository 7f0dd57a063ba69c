"""The compiled denoising step on the CPU (oxygen_ros/models/cpu_compile.py) against the eager one."""

import pytest
import torch

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.models import DenseKVCache, cpu_compile, load_model

# Compiled and eager differ by fp32 summation order only (measured max 1e-6 on outputs of magnitude ~4).
ATOL = RTOL = 1e-4


def _prefix(model, prefix_len: int, seed: int):
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    kv = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim, model.dtype, model.device)
    ids = torch.randint(3, c.vocab_size, (1, prefix_len), generator=gen)
    lens = torch.tensor([prefix_len])
    model.prefill(model.embed_tokens(ids), kv.begin(lens), lens, need_logits=False)
    kv.commit()
    return kv, torch.randn(1, c.action_horizon, c.action_dim, generator=gen)


@pytest.mark.slow
def test_compiled_denoise_matches_eager_for_any_prefix_length():
    # Inductor's cache in its usual place (~/.cache/oxygen_ros/inductor unless set): warm after the first run.
    model = load_model("pi05_tiny", dtype="float32", device="cpu")
    model.enable_cpu_compile(False)
    cases = [_prefix(model, length, seed) for seed, length in enumerate((40, 71))]
    eager = [model.denoise(kv.begin(None), noise) for kv, noise in cases]
    model.enable_cpu_compile(True)
    assert model.warm_cpu_compile() > 0.0
    assert model.cpu_compile.failed is None and list(model.cpu_compile.compile_seconds) == [(1, 10)]
    assert any(cpu_compile.cache_dir().iterdir())
    with torch._dynamo.config.patch(error_on_recompile=True):   # another prefix length: the same graph
        compiled = [model.denoise(kv.begin(None), noise) for kv, noise in cases]
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # A prefix length other than the warm-up's is not a trivial pass: the outputs differ between cases.
    assert not torch.allclose(compiled[0], compiled[1])


@pytest.mark.slow
def test_compiled_guided_denoise_matches_eager():
    """Real-time chunking's guided steps (autograd through the velocity) through their own compiled graph:
    the same chunk as the eager guided loop, and not the plain one (the guidance acts)."""
    from oxygen_ros.models.rtc import RTCGuidance, prefix_weights

    model = load_model("pi05_tiny", dtype="float32", device="cpu")
    model.enable_cpu_compile(False)
    cases = [_prefix(model, length, seed) for seed, length in ((3, 40), (4, 71))]
    c = model.config
    target = torch.randn(1, c.action_horizon, c.action_dim, generator=torch.Generator().manual_seed(7))
    guidance = RTCGuidance(target, prefix_weights(3, 8, c.action_horizon, "linear")[None], 10.0)
    eager = [model.denoise(kv.begin(None), noise, num_steps=4, guidance=guidance) for kv, noise in cases]
    plain = model.denoise(cases[0][0].begin(None), cases[0][1], num_steps=4)
    model.enable_cpu_compile(True)
    assert model.warm_cpu_compile(guided=True) > 0.0
    compiled = model.cpu_compile
    assert compiled.guided_failed is None and list(compiled.guided_compile_seconds) == [(1, c.action_horizon)]
    # Warmed: no compile inside the cycle, for the warm-up's prefix length or another.
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = [model.denoise(kv.begin(None), noise, num_steps=4, guidance=guidance) for kv, noise in cases]
    for chunk, want in zip(got, eager):
        torch.testing.assert_close(chunk, want, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(got[0], plain, atol=1e-3)
    assert compiled.eager_calls == 0
    # The vector-Jacobian product is taken with respect to the noisy actions only: the weights stay frozen
    # (the compiled backward computes no weight gradient) and hold none.
    assert not any(p.requires_grad or p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_a_thread_count_without_a_graph_runs_eagerly_instead_of_compiling_in_a_cycle(caplog):
    """Inductor bakes the intra-op thread count into its loops: warm-up compiles the count in force and one
    thread; at a third count a known shape runs eagerly (same numbers) rather than compiling for seconds."""
    from oxygen_ros.models import cpu_fast_paths

    model = load_model("pi05_tiny", dtype="float32", device="cpu")
    kv, noise = _prefix(model, 30, 5)
    cpu_fast_paths.use_one_thread_for_small_forwards(False)     # the tiny loop's 10 rows would take one thread
    try:
        _check_thread_counts(model, kv, noise, caplog)
    finally:
        cpu_fast_paths.use_one_thread_for_small_forwards(True)


def _check_thread_counts(model, kv, noise, caplog):
    from oxygen_ros.models import cpu_fast_paths

    c = model.config
    with cpu_fast_paths.fixed_threads(3):
        eager = model.denoise(kv.begin(None), noise, num_steps=2)
        model.enable_cpu_compile(True)
        assert model.warm_cpu_compile() > 0.0
        compiled = model.cpu_compile
        assert compiled.compiled_threads[(False, 1, c.action_horizon)] == {1, 3}
        with cpu_fast_paths.fixed_threads(2), caplog.at_level("INFO", logger="oxygen_ros.models.cpu_compile"), \
                torch._dynamo.config.patch(error_on_recompile=True):
            got = model.denoise(kv.begin(None), noise, num_steps=2)
        assert compiled.eager_calls == 2 and "no graph for 2 intra-op threads" in caplog.text
        torch.testing.assert_close(got, eager, atol=ATOL, rtol=RTOL)
        with torch._dynamo.config.patch(error_on_recompile=True):     # 3 threads: its graph, no compile
            torch.testing.assert_close(model.denoise(kv.begin(None), noise, num_steps=2), eager, atol=ATOL,
                                       rtol=RTOL)
        assert compiled.eager_calls == 2


def test_failed_compile_runs_eagerly(monkeypatch, caplog):
    model = load_model("pi05_tiny", dtype="float32", device="cpu")
    kv, noise = _prefix(model, 20, 0)
    eager = model.denoise(kv.begin(None), noise, num_steps=2)
    monkeypatch.setattr(cpu_compile, "_OPTIONS", {"no_such_inductor_option": True})
    model.enable_cpu_compile(True)
    with caplog.at_level("WARNING", logger="oxygen_ros.models.cpu_compile"):
        got = model.denoise(kv.begin(None), noise, num_steps=2)
    assert model.cpu_compile.failed and "no_such_inductor_option" in caplog.text
    torch.testing.assert_close(got, eager, atol=ATOL, rtol=RTOL)
    assert model.warm_cpu_compile() == 0.0 or model.cpu_compile.failed   # stays eager, no new attempt


def test_switch_and_knob_validation():
    model = load_model("pi05_tiny", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="True or False"):
        model.enable_cpu_compile("yes")
    assert model.cpu_compile is None and model.warm_cpu_compile() == 0.0   # off: a no-op
    with pytest.raises(ValueError, match="batch"):
        model.warm_cpu_compile(batch=0)
    assert EngineConfig().cpu_compile is False
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(cpu_compile="on")


@pytest.mark.slow
def test_engine_knob_compiles_at_construction_and_keeps_the_chunks():
    """``cpu_compile`` (the node parameter of the same name): compiled when the engine is built, same chunks."""
    import numpy as np

    from engine_support import ByteIO, engine_config, observation, tiny_model
    from oxygen_ros.engine import Engine

    chunks = {}
    for compiled in (False, True):
        model = tiny_model(3)
        engine = Engine(model, ByteIO(model.config), engine_config("unified", cpu_compile=compiled))
        if compiled:   # compiled at construction, before any cycle
            assert list(model.cpu_compile.compile_seconds) == [(1, model.config.action_horizon)]
        else:
            assert model.cpu_compile is None
        chunks[compiled] = [engine.run_cycle(observation(seq)).action.actions for seq in range(2)]
    assert model.cpu_compile.failed is None
    for got, want in zip(chunks[True], chunks[False]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_inductors_cache_goes_to_ours_unless_the_user_chose_one(monkeypatch, tmp_path):
    """Importing inductor sets $TORCHINDUCTOR_CACHE_DIR to torch's own default (a temporary directory): that
    counts as unset, so compiled graphs survive a reboot in ~/.cache/oxygen_ros/inductor; a user's choice stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    for before in (None, default_cache_dir()):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        cpu_compile.use_default_cache_dir()
        assert cpu_compile.cache_dir() == cpu_compile.DEFAULT_CACHE_DIR
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cpu_compile.use_default_cache_dir()
    assert cpu_compile.cache_dir() == tmp_path
