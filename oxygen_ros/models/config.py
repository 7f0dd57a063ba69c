"""Model presets, robot configurations and normalisation statistics, as data.

Sizes of the full presets are those of π0 / π0.5 (PaliGemma 3B = SigLIP So400m/14 + Gemma 2B, and a
Gemma 300M action expert), as in the π0 / π0.5 papers and the openpi / LeRobot / transformers configs.
The tiny presets keep π0.5's proportions (patch 14 → 256 tokens per 224 px camera, expert half the VLM
width, same depth, one KV head) at a size that runs a control cycle on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class VLAConfig:
    """Architecture of one π0 / π0.5 model.

    Attributes:
        name: preset name.
        variant: ``'pi05'`` (adaRMSNorm time conditioning, state in the prompt) or ``'pi0'``
            (continuous state token, action-time MLP).
        prompt_mask: ``'bidirectional'`` (openpi / LeRobot: images + prompt form one block) or
            ``'causal'`` (OxyGen: images one block, each prompt token its own block).
        vision_width, vision_num_layers, vision_num_heads, vision_mlp_dim: SigLIP tower.
        image_size, patch_size: input side in pixels and patch side; 224 / 14 → 256 tokens.
        image_crops: per camera slot, the region of its frame the model sees, cut out before the resize:
            ``(slot, top, left, height, width)``, each a fraction of the frame's height (top, height) or width
            (left, width), so that one crop fits every resolution of the same view (LeRobot's
            ``crop_params_dict`` gives the same box in pixels); slots not listed see the whole frame.
            ``()``: no crop (every preset). A trained model records its crops in ``oxygen_config.json``.
        vlm_width, vlm_mlp_dim: Gemma VLM width and GeGLU hidden size.
        vlm_num_layers: depth of the VLM and of the action expert (MoT layers pair up).
        num_heads, num_kv_heads, head_dim: attention layout shared by both experts.
        expert_width, expert_mlp_dim: action expert width and GeGLU hidden size.
        vocab_size: embedding rows (tied LM head).
        action_horizon: H, actions per chunk.
        action_dim: padded action (and state) dimension, 32.
        max_token_len: prompt budget in tokens.
        num_steps: default Euler steps S.
        rope_theta, rms_eps, vision_eps: RoPE base, RMSNorm and SigLIP LayerNorm epsilons.
        min_period, max_period: sinusoidal time-embedding periods (openpi: 4e-3, 4.0).
        pad_token_id, eos_token_id, bos_token_id: tokenizer specials (PaliGemma: 0, 1, 2).
        dtype: ``'float32'`` or ``'bfloat16'`` default weight dtype.
        tokenizer: ``'paligemma'`` (SentencePiece model from a local file) or ``'tiny'`` (built offline).
        seed: seed of the random initialisation used when no checkpoint is loaded.

    Raises:
        ValueError: on an unknown variant / prompt mask / dtype or inconsistent sizes.
    """

    name: str
    variant: str
    prompt_mask: str
    vision_width: int
    vision_num_layers: int
    vision_num_heads: int
    vision_mlp_dim: int
    vlm_width: int
    vlm_mlp_dim: int
    vlm_num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    expert_width: int
    expert_mlp_dim: int
    vocab_size: int
    action_horizon: int
    max_token_len: int
    image_size: int = 224
    patch_size: int = 14
    image_crops: tuple[tuple[str, float, float, float, float], ...] = ()
    action_dim: int = 32
    num_steps: int = 10
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    vision_eps: float = 1e-6
    min_period: float = 4e-3
    max_period: float = 4.0
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int = 2
    dtype: str = "float32"
    tokenizer: str = "paligemma"
    seed: int = 0

    def __post_init__(self):
        if self.variant not in ("pi05", "pi0"):
            raise ValueError(f"variant must be 'pi05' or 'pi0', got {self.variant!r}")
        if self.prompt_mask not in ("bidirectional", "causal"):
            raise ValueError(f"prompt_mask must be 'bidirectional' or 'causal', got {self.prompt_mask!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.tokenizer not in ("paligemma", "tiny"):
            raise ValueError(f"tokenizer must be 'paligemma' or 'tiny', got {self.tokenizer!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2 or self.expert_width % 2:
            raise ValueError("head_dim and expert_width must be even (RoPE halves, sin/cos halves)")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} not a multiple of patch_size {self.patch_size}")
        # JSON gives lists: store tuples (the config is frozen and hashable), validated.
        object.__setattr__(self, "image_crops", tuple(check_image_crop(c) for c in self.image_crops))
        slots = [c[0] for c in self.image_crops]
        if len(set(slots)) != len(slots):
            raise ValueError(f"image_crops names a camera slot twice: {slots}")

    def image_crop(self, slot: str) -> tuple[float, float, float, float] | None:
        """The ``(top, left, height, width)`` fractions of ``slot``'s crop, None when it sees the whole frame."""
        return next((tuple(c[1:]) for c in self.image_crops if c[0] == slot), None)

    @property
    def num_image_tokens(self) -> int:
        """Tokens per camera image: (image_size / patch_size)^2, 256 for 224 / 14."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def replace(self, **changes) -> "VLAConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def check_image_crop(entry) -> tuple[str, float, float, float, float]:
    """One ``(name, top, left, height, width)`` crop, checked: a box of positive size inside the frame
    (fractions in [0, 1]). ``name`` is the camera slot (or, for a message in the user's words, the camera).

    Raises:
        ValueError: naming ``name``, when the entry is malformed or the box is empty or outside the frame.
    """
    try:
        slot, *box = entry
        top, left, height, width = (float(v) for v in box)
    except (TypeError, ValueError):
        raise ValueError(f"an image crop is (slot, top, left, height, width), got {entry!r}") from None
    if not isinstance(slot, str) or not slot:
        raise ValueError(f"an image crop's slot must be a camera slot name, got {slot!r}")
    eps = 1e-9
    if not (top >= 0 and left >= 0 and height > 0 and width > 0
            and top + height <= 1 + eps and left + width <= 1 + eps):
        raise ValueError(f"image crop of {slot}: (top {top}, left {left}, height {height}, width {width}) must be "
                         "fractions of the frame with a positive size, inside it")
    return (slot, top, left, height, width)


def _full(name: str, variant: str, horizon: int, max_token_len: int) -> VLAConfig:
    return VLAConfig(name=name, variant=variant, prompt_mask="bidirectional",
                     vision_width=1152, vision_num_layers=27, vision_num_heads=16, vision_mlp_dim=4304,
                     vlm_width=2048, vlm_mlp_dim=16384, vlm_num_layers=18,
                     num_heads=8, num_kv_heads=1, head_dim=256,
                     expert_width=1024, expert_mlp_dim=4096,
                     vocab_size=257152, action_horizon=horizon, max_token_len=max_token_len,
                     dtype="bfloat16")


def _tiny(name: str, variant: str) -> VLAConfig:
    return VLAConfig(name=name, variant=variant, prompt_mask="bidirectional",
                     vision_width=128, vision_num_layers=2, vision_num_heads=2, vision_mlp_dim=512,
                     vlm_width=256, vlm_mlp_dim=1024, vlm_num_layers=4,
                     num_heads=4, num_kv_heads=1, head_dim=64,
                     expert_width=128, expert_mlp_dim=512,
                     vocab_size=1024, action_horizon=10, max_token_len=200, tokenizer="tiny")


PRESETS: dict[str, VLAConfig] = {
    "pi05": _full("pi05", "pi05", horizon=50, max_token_len=200),
    "pi0": _full("pi0", "pi0", horizon=50, max_token_len=48),
    "pi05_tiny": _tiny("pi05_tiny", "pi05"),
    "pi0_tiny": _tiny("pi0_tiny", "pi0"),
    # The demo policy trained in the simulator (oxygen_ros/training, docs/demo-policy.md): half the tiny
    # widths (training on two CPU cores costs ~2.7x less per sample than at pi05_tiny's), ALOHA's
    # 50-action horizon, and 112 px cameras (64 tokens each) so that the cube stays a few patches wide
    # in the top camera.
    "pi05_demo": _tiny("pi05_demo", "pi05").replace(
        vision_width=64, vision_mlp_dim=256, vlm_width=128, vlm_mlp_dim=512, head_dim=32,
        expert_width=64, expert_mlp_dim=256, action_horizon=50, image_size=112),
}


def get_preset(name: str, **overrides) -> VLAConfig:
    """The preset ``name`` (``pi05``, ``pi0``, ``pi05_tiny``, ``pi0_tiny``, ``pi05_demo``) with optional field
    overrides.

    Raises:
        ValueError: unknown preset name or invalid override.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


@dataclasses.dataclass(frozen=True)
class RobotConfig:
    """One robot's interface to the policy: its dimensions and camera slots.

    How its data is normalised, prompted and adapted is the checkpoint family's business
    (:class:`oxygen_ros.models.conventions.Conventions`).

    Attributes:
        name: robot / dataset name.
        state_dim: proprioceptive state dimension before padding.
        action_dim: action dimension after slicing the padded model output.
        camera_slots: camera names in the order the model sees them (openpi image keys).
    """

    name: str
    state_dim: int
    action_dim: int
    camera_slots: tuple[str, ...]

    def __post_init__(self):
        if self.state_dim <= 0 or self.action_dim <= 0:
            raise ValueError(f"state_dim and action_dim must be positive, got {self.state_dim}, {self.action_dim}")
        if not self.camera_slots:
            raise ValueError("a robot needs at least one camera slot")


# Camera slot names follow openpi's image keys (base_0_rgb, left_wrist_0_rgb, right_wrist_0_rgb).
ROBOTS: dict[str, RobotConfig] = {
    "libero": RobotConfig("libero", state_dim=8, action_dim=7,
                          camera_slots=("base_0_rgb", "left_wrist_0_rgb")),
    "droid": RobotConfig("droid", state_dim=8, action_dim=8,
                         camera_slots=("base_0_rgb", "left_wrist_0_rgb")),
    "aloha": RobotConfig("aloha", state_dim=14, action_dim=14,
                         camera_slots=("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")),
}


def get_robot(name: str) -> RobotConfig:
    """The robot configuration ``name`` (``libero``, ``droid``, ``aloha``).

    Raises:
        ValueError: unknown robot name.
    """
    if name not in ROBOTS:
        raise ValueError(f"unknown robot {name!r}; known: {sorted(ROBOTS)}")
    return ROBOTS[name]


_STAT_NAMES = ("mean", "std", "q01", "q99")


@dataclasses.dataclass(frozen=True)
class NormStats:
    """Per-dimension statistics of one quantity (state or actions), float64 numpy arrays ``[D]``.

    Any of them may be None (openpi files always carry ``mean``/``std``, quantiles optionally;
    LeRobot files carry what its dataset computed); at least one must be given.

    Raises:
        ValueError: no array, or arrays that are not 1-D of one length.
    """

    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    def __post_init__(self):
        dims = {a.shape for a in (self.mean, self.std, self.q01, self.q99) if a is not None}
        if len(dims) != 1 or len(next(iter(dims))) != 1:
            raise ValueError(f"norm stats arrays must be 1-D of one length, got shapes {sorted(dims)}")

    @property
    def dim(self) -> int:
        return int(next(a for a in (self.mean, self.std, self.q01, self.q99) if a is not None).shape[0])


def check_norm_stats(stats: NormStats, key: str, dim: int, mode: str) -> None:
    """Reject statistics that would make normalisation non-finite, in the ``dim`` dimensions used.

    Every array present must be finite in its first ``dim`` entries; the mode's own statistics must be
    present and non-degenerate there: ``q99 > q01`` (quantile), ``std > 0`` (mean_std). Dimensions
    beyond ``dim`` (openpi pads some statistics to 32 with zeros) are not looked at.

    Args:
        stats: the statistics of ``key``.
        key: ``'state'`` or ``'actions'`` (for the message).
        dim: dimensions actually used.
        mode: ``'quantile'``, ``'mean_std'`` or ``'identity'`` (nothing is checked).

    Raises:
        ValueError: naming the key, the statistic, the dimension and the value.
    """
    if mode == "identity":
        return
    needed = {"quantile": ("q01", "q99"), "mean_std": ("mean", "std")}[mode]
    for name in needed:
        if getattr(stats, name) is None:
            raise ValueError(f"norm stats {key!r}: {mode} normalisation needs {name}, which is missing")
    if stats.dim < dim:
        raise ValueError(f"norm stats {key!r} have {stats.dim} dimensions, {dim} are used")
    for name in _STAT_NAMES:
        values = getattr(stats, name)
        if values is None:
            continue
        bad = np.flatnonzero(~np.isfinite(values[:dim]))
        if bad.size:
            raise ValueError(f"norm stats {key!r}: {name}[{bad[0]}] is {values[bad[0]]} (not finite)")
    if mode == "quantile":
        bad = np.flatnonzero(stats.q99[:dim] <= stats.q01[:dim])
        if bad.size:
            i = bad[0]
            raise ValueError(f"norm stats {key!r}: q99[{i}] = {stats.q99[i]} is not above q01[{i}] = "
                             f"{stats.q01[i]} (degenerate quantile range)")
    else:
        bad = np.flatnonzero(stats.std[:dim] <= 0)
        if bad.size:
            raise ValueError(f"norm stats {key!r}: std[{bad[0]}] = {stats.std[bad[0]]} (degenerate: not positive)")


def load_norm_stats(path: str | Path) -> dict[str, NormStats]:
    """Read an openpi ``norm_stats.json`` (``{"norm_stats": {"state": {...}, "actions": {...}}}``).

    Each entry has ``mean``, ``std`` and optionally ``q01``, ``q99`` lists.

    Returns:
        ``{"state": NormStats, "actions": NormStats}`` (whatever keys the file holds).

    Raises:
        FileNotFoundError: no such file.
        ValueError: malformed content, naming the file and what is wrong: not valid JSON (line, column,
            truncated), no ``norm_stats`` mapping, an entry without mean/std, a value that is not a flat
            list of numbers, lists of different lengths in one entry.
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except ValueError as error:     # json.JSONDecodeError: line, column and what the parser expected
        where = " (the file ends there: truncated?)" if getattr(error, "pos", -1) >= len(text.rstrip()) else ""
        raise ValueError(f"{path}: not valid JSON: {error}{where}") from None
    stats = data.get("norm_stats", data) if isinstance(data, dict) else None
    if not isinstance(stats, dict) or not stats:
        raise ValueError(f"{path}: no 'norm_stats' mapping")
    out = {}
    for key, entry in stats.items():
        if not isinstance(entry, dict) or entry.get("mean") is None or entry.get("std") is None:
            raise ValueError(f"{path}: entry {key!r} lacks mean/std")
        arrays = {}
        for name in _STAT_NAMES:
            try:
                arrays[name] = np.asarray(entry[name], dtype=np.float64) if entry.get(name) is not None else None
            except (TypeError, ValueError) as error:
                raise ValueError(f"{path}: {key}.{name} is not a list of numbers ({error})") from None
            if arrays[name] is not None and arrays[name].ndim != 1:
                raise ValueError(f"{path}: {key}.{name} is not a flat list of numbers (shape {arrays[name].shape})")
        lengths = {name: len(a) for name, a in arrays.items() if a is not None}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{path}: entry {key!r} has lists of different lengths {lengths}")
        out[key] = NormStats(**arrays)
    return out


def save_norm_stats(stats: dict[str, NormStats], path: str | Path) -> None:
    """Write ``stats`` in openpi's ``norm_stats.json`` format (inverse of :func:`load_norm_stats`)."""
    payload = {"norm_stats": {
        key: {k: getattr(s, k).tolist() for k in _STAT_NAMES if getattr(s, k) is not None}
        for key, s in stats.items()}}
    Path(path).write_text(json.dumps(payload, indent=2))

