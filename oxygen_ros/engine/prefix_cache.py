"""Prefix tree of prefilled KV for the current control cycle (a radix cache with a namespace key).

A node is a prefilled prefix: its key path names what was prefilled (the observation and the camera
mask, then the prompt's token ids) and its :class:`KVSequence` holds the KV of the whole path. Which
parts are separate nodes follows the model's masks (docs/models.md, "Masks and positions"):

* ``prompt_mask == 'bidirectional'`` (openpi / LeRobot π0.5): images attend to the prompt, so the
  image KV depends on the prompt; the key path is one node ``(observation, prompt)``. Tasks with the
  same prompt share the node; other prompts get their own prefill (they share only the vision
  encoding, which the engine caches per observation).
* ``prompt_mask == 'causal'`` (OxyGen variant): images attend only to images, so the image KV is one
  node ``(observation,)`` and each prompt is a child fork prefilled on top of it.

Users (the action task, language requests) take their own references with
:meth:`KVCacheManager.fork`, so the tree itself is dropped at the end of each cycle
(:meth:`PrefixCache.clear`) and pages live exactly as long as some request reads them. The
namespace in the key keeps tasks apart when they must (SGLang's extra key idea).

:class:`PrefixPlanner` plans with the tree: the key path of a request's prefix, what a node must keep
for the requests that will fork it, the tokens a request still needs prefilled, and the batched
prefill (one call per tree level) of the prefixes a cycle asks for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Hashable

import torch

from oxygen_ros.engine.kv_cache_manager import KVCacheManager, KVSequence
from oxygen_ros.engine.model_runner import ModelRunner, PrefillRow
from oxygen_ros.engine.request import Request

if TYPE_CHECKING:
    from oxygen_ros.engine.meter import CycleMeter


@dataclass(eq=False)
class PrefixNode:
    """One prefilled prefix.

    Attributes:
        key: this node's key (its part of the path).
        seq: KV of the whole path from the root to this node (the tree holds one reference).
        logits: fp32 ``[V]`` next-token logits at the last prefix token, or None if not computed.
        pooled: ``[W]`` pooled hidden state of the prefix, or None.
        children: child nodes by key.
    """

    key: Hashable
    seq: KVSequence
    logits: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    children: dict[Hashable, "PrefixNode"] = field(default_factory=dict)


class PrefixCache:
    """The cycle's prefix tree over one :class:`KVCacheManager`."""

    def __init__(self, manager: KVCacheManager):
        self._manager = manager
        self._root: dict[Hashable, PrefixNode] = {}

    def lookup(self, path: tuple[Hashable, ...]) -> PrefixNode | None:
        """The node at ``path`` or None (also None for an empty path)."""
        children, node = self._root, None
        for key in path:
            node = children.get(key)
            if node is None:
                return None
            children = node.children
        return node

    def insert(self, path: tuple[Hashable, ...], seq: KVSequence,
               logits: torch.Tensor | None = None, pooled: torch.Tensor | None = None) -> PrefixNode:
        """Add the node at ``path``; the tree takes over ``seq``'s references.

        Raises:
            KeyError: the parent path is missing or the node already exists.
        """
        if not path:
            raise KeyError("empty prefix path")
        children = self._root
        if len(path) > 1:
            parent = self.lookup(path[:-1])
            if parent is None:
                raise KeyError(f"parent of {path!r} is not cached")
            children = parent.children
        if path[-1] in children:
            raise KeyError(f"prefix {path!r} already cached")
        node = PrefixNode(path[-1], seq, logits, pooled)
        children[path[-1]] = node
        return node

    def clear(self) -> None:
        """Drop every node's references (forks held by requests keep their pages)."""
        stack = list(self._root.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._manager.free(node.seq)
        self._root = {}

    def __len__(self) -> int:
        count, stack = 0, list(self._root.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


@dataclass
class PrefixJob:
    """A prefix to find in, or add to, the cycle's prefix tree.

    Attributes:
        path: its key path (:meth:`PrefixPlanner.path`, or a private path that shares nothing).
        features: ``[n_cams, tokens, W]`` vision encoding of its images.
        prompt_ids: the prompt's token ids.
        logits: keep the next-token logits at its last token (a language request starts from it).
        pooled: keep the pooled hidden state (a memory request's embedding).
    """

    path: tuple[Hashable, ...]
    features: torch.Tensor
    prompt_ids: tuple[int, ...]
    logits: bool
    pooled: bool


class PrefixPlanner:
    """Plans and prefills the cycle's prefixes over one :class:`PrefixCache`.

    Args:
        manager: the KV-cache manager (pages for new prefixes, forks for prompt children).
        runner: the model runner that prefills.
        prompt_mask: the model's prompt mask, ``bidirectional`` or ``causal`` (how prefixes split).
    """

    def __init__(self, manager: KVCacheManager, runner: ModelRunner, prompt_mask: str):
        self.tree = PrefixCache(manager)
        self._manager = manager
        self._runner = runner
        self._prompt_mask = prompt_mask

    def path(self, obs_seq: int, mask: tuple[bool, ...], prompt_ids: tuple[int, ...],
             robot: Hashable = None) -> tuple[Hashable, ...]:
        """Key path of a prefix in the cycle's tree, split where the model's mask allows; ``robot``
        (a fleet's robot id, None for a single-robot engine) keeps the robots of one tree apart."""
        if self._prompt_mask == "causal":
            return (("images", robot, obs_seq, mask), ("prompt", prompt_ids))
        return (("prefix", robot, obs_seq, mask, prompt_ids),)

    def request_path(self, request: Request) -> tuple[Hashable, ...]:
        """Key path of ``request``'s prefix."""
        return self.path(request.obs_seq, request.camera_mask, tuple(request.prompt_ids), request.robot)

    def needs(self, path: tuple[Hashable, ...], candidates: list[Request]) -> tuple[bool, bool]:
        """``(logits, pooled)`` a prefix node at ``path`` must keep.

        The cycle's prefix tree prefills each prefix once, so its node must serve every request
        that will fork it, not only the one whose start triggers the prefill: the next-token logits
        if any not-yet-started request among ``candidates`` maps to ``path``, the pooled hidden
        state if any of those is a memory request.
        """
        users = [r for r in candidates if r.kv is None and self.request_path(r) == path]
        return bool(users), any(r.task.kind == "memory" for r in users)

    def cost(self, request: Request) -> int:
        """Tokens to prefill before ``request`` can start, given the cycle's prefix tree."""
        path = self.request_path(request)
        if self.tree.lookup(path) is not None:
            return 0
        if len(path) == 2 and self.tree.lookup(path[:1]) is not None:
            return len(request.prompt_ids)
        return request.prefix_len

    def job(self, request: Request, candidates: list[Request]) -> PrefixJob:
        """The shared prefix job of ``request`` (its image features, its prompt), keeping what the
        ``candidates`` that will fork the same node need.

        Raises:
            RuntimeError: the node exists but was prefilled without the logits or pooled state its
                requests need (a planning error).
        """
        path = self.request_path(request)
        node = self.tree.lookup(path)
        if node is not None and (node.logits is None or
                                 (request.task.kind == "memory" and node.pooled is None)):
            raise RuntimeError("a shared prefix was prefilled without the logits or pooled "
                               "state its requests need")
        logits, pooled = self.needs(path, candidates)
        return PrefixJob(path, request.image_features, tuple(request.prompt_ids), logits, pooled)

    def nodes(self, jobs: list[PrefixJob], meter: CycleMeter) -> list[PrefixNode]:
        """Find or prefill every job's prefix; one batched prefill per tree level.

        Level 1 is the whole prefix (bidirectional model, or a private path) or the image block
        (causal model: images bidirectional among themselves); level 2 the prompt forks of a causal
        model (prefilled on top of the cached image KV with ``bidirectional_len = 0``). Jobs for
        the same prefix are one prefill whose outputs are the union of their needs (logits OR,
        pooled OR).

        Raises:
            BlockPoolExhausted: the pool cannot hold a level's new tokens (nothing allocated for it).
        """
        merged: dict[tuple[Hashable, ...], PrefixJob] = {}
        for job in jobs:
            first = merged.setdefault(job.path, replace(job))
            first.logits |= job.logits
            first.pooled |= job.pooled
        for depth in (1, 2):
            rows, pending = [], []
            for job in merged.values():
                if len(job.path) < depth or self.tree.lookup(job.path[:depth]) is not None:
                    continue
                if any(job.path[:depth] == other.path[:depth] for other in pending):
                    continue
                pending.append(job)
                rows.append(self._row(job, depth))
            if not rows:
                continue
            final = [len(job.path) == depth for job in pending]
            want_logits = any(job.logits for job, f in zip(pending, final) if f)
            want_pooled = any(job.pooled for job, f in zip(pending, final) if f)
            t = time.perf_counter()
            self._manager.reserve([row.seq for row in rows], [row.embeds.shape[0] for row in rows])
            logits, pooled = self._runner.prefill(rows, logits=want_logits, pooled=want_pooled)
            meter.prefill(sum(r.embeds.shape[0] for r in rows), time.perf_counter() - t)
            for b, (job, row) in enumerate(zip(pending, rows)):
                self.tree.insert(job.path[:depth], row.seq,
                                 None if logits is None else logits[b],
                                 None if pooled is None else pooled[b])
        return [self.tree.lookup(job.path) for job in jobs]

    def _row(self, job: PrefixJob, depth: int) -> PrefillRow:
        """The prefill row of ``job``'s tree level ``depth``."""
        last = len(job.path) == depth
        if depth == 2:
            parent = self.tree.lookup(job.path[:1])
            return PrefillRow(self._manager.fork(parent.seq),
                              self._runner.embed_prompt(job.prompt_ids), 0)
        embeds = job.features.reshape(-1, job.features.shape[-1])
        # Images are one bidirectional block; the prompt joins it only in openpi's mask.
        bidirectional = embeds.shape[0]
        if last:
            embeds = torch.cat([embeds, self._runner.embed_prompt(job.prompt_ids)])
            if self._prompt_mask == "bidirectional":
                bidirectional = embeds.shape[0]
        return PrefillRow(self._manager.new_sequence(), embeds, bidirectional)
