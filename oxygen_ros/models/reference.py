"""The cache-free reference path of :class:`oxygen_ros.models.vla.VLAModel`: a test oracle.

The cached path (prefill into a KV cache, denoise and decode steps reading it, left-packed prefixes)
is what the engine runs; this module computes the same outputs the way the public reference
implementations (openpi, LeRobot) do, with no cache and no packing, so the tests can hold the cached
path to it: one joint Mixture-of-Transformers forward over the (unpacked, masked) prefix and the
suffix, with openpi's block masks (``cumsum`` of block starts, :func:`block_mask`) and positions
(``cumsum(valid) - 1``).

* :func:`reference_actions` — an action chunk, one joint forward per Euler step;
* :func:`reference_logits` — the LM logits of each row's last valid prefix token;
* :func:`reference_generate` — greedy decoding that re-runs the whole sequence per token.

Every function takes the model first and runs under ``torch.inference_mode``; it reads the model's
weights and its time-conditioning helpers, never its caches.
"""

from __future__ import annotations

import torch

from .gemma import AttentionMask, apply_rope, attention, rope_cos_sin
from .vla import VLAModel


def block_mask(valid: torch.Tensor, block_start: torch.Tensor) -> torch.Tensor:
    """openpi prefix-LM mask: token i attends to valid j iff ``blocks[j] <= blocks[i]``.

    Args:
        valid: bool ``[B, T]``.
        block_start: bool ``[B, T]``; True where a token starts a new block (openpi's ``ar_mask``).

    Returns:
        bool ``[B, T, T]``. Rows of invalid queries attend to themselves only (never read).
    """
    blocks = torch.cumsum(block_start.to(torch.long), dim=1)
    mask = (blocks[:, None, :] <= blocks[:, :, None]) & valid[:, None, :] & valid[:, :, None]
    eye = torch.eye(valid.shape[1], dtype=torch.bool, device=valid.device)
    return mask | (eye[None] & ~valid[:, :, None])


def joint_forward(model: VLAModel, prefix: torch.Tensor, prefix_valid: torch.Tensor,
                   prefix_start: torch.Tensor, suffix: torch.Tensor | None, suffix_start: torch.Tensor | None,
                   conditioning=None, step: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One MoT forward over ``[prefix (VLM weights); suffix (expert weights)]`` with no cache.

    Returns the final-normed prefix hidden states ``[B, P, Wv]`` and suffix hidden states
    ``[B, Q, We]`` (None without a suffix).
    """
    b, p = prefix.shape[:2]
    q_len = 0 if suffix is None else suffix.shape[1]
    ones = torch.ones(b, q_len, dtype=torch.bool, device=model.device)
    valid = torch.cat((prefix_valid.to(model.device), ones), dim=1)
    starts = torch.cat((prefix_start.to(model.device),
                        ones if suffix is None else suffix_start.to(model.device).expand(b, q_len)), dim=1)
    mask = AttentionMask(block_mask(valid, starts))
    positions = torch.cumsum(valid.to(torch.long), dim=1) - 1
    cos, sin = rope_cos_sin(positions, model.rope_inv_freq, model.dtype)
    xp = prefix.to(model.device, model.dtype)
    xs = suffix
    for i, vlm_layer in enumerate(model.vlm.layers):
        qp, kp, vp, _ = vlm_layer.project_qkv(xp)
        q, k, v = qp, kp, vp
        if xs is not None:
            mod_in, mod_post = model._layer_modulation(conditioning, i, step)
            qs, ks, vs, gate = model.expert.layers[i].project_qkv(xs, mod_in)
            q, k, v = torch.cat((qp, qs), 1), torch.cat((kp, ks), 1), torch.cat((vp, vs), 1)
        attn = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask)
        xp = vlm_layer.finish(xp, attn[:, :p], None)
        if xs is not None:
            xs = model.expert.layers[i].finish(xs, attn[:, p:], gate, mod_post)
    out_s = None if xs is None else model.expert.norm(xs, model._final_modulation(conditioning, step))[0]
    return model.vlm.norm(xp)[0], out_s


def _prefix_starts(prefix_mask: torch.Tensor, prefix_block_start: torch.Tensor | None) -> torch.Tensor:
    if prefix_block_start is None:
        return torch.zeros_like(prefix_mask, dtype=torch.bool)
    if prefix_block_start.shape != prefix_mask.shape:
        raise ValueError(f"prefix_block_start {tuple(prefix_block_start.shape)} must match prefix_mask "
                         f"{tuple(prefix_mask.shape)}")
    return prefix_block_start.to(torch.bool)


@torch.inference_mode()
def reference_actions(model: VLAModel, prefix_embeds: torch.Tensor, prefix_mask: torch.Tensor,
                      noise: torch.Tensor, num_steps: int | None = None, state: torch.Tensor | None = None,
                      prefix_block_start: torch.Tensor | None = None) -> torch.Tensor:
    """Cache-free action chunk: one joint prefix+suffix forward per Euler step (openpi masks).

    Args:
        prefix_embeds: ``[B, P, vlm_width]``, valid tokens anywhere (need not be packed).
        prefix_mask: bool ``[B, P]`` valid prefix tokens.
        noise, num_steps, state: as in :meth:`VLAModel.denoise`.
        prefix_block_start: bool ``[B, P]`` openpi ``ar_mask`` of the prefix (True = token starts a
            new block); None = one bidirectional prefix block.

    Returns:
        fp32 ``[B, H, action_dim]``.
    """
    c = model.config
    steps = c.num_steps if num_steps is None else int(num_steps)
    if steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {steps}")
    b, horizon = noise.shape[:2]
    model._check_state(state, b)
    starts = _prefix_starts(prefix_mask, prefix_block_start)
    dt = -1.0 / steps
    conditioning = model._time_conditioning(1.0 + dt * torch.arange(steps, dtype=torch.float32,
                                                                   device=model.device))
    # openpi ar_mask of the suffix: π0.5 [1, 0, ...]; π0 [1 (state), 1, 0, ...].
    suffix_start = torch.zeros(horizon + (c.variant == "pi0"), dtype=torch.bool, device=model.device)
    suffix_start[: 1 + (c.variant == "pi0")] = True
    x = noise.to(model.device, torch.float32)
    for step in range(steps):
        tokens = model._action_tokens(x, conditioning, step)
        if c.variant == "pi0":
            tokens = torch.cat((model.state_proj(state.to(model.device, model.dtype))[:, None, :], tokens), dim=1)
        _, out = joint_forward(model, prefix_embeds, prefix_mask, starts, tokens, suffix_start[None],
                                     conditioning, step)
        x = x + dt * model.action_out_proj(out[:, -horizon:]).float()
    return x


@torch.inference_mode()
def reference_logits(model: VLAModel, prefix_embeds: torch.Tensor, prefix_mask: torch.Tensor,
                     prefix_block_start: torch.Tensor | None = None) -> torch.Tensor:
    """Cache-free fp32 logits ``[B, vocab]`` of each row's last valid prefix token (found by mask)."""
    starts = _prefix_starts(prefix_mask, prefix_block_start)
    hidden, _ = joint_forward(model, prefix_embeds, prefix_mask, starts, None, None)
    mask = prefix_mask.to(model.device, torch.bool)
    last = (torch.arange(mask.shape[1], device=model.device)[None, :] * mask).argmax(1)
    return model._lm_logits(hidden[torch.arange(mask.shape[0], device=model.device), last])


@torch.inference_mode()
def reference_generate(model: VLAModel, prefix_embeds: torch.Tensor, prefix_mask: torch.Tensor,
                       max_new_tokens: int, prefix_block_start: torch.Tensor | None = None) -> torch.Tensor:
    """Cache-free greedy decoding: re-runs the whole sequence for every new token.

    Decoded tokens are appended after the (possibly padded) prefix, each as its own causal block.

    Returns:
        int64 ``[B, max_new_tokens]`` argmax tokens (no early stop at EOS).
    """
    embeds = prefix_embeds.to(model.device, model.dtype)
    mask = prefix_mask.to(model.device, torch.bool)
    starts = _prefix_starts(mask, prefix_block_start).to(model.device)
    out = []
    for _ in range(max_new_tokens):
        token = reference_logits(model, embeds, mask, starts).argmax(-1)
        out.append(token)
        embeds = torch.cat((embeds, model.embed_tokens(token)[:, None, :].to(embeds.dtype)), dim=1)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        starts = torch.cat((starts, torch.ones_like(starts[:, :1])), dim=1)
    return torch.stack(out, dim=1)
