"""One language request's state: prompt, pages, generated tokens, sampling, streaming, timings."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from oxygen_ros.engine.config import TaskConfig
from oxygen_ros.engine.detokenizer import IncrementalDetokenizer
from oxygen_ros.engine.kv_cache_manager import KVSequence
from oxygen_ros.engine.types import RequestStatus

_request_ids = itertools.count(1)


def new_request_id() -> int:
    """A fresh engine-wide request id (what a :class:`Request` gets by default). Thread-safe: CPython's
    ``itertools.count`` advances atomically under the GIL."""
    return next(_request_ids)


@dataclass(eq=False)
class Request:
    """A language request triggered by one observation.

    Attributes:
        task: the language task it belongs to.
        obs_seq, stamp: the triggering observation's sequence number and stamp (s).
        prompt_ids: the prompt's token ids.
        image_tokens: image tokens of the prefix (present cameras x tokens per camera).
        camera_mask: which configured camera slots were present (part of the prefix key).
        image_features: ``[n_cams, num_image_tokens, W]`` vision encoding of the observation, shared
            by every request of the frame; kept only until the request is prefilled, so a waiting
            request can be prefilled in a later cycle. None in ``isolated`` mode.
        images: the raw camera images, kept instead of features in ``isolated`` mode, where each
            request runs its own vision encoding.
        status: lifecycle (:class:`RequestStatus`).
        kv: the request's own KV sequence once admitted (forked from the shared prefix).
        charged_blocks: pages reserved at admission (worst case for the whole request).
        output_ids: generated tokens; the last one is fed to the next decode step.
        next_logits: fp32 ``[V]`` logits that sample the next token (from prefill or decode step).
        generator: per-request ``torch.Generator`` for temperature sampling (None for greedy).
        text: the text streamed so far (the concatenation of the request's event deltas).
        detokenizer: the request's incremental detokenizer, created with its first token; its
            ``text`` may run ahead of ``text`` by text not yet streamed.
        t_arrival, t_first_token, t_finish: ``time.perf_counter()`` instants (s).
        pooled: pooled prefix hidden state (memory tasks), or None.
        tag: the triggering observation's ``tag``, handed back on every output of the request.
        events_sent: text events emitted so far (the next event's ``index``).
        robot: the id of the robot whose observation triggered it in a :class:`~oxygen_ros.engine.fleet.Fleet`
            (part of its prefix key, so robots never share a prefix); None in a single-robot engine.
        instruction: the instruction its prompt was built with.
        subtask_source: prompted with its task's own template and the observation's instruction (not a
            submission with its own), so its text may be the robot's subtask (``subtask.py``).
    """

    task: TaskConfig
    obs_seq: int
    stamp: float
    prompt_ids: list[int]
    image_tokens: int
    camera_mask: tuple[bool, ...]
    t_arrival: float
    image_features: torch.Tensor | None = None
    images: list | None = None
    request_id: int = field(default_factory=new_request_id)
    status: RequestStatus = RequestStatus.WAITING
    kv: KVSequence | None = None
    charged_blocks: int = 0
    output_ids: list[int] = field(default_factory=list)
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None
    t_first_token: float | None = None
    t_finish: float | None = None
    pooled: torch.Tensor | None = None
    tag: Any = None
    events_sent: int = 0
    robot: Hashable = None
    instruction: str = ""
    subtask_source: bool = True

    def __post_init__(self) -> None:
        if self.task.sampling.temperature > 0:
            self.generator = torch.Generator().manual_seed(self.task.sampling.seed + self.obs_seq)

    @property
    def prefix_len(self) -> int:
        """Image tokens plus prompt tokens."""
        return self.image_tokens + len(self.prompt_ids)

    def stop_tokens(self, eos_token_id: int) -> tuple[int, ...]:
        """The task's stop tokens, or the model's EOS when the task names none."""
        return (eos_token_id,) if self.task.stop_token_ids is None else self.task.stop_token_ids

    def is_done(self, eos_token_id: int) -> bool:
        """Whether the last generated token ends the request (stop token or max new tokens)."""
        if not self.output_ids:
            return False
        return len(self.output_ids) >= self.task.max_new_tokens or \
            self.output_ids[-1] in self.stop_tokens(eos_token_id)


def sample_tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Next token per request from fp32 ``logits [B, V]``: greedy argmax, or temperature sampling
    with each request's own generator (reproducible per request, whatever the batch)."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, request in enumerate(requests):
        temperature = request.task.sampling.temperature
        if temperature > 0:
            # The request's generator lives on the CPU (reproducible whatever the device).
            probs = torch.softmax(logits[row].float().cpu() / temperature, dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=request.generator))
    return tokens
