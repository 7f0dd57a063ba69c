"""Pre- and post-processing between robot data and the model (pi05-facts.md, "Inputs and tokenization").

* Images: resize with padding to 224x224 keeping the aspect ratio, scale to [-1, 1]; the pad is
  exactly -1; uint8 [0, 255] and float [0, 1] inputs give identical tensors (both are converted to
  float [0, 1] before any arithmetic).
* State / actions: quantile normalisation ``2·(x − q01)/(q99 − q01 + 1e-6) − 1`` or mean/std
  ``(x − mean)/(std + 1e-6)`` (openpi), zero-padded to the model's 32 dimensions; actions are
  unnormalised and sliced back to the robot's dimension.
* π0.5 discretises the normalised, padded state into 256 bins over [-1, 1] (openpi / LeRobot:
  ``digitize(x, linspace(-1, 1, 257)[:-1]) − 1``) and writes it into the prompt.
* Prompts: ``"Task: {instruction}, State: {state};\\nAction: "`` (π0.5 action), ``"Task: {instruction}.
  Subtask: "`` (language) and ``"{instruction}\\n"`` (π0), all after BOS; the instruction is cleaned
  as openpi does (strip, ``_`` and newlines → spaces). An over-long prompt loses instruction tokens
  from its end, with a warning; the template's trailing anchor is never cut.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.nn.functional as F

from .config import NormStats, RobotConfig, VLAConfig
from .tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

ACTION_PROMPT = "Task: {instruction}, State: {state};\nAction: "
LANGUAGE_PROMPT = "Task: {instruction}. Subtask: "
PI0_PROMPT = "{instruction}\n"
NUM_STATE_BINS = 256
_EPS = 1e-6


def resize_with_pad(image, size: int = 224) -> torch.Tensor:
    """Camera image(s) → model pixels.

    Args:
        image: ``[H, W, 3]`` or ``[N, H, W, 3]`` (numpy or torch), uint8 in [0, 255] or float in [0, 1].
        size: output side in pixels.

    Returns:
        fp32 ``[3, size, size]`` or ``[N, 3, size, size]`` in [-1, 1]: bilinear (antialiased) resize
        so the longer side is ``size``, centred, padded with exactly -1.

    Raises:
        ValueError: wrong shape, an empty image or a dtype other than uint8 / floating point.
    """
    x = torch.as_tensor(image)
    single = x.dim() == 3
    if single:
        x = x[None]
    if x.dim() != 4 or x.shape[-1] != 3 or x.shape[1] == 0 or x.shape[2] == 0:
        raise ValueError(f"image must be [H, W, 3] or [N, H, W, 3], got {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        x = x.to(torch.float32) / 255.0
    elif x.is_floating_point():
        x = x.to(torch.float32)
    else:
        raise ValueError(f"image dtype must be uint8 or floating point, got {x.dtype}")
    x = x.permute(0, 3, 1, 2)
    height, width = x.shape[2:]
    ratio = max(height / size, width / size)
    new_h, new_w = max(1, int(height / ratio)), max(1, int(width / ratio))
    if (new_h, new_w) != (height, width):
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
    x = x.clamp(0.0, 1.0) * 2.0 - 1.0
    top, left = (size - new_h) // 2, (size - new_w) // 2
    x = F.pad(x, (left, size - new_w - left, top, size - new_h - top), value=-1.0)
    return x[0] if single else x


def normalize(x: np.ndarray, stats: NormStats, mode: str) -> np.ndarray:
    """Normalise ``x [..., D]`` with the first D dims of ``stats`` (mode ``'quantile'`` or ``'mean_std'``).

    Raises:
        ValueError: stats shorter than D, quantiles missing, unknown mode.
    """
    lo, scale = _affine(stats, mode, np.shape(x)[-1])
    y = (np.asarray(x, dtype=np.float64) - lo) / scale
    return y * 2.0 - 1.0 if mode == "quantile" else y


def unnormalize(x: np.ndarray, stats: NormStats, mode: str) -> np.ndarray:
    """Inverse of :func:`normalize`."""
    lo, scale = _affine(stats, mode, np.shape(x)[-1])
    x = np.asarray(x, dtype=np.float64)
    return ((x + 1.0) / 2.0 if mode == "quantile" else x) * scale + lo


def _affine(stats: NormStats, mode: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    if stats.dim < dim:
        raise ValueError(f"norm stats have {stats.dim} dims, data has {dim}")
    if mode == "quantile":
        if stats.q01 is None or stats.q99 is None:
            raise ValueError("quantile normalisation needs q01/q99 in the norm stats")
        return stats.q01[:dim], stats.q99[:dim] - stats.q01[:dim] + _EPS
    if mode == "mean_std":
        return stats.mean[:dim], stats.std[:dim] + _EPS
    raise ValueError(f"norm mode must be 'quantile' or 'mean_std', got {mode!r}")


def pad_to(x: np.ndarray, dim: int) -> np.ndarray:
    """Zero-pad the last axis of ``x`` to ``dim``.

    Raises:
        ValueError: ``x`` already has more than ``dim`` entries (never truncated silently).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] > dim:
        raise ValueError(f"dimension {x.shape[-1]} exceeds the model's padded dimension {dim}")
    return np.concatenate([x, np.zeros((*x.shape[:-1], dim - x.shape[-1]))], axis=-1)


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Bins 0..255 of a normalised state over [-1, 1] (values outside are clipped to the end bins)."""
    edges = np.linspace(-1.0, 1.0, NUM_STATE_BINS + 1)[:-1]
    return np.clip(np.digitize(np.asarray(state, dtype=np.float64), edges) - 1, 0, NUM_STATE_BINS - 1)


def clean_instruction(instruction: str) -> str:
    """openpi's prompt cleaning: strip, underscores and newlines become spaces."""
    return instruction.strip().replace("_", " ").replace("\n", " ")


def build_prompt_tokens(tokenizer: TextTokenizer, instruction: str, template: str, max_len: int,
                        state_bins: np.ndarray | None = None) -> list[int]:
    """BOS + the tokens of ``template`` filled with the cleaned instruction (and state bins).

    Over-long prompts are truncated deliberately: instruction tokens are removed from its end (with a
    logged warning) until the prompt fits; the rest of the template — its trailing anchor such as
    ``"Action: "`` or ``"Subtask: "`` and the state — is always kept.

    Args:
        tokenizer: see :mod:`oxygen_ros.models.tokenizer`.
        instruction: free text.
        template: a format string with ``{instruction}`` and optionally ``{state}``.
        max_len: token budget (``config.max_token_len``).
        state_bins: int bins for ``{state}`` (space separated), required iff the template has it.

    Returns:
        list of int token ids, ``len <= max_len``.

    Raises:
        ValueError: a missing/extra state, or a budget too small even for an empty instruction.
    """
    if ("{state}" in template) != (state_bins is not None):
        raise ValueError("state_bins must be given exactly when the template has a {state} field")
    state_text = "" if state_bins is None else " ".join(str(int(b)) for b in state_bins)
    text = clean_instruction(instruction)

    def encode(instr: str) -> list[int]:
        return tokenizer.encode(template.format(instruction=instr, state=state_text), add_bos=True)

    tokens = encode(text)
    if len(tokens) <= max_len:
        return tokens
    if len(encode("")) > max_len:
        raise ValueError(f"prompt budget {max_len} is too small for the template and state alone")
    instruction_ids = tokenizer.encode(text)
    keep_lo, keep_hi = 0, len(instruction_ids)
    while keep_lo < keep_hi:  # binary search: the longest instruction prefix that fits
        mid = (keep_lo + keep_hi + 1) // 2
        if len(encode(tokenizer.decode(instruction_ids[:mid]))) <= max_len:
            keep_lo = mid
        else:
            keep_hi = mid - 1
    kept = tokenizer.decode(instruction_ids[:keep_lo])
    _warn_truncated(text, len(tokens), max_len, kept)
    return encode(kept)


_TRUNCATION_WARNED: set[tuple[str, int]] = set()


def _warn_truncated(instruction: str, num_tokens: int, max_len: int, kept: str) -> None:
    """Log a truncation once per distinct instruction and budget, not on every control cycle."""
    if (instruction, max_len) in _TRUNCATION_WARNED:
        return
    if len(_TRUNCATION_WARNED) >= 64:  # bounded: a long-running node sees many instructions
        _TRUNCATION_WARNED.clear()
    _TRUNCATION_WARNED.add((instruction, max_len))
    logger.warning("prompt of %d tokens exceeds the budget of %d: instruction %r truncated to %r",
                   num_tokens, max_len, instruction[:80], kept)


@dataclasses.dataclass
class Processor:
    """Robot data ↔ model tensors for one model and one robot (the engine need not know the variant).

    Args:
        config: model architecture (variant, sizes, prompt budget).
        robot: state/action dimensions, camera slots, normalisation mode.
        tokenizer: text tokenizer.
        norm_stats: ``{"state": NormStats, "actions": NormStats}``; None = data already normalised
            (identity, for random-weight tests).
    """

    config: VLAConfig
    robot: RobotConfig
    tokenizer: TextTokenizer
    norm_stats: dict[str, NormStats] | None = None

    def __post_init__(self):
        # π0.5 reads the state only as discretised prompt tokens, so a state longer than the padded
        # action dimension is kept whole (openpi's pad_to_dim never truncates); π0's state projection
        # takes exactly action_dim inputs.
        state_limit = self.config.action_dim if self.config.variant == "pi0" else None
        if self.robot.action_dim > self.config.action_dim or (
                state_limit is not None and self.robot.state_dim > state_limit):
            raise ValueError(f"robot {self.robot.name} dims (state {self.robot.state_dim}, action "
                             f"{self.robot.action_dim}) exceed the model's {self.config.action_dim}")
        if self.norm_stats is not None and not {"state", "actions"} <= set(self.norm_stats):
            raise ValueError(f"norm_stats need 'state' and 'actions', got {sorted(self.norm_stats)}")

    def images(self, frames: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
        """Camera frames by slot name → ``(pixels fp32 [C, 3, 224, 224], camera_mask bool [C])``.

        Slots follow ``robot.camera_slots``; a missing slot (absent or None) is masked and its pixels
        are -1 (never encoded: callers skip masked cameras).

        Raises:
            ValueError: unknown slot names or no camera at all.
        """
        unknown = set(frames) - set(self.robot.camera_slots)
        if unknown:
            raise ValueError(f"unknown camera slots {sorted(unknown)}; robot has {self.robot.camera_slots}")
        size = self.config.image_size
        pixels = torch.full((len(self.robot.camera_slots), 3, size, size), -1.0)
        mask = torch.zeros(len(self.robot.camera_slots), dtype=torch.bool)
        for i, slot in enumerate(self.robot.camera_slots):
            if frames.get(slot) is not None:
                pixels[i] = resize_with_pad(frames[slot], size)
                mask[i] = True
        if not bool(mask.any()):
            raise ValueError("no camera image given")
        return pixels, mask

    def normalized_state(self, state) -> np.ndarray:
        """Robot state ``[state_dim]`` → normalised, zero-padded float64 ``[max(32, state_dim)]``.

        Only a π0.5 robot may have ``state_dim`` > 32 (its state goes into the prompt whole).

        Raises:
            ValueError: wrong state dimension.
        """
        state = np.asarray(state, dtype=np.float64)
        if state.shape != (self.robot.state_dim,):
            raise ValueError(f"state must have shape ({self.robot.state_dim},), got {state.shape}")
        if self.norm_stats is not None:
            state = normalize(state, self.norm_stats["state"], self.robot.norm_mode)
        return pad_to(state, max(self.config.action_dim, self.robot.state_dim))

    def prompt_tokens(self, instruction: str, state=None, task: str = "action") -> list[int]:
        """Prompt token ids for ``task`` ``'action'`` or ``'language'``.

        π0.5 action prompts carry the discretised state (``state`` required); language prompts and π0
        prompts do not use it.

        Raises:
            ValueError: unknown task, or a π0.5 action prompt without state.
        """
        if task not in ("action", "language"):
            raise ValueError(f"task must be 'action' or 'language', got {task!r}")
        if task == "language":
            template, bins = LANGUAGE_PROMPT, None
        elif self.config.variant == "pi0":
            template, bins = PI0_PROMPT, None
        else:
            if state is None:
                raise ValueError("the π0.5 action prompt needs the robot state")
            template, bins = ACTION_PROMPT, discretize_state(self.normalized_state(state))
        return build_prompt_tokens(self.tokenizer, instruction, template, self.config.max_token_len, bins)

    def model_state(self, state) -> torch.Tensor | None:
        """The continuous state input of :meth:`VLAModel.denoise`: fp32 ``[32]`` for π0, None for π0.5."""
        if self.config.variant == "pi05":
            return None
        return torch.as_tensor(self.normalized_state(state), dtype=torch.float32)

    def actions(self, actions: torch.Tensor) -> np.ndarray:
        """Model output ``[..., H, 32]`` → unnormalised float64 ``[..., H, robot.action_dim]``.

        Raises:
            ValueError: last axis is not the model's action dimension.
        """
        x = actions.detach().to(torch.float64).cpu().numpy() if isinstance(actions, torch.Tensor) \
            else np.asarray(actions, dtype=np.float64)
        if x.shape[-1] != self.config.action_dim:
            raise ValueError(f"actions must end in {self.config.action_dim}, got {x.shape}")
        x = x[..., :self.robot.action_dim]
        if self.norm_stats is not None:
            x = unnormalize(x, self.norm_stats["actions"], self.robot.norm_mode)
        return x
