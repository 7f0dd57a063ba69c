"""The roofline bench (oxygen_ros/bench/roofline.py): its analytic counts and one end-to-end run.

No test here looks at a time: the counts are checked by hand and against torch's own FLOP counter
on the model, and the run only has to produce consistent figures.
"""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from oxygen_ros.bench import roofline
from oxygen_ros.bench.cpu_paths import cpu_kernel_choice
from oxygen_ros.models import DenseKVCache, VLAConfig, cpu_fast_paths
from oxygen_ros.models.vla import VLAModel

# One VLM layer, 2 query heads on 1 K/V head of 4, width 8, MLP 16; 28 px images in 14 px patches
# (4 image tokens per camera).
HAND = VLAConfig(name="hand", variant="pi05", prompt_mask="bidirectional", vision_width=8, vision_num_layers=1,
                 vision_num_heads=2, vision_mlp_dim=16, vlm_width=8, vlm_mlp_dim=16, vlm_num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=4, expert_width=8, expert_mlp_dim=16, vocab_size=10, action_horizon=2,
                 max_token_len=8, image_size=28, tokenizer="tiny")


def test_prefill_and_decode_counts_match_a_hand_count():
    phases = {p.name: p for p in roofline.count_phases(HAND, cameras=1, prompt_len=2, steps=1, batch=3)}
    prefill = phases["prefill"]
    # T = 1 camera x 4 + 2 = 6 tokens. q 8->8, k 8->4, v 8->4, o 8->8: 2*6*(64+32+32+64) = 2304;
    # gate, up 8->16, down 16->8: 2*6*3*128 = 4608; attention 4 * 2 heads * 6 * 6 * 4 = 1152.
    assert prefill.terms == {"q/k/v/o": 2304, "mlp": 4608, "attention": 1152}
    assert prefill.flop == 8064
    assert prefill.weight_bytes == 4 * (64 + 32 + 32 + 64 + 3 * 128)              # every weight once, fp32
    assert prefill.kv_bytes == 4 * (2 * 6 * 4 + 2 * 6 * 4)                        # K/V read + written
    # Inputs and outputs of the 7 matmuls (6 rows each) and q in / out of the attention.
    activations = 6 * ((8 + 8) + (8 + 4) * 2 + (8 + 8) + (8 + 16) * 2 + (16 + 8)) + 2 * 6 * 2 * 4
    assert prefill.activation_bytes == 4 * activations
    assert prefill.bytes == prefill.weight_bytes + prefill.kv_bytes + prefill.activation_bytes
    assert prefill.intensity == pytest.approx(8064 / prefill.bytes)
    decode = phases["decode x3"]
    # 3 rows: projections and MLP 2*3*576 = 3456; attention over 6 + 1 keys: 4*3*2*1*7*4 = 672;
    # LM head 8 -> 10 vocabulary: 2*3*8*10 = 480.
    assert decode.terms == {"q/k/v/o": 1152, "mlp": 2304, "attention": 672, "lm head": 480}
    assert decode.kv_bytes == 4 * (2 * 3 * 7 * 4 + 2 * 3 * 4)                    # each row's K/V + new K/V
    frame = phases["frame"]
    assert frame.flop == sum(phases[n].flop for n in ("vision", "prefill", "denoise", "decode x3"))
    assert [p.name for p in phases.values()] == ["vision", "prefill", "denoise", "decode x1", "decode x3", "frame"]


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        roofline.count_phases(HAND, cameras=0, prompt_len=2, steps=1, batch=1)
    with pytest.raises(ValueError):
        roofline.count_phases(HAND, cameras=1, prompt_len=2, steps=1, batch=1, dtype="float16")


def test_counts_agree_with_torchs_flop_counter_on_the_model():
    """torch's FlopCounterMode over the model's own calls (plain torch paths, so every matmul is an
    aten op it knows) finds the counted FLOP; on the CPU it does not count SDPA, so where SDPA serves
    (vision, prefill) the attention term may be missing from its total."""
    config = HAND.replace(vision_width=16, vision_mlp_dim=32, vlm_width=16, vlm_mlp_dim=32, vlm_num_layers=2,
                          head_dim=16, expert_width=16, expert_mlp_dim=32, vocab_size=40, action_horizon=3,
                          max_token_len=20)
    counts = {p.name: p for p in roofline.count_phases(config, cameras=2, prompt_len=3, steps=2, batch=3)}
    model = VLAModel(config).init_random(0)

    def counted(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    def check(name, found):
        count = counts[name]
        assert found in (count.flop, count.flop - count.terms["attention"]), (name, found, count.terms)

    with cpu_kernel_choice(True):
        pixels = torch.rand(2, 3, 28, 28)
        check("vision", counted(lambda: model.encode_images(pixels)))
        embeds, lens, _ = model.embed_prefix(model.encode_images(pixels)[None], torch.ones(1, 2, dtype=torch.bool),
                                             torch.randint(3, 40, (1, 3)), torch.ones(1, 3, dtype=torch.bool))
        kv = DenseKVCache(2, 1, 1, 16)
        check("prefill", counted(lambda: model.prefill(embeds, kv.begin(lens), lens, need_logits=False)))
        kv.commit()
        check("denoise", counted(lambda: model.denoise(kv.begin(None), torch.randn(1, 3, 32), num_steps=2)))
        rows = DenseKVCache(2, 3, 1, 16)
        row_lens = lens.expand(3).contiguous()
        model.prefill(embeds.expand(3, -1, -1), rows.begin(row_lens), row_lens, need_logits=False)
        rows.commit()
        ones = torch.ones(3, dtype=torch.long)
        check("decode x3", counted(lambda: model.decode_step(torch.tensor([5, 6, 7]), rows.begin(ones))))


def test_the_bench_runs_end_to_end_at_tiny_dims(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    result = roofline.main(["--cameras", "1", "--prompt-len", "4", "--num-denoise-steps", "2", "--batch", "2", "--rounds", "1",
                            "--gemm-n", "64", "--stream-mib", "1", "--compare", "--out", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["phases"] == json.loads(json.dumps(result["phases"]))
    names = [r["phase"] for r in result["phases"]]
    phases = ["vision", "prefill", "denoise", "decode x1", "decode x2", "frame"]
    assert names == [label for name in phases for label in (name, f"{name} [before]")]
    # --compare's earlier paths are switched back on after the run.
    assert cpu_fast_paths.fused_projections_in_use() and cpu_fast_paths.one_thread_for_small_forwards_in_use()
    assert result["prefix"] == 256 + 4
    ceilings = result["ceilings"]
    assert ceilings["gemm_flop_per_s"] > 0 and min(ceilings["stream_bytes_per_s"].values()) > 0
    # The GEMM ceiling is the faster route: torch.mm and, where oneDNN's linear ops exist, the prepacked one.
    routes = ceilings["gemm_flop_per_s_by_route"]
    assert set(routes) == ({"mm", "packed"} if cpu_fast_paths.packed_weights_available() else {"mm"})
    assert ceilings["gemm_flop_per_s"] == max(routes.values())
    for row in result["phases"]:
        assert row["phase"] in printed
        assert row["flop"] > 0 and row["bytes"] > 0 and row["seconds"] > 0
        assert row["flop_per_s"] == pytest.approx(row["flop"] / row["seconds"])
        assert row["pct_gemm"] == pytest.approx(100 * row["flop_per_s"] / ceilings["gemm_flop_per_s"])
        assert row["bound"] == ("compute" if row["intensity"] >= ceilings["balance_flop_per_byte"] else "bandwidth")
        assert row["pct_attainable"] >= row["pct_gemm"]
    assert "machine:" in printed and "ceilings: GEMM" in printed


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        roofline.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        roofline.main(["--stream-mib", "-1"])


@pytest.mark.slow
def test_the_bench_compares_the_compiled_denoising_step(capsys):
    result = roofline.main(["--cameras", "1", "--prompt-len", "4", "--num-denoise-steps", "2", "--batch", "2", "--rounds", "1",
                            "--gemm-n", "64", "--stream-mib", "1", "--compiled", "--guided"])
    names = [r["phase"] for r in result["phases"]]
    assert names == ["vision", "prefill", "denoise", "denoise [compiled]", "decode x1", "decode x2", "frame",
                     "frame [compiled]"]
    assert list(result["compile_seconds"]) == ["batch 1, horizon 10"]
    out = capsys.readouterr().out
    assert "denoising step compiled for batch 1, horizon 10" in out
    # the guided loops (real-time chunking) eager and compiled: timed, not counted
    assert list(result["timed_only"]) == ["denoise [guided]", "denoise [guided, compiled]"]
    assert all(seconds > 0 for seconds in result["timed_only"].values())
    assert "denoise [guided, compiled]" in out and "timed only" in out
