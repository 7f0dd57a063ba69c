"""Attention paths against a naive softmax: the few-query, SDPA and cascade (shared-prefix) paths."""

import torch

from oxygen_ros.models.gemma import attention


def test_cascade_attention_matches_plain_attention():
    torch.manual_seed(0)
    for heads, b, length, prefix in ((4, 30, 600, 560), (4, 5, 50, 17), (8, 3, 20, 1), (4, 2, 10, 9)):
        q = torch.randn(b, 1, heads, 64)
        k = torch.randn(1, length, 1, 64).expand(b, length, 1, 64).clone()
        v = torch.randn(1, length, 1, 64).expand(b, length, 1, 64).clone()
        k[:, prefix:], v[:, prefix:] = torch.randn(2, b, length - prefix, 1, 64)
        lens = torch.randint(prefix + 1, length + 1, (b,))
        mask = torch.arange(length)[None, None, :] < lens[:, None, None]
        plain, cascade = attention(q, k, v, mask), attention(q, k, v, mask, shared_prefix=prefix)
        assert cascade.shape == plain.shape == (b, 1, heads * 64)
        torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)


def naive_attention(q, k, v, mask):
    """fp64 softmax attention with K/V heads repeated for their query groups."""
    b, t, heads, hd = q.shape
    group = heads // k.shape[2]
    k, v = (x.double().repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    scores = q.double().transpose(1, 2) @ k.transpose(-1, -2) * hd ** -0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * hd)


def test_grouped_query_attention_with_several_kv_heads_matches_naive():
    torch.manual_seed(1)
    for t in (1, 40):   # a decode step (few queries) and a prefill (SDPA)
        q, k, v = torch.randn(3, t, 8, 32), torch.randn(3, 50, 2, 32), torch.randn(3, 50, 2, 32)
        mask = torch.rand(3, t, 50) < 0.7
        mask[..., 0] = True
        torch.testing.assert_close(attention(q, k, v, mask).double(), naive_attention(q, k, v, mask),
                                   atol=1e-5, rtol=1e-5)
