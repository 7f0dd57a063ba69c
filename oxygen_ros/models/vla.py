"""π0.5 / π0 as one PyTorch module with the split the engine needs.

Architecture and numerics follow the public reference implementations (openpi, LeRobot and transformers'
π0): SigLIP vision tower + linear projector, a Gemma VLM and a Gemma action expert with separate
weights joined by one attention per layer (Mixture-of-Transformers), flow matching with a fixed
S-step Euler loop from t = 1 (noise) to t = 0 with dt = -1/S.

Cached path (what the engine calls):

* :meth:`VLAModel.encode_images` — one SigLIP call for all cameras of all observations;
* :meth:`VLAModel.prefill` — appends left-packed prefix tokens to a :class:`KVCacheView`;
* :meth:`VLAModel.denoise` — action chunk from a read-only prefix view;
* :meth:`VLAModel.decode_step` — one batched language decode step.

Because the prefix never attends to the suffix, expert layer i at inference needs exactly the prefix
K/V of VLM layer i; that is why a prefix KV cache written by the VLM alone serves both the action
expert and language decoding.

The cache-free reference path the tests hold this one to (one joint forward over the unpacked,
masked prefix and the suffix with openpi's block masks) is :mod:`oxygen_ros.models.reference`.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from .config import VLAConfig
from .cpu_compile import CompiledVelocity
from .cuda_graphs import BACKENDS, GraphCache, batch_bucket, round_up
from .gemma import (AdaRMSNorm, AttentionMask, GemmaStack, RMSNorm, apply_rope, attention, rope_cos_sin,
                    rope_inverse_frequencies)
from . import cpu_fast_paths, native
from .kv_cache import KVCacheView
from .rtc import RTCGuidance, guidance_weight, guided_velocity
from .siglip import SiglipVisionTower


def left_pack(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid tokens of each row to the front, keeping their order.

    Args:
        x: ``[B, T, ...]``.
        valid: bool ``[B, T]``.

    Returns:
        ``(packed [B, max(lens), ...], lens int64 [B])``; entries beyond ``lens[b]`` are padding.
    """
    lens = valid.sum(1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    width = int(lens.max()) if lens.numel() else 0
    index = order[:, :width].reshape(*order.shape[:1], width, *([1] * (x.dim() - 2)))
    return torch.gather(x, 1, index.expand(-1, -1, *x.shape[2:])), lens


class _StaticDecodeStep:
    """The ``KVCacheView`` a replayed decode step attends through: fixed rows and key length, the new
    token's K/V written with static slot tensors (:meth:`VLAModel._decode_graphed`).

    ``source [rows]`` picks, for each padded row, the batch row whose K/V it writes (its own; row 0
    for the padding, whose slots are row 0's too), so duplicate slots receive identical values.
    """

    shared_prefix_len = 0

    def __init__(self, cached: torch.Tensor, page_slots: torch.Tensor, row_slots: torch.Tensor,
                 source: torch.Tensor, tensors, rows: int, length: int):
        self.cached_lens = cached
        self.new_lens = torch.ones_like(cached)
        self._page_slots, self._row_slots, self._source = page_slots, row_slots, source
        self._tensors, self._rows, self._length = tensors, rows, length

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._tensors
        for pool, dense, new in ((t.pool_k[layer], t.rows_k[layer], k), (t.pool_v[layer], t.rows_v[layer], v)):
            token = new[:, 0].to(pool.dtype).index_select(0, self._source)
            pool.view(-1, *token.shape[1:]).index_copy_(0, self._page_slots, token)
            dense.view(-1, *token.shape[1:]).index_copy_(0, self._row_slots, token)
        return (t.rows_k[layer][:self._rows, :self._length], t.rows_v[layer][:self._rows, :self._length])


def sinusoidal_time_embedding(t: torch.Tensor, width: int, min_period: float, max_period: float) -> torch.Tensor:
    """fp32 ``[N, width]`` = ``[sin, cos](2π t / period)`` for ``t [N]``.

    ``width/2`` periods log-spaced from ``min_period`` to ``max_period`` (openpi: 4e-3 to 4.0).
    """
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = t.to(torch.float32)[:, None] * (2.0 * math.pi / period)[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


class VLAModel(nn.Module):
    """π0.5 or π0 (per ``config.variant``) with cached inference (reference: :mod:`.reference`).

    Submodule names are the project's own; :mod:`oxygen_ros.models.checkpoint` maps the openpi,
    LeRobot and transformers layouts onto them. Construct with random weights via
    :func:`oxygen_ros.models.checkpoint.load_model`.

    Args:
        config: the architecture.
    """

    def __init__(self, config: VLAConfig):
        super().__init__()
        c = self.config = config
        self.vision_tower = SiglipVisionTower(c.vision_width, c.vision_mlp_dim, c.vision_num_layers,
                                              c.vision_num_heads, c.image_size, c.patch_size, c.vision_eps)
        self.projector = nn.Linear(c.vision_width, c.vlm_width)
        self.token_embedding = nn.Embedding(c.vocab_size, c.vlm_width)
        self.vlm = GemmaStack(c.vlm_num_layers, c.vlm_width, c.vlm_mlp_dim, c.num_heads, c.num_kv_heads,
                              c.head_dim, c.rms_eps)
        is_pi05 = c.variant == "pi05"
        self.expert = GemmaStack(c.vlm_num_layers, c.expert_width, c.expert_mlp_dim, c.num_heads,
                                 c.num_kv_heads, c.head_dim, c.rms_eps,
                                 cond_dim=c.expert_width if is_pi05 else None)
        self.action_in_proj = nn.Linear(c.action_dim, c.expert_width)
        self.action_out_proj = nn.Linear(c.expert_width, c.action_dim)
        if is_pi05:
            self.time_mlp_in = nn.Linear(c.expert_width, c.expert_width)
            self.time_mlp_out = nn.Linear(c.expert_width, c.expert_width)
        else:
            self.state_proj = nn.Linear(c.action_dim, c.expert_width)
            self.action_time_mlp_in = nn.Linear(2 * c.expert_width, c.expert_width)
            self.action_time_mlp_out = nn.Linear(c.expert_width, c.expert_width)
        self.register_buffer("rope_inv_freq", rope_inverse_frequencies(c.head_dim, c.rope_theta), persistent=False)
        self._embed_scale = math.sqrt(c.vlm_width)
        self._graphs: GraphCache | None = None
        self._prefix_bucket = 64
        # Keep the fp32 copy of a bf16 LM head between decode steps (_lm_logits): None = on CUDA only.
        self.keep_lm_head_fp32: bool | None = None
        self._cpu_compile = None

    # ------------------------------------------------------------------ setup helpers

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the matmul weights (norm parameters stay fp32)."""
        return self.projector.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.projector.weight.device

    def to_dtype(self, dtype: torch.dtype) -> "VLAModel":
        """Cast weights to ``dtype`` (fp32 or bf16) keeping every Gemma RMS/adaRMS norm in fp32.

        Raises:
            ValueError: dtype other than float32 / bfloat16.
        """
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.to(dtype)
        for module in self.modules():
            if isinstance(module, (RMSNorm, AdaRMSNorm)):
                module.float()
        self.rope_inv_freq = self.rope_inv_freq.float()
        return self

    def prepare_cpu_kernels(self) -> str:
        """Build (first time) and load the native CPU decode attention now, instead of at the first
        decode step; a no-op away from the CPU or below fp32. Returns its status
        (:func:`oxygen_ros.models.native.status`); never raises."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            native.load()
        return native.status()

    def enable_cuda_graphs(self, enabled: bool = True, prefix_bucket: int = 64, max_graphs: int = 16,
                           backend: str = "cuda") -> None:
        """Replay :meth:`denoise`, :meth:`encode_images` and :meth:`decode_step` from CUDA graphs on a
        CUDA device.

        Each distinct shape (images per vision call; batch bucket, prefix-length bucket, horizon,
        steps per denoise; batch bucket, key-length bucket and decode-row storage per decode step,
        over the engine's decode view) is captured on its first call (one eager run plus the capture, ~2x one
        call) and replayed afterwards with one launch (:mod:`oxygen_ros.models.cuda_graphs`). A
        denoise is padded (masked) up to its buckets: the prefix to a multiple of ``prefix_bucket``
        tokens, the batch to :func:`~oxygen_ros.models.cuda_graphs.batch_bucket` rows. Results equal
        the eager path's up to kernel summation order. Capturing allocates the graphs' static buffers
        and working memory in one private pool; weights must not be replaced afterwards (call again
        to drop the graphs after loading new weights).

        Args:
            enabled: False drops every graph and runs eagerly.
            prefix_bucket: denoise prefixes are padded (masked) up to a multiple of this many tokens.
            max_graphs: most graphs kept, least recently used dropped first.
            backend: ``"cuda"``: CUDA graphs, on a CUDA device only (no effect on the CPU);
                ``"direct"``: the same path (buckets, padding, static buffers, cache, replay
                selection) with each replay a direct call, on any device (tests and benches of the
                graph path without a GPU).

        Raises:
            ValueError: ``enabled`` not a bool, ``prefix_bucket`` or ``max_graphs`` not an int >= 1,
                unknown ``backend``.
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False, got {enabled!r}")
        for name, value in (("prefix_bucket", prefix_bucket), ("max_graphs", max_graphs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self._graphs = GraphCache(max_graphs, backend) if enabled else None
        self._prefix_bucket = prefix_bucket

    def enable_cpu_compile(self, enabled: bool = True) -> None:
        """Run each Euler step of :meth:`denoise` on the CPU (fp32, plain or guided) as a graph compiled by
        ``torch.compile`` (:mod:`oxygen_ros.models.cpu_compile`): compiled on the first call of each
        batch size and horizon (any prefix length), then replayed. Results equal the eager path's up
        to fp32 summation order. No effect on other devices or dtypes.

        Args:
            enabled: False drops the compiled graph and runs eagerly.

        Raises:
            ValueError: ``enabled`` not a bool.
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False, got {enabled!r}")
        self._cpu_compile = CompiledVelocity() if enabled else None

    @property
    def cpu_compile(self) -> CompiledVelocity | None:
        """The compiled denoising step's bookkeeping (compile seconds per shape, a failure) when
        enabled, else None."""
        return self._cpu_compile

    @torch.inference_mode()
    def warm_cpu_compile(self, batch: int = 1, horizon: int | None = None, prefix_len: int = 64,
                         guided: bool = False) -> float:
        """Compile the denoising step for ``batch`` x ``horizon`` now (a denoise of one step over a
        zero prefix of ``prefix_len`` tokens), instead of at the first control cycle, for the intra-op thread
        count in force and for one thread (the graphs are per count: :class:`~.cpu_compile.CompiledVelocity`);
        with ``guided`` also the graphs of real-time chunking's guided steps (one guided step). A no-op when
        :meth:`enable_cpu_compile` is off or the model is not fp32 on the CPU.

        Returns:
            seconds it took (0.0 when a no-op or already compiled).

        Raises:
            ValueError: ``batch``, ``horizon`` or ``prefix_len`` below 1.
        """
        c = self.config
        horizon = c.action_horizon if horizon is None else horizon
        if min(batch, horizon, prefix_len) < 1:
            raise ValueError(f"batch, horizon and prefix_len must be >= 1, got {batch}, {horizon}, {prefix_len}")
        compiled = self._cpu_compile
        if compiled is None or self.device.type != "cpu" or self.dtype != torch.float32:
            return 0.0
        start = time.perf_counter()
        kv = [torch.zeros(batch, prefix_len, c.num_kv_heads, c.head_dim, dtype=self.dtype)
              for _ in range(c.vlm_num_layers)]
        valid = torch.ones(batch, prefix_len, dtype=torch.bool)
        lens = torch.full((batch,), prefix_len, dtype=torch.long)
        noise = torch.zeros(batch, horizon, c.action_dim)
        state = torch.zeros(batch, c.action_dim, dtype=self.dtype) if c.variant == "pi0" else None
        compiled_any = False
        compiled.warming = True
        try:
            # The count in force and one thread: the two the engine's automatic count moves between on 2 cores.
            for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
                with cpu_fast_paths.fixed_threads(threads), cpu_fast_paths.threads_for(batch * horizon, self.device):
                    in_force = torch.get_num_threads()
                    if compiled.failed is None and in_force not in compiled.compiled_threads.get(
                            (False, batch, horizon), ()):
                        self._denoise_loop(kv, list(kv), valid, lens, noise, 1, state)
                        compiled_any = True
                    if guided and compiled.guided_failed is None and in_force not in compiled.compiled_threads.get(
                            (True, batch, horizon), ()):
                        guidance = RTCGuidance(torch.zeros(batch, horizon, c.action_dim),
                                               torch.ones(batch, horizon), 1.0)
                        self._denoise_guided(kv, list(kv), valid, lens, noise, 1, state, guidance)
                        compiled_any = True
        finally:
            compiled.warming = False
        return time.perf_counter() - start if compiled_any else 0.0

    @property
    def cuda_graphs(self) -> GraphCache | None:
        """The graph cache (capture and replay counters) when enabled, else None."""
        return self._graphs

    def _graphed(self) -> bool:
        """True when calls go through the graph cache (enabled, and its backend serves the device)."""
        return self._graphs is not None and self._graphs.serves(self.device)

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE frequencies, SigLIP position ids), e.g. after
        ``to_empty`` of a model built on the meta device."""
        self.rope_inv_freq = rope_inverse_frequencies(self.config.head_dim, self.config.rope_theta).to(self.device)
        embeddings = self.vision_tower.embeddings
        embeddings.position_ids = torch.arange(embeddings.num_positions, device=self.device)[None, :]

    def init_random(self, seed: int) -> "VLAModel":
        """Deterministic random weights for tests and tiny presets (same seed and device ⇒ same weights).

        Matrices get N(0, 1/fan_in); the token embedding N(0, 1); LayerNorm scales 1 + N(0, 0.1²);
        biases and Gemma norm parameters N(0, 0.1²), so that every path (including adaRMSNorm,
        zero-initialised in training) is exercised.
        """
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name == "token_embedding.weight":
                    std = 1.0
                elif param.dim() >= 2:
                    std = 1.0 / math.sqrt(param[0].numel())
                else:
                    std = 0.1
                sample = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=self.device) * std
                if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
                    sample += 1.0
                param.copy_(sample.to(param.dtype))
        return self

    # ------------------------------------------------------------------ embeddings

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """SigLIP + projector for a batch of camera images (one vision call).

        Args:
            pixels: float ``[N, 3, image_size, image_size]`` in [-1, 1] (see ``processing``).

        Returns:
            ``[N, num_image_tokens, vlm_width]`` in the model dtype (image tokens are not scaled).

        Raises:
            ValueError: wrong shape.
        """
        c = self.config
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"pixels must be [N, 3, {c.image_size}, {c.image_size}], got {tuple(pixels.shape)}")
        pixels = pixels.to(self.device, self.dtype)
        if self._graphed():
            call = self._graphs.get(("vision", pixels.shape[0]), self._encode, [pixels])
            if call is not None:
                call.inputs[0].copy_(pixels)
                return call.replay().clone()
        return self._encode(pixels)

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_tower(pixels))

    @torch.inference_mode()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings × sqrt(vlm_width): int64 ``[...]`` → ``[..., vlm_width]``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        self._check_token_ids(token_ids)
        return self._embed(token_ids)

    def _check_token_ids(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`embed_tokens` without the range check (no host synchronisation: graph-capturable)."""
        return self.token_embedding(token_ids.to(self.device)) * self._embed_scale

    @torch.inference_mode()
    def embed_prefix(self, image_tokens: torch.Tensor, camera_mask: torch.Tensor, token_ids: torch.Tensor,
                     token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-packed prefix embeddings: valid cameras' image tokens, then the valid prompt tokens.

        Args:
            image_tokens: ``[B, C, num_image_tokens, W]`` from :meth:`encode_images` (masked cameras:
                any values, e.g. zeros; they are dropped).
            camera_mask: bool ``[B, C]``, True = camera present.
            token_ids: int64 ``[B, L]`` prompt tokens.
            token_mask: bool ``[B, L]`` valid prompt tokens.

        Returns:
            ``(embeds [B, T, W], prefix_lens [B], image_lens [B])`` — int64 lengths; ``image_lens`` is
            the bidirectional image block size for the causal-prompt variant.
        """
        b, cams, n, w = image_tokens.shape
        text = self.embed_tokens(token_ids).to(image_tokens.dtype)
        x = torch.cat((image_tokens.reshape(b, cams * n, w), text), dim=1)
        image_valid = camera_mask.to(torch.bool).repeat_interleave(n, dim=1)
        valid = torch.cat((image_valid, token_mask.to(torch.bool)), dim=1)
        packed, lens = left_pack(x, valid.to(x.device))
        return packed, lens, image_valid.sum(1)

    # ------------------------------------------------------------------ cached path

    def bidirectional_lens(self, prefix_lens: torch.Tensor, image_lens: torch.Tensor) -> torch.Tensor:
        """``bidirectional_lens`` for a one-shot prefix prefill under ``config.prompt_mask``.

        ``'bidirectional'`` (openpi / LeRobot): the whole prefix; ``'causal'`` (OxyGen): the images only.
        Both arguments and the result are int64 ``[B]``.
        """
        return prefix_lens if self.config.prompt_mask == "bidirectional" else image_lens

    def _check_kv(self, kv: KVCacheView) -> None:
        if not isinstance(kv, KVCacheView):
            raise ValueError(f"kv must implement KVCacheView, got {type(kv).__name__}")

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, kv: KVCacheView, bidirectional_lens: torch.Tensor,
                need_logits: bool = True, return_hidden: bool = False):
        """Run the VLM over new left-packed tokens on top of a KV cache and write their K/V.

        Row b's new tokens are ``embeds[b, :kv.new_lens[b]]`` at positions ``kv.cached_lens[b] + i``.
        They attend to every valid cached token; among themselves the first ``bidirectional_lens[b]``
        form one bidirectional block and each later token is causal (sees everything before it and
        itself). openpi π0.5 prefix: ``bidirectional_lens = new_lens``; causal-prompt variant: the image
        count; a prompt fork on top of cached images: 0.

        Args:
            embeds: ``[B, T, vlm_width]`` (T >= max new_lens).
            kv: view with ``new_lens`` set; every layer is written.
            bidirectional_lens: int64 ``[B]``, ``0 <= bidirectional_lens <= new_lens``.
            need_logits: compute the LM logits of each row's last new token.
            return_hidden: also return the final-normed hidden state mean-pooled over each row's
                valid new tokens, ``[B, vlm_width]`` fp32 (memory-task embedding).

        Returns:
            logits fp32 ``[B, vocab]`` (None if not ``need_logits``), or ``(logits, pooled)`` if
            ``return_hidden``. Rows with ``new_lens == 0`` get meaningless values.

        Raises:
            ValueError: bad shapes or lengths.
        """
        self._check_kv(kv)
        if embeds.dim() != 3 or embeds.shape[-1] != self.config.vlm_width:
            raise ValueError(f"embeds must be [B, T, {self.config.vlm_width}], got {tuple(embeds.shape)}")
        b, t = embeds.shape[:2]
        new_lens = kv.new_lens.to(self.device)
        bidir = torch.as_tensor(bidirectional_lens, dtype=torch.long, device=self.device)
        if new_lens.shape != (b,) or bidir.shape != (b,):
            raise ValueError(f"new_lens {tuple(new_lens.shape)} and bidirectional_lens {tuple(bidir.shape)} "
                             f"must be [B] with B = {b}")
        if bool((new_lens > t).any()) or bool((bidir > new_lens).any()) or bool((bidir < 0).any()):
            raise ValueError(f"need 0 <= bidirectional_lens <= new_lens <= T={t}; "
                             f"got new_lens={new_lens.tolist()}, bidirectional_lens={bidir.tolist()}")
        idx = torch.arange(t, device=self.device)
        query, key = idx[None, :, None], idx[None, None, :]
        limit = torch.maximum(query, (bidir - 1)[:, None, None])
        new_mask = (key <= limit) & (key < new_lens[:, None, None])
        new_mask |= (query >= new_lens[:, None, None]) & (query == key)
        hidden = self._vlm_cached(embeds.to(self.dtype), kv, new_mask)
        last = (new_lens - 1).clamp(min=0)
        logits = None
        if need_logits:
            h_last = hidden[torch.arange(b, device=self.device), last]
            logits = self._lm_logits(self.vlm.norm(h_last)[0])
        if not return_hidden:
            return logits
        valid = (idx[None, :] < new_lens[:, None]).to(torch.float32)
        normed = self.vlm.norm(hidden)[0].float()
        pooled = (normed * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1.0)
        return logits, pooled

    @torch.inference_mode()
    def decode_step(self, token_ids: torch.Tensor, kv: KVCacheView) -> torch.Tensor:
        """One batched language decode step; writes each request's new K/V.

        Args:
            token_ids: int64 ``[B]``, the last token of each request, at position ``kv.cached_lens[b]``.
            kv: view with ``new_lens`` all 1; rows may have different prefixes and lengths.

        Returns:
            fp32 logits ``[B, vocab]`` of the next token (tied LM head). On the CPU a step of few
            requests runs on one intra-op thread (:func:`oxygen_ros.models.cpu_fast_paths.threads_for`).
            With :meth:`enable_cuda_graphs` and a view that offers ``step_tensors`` (the engine's decode
            view) the step is replayed from the graph of its batch and length buckets
            (:meth:`_decode_graphed`).

        Raises:
            ValueError: ``token_ids`` not ``[B]`` or ``new_lens`` not all 1.
        """
        self._check_kv(kv)
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be [B], got {tuple(token_ids.shape)}")
        if not bool((kv.new_lens == 1).all()):
            raise ValueError(f"decode_step needs new_lens all 1, got {kv.new_lens.tolist()}")
        self._check_token_ids(token_ids)
        with cpu_fast_paths.threads_for(token_ids.shape[0], self.device):
            if self._graphed() and hasattr(kv, "step_tensors"):
                return self._decode_graphed(token_ids, kv)
            return self._decode(self._embed(token_ids)[:, None, :], kv)

    def _decode(self, embeds: torch.Tensor, kv) -> torch.Tensor:
        """The decode step's forward over ``embeds [B, 1, W]``: fp32 logits ``[B, vocab]``."""
        new_mask = torch.ones(embeds.shape[0], 1, 1, dtype=torch.bool, device=self.device)
        hidden = self._vlm_cached(embeds, kv, new_mask)
        return self._lm_logits(self.vlm.norm(hidden[:, 0])[0])

    def _decode_graphed(self, token_ids: torch.Tensor, kv) -> torch.Tensor:
        """:meth:`decode_step` replayed from the graph of its batch bucket and key-length bucket.

        The batch is padded to :func:`batch_bucket` rows with copies of row 0 (its token, length and
        slots: a padded row writes row 0's own K/V into row 0's slots, so nothing else is touched) and
        the keys to a multiple of ``prefix_bucket`` (at most the decode rows' width; keys past a row's
        length are masked, and the rows hold finite values there). The graph writes the new token's
        K/V into the pool and the decode rows (:class:`~oxygen_ros.models.kv_cache.DecodeStepTensors`)
        as :meth:`KVCacheView.attend` would. A graph records the storage it was captured on, so its key
        holds the storage's address and shape; graphs of storage since replaced are dropped.
        """
        batch = token_ids.shape[0]
        rows = batch_bucket(batch)
        tensors = kv.step_tensors(rows)
        dense = tensors.rows_k[0]
        length = min(round_up(int(kv.cached_lens.max()) + 1, self._prefix_bucket), dense.shape[1])
        storage = (dense.data_ptr(), tuple(dense.shape), tensors.pool_k[0].data_ptr())
        self._graphs.discard(lambda key: key[0] == "decode" and key[3] != storage and key[3][2] == storage[2])
        key = ("decode", rows, length, storage)

        def step(ids, cached, page_slots, row_slots, source):
            view = _StaticDecodeStep(cached, page_slots, row_slots, source, tensors, rows, length)
            return self._decode(self._embed(ids)[:, None, :], view)

        device, pad = self.device, rows - batch

        def padded(x: torch.Tensor) -> torch.Tensor:
            x = x.to(device)
            return torch.cat((x, x[:1].expand(pad))) if pad else x

        source = torch.cat((torch.arange(batch, device=device), torch.zeros(pad, dtype=torch.long, device=device)))
        values = [padded(token_ids), padded(kv.cached_lens), padded(tensors.page_slots), padded(tensors.row_slots),
                  source]
        call = self._graphs.get(key, step, values)
        if call is None:
            return step(*values)[:batch]
        for buffer, value in zip(call.inputs, values):
            buffer.copy_(value)
        return call.replay()[:batch].clone()

    def _vlm_cached(self, x: torch.Tensor, kv: KVCacheView, new_mask: torch.Tensor) -> torch.Tensor:
        """VLM layers over new tokens ``x [B, T, W]`` with cached K/V; ``new_mask [B, T, T]`` among new.

        Positions, RoPE tables and the attention mask depend on the lengths only, so they are built
        once per forward; each layer hands its new K/V to ``kv.attend`` and attends over what it
        returns (cached tokens, then the new ones, per row).
        """
        b, t = x.shape[:2]
        cached = kv.cached_lens.to(self.device)
        new_lens = kv.new_lens.to(self.device)
        positions = cached[:, None] + torch.arange(t, device=self.device)[None, :]
        cos, sin = rope_cos_sin(positions, self.rope_inv_freq, x.dtype)
        mask = None
        for i, layer in enumerate(self.vlm.layers):
            q, k, v, _ = layer.project_qkv(x)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = kv.attend(i, k, v)
            if mask is None:
                mask = AttentionMask(self._cached_mask(cached, new_lens, new_mask, keys.shape[1]))
            x = layer.finish(x, attention(q, keys, values, mask, kv.shared_prefix_len), None)
        return x

    @staticmethod
    def _cached_mask(cached: torch.Tensor, new_lens: torch.Tensor, new_mask: torch.Tensor,
                     length: int) -> torch.Tensor:
        """bool ``[B, T, length]`` mask over the keys of :meth:`KVCacheView.attend`.

        Key j of row b is a cached token when ``j < cached[b]`` (always visible), new token
        ``j - cached[b]`` when below ``cached[b] + new_lens[b]`` (visible per ``new_mask``), else
        padding. Padded queries (``>= new_lens[b]``) see key 0 only, so no row is empty.
        """
        b, t = new_mask.shape[:2]
        keys = torch.arange(length, device=cached.device)[None, None, :]
        if t == 1:   # one new token (decode step): it sees every cached token and itself
            return (keys < (cached + new_lens)[:, None, None]) | (keys == 0)
        offset = keys - cached[:, None, None]
        in_new = (offset >= 0) & (offset < new_lens[:, None, None])
        among_new = torch.gather(new_mask, 2, offset.clamp(0, t - 1).expand(b, t, length))
        queries = torch.arange(t, device=cached.device)[None, :, None]
        padded = (queries >= new_lens[:, None, None]) & (keys == 0)
        return (offset < 0) | (in_new & among_new) | padded

    def _lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed ``h [B, W]`` through the tied embedding (fp32 matmul, so bf16
        rounding creates no ties over the vocabulary).

        On CUDA the fp32 copy of a bf16 embedding is kept between calls (2.1 GB for π0.5's
        257152 x 2048 vocabulary), instead of converting it at every decode step; on CPU it is
        converted per call, trading time for memory (``keep_lm_head_fp32`` True / False overrides
        the choice on any device). The copy is refreshed if the weight changes.
        """
        weight = self.token_embedding.weight
        if weight.dtype == torch.float32:
            return F.linear(h.float(), weight)
        keep = weight.device.type == "cuda" if self.keep_lm_head_fp32 is None else self.keep_lm_head_fp32
        if not keep:
            return F.linear(h.float(), weight.float())
        key = (weight.data_ptr(), weight._version)
        cached = getattr(self, "_lm_head_fp32", None)
        if cached is None or cached[0] != key:
            cached = (key, weight.float())
            self._lm_head_fp32 = cached
        return F.linear(h.float(), cached[1])

    @torch.inference_mode()
    def denoise(self, kv: KVCacheView, noise: torch.Tensor, num_steps: int | None = None,
                state: torch.Tensor | None = None, guidance: RTCGuidance | None = None) -> torch.Tensor:
        """Flow-matching action chunk from a cached prefix (never writes ``kv``).

        Euler from t = 1 to 0, ``x ← x + dt · v(x, t)`` with ``dt = -1/S`` for a fixed ``S`` steps
        (docs/models.md, "Flow matching"). Action tokens sit at positions ``cached_lens + [0..H-1]`` (π0: the state
        token at ``cached_lens``, actions after it) and attend to every valid prefix token and to each
        other. The prefix K/V of all layers is read once, before the loop. With
        :meth:`enable_cuda_graphs` on a CUDA device the loop is replayed from a CUDA graph; on the
        CPU a loop of few action rows runs on one intra-op thread
        (:func:`oxygen_ros.models.cpu_fast_paths.threads_for`).

        Args:
            kv: read-only view of the prefix (``new_lens`` all 0).
            noise: ``[B, H, action_dim]`` standard normal sample x_1.
            num_steps: S (default ``config.num_steps``).
            state: ``[B, action_dim]`` normalised, padded state; required for π0, ignored by π0.5
                (its state is in the prompt) — passing one to π0.5 raises.
            guidance: real-time chunking's inpainting guidance toward the chunks in flight
                (:mod:`oxygen_ros.models.rtc`); None, β = 0 or all-zero weights: plain denoising. A
                guided call takes a vector-Jacobian product through the action expert per step (about
                three forward passes' work), eagerly by autograd or, with :meth:`enable_cpu_compile`, in one
                compiled graph per step; never from a CUDA graph.

        Returns:
            fp32 ``[B, H, action_dim]`` normalised actions x_0.

        Raises:
            ValueError: bad shapes, num_steps < 1, state missing (π0) or given (π0.5), guidance of
                another shape.
        """
        self._check_kv(kv)
        c = self.config
        steps = c.num_steps if num_steps is None else int(num_steps)
        if steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {steps}")
        batch = kv.cached_lens.shape[0]
        if noise.dim() != 3 or noise.shape[2] != c.action_dim or noise.shape[0] != batch:
            raise ValueError(f"noise must be [B={batch}, H, {c.action_dim}], got {tuple(noise.shape)}")
        b, horizon = noise.shape[:2]
        self._check_state(state, b)
        prefix_k, prefix_v, prefix_valid = [], [], None
        for i in range(c.vlm_num_layers):
            k, v, valid = kv.read(i)
            prefix_k.append(k.to(self.device, self.dtype))
            prefix_v.append(v.to(self.device, self.dtype))
            prefix_valid = valid.to(self.device) if prefix_valid is None else prefix_valid
        cached_lens = kv.cached_lens.to(self.device)
        noise = noise.to(self.device, torch.float32)
        state = None if state is None else state.to(self.device, self.dtype)
        if guidance is not None:
            guidance.check(b, horizon, c.action_dim)
        with cpu_fast_paths.threads_for(b * horizon, self.device):     # guided or plain: one thread rule
            if guidance is not None and guidance.active:
                return self._denoise_guided(prefix_k, prefix_v, prefix_valid, cached_lens, noise, steps, state,
                                            guidance)
            if self._graphed():
                return self._denoise_graphed(prefix_k, prefix_v, prefix_valid, cached_lens, noise, steps, state)
            return self._denoise_loop(prefix_k, prefix_v, prefix_valid, cached_lens, noise, steps, state)

    def _denoise_guided(self, prefix_k, prefix_v, prefix_valid, cached_lens, noise, steps, state,
                        guidance: RTCGuidance) -> torch.Tensor:
        """:meth:`_denoise_loop` with RTC guidance, outside inference mode and under ``no_grad``: each guided
        step tracks the gradient with respect to the noisy actions itself (autograd eagerly, a function transform
        when compiled), and tensors saved for it may not be inference tensors (the prefix K/V are copied out of
        inference mode once). Outside inference mode the CPU fast paths without a derivative (native attention,
        prepacked and fused products) stay off."""
        with torch.inference_mode(False), torch.no_grad():
            guidance = RTCGuidance(guidance.target.to(self.device, torch.float32).clone(),
                                   guidance.weights.to(self.device, torch.float32).clone(),
                                   guidance.max_guidance_weight)
            return self._denoise_loop([k.clone() for k in prefix_k], [v.clone() for v in prefix_v],
                                      prefix_valid.clone(), cached_lens.clone(), noise.clone(), steps,
                                      None if state is None else state.clone(), guidance)

    def _denoise_graphed(self, prefix_k, prefix_v, prefix_valid, cached_lens, noise, steps, state):
        """:meth:`_denoise_loop` replayed from the graph of the call's buckets.

        The prefix is padded with invalid (masked) tokens up to a multiple of ``prefix_bucket`` and
        the batch with rows of no valid prefix token up to :func:`batch_bucket` rows; masked keys get
        zero weight and rows are independent, so the first B rows of the result are the unpadded
        loop's up to summation order. A replay writes the call's values into the graph's static
        buffers and marks the rest invalid (the padded K/V keep finite values of earlier calls).
        """
        layers = len(prefix_k)
        batch, length = prefix_valid.shape
        rows = batch_bucket(batch)
        bucket = round_up(max(length, 1), self._prefix_bucket)
        values = prefix_k + prefix_v + [prefix_valid, cached_lens, noise] + ([] if state is None else [state])

        prefix_inputs = 2 * layers + 1       # K, V of every layer and the validity: [B, L, ...]

        def example() -> list[torch.Tensor]:
            """The call's values padded to the buckets (capture, or an eager call after a failed one)."""
            out = []
            for i, x in enumerate(values):
                padded = x.new_zeros((rows, bucket, *x.shape[2:]) if i < prefix_inputs else (rows, *x.shape[1:]))
                padded[tuple(slice(0, n) for n in x.shape)] = x
                out.append(padded)
            return out

        def loop(*flat: torch.Tensor) -> torch.Tensor:
            return self._denoise_loop(list(flat[:layers]), list(flat[layers:2 * layers]), flat[2 * layers],
                                      flat[2 * layers + 1], flat[2 * layers + 2], steps,
                                      flat[2 * layers + 3] if state is not None else None)

        key = ("denoise", rows, bucket, noise.shape[1], steps, state is not None)
        call = self._graphs.get(key, loop, example)
        if call is None:
            return loop(*example())[:batch]
        call.inputs[2 * layers].zero_()
        for buffer, value in zip(call.inputs, values):
            buffer[tuple(slice(0, n) for n in value.shape)].copy_(value)
        return call.replay()[:batch].clone()

    def _denoise_loop(self, prefix_k: list[torch.Tensor], prefix_v: list[torch.Tensor],
                      prefix_valid: torch.Tensor, cached_lens: torch.Tensor, noise: torch.Tensor,
                      steps: int, state: torch.Tensor | None, guidance: RTCGuidance | None = None) -> torch.Tensor:
        """The Euler loop of :meth:`denoise` over prefix K/V already on the device.

        Args:
            prefix_k, prefix_v: per VLM layer ``[B, Lp, kv_heads, head_dim]`` in the model dtype.
            prefix_valid: bool ``[B, Lp]`` (False = padding, masked out).
            cached_lens: int64 ``[B]``, each row's prefix length (positions of the action tokens).
            noise: fp32 ``[B, H, action_dim]``.
            steps: S.
            state: π0's ``[B, action_dim]`` in the model dtype, else None.
            guidance: RTC guidance of each step's velocity (:func:`oxygen_ros.models.rtc.guided_velocity`);
                None: plain.

        Returns:
            fp32 ``[B, H, action_dim]``. Without guidance pure tensor code with no host synchronisation,
            so that :meth:`_denoise_graphed` can capture it.
        """
        c = self.config
        b, horizon = noise.shape[:2]
        dt = -1.0 / steps
        times = 1.0 + dt * torch.arange(steps, dtype=torch.float32, device=self.device)
        offset = 0
        if c.variant == "pi0":
            prefix_k, prefix_v, prefix_valid = self._state_token_kv(state, prefix_k, prefix_v, prefix_valid,
                                                                    cached_lens)
            offset = 1
        prefix_len = prefix_k[0].shape[1]
        mask = AttentionMask(torch.cat((prefix_valid[:, None, :].expand(b, horizon, prefix_len),
                                        torch.ones(b, horizon, horizon, dtype=torch.bool, device=self.device)), dim=2))
        positions = cached_lens[:, None] + offset + torch.arange(horizon, device=self.device)[None, :]
        cos, sin = rope_cos_sin(positions, self.rope_inv_freq, self.dtype)
        conditioning = self._time_conditioning(times)
        compiled = self._cpu_compile if self.device.type == "cpu" and self.dtype == torch.float32 else None
        if guidance is None:
            # Room for the action tokens' K/V after the prefix's, written by every step.
            keys = [torch.cat((k, k.new_zeros(b, horizon, *k.shape[2:])), dim=1) for k in prefix_k]
            values = [torch.cat((v, v.new_zeros(b, horizon, *v.shape[2:])), dim=1) for v in prefix_v]
            eager = self._velocity
        else:
            keys, values, eager = prefix_k, prefix_v, self._guided_velocity     # the action tokens' K/V appended
        velocity_fn = eager if compiled is None else compiled.velocity(self, guided=guidance is not None)
        # Eager: the mask wrapper, so that its layouts are built once per denoise; compiled: the tensor.
        step_mask = mask if velocity_fn == eager else mask.mask
        x = noise
        for step in range(steps):
            args = (x, self._step_conditioning(conditioning, step), keys, values, step_mask, cos, sin)
            if guidance is None:
                velocity = velocity_fn(*args)
            else:
                t = 1.0 + dt * step
                weight = guidance_weight(t, guidance.max_guidance_weight)
                t_w = [torch.tensor(value, dtype=torch.float32, device=self.device) for value in (t, weight)]
                velocity = velocity_fn(*args, *t_w, guidance.target, guidance.weights)
            x = x + dt * velocity.float()
        return x

    def _step_conditioning(self, conditioning: dict[str, object], step: int) -> dict[str, object]:
        """The tensors of :meth:`_time_conditioning` for Euler step ``step`` only (what one velocity needs)."""
        if "time_emb" in conditioning:
            return {"time_emb": conditioning["time_emb"][step]}
        return {"layers": [(mod_in[step], mod_post[step]) for mod_in, mod_post in conditioning["layers"]],
                "final": conditioning["final"][step]}

    def _velocity(self, x: torch.Tensor, cond: dict[str, object], keys: list[torch.Tensor],
                  values: list[torch.Tensor], mask: torch.Tensor | AttentionMask, cos: torch.Tensor,
                  sin: torch.Tensor, append: bool = False) -> torch.Tensor:
        """One Euler step's velocity ``v(x, t)``: the action expert over the action tokens of ``x``
        (fp32 ``[B, H, action_dim]``) attending to the prefix K/V.

        Args:
            cond: :meth:`_step_conditioning` of the step.
            keys, values: per layer ``[B, P + H, kv_heads, head_dim]``, the P prefix tokens' K/V, then room
                for the action tokens' (written here); with ``append`` the P prefix tokens' only
                ``[B, P, kv_heads, head_dim]``, and the action tokens' are concatenated to them (nothing is
                written: what a function transform such as RTC's vector-Jacobian product needs).
            mask: bool ``[B, H, P + H]`` (or its :class:`AttentionMask`).
            cos, sin: the action tokens' RoPE tables ``[B, H, 1, head_dim]``.
            append: see ``keys``.

        Returns:
            ``[B, H, action_dim]`` in the model dtype. Pure tensor code of fixed shapes (no host
            synchronisation), so that it can be captured (CUDA graphs) or compiled (:mod:`.cpu_compile`).
        """
        attention_mask = mask if isinstance(mask, AttentionMask) else AttentionMask(mask)
        prefix_len = keys[0].shape[1] - (0 if append else x.shape[1])
        tokens = self.action_in_proj(x.to(self.dtype))
        if "time_emb" in cond:
            emb = cond["time_emb"].expand_as(tokens)
            tokens = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat((tokens, emb), dim=-1))))
        layer_mods = cond.get("layers")
        for i, layer in enumerate(self.expert.layers):
            mod_in, mod_post = (None, None) if layer_mods is None else layer_mods[i]
            q, k, v, gate = layer.project_qkv(tokens, mod_in)
            if append:
                layer_keys = torch.cat((keys[i], apply_rope(k, cos, sin)), dim=1)
                layer_values = torch.cat((values[i], v), dim=1)
            else:
                layer_keys, layer_values = keys[i], values[i]
                layer_keys[:, prefix_len:] = apply_rope(k, cos, sin)
                layer_values[:, prefix_len:] = v
            attn = attention(apply_rope(q, cos, sin), layer_keys, layer_values, attention_mask)
            tokens = layer.finish(tokens, attn, gate, mod_post)
        return self.action_out_proj(self.expert.norm(tokens, cond.get("final"))[0])

    def _guided_velocity(self, x: torch.Tensor, cond: dict[str, object], keys: list[torch.Tensor],
                         values: list[torch.Tensor], mask: torch.Tensor | AttentionMask, cos: torch.Tensor,
                         sin: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        """One Euler step's velocity guided by real-time chunking (:func:`oxygen_ros.models.rtc.guided_velocity`):
        :meth:`_velocity` with ``append`` over the prefix K/V ``keys``, ``values`` (``[B, P, kv_heads,
        head_dim]`` per layer), and its vector-Jacobian product, in one piece of pure tensor code (compiled
        whole by :mod:`.cpu_compile`). ``t``, ``weight``: 0-dim fp32 π0 time and guidance weight; ``target``
        ``[B, H, action_dim]`` and ``weights`` ``[B, H]`` fp32. Returns fp32 ``[B, H, action_dim]``."""
        return guided_velocity(lambda x_t: self._velocity(x_t, cond, keys, values, mask, cos, sin, append=True).float(),
                               x, t, weight, target, weights)

    def _check_state(self, state: torch.Tensor | None, batch: int) -> None:
        if self.config.variant == "pi0":
            if state is None or tuple(state.shape) != (batch, self.config.action_dim):
                raise ValueError(f"π0 needs state [B={batch}, {self.config.action_dim}], got "
                                 f"{None if state is None else tuple(state.shape)}")
        elif state is not None:
            raise ValueError("π0.5 takes its state in the prompt; pass state=None")

    def _state_token_kv(self, state, prefix_k, prefix_v, prefix_valid, cached_lens):
        """π0: run the state token (its own block: sees the prefix and itself) through the expert once.

        Its hidden states do not depend on the noise or the time, so its K/V is computed once per
        denoise call and appended to the prefix K/V (openpi recomputes it every step: same numbers).
        """
        b = state.shape[0]
        x = self.state_proj(state.to(self.device, self.dtype))[:, None, :]
        cos, sin = rope_cos_sin(cached_lens[:, None], self.rope_inv_freq, self.dtype)
        valid = torch.cat((prefix_valid, torch.ones(b, 1, dtype=torch.bool, device=self.device)), dim=1)
        mask = valid[:, None, :]
        out_k, out_v = [], []
        for i, layer in enumerate(self.expert.layers):
            q, k, v, _ = layer.project_qkv(x)
            keys = torch.cat((prefix_k[i], apply_rope(k, cos, sin)), dim=1)
            values = torch.cat((prefix_v[i], v), dim=1)
            x = layer.finish(x, attention(apply_rope(q, cos, sin), keys, values, mask), None)
            out_k.append(keys)
            out_v.append(values)
        return out_k, out_v, valid

    def _time_conditioning(self, times: torch.Tensor) -> dict[str, object]:
        """Everything that depends on the Euler time only, for all S steps at once.

        π0.5: cond = swish(time_mlp_out(swish(time_mlp_in(sinusoid(t))))) and every adaRMSNorm's
        modulation ``[S, 3·We]``. π0: the sinusoidal embedding ``[S, We]`` for the action-time MLP.
        """
        c = self.config
        emb = sinusoidal_time_embedding(times, c.expert_width, c.min_period, c.max_period).to(self.dtype)
        if c.variant == "pi0":
            return {"time_emb": emb}
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))
        return {
            "layers": [(layer.input_layernorm.modulation(cond), layer.post_attention_layernorm.modulation(cond))
                       for layer in self.expert.layers],
            "final": self.expert.norm.modulation(cond),
        }

    def _layer_modulation(self, conditioning, layer: int, step: int):
        if "layers" not in conditioning:
            return None, None
        mod_in, mod_post = conditioning["layers"][layer]
        return mod_in[step], mod_post[step]

    def _final_modulation(self, conditioning, step: int):
        return conditioning["final"][step] if "final" in conditioning else None

    def _action_tokens(self, x: torch.Tensor, conditioning, step: int) -> torch.Tensor:
        """Expert input tokens ``[B, H, We]`` for noisy actions ``x [B, H, 32]`` at Euler step ``step``.

        π0.5: ``action_in_proj(x)``; π0: ``mlp_out(swish(mlp_in([action_in_proj(x), time_emb])))``.
        """
        tokens = self.action_in_proj(x.to(self.dtype))
        if "time_emb" not in conditioning:
            return tokens
        emb = conditioning["time_emb"][step].expand_as(tokens)
        return self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat((tokens, emb), dim=-1))))
