"""Cascade attention (a prefix shared by all rows, attended once) equals plain attention."""

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
