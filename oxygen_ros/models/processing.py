r"""Pre- and post-processing between robot data and the model, following a checkpoint family's
:class:`~oxygen_ros.models.conventions.Conventions` (docs/conventions.md lists each fact's source).

* Images: an optional crop per camera (a fixed region of the frame, ``VLAConfig.image_crops``), then resize with padding to 224x224 keeping the aspect ratio, scale to [-1, 1]; the pad is
  exactly -1. The filter is the family's: openpi's PIL bilinear on uint8, or LeRobot's torch bilinear
  (no antialiasing) on float [0, 1]. A missing camera's slot is masked.
* State: the robot adaptation (ALOHA's joint flips and gripper conversion), then the family's
  normalisation of the robot's own, **unpadded** state; π0.5 discretises it into the prompt
  (``digitize(x, linspace(-1, 1, 257)[:-1]) - 1``, not clipped), π0 takes it zero-padded to 32.
* Prompts: the family's layout (``conventions.PromptLayout``): openpi π0.5 ``"Task: {clean}, State:
  {bins};\nAction: "``; openpi π0 and π0.5 without state BOS + the cleaned instruction, then ``"\n"``
  tokenised on its own; LeRobot π0 ``"{instruction}\n"`` in one piece; language tasks ``"Task:
  {instruction}. Subtask: "``. An over-long prompt is cut as the family cuts it, with a warning.
* Actions: the model's ``[H, 32]`` → the robot's ``[H, action_dim]``: slice, unnormalise, add the state
  back on the delta dimensions, the robot adaptation's action side.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.nn.functional as F

from .config import NormStats, RobotConfig, VLAConfig, check_norm_stats
from .conventions import (LANGUAGE_PROMPT, NEWLINE_PROMPT, PI05_STATE_PROMPT, TOKEN_BREAK, Conventions,
                          PromptLayout, discretize_state, variant_defaults)
from .tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

ACTION_PROMPT = PI05_STATE_PROMPT
PI0_PROMPT = NEWLINE_PROMPT
__all__ = ["ACTION_PROMPT", "LANGUAGE_PROMPT", "PI0_PROMPT", "Processor", "build_prompt_tokens",
           "clean_instruction", "crop_image", "discretize_state", "pad_to", "prompt_parts", "resize_with_pad"]


def crop_image(image, box: tuple[float, float, float, float]):
    """The region ``box`` of camera image(s), before the resize (``VLAConfig.image_crops``).

    Args:
        image: ``[H, W, 3]`` or ``[N, H, W, 3]`` (numpy or torch, any dtype).
        box: ``(top, left, height, width)`` as fractions of the frame's height (top, height) and width
            (left, width). Pixel bounds are rounded: rows ``round(top·H)`` .. ``round((top + height)·H)``
            (end excluded), columns likewise with W — e.g. ``(0.35, 0.35, 0.4667, 0.35)`` of a 240 x 320 frame
            is rows 84..196 and columns 112..224, a 112 x 112 region.

    Returns:
        a contiguous array of the same kind and dtype, ``[h, w, 3]`` or ``[N, h, w, 3]``.

    Raises:
        ValueError: an image that is not ``[..., H, W, 3]``, or a box that rounds to no pixel on this frame.
    """
    if image.ndim not in (3, 4) or image.shape[-1] != 3:
        raise ValueError(f"image must be [H, W, 3] or [N, H, W, 3], got {tuple(image.shape)}")
    height, width = image.shape[-3], image.shape[-2]
    top, left, box_h, box_w = box
    r0, r1 = round(top * height), min(height, round((top + box_h) * height))
    c0, c1 = round(left * width), min(width, round((left + box_w) * width))
    if r1 <= r0 or c1 <= c0:
        raise ValueError(f"image crop {tuple(box)} covers no pixel of a {height} x {width} frame")
    region = image[..., r0:r1, c0:c1, :]
    return region.contiguous() if isinstance(region, torch.Tensor) else np.ascontiguousarray(region)


def resize_with_pad(image, size: int = 224, method: str = "pil_bilinear") -> torch.Tensor:
    """Camera image(s) → model pixels.

    Args:
        image: ``[H, W, 3]`` or ``[N, H, W, 3]`` (numpy or torch), uint8 in [0, 255] or float in [0, 1].
        size: output side in pixels.
        method: ``'pil_bilinear'`` (openpi ``image_tools.resize_with_pad``: uint8 through PIL's
            bilinear filter, zero pad, then ``/255·2 − 1``; float input is first rounded to uint8) or
            ``'torch_bilinear'`` (LeRobot ``resize_with_pad_torch``: float [0, 1] through
            ``F.interpolate(mode='bilinear', align_corners=False)``, clamp to [0, 1], pad, ``·2 − 1``).

    Returns:
        fp32 ``[3, size, size]`` or ``[N, 3, size, size]`` in [-1, 1]: resized so the longer side is
        ``size`` (``int(side / ratio)``), centred (offset ``floor((size − side)/2)``), padded with
        exactly -1; an image already ``size`` x ``size`` is only scaled.

    Raises:
        ValueError: wrong shape, an empty image, a dtype other than uint8 / floating point, or an
            unknown method.
        ImportError: ``pil_bilinear`` without Pillow installed.
    """
    x = torch.as_tensor(image)
    single = x.dim() == 3
    if single:
        x = x[None]
    if x.dim() != 4 or x.shape[-1] != 3 or x.shape[1] == 0 or x.shape[2] == 0:
        raise ValueError(f"image must be [H, W, 3] or [N, H, W, 3], got {tuple(x.shape)}")
    if x.dtype != torch.uint8 and not x.is_floating_point():
        raise ValueError(f"image dtype must be uint8 or floating point, got {x.dtype}")
    height, width = x.shape[1:3]
    ratio = max(height / size, width / size)
    new_h, new_w = max(1, int(height / ratio)), max(1, int(width / ratio))
    top, left = (size - new_h) // 2, (size - new_w) // 2
    if method == "pil_bilinear":
        if x.is_floating_point():
            x = (x.to(torch.float64).clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
        pixels = x.numpy() if (new_h, new_w) == (height, width) else _pil_resize(x.numpy(), new_h, new_w)
        out = torch.zeros((x.shape[0], size, size, 3), dtype=torch.uint8)
        out[:, top:top + new_h, left:left + new_w] = torch.from_numpy(np.ascontiguousarray(pixels))
        out = out.permute(0, 3, 1, 2).to(torch.float32) / 255.0 * 2.0 - 1.0
    elif method == "torch_bilinear":
        x = x.to(torch.float32) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float32)
        x = x.permute(0, 3, 1, 2)
        if (new_h, new_w) != (height, width):
            x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False)
        x = x.clamp(0.0, 1.0) * 2.0 - 1.0
        out = F.pad(x, (left, size - new_w - left, top, size - new_h - top), value=-1.0)
    else:
        raise ValueError(f"resize method must be 'pil_bilinear' or 'torch_bilinear', got {method!r}")
    return out[0] if single else out


def _pil_resize(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 ``[N, H, W, 3]`` → ``[N, height, width, 3]`` with PIL's bilinear filter."""
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(im).resize((width, height), resample=Image.BILINEAR))
                     for im in images])


def pad_to(x: np.ndarray, dim: int) -> np.ndarray:
    """Zero-pad the last axis of ``x`` to ``dim``.

    Raises:
        ValueError: ``x`` already has more than ``dim`` entries (never truncated silently).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] > dim:
        raise ValueError(f"dimension {x.shape[-1]} exceeds the model's padded dimension {dim}")
    return np.concatenate([x, np.zeros((*x.shape[:-1], dim - x.shape[-1]))], axis=-1)


def clean_instruction(instruction: str, mode: str = "openpi") -> str:
    r"""The instruction as the family cleans it: ``openpi`` (strip, ``_`` and newlines → spaces;
    openpi ``tokenizer.py``, LeRobot ``processor_pi05.py``), ``final_newline`` (one trailing ``\n``
    dropped, since LeRobot π0 appends ``\n`` only where missing), ``none``."""
    if mode == "openpi":
        return instruction.strip().replace("_", " ").replace("\n", " ")
    if mode == "final_newline":
        return instruction[:-1] if instruction.endswith("\n") else instruction
    return instruction


def prompt_parts(layout: PromptLayout, instruction: str, state_bins=None) -> list[str]:
    """The prompt text of ``layout``, split at :data:`TOKEN_BREAK` into the parts tokenised separately;
    ``"".join`` of them is the whole prompt string.

    Args:
        layout: template, cleaning and truncation.
        instruction: raw instruction (cleaned here).
        state_bins: int bins for ``{state}`` (space separated), required iff the template has it.

    Raises:
        ValueError: a missing or extra state.
    """
    if layout.has_state != (state_bins is not None):
        raise ValueError("state_bins must be given exactly when the template has a {state} field")
    state_text = "" if state_bins is None else " ".join(str(int(b)) for b in state_bins)
    text = clean_instruction(instruction, layout.clean)
    return [part.format(instruction=text, state=state_text) for part in layout.template.split(TOKEN_BREAK)]


def _encode_parts(tokenizer: TextTokenizer, parts: list[str]) -> list[int]:
    return [i for n, part in enumerate(parts) for i in tokenizer.encode(part, add_bos=n == 0)]


def build_prompt_tokens(tokenizer: TextTokenizer, instruction: str, layout: PromptLayout | str, max_len: int,
                        state_bins=None) -> list[int]:
    """BOS + the tokens of the prompt (:func:`prompt_parts`, each part tokenised on its own).

    An over-long prompt is cut per ``layout.truncation`` (a warning is logged once per instruction):
    ``tail`` keeps the first ``max_len`` tokens (openpi, LeRobot); ``instruction`` removes instruction
    tokens from the instruction's end until the prompt fits, keeping the rest of the template (its
    trailing anchor such as ``"Subtask: "`` and the state).

    Args:
        tokenizer: see :mod:`oxygen_ros.models.tokenizer`.
        instruction: free text.
        layout: a :class:`PromptLayout`, or a template string (openpi cleaning, ``instruction``
            truncation).
        max_len: token budget (``max_token_len``).
        state_bins: int bins for ``{state}``, required iff the template has it.

    Returns:
        list of int token ids, ``len <= max_len``.

    Raises:
        ValueError: a missing/extra state, or (``instruction`` truncation) a budget too small even for
            an empty instruction.
    """
    if isinstance(layout, str):
        layout = PromptLayout(layout, truncation="instruction")
    tokens = _encode_parts(tokenizer, prompt_parts(layout, instruction, state_bins))
    if len(tokens) <= max_len:
        return tokens
    if layout.truncation == "tail":
        _warn_truncated(instruction, len(tokens), max_len, tokenizer.decode(tokens[:max_len]))
        return tokens[:max_len]
    plain = dataclasses.replace(layout, clean="none")
    text = clean_instruction(instruction, layout.clean)

    def encode(instr: str) -> list[int]:
        return _encode_parts(tokenizer, prompt_parts(plain, instr, state_bins))

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
                   num_tokens, max_len, instruction[:80], kept[-80:])


@dataclasses.dataclass
class Processor:
    """Robot data ↔ model tensors for one model, one robot and one checkpoint family.

    Args:
        config: model architecture (variant, sizes, prompt budget).
        robot: state/action dimensions and camera slots.
        tokenizer: text tokenizer.
        norm_stats: ``{"state": NormStats, "actions": NormStats}``; None = data already normalised
            (identity, for random-weight tests).
        conventions: the checkpoint family's conventions; None = the defaults of ``config.variant``
            with its horizon and prompt budget (:func:`~oxygen_ros.models.conventions.variant_defaults`).

    Raises:
        ValueError: a family of another variant or model dimension; robot dimensions or cameras that
            contradict the family; statistics missing for a normalised key, or non-finite / degenerate
            in the dimensions used (naming key, dimension and value); Pillow missing for a family that
            resizes with PIL.
    """

    config: VLAConfig
    robot: RobotConfig
    tokenizer: TextTokenizer
    norm_stats: dict[str, NormStats] | None = None
    conventions: Conventions | None = None

    def __post_init__(self):
        if self.conventions is None:
            self.conventions = variant_defaults(self.config.variant, self.config.action_horizon,
                                                self.config.max_token_len)
        conv, robot = self.conventions, self.robot
        if conv.variant != self.config.variant:
            raise ValueError(f"model {self.config.name} is {self.config.variant}, {conv.source} is {conv.variant}")
        if conv.model_dim != self.config.action_dim:
            raise ValueError(f"{conv.source}: model dimension {conv.model_dim}, the model has {self.config.action_dim}")
        for what, have, want in (("state", robot.state_dim, conv.state_dim), ("action", robot.action_dim,
                                                                               conv.action_dim)):
            if want is not None and have != want:
                raise ValueError(f"robot {robot.name} has {have} {what} dimensions, {conv.source} has {want}")
        # π0.5 reads the state only as discretised prompt tokens, so a state longer than the padded
        # action dimension is kept whole (openpi's pad_to_dim never truncates); π0's state projection
        # takes exactly action_dim inputs.
        state_limit = self.config.action_dim if self.config.variant == "pi0" else None
        if robot.action_dim > self.config.action_dim or (state_limit is not None and robot.state_dim > state_limit):
            raise ValueError(f"robot {robot.name} dims (state {robot.state_dim}, action "
                             f"{robot.action_dim}) exceed the model's {self.config.action_dim}")
        if len(conv.delta_mask) > min(robot.state_dim, robot.action_dim):
            raise ValueError(f"{conv.source}: delta mask of {len(conv.delta_mask)} dimensions, robot {robot.name} "
                             f"has state {robot.state_dim}, action {robot.action_dim}")
        if conv.adaptation is not None and conv.adaptation.dim != robot.state_dim or \
                conv.adaptation is not None and conv.adaptation.dim != robot.action_dim:
            raise ValueError(f"{conv.source}: robot adaptation of {conv.adaptation.dim} dimensions, robot "
                             f"{robot.name} has state {robot.state_dim}, action {robot.action_dim}")
        cropped = [c[0] for c in self.config.image_crops if c[0] not in robot.camera_slots]
        if cropped:
            raise ValueError(f"image crops for camera slots {cropped} the robot {robot.name} does not have "
                             f"(its slots: {list(robot.camera_slots)})")
        unknown = [slot for slot in robot.camera_slots if conv.camera(slot) is None]
        if unknown:
            raise ValueError(f"camera slots {unknown} are not used by {conv.source} "
                             f"(its slots: {[c.slot for c in conv.cameras]})")
        if self.norm_stats is not None:
            for key, norm, dim in (("state", conv.state_norm, robot.state_dim),
                                   ("actions", conv.action_norm, robot.action_dim)):
                if norm.mode == "identity":
                    continue
                if key not in self.norm_stats:
                    raise ValueError(f"norm stats need {key!r} ({norm.mode} normalisation), got "
                                     f"{sorted(self.norm_stats)}")
                check_norm_stats(self.norm_stats[key], key, dim, norm.mode)
        if conv.image_resize == "pil_bilinear":
            try:
                import PIL  # noqa: F401
            except ImportError as error:
                raise ValueError(f"{conv.source} resizes images with PIL (openpi): install Pillow") from error

    def _stats(self, key: str) -> NormStats | None:
        return None if self.norm_stats is None else self.norm_stats.get(key)

    def camera_view(self, slot: str, image):
        """The part of camera ``slot``'s frame the model sees: its crop (``config.image_crops``,
        :func:`crop_image`), or the frame itself when the slot has none. Image as :func:`crop_image`."""
        box = self.config.image_crop(slot)
        return image if box is None else crop_image(image, box)

    def images(self, frames: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
        """Camera frames by slot name → ``(pixels fp32 [C, 3, 224, 224], camera_mask bool [C])``.

        Slots follow ``robot.camera_slots``; a missing slot (absent or None) is masked and its pixels
        are -1 (never encoded: callers skip masked cameras). Cropped (:meth:`camera_view`), then resized per
        ``conventions.image_resize``.

        Raises:
            ValueError: unknown slot names, no camera at all, or a camera the family requires missing.
        """
        unknown = set(frames) - set(self.robot.camera_slots)
        if unknown:
            raise ValueError(f"unknown camera slots {sorted(unknown)}; robot has {self.robot.camera_slots}")
        size = self.config.image_size
        pixels = torch.full((len(self.robot.camera_slots), 3, size, size), -1.0)
        mask = torch.zeros(len(self.robot.camera_slots), dtype=torch.bool)
        for i, slot in enumerate(self.robot.camera_slots):
            if frames.get(slot) is not None:
                pixels[i] = resize_with_pad(self.camera_view(slot, frames[slot]), size, self.conventions.image_resize)
                mask[i] = True
            elif self.conventions.camera(slot).required:
                raise ValueError(f"camera {slot} ({self.conventions.camera(slot).key}) is required by "
                                 f"{self.conventions.source}")
        if not bool(mask.any()):
            raise ValueError("no camera image given")
        return pixels, mask

    def _raw_state(self, state) -> np.ndarray:
        state = np.asarray(state, dtype=np.float64)
        if state.shape != (self.robot.state_dim,):
            raise ValueError(f"state must have shape ({self.robot.state_dim},), got {state.shape}")
        return state

    def adapted_state(self, state) -> np.ndarray:
        """Robot state ``[state_dim]`` → float64 ``[state_dim]`` after the family's robot adaptation
        (ALOHA: joint flips, gripper linear → angular); unchanged without one.

        Raises:
            ValueError: wrong state dimension.
        """
        state = self._raw_state(state)
        adaptation = self.conventions.adaptation
        return state if adaptation is None else adaptation.state_in(state)

    def normalized_state(self, state) -> np.ndarray:
        """Robot state ``[state_dim]`` → adapted and normalised float64 ``[state_dim]`` (not padded).

        Raises:
            ValueError: wrong state dimension.
        """
        return self.conventions.state_norm.normalize(self.adapted_state(state), self._stats("state"))

    def state_bins(self, state) -> np.ndarray:
        """The discretised normalised state, int ``[state_dim]`` (bins -1 … 255, not clipped)."""
        return discretize_state(self.normalized_state(state))

    def layout(self, task: str) -> PromptLayout:
        """The prompt layout of ``task`` ``'action'`` or ``'language'``.

        Raises:
            ValueError: unknown task.
        """
        if task not in ("action", "language"):
            raise ValueError(f"task must be 'action' or 'language', got {task!r}")
        return self.conventions.action_prompt if task == "action" else self.conventions.language_prompt

    def prompt(self, instruction: str, state=None, task: str = "action", layout: PromptLayout | None = None
               ) -> list[str]:
        """The prompt's text, as the parts tokenised separately (``"".join`` = the prompt string).

        Args:
            instruction: raw instruction.
            state: robot state ``[state_dim]``; required when the layout carries the state.
            task: ``'action'`` or ``'language'`` (ignored when ``layout`` is given).
            layout: an explicit layout instead of the task's.

        Raises:
            ValueError: unknown task, or a layout with the state and no state given.
        """
        layout = self.layout(task) if layout is None else layout
        if layout.has_state and state is None:
            raise ValueError("this prompt carries the robot state: give the state")
        return prompt_parts(layout, instruction, self.state_bins(state) if layout.has_state else None)

    def prompt_tokens(self, instruction: str, state=None, task: str = "action",
                      layout: PromptLayout | None = None) -> list[int]:
        """Prompt token ids (BOS first; see :meth:`prompt` and :func:`build_prompt_tokens`)."""
        layout = self.layout(task) if layout is None else layout
        if layout.has_state and state is None:
            raise ValueError("this prompt carries the robot state: give the state")
        bins = self.state_bins(state) if layout.has_state else None
        return build_prompt_tokens(self.tokenizer, instruction, layout, self.conventions.max_token_len, bins)

    def model_state(self, state) -> torch.Tensor | None:
        """The continuous state input of :meth:`VLAModel.denoise`: fp32 ``[32]`` (normalised, zero-padded)
        for π0, None for π0.5."""
        if self.config.variant == "pi05":
            return None
        return torch.as_tensor(pad_to(self.normalized_state(state), self.config.action_dim), dtype=torch.float32)

    def robot_actions(self, actions, state=None) -> np.ndarray:
        """Model output ``[..., H, 32]`` + the state the chunk was computed from → the robot's actions.

        In the family's order (openpi ``policy_config.py`` output transforms, LeRobot post-processor):
        slice to ``robot.action_dim``, unnormalise, add the state back on the delta dimensions
        (``conventions.delta_mask``, against the adapted or the raw state per ``delta_state``), the
        robot adaptation's action side.

        Args:
            actions: ``[..., H, 32]`` (torch or numpy).
            state: robot state ``[state_dim]`` in the robot's units; required when the family has
                delta dimensions.

        Returns:
            float64 ``[..., H, robot.action_dim]``.

        Raises:
            ValueError: last axis is not the model's action dimension, or a delta family without state.
        """
        x = actions.detach().to(torch.float64).cpu().numpy() if isinstance(actions, torch.Tensor) \
            else np.asarray(actions, dtype=np.float64)
        if x.shape[-1] != self.config.action_dim:
            raise ValueError(f"actions must end in {self.config.action_dim}, got {x.shape}")
        conv = self.conventions
        x = conv.action_norm.unnormalize(x[..., :self.robot.action_dim], self._stats("actions"))
        if conv.delta_mask:
            if state is None:
                raise ValueError(f"{conv.source} predicts delta actions: the state is needed")
            reference = self.adapted_state(state) if conv.delta_state == "adapted" else self._raw_state(state)
            mask = np.asarray(conv.delta_mask)
            x[..., :mask.size] += np.where(mask, reference[:mask.size], 0.0)
        if conv.adaptation is not None:
            x = conv.adaptation.actions_out(x)
        return x
