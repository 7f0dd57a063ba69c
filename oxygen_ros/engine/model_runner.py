"""Batched model calls over paged KV: the only engine module that calls the model.

Like nano-vllm's ``model_runner.py``: it prepares the inputs of one batched forward (padded embeds,
the paged view), runs it, and commits the KV. It only executes: the pages a call appends into were
reserved by its caller (:meth:`KVCacheManager.reserve` / ``prepare_append``, under the scheduler's
charge accounting), and a view refuses a sequence without them. It also counts the work done (vision
calls, images encoded, prefilled tokens) so tests can assert what was shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from oxygen_ros.engine.kv_cache_manager import KVCacheManager, KVSequence
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.models.kv_cache import KVCacheView
from oxygen_ros.models.rtc import RTCGuidance


class ModelShape(Protocol):
    """The model configuration fields the engine reads (``oxygen_ros/models/config.py``)."""

    vlm_num_layers: int
    vlm_width: int
    num_kv_heads: int
    head_dim: int
    num_image_tokens: int
    prompt_mask: str              # "bidirectional" or "causal"
    eos_token_id: int
    action_horizon: int
    action_dim: int


class RunnerModel(Protocol):
    """What the runner (and the engine) call on a π0.5 / π0 model (``oxygen_ros/models/vla.py``).

    Optional: ``enable_cuda_graphs(enabled)`` with ``cuda_graphs`` (None when off),
    ``enable_cpu_compile(enabled)`` with ``cpu_compile`` (None when off) and ``warm_cpu_compile(guided=)``, and
    ``prepare_cpu_kernels()``; the runner uses them when the model has them.
    """

    config: ModelShape
    dtype: torch.dtype
    device: torch.device

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, 3, 224, 224]`` -> ``[N, num_image_tokens, W]``."""

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` -> ``[B, T, W]``."""

    def prefill(self, embeds: torch.Tensor, kv: KVCacheView, bidirectional_lens: torch.Tensor,
                need_logits: bool = True, return_hidden: bool = False):
        """Append ``embeds [B, T, W]`` to ``kv``; logits ``[B, V]`` (or None), and with
        ``return_hidden`` a ``(logits, pooled [B, W])`` pair."""

    def denoise(self, kv: KVCacheView, noise: torch.Tensor, num_steps: int,
                state: torch.Tensor | None = None, guidance: RTCGuidance | None = None) -> torch.Tensor:
        """Flow-matching actions ``[B, H, action_dim]`` from ``noise`` over the prefix in ``kv``
        (guided toward the chunks in flight when ``guidance`` is given)."""

    def decode_step(self, token_ids: torch.Tensor, kv: KVCacheView) -> torch.Tensor:
        """One token per row ``token_ids [B]`` appended to ``kv``; logits ``[B, V]``."""


@dataclass
class WorkCounters:
    """Work done by the model since the last reset (tests assert sharing with these)."""

    vision_calls: int = 0
    images_encoded: int = 0
    prefill_calls: int = 0
    prefilled_tokens: int = 0
    denoise_calls: int = 0
    decode_steps: int = 0
    decoded_tokens: int = 0


@dataclass
class PrefillRow:
    """One row of a batched prefill: new tokens appended to ``seq``.

    Attributes:
        seq: KV sequence that receives the tokens (already holding any cached prefix).
        embeds: ``[T, W]`` new-token embeddings.
        bidirectional_len: how many of the new tokens form one bidirectional block (the rest causal).
    """

    seq: KVSequence
    embeds: torch.Tensor
    bidirectional_len: int


class ModelRunner:
    """Runs encode / prefill / denoise / decode step for the engine.

    Args:
        model: the VLA (:class:`RunnerModel`).
        io: its :class:`~oxygen_ros.engine.model_io.ModelIO` (image pixels).
        manager: KV-cache manager of the engine's pool.
        cuda_graphs: on a CUDA device, switch the model's CUDA graphs on (True) or off (False) if
            it has them; the setting belongs to the model, so it holds for every runner that shares it.
        cpu_compile: on the CPU, switch the model's compiled denoising step on (True) or off (False) if it
            has one, and compile it now for a batch of one (a model setting too).
        guided: real-time chunking is on: with ``cpu_compile``, the guided steps' graph is compiled now too.
    """

    def __init__(self, model: RunnerModel, io: ModelIO, manager: KVCacheManager, cuda_graphs: bool = True,
                 cpu_compile: bool = False, guided: bool = False):
        self.model = model
        self.io = io
        self.manager = manager
        self.counters = WorkCounters()
        self.device = manager.pool.k[0].device
        if self.device.type == "cuda" and hasattr(model, "enable_cuda_graphs"):
            if cuda_graphs != (model.cuda_graphs is not None):
                model.enable_cuda_graphs(cuda_graphs)
        # Native CPU kernels build on first use (seconds, once per machine): build them now, at
        # engine construction, rather than inside the first control cycle that decodes.
        if self.device.type == "cpu" and hasattr(model, "prepare_cpu_kernels"):
            model.prepare_cpu_kernels()
        # Likewise the compiled denoising step: compiled here for one robot's denoise, not in a cycle.
        if self.device.type == "cpu" and hasattr(model, "enable_cpu_compile"):
            if cpu_compile != (model.cpu_compile is not None):
                model.enable_cpu_compile(cpu_compile)
            if cpu_compile:
                model.warm_cpu_compile(guided=guided)

    @torch.inference_mode()
    def encode(self, images: Sequence[np.ndarray], io: ModelIO | None = None) -> torch.Tensor:
        """One vision call for all ``images`` -> ``[N, num_image_tokens, W]``; N = 0 gives an empty
        tensor without a call. ``io``: whose ``images_to_pixels`` converts them (default the runner's)."""
        return self.encode_groups([(self.io if io is None else io, images)])[0]

    @torch.inference_mode()
    def encode_groups(self, groups: Sequence[tuple[ModelIO, Sequence[np.ndarray]]]) -> list[torch.Tensor]:
        """One vision call for the images of every group (a fleet: one group per robot, each converted
        to pixels by its own ``ModelIO``) -> per group ``[N_g, num_image_tokens, W]``, in order. No
        call when there are no images at all (empty tensors)."""
        pixels = [io.images_to_pixels(images).to(self.device) for io, images in groups if images]
        counts = [len(images) for _, images in groups]
        if not pixels:
            cfg = self.model.config
            empty = torch.zeros((0, cfg.num_image_tokens, cfg.vlm_width), device=self.device)
            return [empty for _ in groups]
        self.counters.vision_calls += 1
        self.counters.images_encoded += sum(counts)
        features = self.synchronized(self.model.encode_images(torch.cat(pixels)))
        return list(torch.split(features, counts))

    def synchronized(self, result):
        """``result`` once the device has finished the work queued so far.

        CUDA kernels run asynchronously: without this, the engine's phase timings (and the
        scheduler's online cost estimates built from them) would measure kernel launches, not
        work. A no-op on CPU.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return result

    def embed_prompt(self, ids: Sequence[int]) -> torch.Tensor:
        """``[T, W]`` embeddings of prompt token ids."""
        with torch.inference_mode():
            tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            return self.model.embed_tokens(tensor)[0]

    @torch.inference_mode()
    def prefill(self, rows: list[PrefillRow], logits: bool,
                pooled: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batched prefill of ragged rows; each row's tokens are committed to its sequence.

        The caller reserved the rows' pages (:meth:`KVCacheManager.reserve`).

        Returns:
            (fp32 logits ``[B, V]`` at each row's last new token or None,
            pooled hidden state ``[B, W]`` or None).

        Raises:
            ValueError: a row's pages cannot hold its new tokens (nothing is written then).
        """
        lens = [row.embeds.shape[0] for row in rows]
        width = rows[0].embeds.shape[1]
        embeds = rows[0].embeds.new_zeros((len(rows), max(lens), width))
        for b, row in enumerate(rows):
            embeds[b, :lens[b]] = row.embeds
        view = self.manager.view([row.seq for row in rows], lens)
        bidirectional = torch.tensor([row.bidirectional_len for row in rows], dtype=torch.long)
        out = self.model.prefill(embeds, view, bidirectional, need_logits=logits,
                                 return_hidden=pooled)
        view.commit()
        self.counters.prefill_calls += 1
        self.counters.prefilled_tokens += sum(lens)
        logits_out, pooled_out = out if pooled else (out, None)
        return self.synchronized(((None if logits_out is None else logits_out.float()), pooled_out))

    @torch.inference_mode()
    def denoise(self, seq: KVSequence, noise: torch.Tensor, num_steps: int,
                state: torch.Tensor | None) -> torch.Tensor:
        """Flow-matching actions ``[1, H, action_dim]`` from ``noise [1, H, action_dim]``, reading
        ``seq``'s prefix KV through a read-only view (gathered once for all steps)."""
        return self.denoise_batch([seq], noise, num_steps, None if state is None else [state])

    @torch.inference_mode()
    def denoise_batch(self, seqs: list[KVSequence], noise: torch.Tensor, num_steps: int,
                      states: list[torch.Tensor] | None, guidance: RTCGuidance | None = None) -> torch.Tensor:
        """One denoising loop for a batch of prefixes (a fleet: one per robot; ragged lengths,
        masked): actions ``[B, H, action_dim]`` from ``noise [B, H, action_dim]``; ``states``: π0's
        ``[action_dim]`` per row, or None (π0.5); ``guidance``: real-time chunking's guidance per row
        (:mod:`oxygen_ros.models.rtc`), None: plain."""
        view = self.manager.view(list(seqs))
        self.counters.denoise_calls += 1
        state_batch = None if states is None else torch.stack(list(states)).to(self.device)
        return self.synchronized(self.model.denoise(view, noise.to(self.device), num_steps=num_steps,
                                                    state=state_batch, guidance=guidance))

    @torch.inference_mode()
    def decode_step(self, seqs: list[KVSequence], token_ids: list[int]) -> torch.Tensor:
        """One batched decode step: append one token per sequence; fp32 logits ``[B, V]`` in the
        order of ``seqs``. The K/V is read from the manager's decode rows (no per-step gather).

        The caller gave every sequence a page for its token (``prepare_append``, covered by the
        request's admission charge).

        Raises:
            ValueError: a sequence has no page for its next token.
        """
        view, order = self.manager.decode_view(seqs)
        ids = torch.tensor([token_ids[i] for i in order], dtype=torch.long, device=self.device)
        logits = self.model.decode_step(ids, view)
        view.commit()
        self.counters.decode_steps += 1
        self.counters.decoded_tokens += len(seqs)
        # The view's row j is seqs[order[j]]: put the logits back in the caller's order.
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits.float()[inverse.to(logits.device)]

