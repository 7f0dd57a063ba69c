"""π0.5 / π0 models: architecture, checkpoints, tokenizers and pre/post-processing (no ROS)."""

from .checkpoint import load_model
from .config import PRESETS, ROBOTS, NormStats, RobotConfig, VLAConfig, get_preset, get_robot, load_norm_stats
from .kv_cache import DenseKVCache, KVCacheView
from .vla import VLAModel, left_pack

__all__ = ["PRESETS", "ROBOTS", "DenseKVCache", "KVCacheView", "NormStats", "RobotConfig", "VLAConfig", "VLAModel",
           "get_preset", "get_robot", "left_pack", "load_model", "load_norm_stats"]
