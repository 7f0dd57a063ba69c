"""π0.5 / π0 models: architecture, checkpoints, tokenizers and pre/post-processing (no ROS)."""

from .checkpoint import CheckpointError, load_model, save_checkpoint
from .config import (PRESETS, ROBOTS, NormStats, RobotConfig, VLAConfig, get_preset, get_robot, load_norm_stats,
                     save_norm_stats)
from .conventions import FAMILIES, Conventions, get_conventions
from .kv_cache import DenseKVCache, KVCacheView
from .processing import Processor, build_prompt_tokens, resize_with_pad
from .tokenizer import PaliGemmaTokenizer, TinyTokenizer, load_tokenizer
from .vla import VLAModel, left_pack

__all__ = ["FAMILIES", "PRESETS", "ROBOTS", "CheckpointError", "Conventions", "DenseKVCache", "KVCacheView", "NormStats", "PaliGemmaTokenizer",
           "Processor", "RobotConfig", "TinyTokenizer", "VLAConfig", "VLAModel", "build_prompt_tokens", "get_conventions", "get_preset",
           "get_robot", "left_pack", "load_model", "load_norm_stats", "load_tokenizer", "resize_with_pad",
           "save_checkpoint", "save_norm_stats"]
