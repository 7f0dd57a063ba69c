"""The unified KV-cache engine (no ROS): cross-task KV sharing, cross-frame continuous batching and
deadline-aware scheduling of π0.5 / π0 action and language tasks."""

from .block_pool import BlockPool, BlockPoolExhausted
from .config import ActionTaskConfig, EngineConfig, SamplingConfig, TaskConfig, TriggerConfig
from .engine import Engine
from .kv_cache_manager import KVCacheManager, KVSequence
from .kv_views import PagedKVCacheView
from .model_io import ModelIO
from .outputs import CycleResult
from .prefix_cache import PrefixCache
from .types import ActionChunk, MemoryEntry, Observation, RequestStatus, TextEvent, TextOutput

__all__ = ["ActionChunk", "ActionTaskConfig", "BlockPool", "BlockPoolExhausted", "CycleResult",
           "Engine", "EngineConfig", "KVCacheManager", "KVSequence", "MemoryEntry", "ModelIO",
           "Observation", "PagedKVCacheView", "PrefixCache", "RequestStatus", "SamplingConfig",
           "TaskConfig", "TextEvent", "TextOutput", "TriggerConfig"]
