"""CUDA-graph replay of the vision tower and the denoising loop (oxygen_ros.models.cuda_graphs).

Everything but capture and replay runs on the CPU through the ``direct`` backend (the same buckets,
padding, static buffers, cache keys, eviction and replay selection, each replay a direct call) and is
compared with the eager path; the ``cuda`` backend runs the same tests and skips without a device.
"""

import pytest
import torch

from oxygen_ros.models import DenseKVCache, load_model
from oxygen_ros.models.cuda_graphs import DirectCall, GraphCache, batch_bucket, round_up

CUDA = torch.cuda.is_available()
BACKENDS = ["direct", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device"))]
# Graphed vs eager: the same arithmetic over masked padding, up to summation order.
ATOL = 1e-4


def _prefixed(model, prompt_len: int, seed: int, device="cpu"):
    """A committed 1-row prefix cache of 2 cameras + ``prompt_len`` tokens, noise and π0's state."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(2, 3, 224, 224, generator=gen) * 2 - 1).to(device)
    images = model.encode_images(pixels)[None]
    ids = torch.randint(3, c.vocab_size, (1, prompt_len), generator=gen).to(device)
    ones = torch.ones(1, prompt_len, dtype=torch.bool, device=device)
    embeds, lens, image_lens = model.embed_prefix(images, torch.ones(1, 2, dtype=torch.bool, device=device),
                                                  ids, ones)
    kv = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim, model.dtype, device)
    model.prefill(embeds, kv.begin(lens), model.bidirectional_lens(lens, image_lens), need_logits=False)
    kv.commit()
    noise = torch.randn(1, c.action_horizon, c.action_dim, generator=gen).to(device)
    state = torch.randn(1, c.action_dim, generator=gen).to(device) if c.variant == "pi0" else None
    return kv, noise, state


@pytest.mark.parametrize("preset", ["pi05_tiny", "pi0_tiny"])
def test_masked_padding_leaves_the_actions_unchanged(preset):
    model = load_model(preset, dtype=torch.float32, seed=4)
    kv, noise, state = _prefixed(model, 7, seed=5)
    view = kv.begin(None)
    layers = model.config.vlm_num_layers
    k = [view.read(i)[0] for i in range(layers)]
    v = [view.read(i)[1] for i in range(layers)]
    valid = view.read(0)[2]
    pad = round_up(valid.shape[1], 64) - valid.shape[1] + 64

    def padded(x, fill):
        return torch.cat((x, torch.full((1, pad, *x.shape[2:]), fill, dtype=x.dtype)), dim=1)

    with torch.inference_mode():
        plain = model._denoise_loop(k, v, valid, view.cached_lens, noise, 10, state)
        # Finite garbage in the padded keys and values must get exactly zero weight.
        padded_out = model._denoise_loop([padded(x, 3.0) for x in k], [padded(x, -2.0) for x in v],
                                         padded(valid, False), view.cached_lens, noise, 10, state)
    assert torch.allclose(plain, padded_out, atol=1e-5, rtol=0)
    assert torch.allclose(plain, model.denoise(view, noise, state=state), atol=1e-6, rtol=0)


def test_graph_cache_rejects_bad_sizes_and_rounds_buckets():
    with pytest.raises(ValueError):
        GraphCache(max_graphs=0)
    model = load_model("pi05_tiny", dtype=torch.float32, seed=4)
    for bad in ({"prefix_bucket": 0}, {"prefix_bucket": 1.5}, {"max_graphs": 0}, {"enabled": "no"},
                {"enabled": False, "max_graphs": 0}, {"backend": "tpu"}):
        with pytest.raises(ValueError):
            model.enable_cuda_graphs(**bad)
    assert model.cuda_graphs is None
    assert [round_up(n, 64) for n in (1, 64, 65, 600)] == [64, 64, 128, 640]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["pi05_tiny", "pi0_tiny"])
def test_graphs_replay_what_the_eager_path_computes(preset, backend):
    device = "cuda" if backend == "cuda" else "cpu"
    model = load_model(preset, dtype=torch.float32, seed=6, device=device)
    # Two prompts of different lengths that fall in one 64-token bucket share a graph.
    cases = [_prefixed(model, n, seed=7 + n, device=device) for n in (9, 20)]
    eager = [model.denoise(kv.begin(None), noise, state=state) for kv, noise, state in cases]
    pixels = torch.rand(2, 3, 224, 224, device=device) * 2 - 1
    images = model.encode_images(pixels)
    model.enable_cuda_graphs(prefix_bucket=64, backend=backend)
    graphed = [model.denoise(kv.begin(None), noise, state=state) for kv, noise, state in cases]
    again = model.denoise(cases[0][0].begin(None), cases[0][1], state=cases[0][2])
    for expected, got in zip(eager, graphed):
        assert torch.allclose(expected, got, atol=ATOL, rtol=0)
    assert not torch.equal(graphed[0], graphed[1])
    assert torch.equal(graphed[0], again)       # outputs are copies, not the graph's buffer
    assert torch.allclose(images, model.encode_images(pixels), atol=ATOL, rtol=0)
    assert torch.allclose(images, model.encode_images(pixels), atol=ATOL, rtol=0)
    cache = model.cuda_graphs
    assert cache.captures == 2 and len(cache) == 2      # one denoise bucket, one vision shape
    assert cache.replays == 5
    length = cases[1][0].begin(None).cached_lens.item()
    assert cache.keys() == [("denoise", 1, round_up(length, 64), model.config.action_horizon, model.config.num_steps,
                             model.config.variant == "pi0"), ("vision", 2)]
    model.enable_cuda_graphs(False)
    assert model.cuda_graphs is None


def _batched(model, lens, seed):
    """A ragged batch of committed prefixes (one DenseKVCache row each, gathered into one batch)."""
    rows = [_prefixed(model, n, seed=seed + n) for n in lens]
    layers = model.config.vlm_num_layers
    length = max(kv.begin(None).read(0)[0].shape[1] for kv, _, _ in rows)

    def pad(x, fill):
        return torch.cat((x, torch.full((x.shape[0], length - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype)), 1)

    views = [kv.begin(None) for kv, _, _ in rows]
    k = [torch.cat([pad(view.read(i)[0], 0.5) for view in views]) for i in range(layers)]
    v = [torch.cat([pad(view.read(i)[1], -0.5) for view in views]) for i in range(layers)]
    valid = torch.cat([pad(view.read(0)[2], False) for view in views])
    lens_t = torch.cat([view.cached_lens for view in views])
    noise = torch.cat([n for _, n, _ in rows])
    state = None if rows[0][2] is None else torch.cat([s for _, _, s in rows])
    return k, v, valid, lens_t, noise, state


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_and_length_buckets_select_graphs_and_keep_rows_apart(backend):
    model = load_model("pi0_tiny", dtype=torch.float32, seed=8)
    k, v, valid, lens, noise, state = _batched(model, (5, 70, 12), seed=30)       # 3 ragged rows
    bucket = round_up(valid.shape[1], 64)
    assert valid.shape[1] > 64 and bucket - 64 > 10
    steps = 3
    with torch.inference_mode():
        eager = model._denoise_loop(k, v, valid, lens, noise, steps, state)
        eager_one = model._denoise_loop([x[1:2] for x in k], [x[1:2] for x in v], valid[1:2], lens[1:2],
                                        noise[1:2], steps, state[1:2])
        model.enable_cuda_graphs(prefix_bucket=64, max_graphs=2, backend=backend)
        cache = model.cuda_graphs
        graphed = model._denoise_graphed(k, v, valid, lens, noise, steps, state)
        # One row of the same batch reuses nothing: bucket 1 is another graph.
        one = model._denoise_graphed([x[1:2] for x in k], [x[1:2] for x in v], valid[1:2], lens[1:2],
                                     noise[1:2], steps, state[1:2])
        # The first 3-row call again: its padded rows and tokens hold the 1-row call's leftovers in
        # no buffer (each graph has its own), yet masking keeps the padding out of every real row.
        again = model._denoise_graphed(k, v, valid, lens, noise, steps, state)
    horizon = model.config.action_horizon
    assert graphed.shape == eager.shape == (3, horizon, model.config.action_dim)
    assert torch.allclose(graphed, eager, atol=ATOL, rtol=0)
    assert torch.allclose(one, eager_one, atol=ATOL, rtol=0)
    assert torch.equal(again, graphed)
    assert cache.keys() == [("denoise", 1, bucket, horizon, steps, True), ("denoise", 4, bucket, horizon, steps, True)]
    assert (cache.captures, cache.replays, cache.evictions) == (2, 3, 0)
    # A third shape evicts the least recently used graph (the 1-row one).
    with torch.inference_mode():
        short = model._denoise_graphed([x[:1, :10] for x in k], [x[:1, :10] for x in v], valid[:1, :10],
                                       lens[:1], noise[:1], steps, state[:1])
        short_eager = model._denoise_loop([x[:1, :10] for x in k], [x[:1, :10] for x in v], valid[:1, :10],
                                          lens[:1], noise[:1], steps, state[:1])
    assert torch.allclose(short, short_eager, atol=ATOL, rtol=0)
    assert cache.keys() == [("denoise", 4, bucket, horizon, steps, True), ("denoise", 1, 64, horizon, steps, True)]
    assert cache.evictions == 1


def test_a_failed_capture_runs_eagerly_from_then_on():
    class FailingCapture:
        name = "failing"

        def serves(self, device):
            return True

        def capture(self, fn, inputs):
            self.attempts = getattr(self, "attempts", 0) + 1
            raise RuntimeError("operation not permitted when stream is capturing")

    model = load_model("pi05_tiny", dtype=torch.float32, seed=4)
    kv, noise, _ = _prefixed(model, 9, seed=12)
    expected = model.denoise(kv.begin(None), noise)
    model.enable_cuda_graphs(backend="direct")
    model.cuda_graphs.backend = failing = FailingCapture()
    first = model.denoise(kv.begin(None), noise)
    second = model.denoise(kv.begin(None), noise)
    assert torch.allclose(first, expected, atol=ATOL, rtol=0) and torch.equal(first, second)
    assert failing.attempts == 1                 # the key is remembered: no second attempt
    assert (model.cuda_graphs.failures, model.cuda_graphs.captures, len(model.cuda_graphs)) == (1, 0, 0)


def test_direct_calls_keep_the_graph_contract():
    cache = GraphCache(max_graphs=2, backend="direct")
    x = torch.arange(4.0)
    call = cache.get("double", lambda t: t * 2, [x])
    x += 100                                     # the static buffer is a copy taken at capture
    out = call.replay()
    assert torch.equal(out, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    call.inputs[0].copy_(torch.ones(4))
    assert call.replay() is out and torch.equal(out, torch.full((4,), 2.0))   # one static output
    assert cache.get("double", lambda t: t * 3, [x]) is call                   # selected by key alone
    assert (cache.captures, cache.replays) == (1, 2)
    odd = DirectCall(lambda t: t[: int(t.sum()) % 4 + 1], [torch.zeros(3)])
    odd.replay()
    odd.inputs[0].fill_(1.0)
    with pytest.raises(RuntimeError):
        odd.replay()
    with pytest.raises(ValueError):
        GraphCache(backend="tpu")
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 30)] == [1, 2, 4, 8, 8, 16, 24, 32]
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_the_fp32_lm_head_copy_kept_on_cuda_is_refreshed_when_the_weight_changes():
    """The decode step's CUDA-only branch (a bf16 LM head kept as fp32 between steps), run on the CPU."""
    model = load_model("pi05_tiny", dtype=torch.bfloat16, seed=4)
    h = torch.randn(3, model.config.vlm_width, dtype=torch.bfloat16)
    per_call = model._lm_logits(h)
    assert getattr(model, "_lm_head_fp32", None) is None          # the CPU default converts per call
    model.keep_lm_head_fp32 = True
    kept = model._lm_logits(h)
    copy = model._lm_head_fp32[1]
    assert torch.equal(kept, per_call) and kept.dtype == torch.float32
    assert model._lm_logits(h) is not None and model._lm_head_fp32[1] is copy      # reused
    with torch.no_grad():
        model.token_embedding.weight.mul_(2)
    refreshed = model._lm_logits(h)
    assert model._lm_head_fp32[1] is not copy
    assert torch.equal(refreshed, torch.nn.functional.linear(h.float(), model.token_embedding.weight.float()))


def _decode_run(model, device, graphs: bool, backend: str = "direct"):
    """Ragged prompts prefilled into the engine's paged KV, then decode steps of changing batches:
    logits per step and every sequence's K/V (layer 0 and the last) at the end."""
    from oxygen_ros.engine import BlockPool, KVCacheManager

    c = model.config
    pool = BlockPool(c.vlm_num_layers, c.num_kv_heads, c.head_dim, 16, budget_bytes=4 * 2**20, device=device)
    manager = KVCacheManager(pool)
    gen = torch.Generator().manual_seed(21)
    seqs = []
    for n in (5, 60, 9):
        seq = manager.new_sequence()
        manager.prepare_append(seq, n)
        ids = torch.randint(3, c.vocab_size, (1, n), generator=gen).to(device)
        view = manager.view([seq], [n])
        model.prefill(model.embed_tokens(ids), view, torch.tensor([n]), need_logits=False)
        view.commit()
        seqs.append(seq)
    model.enable_cuda_graphs(graphs, backend=backend)
    logits = []
    # batch 3 (x3), batch 1, batch 3 (x2): the last step outgrows the decode rows' 64-token width.
    for members in ([0, 1, 2],) * 3 + ([0],) + ([2, 0, 1],) * 2:
        batch = [seqs[i] for i in members]
        for seq in batch:
            manager.prepare_append(seq, 1)
        view, order = manager.decode_view(batch)
        ids = torch.tensor([(7 * members[i] + len(logits)) % c.vocab_size + 3 for i in order], device=device)
        out = model.decode_step(ids, view)
        view.commit()
        inverse = torch.tensor(order).argsort()
        logits.append(out[inverse.to(out.device)].cpu())
    with torch.inference_mode():
        kv = [manager.view([seq]).read(layer)[:2] for seq in seqs for layer in (0, c.vlm_num_layers - 1)]
    return logits, [(k.cpu().clone(), v.cpu().clone()) for k, v in kv], [seq.num_tokens for seq in seqs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_replay_from_batch_and_length_buckets(backend):
    device = "cuda" if backend == "cuda" else "cpu"
    model = load_model("pi05_tiny", dtype=torch.float32, seed=9, device=device)
    eager_logits, eager_kv, eager_lens = _decode_run(model, device, graphs=False)
    logits, kv, lens = _decode_run(model, device, graphs=True, backend=backend)
    assert lens == eager_lens == [5 + 6, 60 + 5, 9 + 5]
    for expected, got in zip(eager_logits, logits):
        assert torch.allclose(expected, got, atol=ATOL, rtol=1e-4)
    # The padded rows wrote nothing but row 0's own token: every sequence's K/V is the eager one.
    for (k0, v0), (k1, v1) in zip(eager_kv, kv):
        assert k0.shape == k1.shape and torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)
    cache = model.cuda_graphs
    # (4 rows, 64 keys) and (1 row, 64 keys) on the first rows; the last step's wider rows replaced the
    # storage, so both were dropped and (4 rows, 128 keys) captured on the new one.
    assert [key[:3] for key in cache.keys()] == [("decode", 4, 128)]
    assert (cache.captures, cache.replays, cache.evictions, cache.failures) == (3, 6, 2, 0)


def test_the_engine_through_the_graph_path_acts_and_speaks_as_eagerly():
    """Engine cycles (vision, prefills, denoise, batched decode steps of two language tasks) with the
    graph path on direct calls give the eager engine's actions and the same tokens."""
    from engine_support import MEMORY, SPEECH, ByteIO, engine_config, observation

    from oxygen_ros.engine import Engine

    model = load_model("pi05_tiny", dtype=torch.float32, seed=7)
    tasks = [dict(SPEECH, max_new_tokens=5), dict(MEMORY, max_new_tokens=3)]

    def run():
        engine = Engine(model, ByteIO(model.config), engine_config("unified", tasks))
        chunks, texts = [], []
        for seq in range(4):
            result = engine.run_cycle(observation(seq), on_action=chunks.append)
            texts += [(e.task, e.seq, e.text) for e in result.text_events]
        texts += [(e.task, e.seq, e.text) for e in engine.flush()[0]]
        return [torch.as_tensor(c.actions) for c in chunks], texts

    eager_actions, eager_texts = run()
    model.enable_cuda_graphs(backend="direct")
    actions, texts = run()
    assert texts == eager_texts and any(text for _, _, text in texts)
    assert all(torch.allclose(a, b, atol=ATOL, rtol=0) for a, b in zip(eager_actions, actions))
    assert {key[0] for key in model.cuda_graphs.keys()} == {"vision", "denoise", "decode"}
