"""Model-layer benchmark: vision encoding, prefix prefill, denoising and batched decode-step latency.

Run ``oxygen-bench-model`` (or ``python -m oxygen_ros.bench.model_bench``). Defaults: the tiny presets
on CPU in fp32 with a 2-camera observation; ``--device cuda --dtype bfloat16 --presets pi05 pi0`` for the
full presets on a GPU (random weights: timing does not depend on the values). Times are medians over
``--repeats`` runs after ``--warmup`` runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from oxygen_ros.bench.cpu_paths import cpu_kernel_choice, cpu_kernels
from oxygen_ros.models import PRESETS, DenseKVCache, get_preset, load_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def bench_preset(preset: str, device: str, dtype: str, cameras: int, prompt_len: int, steps: int,
                 decode_batch: int, warmup: int, repeats: int, cuda_graphs: bool = True,
                 graph_backend: str = "cuda") -> dict[str, float]:
    """Median latencies (ms) of one preset: ``vision``, ``prefill``, ``denoise``, ``cycle`` (all three
    for one observation) and ``decode_step`` (a batch of ``decode_batch`` requests). ``cuda_graphs``:
    vision and denoise replayed from CUDA graphs on a CUDA device (captured during the warm-up);
    ``graph_backend="direct"``: through the same graph path with direct calls, on any device."""
    model = load_model(preset, dtype=dtype, device=device)
    model.enable_cuda_graphs(cuda_graphs, backend=graph_backend)
    c, dev = model.config, model.device
    gen = torch.Generator(device=dev).manual_seed(0)
    pixels = torch.rand(cameras, 3, c.image_size, c.image_size, generator=gen, device=dev) * 2 - 1
    ids = torch.randint(3, c.vocab_size, (1, prompt_len), generator=gen, device=dev)
    noise = torch.randn(1, c.action_horizon, c.action_dim, generator=gen, device=dev)
    state = torch.zeros(1, c.action_dim, device=dev) if c.variant == "pi0" else None

    def vision():
        return model.encode_images(pixels)[None]

    images = vision()
    embeds, lens, image_lens = model.embed_prefix(images, torch.ones(1, cameras, dtype=torch.bool, device=dev),
                                                  ids, torch.ones(1, prompt_len, dtype=torch.bool, device=dev))
    bidirectional = model.bidirectional_lens(lens, image_lens)

    def prefill():
        kv = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim, model.dtype, dev)
        model.prefill(embeds, kv.begin(lens), bidirectional, need_logits=False)
        kv.commit()
        return kv

    kv = prefill()

    def denoise():
        return model.denoise(kv.begin(None), noise, num_steps=steps, state=state)

    def cycle():
        img = vision()
        emb, n, n_img = model.embed_prefix(img, torch.ones(1, cameras, dtype=torch.bool, device=dev), ids,
                                           torch.ones(1, prompt_len, dtype=torch.bool, device=dev))
        cache = DenseKVCache(c.vlm_num_layers, 1, c.num_kv_heads, c.head_dim, model.dtype, dev)
        model.prefill(emb, cache.begin(n), model.bidirectional_lens(n, n_img), need_logits=False)
        cache.commit()
        return model.denoise(cache.begin(None), noise, num_steps=steps, state=state)

    batch_embeds = embeds.expand(decode_batch, -1, -1)
    batch_lens = lens.expand(decode_batch).contiguous()
    decode_kv = DenseKVCache(c.vlm_num_layers, decode_batch, c.num_kv_heads, c.head_dim, model.dtype, dev)
    model.prefill(batch_embeds, decode_kv.begin(batch_lens), batch_lens, need_logits=False)
    decode_kv.commit()
    tokens = torch.full((decode_batch,), 5, dtype=torch.long, device=dev)
    ones = torch.ones(decode_batch, dtype=torch.long)

    def decode_step():
        # Not committed: every repeat decodes at the same position, so the cache does not grow.
        return model.decode_step(tokens, decode_kv.begin(ones))

    return {name: _median_ms(fn, dev, warmup, repeats)
            for name, fn in (("vision", vision), ("prefill", prefill), ("denoise", denoise), ("cycle", cycle),
                             ("decode_step", decode_step))}


def _graph_mode(args: argparse.Namespace, device: torch.device) -> str:
    """The header's word for how vision and denoise run: eager, cuda_graphs, or direct_graph_path."""
    if not args.cuda_graphs:
        return " eager"
    if args.graph_backend == "direct":
        return " direct_graph_path"
    return " cuda_graphs" if device.type == "cuda" else " eager"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="oxygen-bench-model", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["pi05_tiny", "pi0_tiny"], choices=sorted(PRESETS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=48, help="prompt tokens (π0.5 with state: ~45 tiny)")
    parser.add_argument("--num-denoise-steps", type=int, default=10, help="Euler steps S (num_denoise_steps)")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on CUDA, replay vision and denoise from CUDA graphs (cuda_graphs; --no-cuda-graphs: "
                             "eager)")
    parser.add_argument("--graph-backend", choices=["cuda", "direct"], default="cuda",
                        help="'direct': vision and denoise through the CUDA-graph path (buckets, static buffers, "
                             "replay selection) with direct calls instead of capture and replay, on any device")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="on the CPU: no native decode attention and no oneDNN-packed weights "
                             "(the plain torch / MKL paths, for A/B)")
    args = parser.parse_args(argv)
    if min(args.cameras, args.prompt_len, args.num_denoise_steps, args.decode_batch, args.repeats) < 1:
        parser.error("--cameras, --prompt-len, --num-denoise-steps, --decode-batch and --repeats must be >= 1")
    if args.warmup < 0 or args.threads < 0:
        parser.error("--warmup and --threads must be >= 0")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch ({torch.__version__}) has no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    with cpu_kernel_choice(args.torch_kernels):
        paths = cpu_kernels(device, get_preset(args.presets[0]), args.torch_kernels) if args.dtype == "float32" \
            else None
        print(f"device={args.device} dtype={args.dtype} cameras={args.cameras} prompt={args.prompt_len} "
              f"S={args.num_denoise_steps} decode_batch={args.decode_batch} threads={torch.get_num_threads()}"
              f"{_graph_mode(args, device)}"
              f"{f' ({paths})' if paths else ''}")
        print(f"{'preset':<12}{'vision':>10}{'prefill':>10}{'denoise':>10}{'cycle':>10}{'decode':>10}   (ms, median)")
        for preset in args.presets:
            r = bench_preset(preset, args.device, args.dtype, args.cameras, args.prompt_len, args.num_denoise_steps,
                             args.decode_batch, args.warmup, args.repeats, args.cuda_graphs, args.graph_backend)
            print(f"{preset:<12}{r['vision']:>10.1f}{r['prefill']:>10.1f}{r['denoise']:>10.1f}"
                  f"{r['cycle']:>10.1f}{r['decode_step']:>10.2f}")


if __name__ == "__main__":
    main()
