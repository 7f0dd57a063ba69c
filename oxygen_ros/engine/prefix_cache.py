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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from oxygen_ros.engine.kv_cache_manager import KVCacheManager, KVSequence


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
