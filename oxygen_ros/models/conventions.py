"""Checkpoint-family conventions as data: everything between a robot's raw data and the model's tensors.

A checkpoint only works with the inputs it was trained on. Which prompt layout, which normalisation,
which action horizon, which joints are predicted relative to the state, which robot-specific
conversions, which camera goes into which slot — these are facts of the *checkpoint family*, here one
frozen, validated :class:`Conventions` per family. The facts reproduce the public reference
implementations; docs/conventions.md lists each with the file it comes from:

* openpi: ``src/openpi/training/config.py`` (``pi05_aloha``, ``pi05_droid``, ``pi05_libero``,
  ``pi0_aloha``, ``pi0_droid``, ``pi0_libero``), ``src/openpi/policies/{aloha,droid,libero}_policy.py``,
  ``src/openpi/transforms.py``, ``src/openpi/models/tokenizer.py``, ``src/openpi/models/pi0_config.py``,
  ``src/openpi/policies/policy_config.py``, ``packages/openpi-client/src/openpi_client/image_tools.py``;
* LeRobot: ``src/lerobot/policies/pi05/processor_pi05.py``, ``src/lerobot/policies/pi0/processor_pi0.py``,
  their ``configuration_*.py``, ``src/lerobot/processor/normalize_processor.py``,
  ``src/lerobot/processor/relative_action_processor.py``, ``src/lerobot/policies/common/vla_utils.py``.

Where the conventions come from (:func:`resolve_conventions`): a LeRobot checkpoint directory carries
them (``config.json``, ``policy_preprocessor.json``, ``policy_postprocessor.json`` and their
``*.safetensors`` statistics) and wins; otherwise the family named by the node's ``conventions``
parameter (:data:`FAMILIES`); otherwise the defaults of the preset's variant (:func:`variant_defaults`:
openpi's base-model conventions, π0 mean/std, π0.5 quantile). Explicit settings may confirm binding
conventions but never contradict them (:func:`apply_settings`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from .config import NormStats

NORM_MODES = ("quantile", "mean_std", "identity")
CLEAN_MODES = ("openpi", "final_newline", "none")
TRUNCATIONS = ("tail", "instruction")
IMAGE_RESIZES = ("pil_bilinear", "torch_bilinear")
DELTA_STATES = ("adapted", "raw")
# The model's camera slots (openpi image keys), in the order the model sees them.
MODEL_CAMERA_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
# Marks a token boundary in a prompt template: the parts before and after it are tokenised separately
# (openpi's π0 layout encodes "\n" on its own), only the first part gets BOS.
TOKEN_BREAK = "{split}"

# Prompt templates (str.format with {instruction} and {state}; TOKEN_BREAK as above).
PI05_STATE_PROMPT = "Task: {instruction}, State: {state};\nAction: "
NEWLINE_PROMPT = "{instruction}" + TOKEN_BREAK + "\n"
LEROBOT_PI0_PROMPT = "{instruction}\n"
LANGUAGE_PROMPT = "Task: {instruction}. Subtask: "


def _check(value, allowed: tuple, what: str):
    if value not in allowed:
        raise ValueError(f"{what} must be one of {list(allowed)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Normalization:
    """How one key (state or actions) is normalised, with the reference's epsilons.

    ``quantile``: ``2·(x − q01)/(q99 − q01 + eps) − 1``, inverse ``(y + 1)/2·(q99 − q01 + inverse_eps) + q01``;
    ``mean_std``: ``(x − mean)/(std + eps)``, inverse ``y·(std + inverse_eps) + mean``; ``identity``: none.
    openpi (``transforms.py`` ``Normalize``/``Unnormalize``): eps = inverse_eps = 1e-6 in both modes.
    LeRobot (``normalize_processor.py``): quantile without epsilon (its 1e-8 only replaces a zero range,
    which :func:`~oxygen_ros.models.config.check_norm_stats` rejects), mean/std eps 1e-8 on the way in
    and none on the way out.

    ``dtype`` is the arithmetic of the way in, which decides the π0.5 state bins at their edges:
    ``float64`` (openpi: numpy on the state as the client sends it and the float64 statistics of its
    ``norm_stats.json``, in the order written above) or ``float32`` (LeRobot: torch float32 tensors of the
    state and the statistics, ``2·(x − q01)/(q99 − q01) − 1`` in that order). The way out is float64 in
    both.

    Raises:
        ValueError: unknown mode or dtype, or a negative epsilon.
    """

    mode: str
    eps: float = 1e-6
    inverse_eps: float = 1e-6
    dtype: str = "float64"

    def __post_init__(self):
        _check(self.mode, NORM_MODES, "normalisation mode")
        _check(self.dtype, ("float64", "float32"), "normalisation dtype")
        if self.eps < 0 or self.inverse_eps < 0:
            raise ValueError(f"normalisation epsilons must be >= 0, got {self.eps}, {self.inverse_eps}")

    def normalize(self, x, stats: NormStats | None) -> np.ndarray:
        """``x [..., D]`` (the robot's units, as received) → normalised float64 ``[..., D]``, with the first D
        dims of ``stats`` (None = identity), computed in :attr:`dtype` (float32 values are returned exactly
        as float64)."""
        if self.mode == "identity" or stats is None:
            return np.asarray(x, dtype=np.float64)
        dim = np.shape(x)[-1]
        if self.dtype == "float32":
            f = np.float32
            x = np.asarray(x, dtype=f)
            if self.mode == "quantile":
                q01, q99 = stats.q01[:dim].astype(f), stats.q99[:dim].astype(f)
                y = f(2.0) * (x - q01) / (q99 - q01 + f(self.eps)) - f(1.0)
            else:
                y = (x - stats.mean[:dim].astype(f)) / (stats.std[:dim].astype(f) + f(self.eps))
            return y.astype(np.float64)
        x = np.asarray(x, dtype=np.float64)
        if self.mode == "quantile":
            q01, q99 = stats.q01[:dim], stats.q99[:dim]
            return (x - q01) / (q99 - q01 + self.eps) * 2.0 - 1.0
        return (x - stats.mean[:dim]) / (stats.std[:dim] + self.eps)

    def unnormalize(self, y, stats: NormStats | None) -> np.ndarray:
        """Inverse of :meth:`normalize` (with ``inverse_eps``)."""
        y = np.asarray(y, dtype=np.float64)
        if self.mode == "identity" or stats is None:
            return y
        dim = y.shape[-1]
        if self.mode == "quantile":
            q01, q99 = stats.q01[:dim], stats.q99[:dim]
            return (y + 1.0) / 2.0 * (q99 - q01 + self.inverse_eps) + q01
        return y * (stats.std[:dim] + self.inverse_eps) + stats.mean[:dim]


@dataclasses.dataclass(frozen=True)
class PromptLayout:
    """How one task's prompt is written and tokenised.

    Attributes:
        template: ``str.format`` text with ``{instruction}`` and optionally ``{state}`` (the
            discretised state, space-separated bins); :data:`TOKEN_BREAK` splits it into parts that
            are tokenised separately (BOS before the first only).
        clean: instruction cleaning — ``openpi`` (strip, ``_`` and newlines → spaces;
            ``tokenizer.py``), ``final_newline`` (drop one trailing ``\\n``: LeRobot π0 appends ``\\n``
            only where missing, ``processor_pi0.py``) or ``none``.
        truncation: an over-long prompt keeps its first ``max_token_len`` tokens (``tail`` is cut: what
            openpi's tokenizer and LeRobot's ``truncation=True`` do) or loses instruction tokens from
            the instruction's end, keeping the template's anchor (``instruction``; our language tasks).

    Raises:
        ValueError: no ``{instruction}`` field, unknown clean / truncation mode.
    """

    template: str
    clean: str = "openpi"
    truncation: str = "tail"

    def __post_init__(self):
        if "{instruction}" not in self.template:
            raise ValueError(f"prompt template must contain {{instruction}}, got {self.template!r}")
        _check(self.clean, CLEAN_MODES, "prompt clean mode")
        _check(self.truncation, TRUNCATIONS, "prompt truncation")

    @property
    def has_state(self) -> bool:
        """Whether the prompt carries the discretised state."""
        return "{state}" in self.template


@dataclasses.dataclass(frozen=True)
class CameraSpec:
    """One camera of a family: the model slot it fills, the reference's camera key, and whether a
    missing frame is allowed (then the slot is filled with −1 pixels and masked out of attention:
    openpi fills zeros in uint8, which scale to −1, LeRobot fills −1; both set the mask false)."""

    slot: str
    key: str
    required: bool

    def __post_init__(self):
        _check(self.slot, MODEL_CAMERA_SLOTS, "camera slot")


def _interval(x, low: float, high: float):
    return (x - low) / (high - low)


def _from_interval(x, low: float, high: float):
    return x * (high - low) + low


@dataclasses.dataclass(frozen=True)
class AlohaAdaptation:
    """openpi's ALOHA robot adaptation (``aloha_policy.py``, ``adapt_to_pi=True``): converts the
    standard ALOHA joint space to the one π0 was pre-trained in, and back for the actions.

    State side (``_decode_state``): ``s ← joint_signs·s``; grippers: the ALOHA runtime's normalised
    linear position g ∈ [0, 1] → metres ``l = g·(0.05800 − 0.01844) + 0.01844`` → horn angle
    ``θ = asin(clip((r² + l² − a²)/(2·r·l), −1, 1))`` (Interbotix arm length a = 0.036, horn radius
    r = 0.022) → ``(θ − 0.5476)/(1.6296 − 0.5476)``.
    Action side (``_encode_actions``, not the inverse of the state side): ``a ← joint_signs·a``;
    grippers: ``(a + 0.5476 − (−0.6213))/(1.4910 − (−0.6213))`` (ALOHA's normalised gripper joint).
    """

    joint_signs: tuple[float, ...] = (1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1)
    gripper_dims: tuple[int, ...] = (6, 13)
    gripper_position_range: tuple[float, float] = (0.01844, 0.05800)
    arm_length: float = 0.036
    horn_radius: float = 0.022
    gripper_angle_range: tuple[float, float] = (0.5476, 1.6296)
    action_gripper_offset: float = 0.5476
    gripper_joint_range: tuple[float, float] = (-0.6213, 1.4910)

    @property
    def dim(self) -> int:
        return len(self.joint_signs)

    def state_in(self, state: np.ndarray) -> np.ndarray:
        """Robot state float64 ``[dim]`` → the model's joint space (flips, gripper linear → angular)."""
        out = np.asarray(state, dtype=np.float64) * np.asarray(self.joint_signs, dtype=np.float64)
        dims = list(self.gripper_dims)
        linear = _from_interval(out[dims], *self.gripper_position_range)
        r, a = self.horn_radius, self.arm_length
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (r ** 2 + linear ** 2 - a ** 2) / (2.0 * r * linear)
        out[dims] = _interval(np.arcsin(np.clip(ratio, -1.0, 1.0)), *self.gripper_angle_range)
        return out

    def actions_out(self, actions: np.ndarray) -> np.ndarray:
        """Model-space actions float64 ``[..., dim]`` → the robot's (flips, gripper affine map)."""
        out = np.asarray(actions, dtype=np.float64) * np.asarray(self.joint_signs, dtype=np.float64)
        dims = list(self.gripper_dims)
        out[..., dims] = _interval(out[..., dims] + self.action_gripper_offset, *self.gripper_joint_range)
        return out


@dataclasses.dataclass(frozen=True)
class CheckpointRTC:
    """The real-time chunking settings a checkpoint's configuration carries (LeRobot's ``rtc_config``:
    ``enabled``, ``prefix_attention_schedule`` LINEAR / EXP / ZEROS / ONES, ``max_guidance_weight``,
    ``execution_horizon``), in this package's names (``rtc.*``, ``models/rtc.py``). The node takes them as the
    defaults of its ``rtc.*`` parameters, ``enabled`` excepted (docs/models.md, "Real-time chunking")."""

    enabled: bool
    schedule: str
    max_guidance_weight: float
    execution_horizon: int


@dataclasses.dataclass(frozen=True)
class Conventions:
    """One checkpoint family's conventions (see the module docstring and docs/conventions.md).

    Attributes:
        name: ``openpi/pi05_droid``, ``lerobot/pi05``, ... (:data:`FAMILIES`).
        variant: ``pi05`` or ``pi0``: the model the family was trained for.
        action_horizon: H, actions per chunk the checkpoint was trained to predict.
        max_token_len: prompt budget in tokens (openpi: 200 for π0.5, 48 for π0).
        model_dim: the model's padded state / action dimension (32).
        state_dim, action_dim: the robot's state and action dimensions (None: any; the node's
            ``joint_names`` / ``action_dim`` decide).
        action_prompt, language_prompt: prompt layouts of the action task and the language tasks.
        state_bins: bins of the π0.5 state discretisation over [−1, 1]
            (``digitize(x, linspace(−1, 1, bins + 1)[:−1]) − 1``, no clipping).
        state_norm, action_norm: normalisation of the state and of the actions.
        delta_mask: action dimensions the model predicts relative to the state (added back on
            output, against ``state[:len(mask)]``); empty = all absolute.
        delta_state: which state the deltas are taken against: ``adapted`` (after the robot
            adaptation, openpi's ``DeltaActions`` sees ``AlohaInputs``' output) or ``raw`` (the robot's
            state as measured; LeRobot's ``RelativeActionsProcessorStep``).
        adaptation: robot-specific conversion (:class:`AlohaAdaptation`) or None.
        cameras: camera specs; slots not listed are always masked (e.g. DROID's right wrist).
        action_dt_s: the action period the family was recorded at [s] (None: unknown).
        default_prompt: the instruction the family's inputs carry when none is given (openpi
            ``default_prompt``, injected only where the data has no prompt); None: none.
        image_resize: ``pil_bilinear`` (openpi: uint8 through PIL's bilinear filter, zero pad) or
            ``torch_bilinear`` (LeRobot: float [0, 1] through ``F.interpolate(mode='bilinear',
            align_corners=False)`` without antialiasing).
        norm_stats_asset: openpi asset id: the checkpoint keeps its statistics in
            ``assets/<asset>/norm_stats.json``; None for other sources.
        action_steps: actions of each chunk the checkpoint's own executor runs before it predicts again
            (LeRobot's ``n_action_steps``); None: not said.
        rtc: the checkpoint's real-time chunking settings (:class:`CheckpointRTC`); None: none.
        source: where these conventions come from (for messages).
        binding: True when they come from the checkpoint or a named family: explicit settings may
            then only confirm them; False for the preset's defaults, which settings override.

    Raises:
        ValueError: inconsistent values (unknown modes, a delta mask longer than the action or state
            dimension, an adaptation of another dimension, duplicate camera slots).
    """

    name: str
    variant: str
    action_horizon: int
    max_token_len: int
    action_prompt: PromptLayout
    state_norm: Normalization
    action_norm: Normalization
    language_prompt: PromptLayout = PromptLayout(LANGUAGE_PROMPT, truncation="instruction")
    model_dim: int = 32
    state_dim: int | None = None
    action_dim: int | None = None
    state_bins: int = 256
    delta_mask: tuple[bool, ...] = ()
    delta_state: str = "adapted"
    adaptation: AlohaAdaptation | None = None
    cameras: tuple[CameraSpec, ...] = tuple(CameraSpec(s, s, False) for s in MODEL_CAMERA_SLOTS)
    action_dt_s: float | None = None
    default_prompt: str | None = None
    image_resize: str = "pil_bilinear"
    norm_stats_asset: str | None = None
    action_steps: int | None = None
    rtc: CheckpointRTC | None = None
    source: str = ""
    binding: bool = True

    def __post_init__(self):
        _check(self.variant, ("pi05", "pi0"), "variant")
        _check(self.delta_state, DELTA_STATES, "delta_state")
        _check(self.image_resize, IMAGE_RESIZES, "image_resize")
        if self.action_horizon < 1 or self.max_token_len < 1 or self.model_dim < 1 or self.state_bins < 2:
            raise ValueError(f"{self.name}: horizon, prompt budget, model dimension and bins must be positive")
        for what, dim in (("state_dim", self.state_dim), ("action_dim", self.action_dim)):
            if dim is not None and dim < 1:
                raise ValueError(f"{self.name}: {what} must be positive, got {dim}")
        if self.action_dim is not None and self.action_dim > self.model_dim:
            raise ValueError(f"{self.name}: action_dim {self.action_dim} exceeds the model's {self.model_dim}")
        if self.variant == "pi0" and self.state_dim is not None and self.state_dim > self.model_dim:
            raise ValueError(f"{self.name}: π0's state projection takes {self.model_dim} inputs, "
                             f"state_dim is {self.state_dim}")
        if self.variant == "pi0" and self.action_prompt.has_state:
            raise ValueError(f"{self.name}: π0 takes the state as a continuous token, not in the prompt")
        for what, dim in (("action_dim", self.action_dim), ("state_dim", self.state_dim)):
            if self.delta_mask and dim is not None and len(self.delta_mask) > dim:
                raise ValueError(f"{self.name}: delta mask of {len(self.delta_mask)} dimensions exceeds {what} {dim}")
        if self.adaptation is not None:
            for what, dim in (("state_dim", self.state_dim), ("action_dim", self.action_dim)):
                if dim != self.adaptation.dim:
                    raise ValueError(f"{self.name}: the robot adaptation is {self.adaptation.dim}-D, {what} is {dim}")
        slots = [c.slot for c in self.cameras]
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"{self.name}: camera slots must be non-empty and unique, got {slots}")
        if self.action_dt_s is not None and not self.action_dt_s > 0:
            raise ValueError(f"{self.name}: action_dt_s must be positive, got {self.action_dt_s}")
        if self.action_steps is not None and not 1 <= self.action_steps <= self.action_horizon:
            raise ValueError(f"{self.name}: action_steps must be in 1..{self.action_horizon} (the horizon), "
                             f"got {self.action_steps}")

    def replace(self, **changes) -> "Conventions":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def norm_mode(self) -> str:
        """The normalisation mode of both keys, or ``'state:<m>/actions:<m>'`` when they differ."""
        s, a = self.state_norm.mode, self.action_norm.mode
        return s if s == a else f"state:{s}/actions:{a}"

    def describe(self) -> str:
        """One line for logs: name, origin, horizon, normalisation, prompt, deltas, adaptation."""
        prompt = "state in the prompt" if self.action_prompt.has_state else repr(self.action_prompt.template)
        delta = [i for i, d in enumerate(self.delta_mask) if d]
        return (f"{self.name} (from {self.source}): H {self.action_horizon}, {self.norm_mode} normalisation, "
                f"prompt {prompt}, delta dims {delta or 'none'}, "
                f"{'ALOHA adaptation' if self.adaptation else 'no robot adaptation'}, resize {self.image_resize}"
                + (f", {self.action_steps} actions per chunk executed" if self.action_steps else "")
                + (f", RTC {'on' if self.rtc.enabled else 'off'} ({self.rtc.schedule}, beta "
                   f"{self.rtc.max_guidance_weight:g}, s {self.rtc.execution_horizon})" if self.rtc else ""))

    def camera(self, slot: str) -> CameraSpec | None:
        """The spec of ``slot``, None if the family never uses it."""
        return next((c for c in self.cameras if c.slot == slot), None)


def discretize_state(state) -> np.ndarray:
    """Bins of a normalised state: ``digitize(x, linspace(−1, 1, 257)[:−1]) − 1`` (openpi
    ``tokenizer.py``, LeRobot ``processor_pi05.py``), int64, **not clipped**: below −1 → −1, values in
    [k/128 − 1, (k+1)/128 − 1) → k, at or above 0.9921875 → 255."""
    edges = np.linspace(-1.0, 1.0, 256 + 1)[:-1]
    return np.digitize(np.asarray(state, dtype=np.float64), edges) - 1


def _bool_mask(*dims: int) -> tuple[bool, ...]:
    """``(6, -1, 6, -1)`` → six True, one False, six True, one False (openpi ``make_bool_mask``)."""
    out: list[bool] = []
    for d in dims:
        out += [d > 0] * abs(d)
    return tuple(out)


_OPENPI_PI05 = dict(variant="pi05", max_token_len=200, action_prompt=PromptLayout(PI05_STATE_PROMPT),
                    state_norm=Normalization("quantile"), action_norm=Normalization("quantile"))
_OPENPI_PI0 = dict(variant="pi0", max_token_len=48, action_prompt=PromptLayout(NEWLINE_PROMPT),
                   state_norm=Normalization("mean_std"), action_norm=Normalization("mean_std"))
_ALOHA = dict(state_dim=14, action_dim=14, delta_mask=_bool_mask(6, -1, 6, -1), adaptation=AlohaAdaptation(),
              cameras=(CameraSpec("base_0_rgb", "cam_high", True),
                       CameraSpec("left_wrist_0_rgb", "cam_left_wrist", False),
                       CameraSpec("right_wrist_0_rgb", "cam_right_wrist", False)),
              action_dt_s=0.02, norm_stats_asset="trossen")
_DROID = dict(state_dim=8, action_dim=8,
              cameras=(CameraSpec("base_0_rgb", "observation/exterior_image_1_left", True),
                       CameraSpec("left_wrist_0_rgb", "observation/wrist_image_left", True)),
              action_dt_s=1.0 / 15.0, norm_stats_asset="droid")
_LIBERO = dict(state_dim=8, action_dim=7,
               cameras=(CameraSpec("base_0_rgb", "observation/image", True),
                        CameraSpec("left_wrist_0_rgb", "observation/wrist_image", True)),
               action_dt_s=0.05, norm_stats_asset="physical-intelligence/libero")

# π0.5 and π0 base conventions of openpi (any robot: no adaptation, no deltas, dims from the robot),
# the six openpi robot configurations, and LeRobot's processors (defaults; a LeRobot checkpoint
# directory's own files override them, see lerobot_conventions).
FAMILIES: dict[str, Conventions] = {
    "openpi/pi05": Conventions("openpi/pi05", action_horizon=50, **_OPENPI_PI05),
    "openpi/pi0": Conventions("openpi/pi0", action_horizon=50, **_OPENPI_PI0),
    "openpi/pi05_aloha": Conventions("openpi/pi05_aloha", action_horizon=50, **_OPENPI_PI05, **_ALOHA),
    "openpi/pi0_aloha": Conventions("openpi/pi0_aloha", action_horizon=50, **_OPENPI_PI0, **_ALOHA),
    # pi0_aloha_sim (ALOHA sim transfer-cube, from pi0_base): LeRobotAlohaDataConfig(use_delta_joint_actions=False,
    # default_prompt="Transfer cube"), adapt_to_pi left True; only cam_high (the sim's top camera); its statistics
    # under the asset id = the dataset's repo id.
    "openpi/pi0_aloha_sim": Conventions("openpi/pi0_aloha_sim", action_horizon=50, **_OPENPI_PI0,
                                        **{**_ALOHA, "delta_mask": (),
                                           "norm_stats_asset": "lerobot/aloha_sim_transfer_cube_human"},
                                        default_prompt="Transfer cube"),
    "openpi/pi05_droid": Conventions("openpi/pi05_droid", action_horizon=15, **_OPENPI_PI05, **_DROID),
    "openpi/pi0_droid": Conventions("openpi/pi0_droid", action_horizon=10, **_OPENPI_PI0, **_DROID),
    # pi05_libero: Pi0Config(discrete_state_input=False): π0's newline layout, no state in the prompt.
    "openpi/pi05_libero": Conventions("openpi/pi05_libero", action_horizon=10,
                                      **{**_OPENPI_PI05, "action_prompt": PromptLayout(NEWLINE_PROMPT)}, **_LIBERO),
    # pi0_libero: LeRobotLiberoDataConfig(extra_delta_transform=True): first 6 dims relative.
    "openpi/pi0_libero": Conventions("openpi/pi0_libero", action_horizon=50, **_OPENPI_PI0, **_LIBERO,
                                     delta_mask=_bool_mask(6, -1)),
    "lerobot/pi05": Conventions("lerobot/pi05", variant="pi05", action_horizon=50, max_token_len=200,
                                action_prompt=PromptLayout(PI05_STATE_PROMPT),
                                state_norm=Normalization("quantile", 0.0, 0.0, "float32"),
                                action_norm=Normalization("quantile", 0.0, 0.0, "float32"),
                                delta_state="raw", image_resize="torch_bilinear"),
    "lerobot/pi0": Conventions("lerobot/pi0", variant="pi0", action_horizon=50, max_token_len=48,
                               action_prompt=PromptLayout(LEROBOT_PI0_PROMPT, clean="final_newline"),
                               state_norm=Normalization("mean_std", 1e-8, 0.0, "float32"),
                               action_norm=Normalization("mean_std", 1e-8, 0.0, "float32"),
                               delta_state="raw", image_resize="torch_bilinear"),
}


def get_conventions(name: str) -> Conventions:
    """The family ``name`` (:data:`FAMILIES`), marked binding with source ``conventions <name>``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown conventions {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name].replace(source=f"conventions {name}", binding=True)


def variant_defaults(variant: str, action_horizon: int, max_token_len: int) -> Conventions:
    """The defaults of a preset's variant when neither the checkpoint nor a family says: openpi's
    base-model conventions (π0.5: quantile, state in the prompt; π0: mean/std, newline layout) with
    the preset's horizon and prompt budget, not binding (settings override them).

    Raises:
        ValueError: unknown variant.
    """
    base = FAMILIES[{"pi05": "openpi/pi05", "pi0": "openpi/pi0"}[_check(variant, ("pi05", "pi0"), "variant")]]
    return base.replace(action_horizon=action_horizon, max_token_len=max_token_len,
                        source=f"the {variant} defaults", binding=False)


# ---- LeRobot checkpoint directories ----------------------------------------------------------------

_LEROBOT_MODES = {"QUANTILES": "quantile", "MEAN_STD": "mean_std", "IDENTITY": "identity"}
_LEROBOT_STATS = {"observation.state": "state", "action": "actions"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: unreadable ({error})") from error


def _pipeline_step(directory: Path, filename: str, registry_name: str) -> tuple[dict, Path | None] | None:
    """``(config, state file)`` of the step ``registry_name`` in a LeRobot processor pipeline file."""
    path = directory / filename
    if not path.is_file():
        return None
    for step in _read_json(path).get("steps", []):
        if step.get("registry_name") == registry_name:
            state = step.get("state_file")
            return step.get("config", {}), (directory / state) if state else None
    return None


def _lerobot_mode(mapping: dict, feature: str, where: Path) -> str:
    mode = mapping.get(feature, "IDENTITY")
    if mode not in _LEROBOT_MODES:
        raise ValueError(f"{where}: normalisation {feature}: {mode} is not supported "
                         f"(supported: {sorted(_LEROBOT_MODES)})")
    return _LEROBOT_MODES[mode]


def lerobot_conventions(checkpoint_dir: str | Path) -> Conventions | None:
    """The conventions a LeRobot pi05 / pi0 checkpoint directory carries, or None if it is not one.

    Read from ``config.json``: ``type`` (variant), ``chunk_size`` (horizon), ``max_state_dim`` /
    ``max_action_dim`` (model dimension), ``input_features`` (``observation.state`` shape → state
    dimension; ``VISUAL`` features in file order → camera slots base, left wrist, right wrist, each
    optional), ``output_features`` (``action`` shape), ``normalization_mapping`` (STATE / ACTION),
    ``tokenizer_max_length``, ``use_relative_actions`` with ``relative_exclude_joints`` and
    ``action_feature_names`` (a dimension is absolute when an excluded name occurs in its name,
    ``relative_action_processor.py``), ``n_action_steps`` and ``rtc_config`` (:class:`CheckpointRTC`); from ``policy_preprocessor.json``: the normaliser's ``eps`` and
    ``norm_map``, the pi05 step's ``include_state_in_prompt``, the tokenizer's ``max_length``.

    Raises:
        ValueError: a LeRobot config this product cannot serve (visual / proprioceptive memory, a
            normalisation mode other than quantile / mean-std / identity, more than three cameras,
            an image resolution other than 224), naming the file and the field.
    """
    directory = Path(checkpoint_dir)
    path = directory / "config.json"
    if not path.is_file():
        return None
    cfg = _read_json(path)
    variant = cfg.get("type")
    if variant not in ("pi05", "pi0"):
        return None
    for flag in ("use_visual_memory", "use_proprioceptive_memory"):
        if cfg.get(flag):
            raise ValueError(f"{path}: {flag} is true; MEM memory is not supported")
    if list(cfg.get("image_resolution", (224, 224))) != [224, 224]:
        raise ValueError(f"{path}: image_resolution {cfg['image_resolution']} (the model takes 224 x 224)")
    features = cfg.get("input_features", {})
    state_shape = features.get("observation.state", {}).get("shape")
    action_shape = cfg.get("output_features", {}).get("action", {}).get("shape")
    images = [k for k, f in features.items() if f.get("type") == "VISUAL"]
    if len(images) > len(MODEL_CAMERA_SLOTS):
        raise ValueError(f"{path}: {len(images)} image features {images}; the model has "
                         f"{len(MODEL_CAMERA_SLOTS)} camera slots")
    base = FAMILIES[f"lerobot/{variant}"]
    mapping = cfg.get("normalization_mapping", {})
    state_mode = _lerobot_mode(mapping, "STATE", path)
    action_mode = _lerobot_mode(mapping, "ACTION", path)
    prompt = base.action_prompt
    max_len = int(cfg.get("tokenizer_max_length", base.max_token_len))
    eps = 1e-8
    normalizer = _pipeline_step(directory, "policy_preprocessor.json", "normalizer_processor")
    if normalizer is not None:
        eps = float(normalizer[0].get("eps", eps))
        norm_map = normalizer[0].get("norm_map", {})
        state_mode = _lerobot_mode(norm_map, "STATE", directory / "policy_preprocessor.json") \
            if "STATE" in norm_map else state_mode
        action_mode = _lerobot_mode(norm_map, "ACTION", directory / "policy_preprocessor.json") \
            if "ACTION" in norm_map else action_mode
    tokenizer = _pipeline_step(directory, "policy_preprocessor.json", "tokenizer_processor")
    if tokenizer is not None and "max_length" in tokenizer[0]:
        max_len = int(tokenizer[0]["max_length"])
    state_step = _pipeline_step(directory, "policy_preprocessor.json", "pi05_prepare_state_tokenizer_processor_step")
    if state_step is not None and state_step[0].get("include_state_in_prompt") is False:
        raise ValueError(f"{directory / 'policy_preprocessor.json'}: include_state_in_prompt is false "
                         "(MEM proprioceptive memory); not supported")

    def norm(mode: str) -> Normalization:
        # normalize_processor.py: quantiles without epsilon, mean/std with eps in, none out.
        return Normalization(mode, eps if mode == "mean_std" else 0.0, 0.0, "float32")

    action_dim = int(action_shape[0]) if action_shape else None
    delta: tuple[bool, ...] = ()
    if cfg.get("use_relative_actions"):
        names = cfg.get("action_feature_names")
        exclude = [str(n).lower() for n in cfg.get("relative_exclude_joints", []) if n]
        dim = action_dim or int(cfg.get("max_action_dim", 32))
        if names is None or not exclude:
            delta = (True,) * dim
        else:
            delta = tuple(not any(t == str(n).lower() or t in str(n).lower() for t in exclude)
                          for n in names[:dim]) + (True,) * max(0, dim - len(names))
    steps = cfg.get("n_action_steps")
    return Conventions(
        f"lerobot/{variant}", variant=variant, action_horizon=int(cfg.get("chunk_size", base.action_horizon)),
        max_token_len=max_len, action_prompt=prompt, state_norm=norm(state_mode), action_norm=norm(action_mode),
        model_dim=int(cfg.get("max_action_dim", 32)),
        state_dim=int(state_shape[0]) if state_shape else None, action_dim=action_dim,
        delta_mask=delta, delta_state="raw",
        cameras=tuple(CameraSpec(slot, key, False) for slot, key in zip(MODEL_CAMERA_SLOTS, images))
        or base.cameras,
        image_resize="torch_bilinear", action_steps=None if steps is None else int(steps),
        rtc=_lerobot_rtc(cfg.get("rtc_config"), path), source=f"the checkpoint's {path}", binding=True)


_LEROBOT_RTC_SCHEDULES = {"LINEAR": "linear", "EXP": "exp", "ZEROS": "zeros", "ONES": "ones"}


def _lerobot_rtc(config: dict | None, where: Path) -> CheckpointRTC | None:
    """LeRobot's ``rtc_config`` (None or a mapping; its defaults where a key is absent: off, LINEAR, 10, 10) as
    :class:`CheckpointRTC`. Raises ValueError naming the file for a schedule it does not have or a bad value."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: rtc_config must be a mapping or null, got {config!r}")
    schedule = str(config.get("prefix_attention_schedule", "LINEAR")).upper()
    if schedule not in _LEROBOT_RTC_SCHEDULES:
        raise ValueError(f"{where}: rtc_config.prefix_attention_schedule {schedule} is not one of "
                         f"{sorted(_LEROBOT_RTC_SCHEDULES)}")
    try:
        beta, horizon = float(config.get("max_guidance_weight", 10.0)), int(config.get("execution_horizon", 10))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: rtc_config max_guidance_weight / execution_horizon are not numbers: "
                         f"{config}") from None
    if not (beta > 0 and math.isfinite(beta)) or horizon < 0:
        raise ValueError(f"{where}: rtc_config needs max_guidance_weight > 0 and execution_horizon >= 0, got "
                         f"{beta}, {horizon}")
    return CheckpointRTC(bool(config.get("enabled", False)), _LEROBOT_RTC_SCHEDULES[schedule], beta, horizon)


def lerobot_norm_stats(checkpoint_dir: str | Path) -> tuple[dict[str, NormStats], str] | None:
    """The statistics a LeRobot checkpoint directory carries (its normaliser's and unnormaliser's
    ``*.safetensors``: ``observation.state.<stat>`` → ``state``, ``action.<stat>`` → ``actions``),
    with a description of the files; None when it has none.

    Raises:
        ValueError: a state file named by a pipeline but missing or unreadable.
    """
    from safetensors.numpy import load_file

    directory = Path(checkpoint_dir)
    arrays: dict[str, dict[str, np.ndarray]] = {}
    files = []
    for filename, step in (("policy_preprocessor.json", "normalizer_processor"),
                           ("policy_postprocessor.json", "unnormalizer_processor")):
        found = _pipeline_step(directory, filename, step)
        if found is None or found[1] is None:
            continue
        try:
            tensors = load_file(str(found[1]))
        except Exception as error:   # safetensors raises its own error types for missing / bad files
            raise ValueError(f"{found[1]}: unreadable ({error})") from error
        files.append(found[1].name)
        for flat, value in tensors.items():
            feature, _, stat = flat.rpartition(".")
            if feature in _LEROBOT_STATS and stat in ("mean", "std", "q01", "q99"):
                arrays.setdefault(_LEROBOT_STATS[feature], {}).setdefault(stat, value.astype(np.float64).ravel())
    if not arrays:
        return None
    return {key: NormStats(**stats) for key, stats in arrays.items()}, f"{directory} ({', '.join(files)})"


# ---- openpi checkpoint directories -----------------------------------------------------------------

def openpi_norm_stats_path(checkpoint_dir: str | Path, conventions: Conventions) -> Path | None:
    """The ``assets/<asset>/norm_stats.json`` an openpi checkpoint keeps beside its weights (openpi
    ``policy_config.py`` loads the statistics from the checkpoint, not from the config's assets).

    With a family that names its asset, exactly that file; otherwise the only one under ``assets/``.

    Raises:
        ValueError: the family's asset is absent but another one is present (the checkpoint belongs to
            another robot), or several assets and no family to choose.
    """
    assets = Path(checkpoint_dir) / "assets"
    if not assets.is_dir():
        return None
    found = sorted(p for p in assets.rglob("norm_stats.json"))
    ids = [str(p.parent.relative_to(assets)) for p in found]
    if conventions.norm_stats_asset is not None and conventions.binding:
        wanted = assets / conventions.norm_stats_asset / "norm_stats.json"
        if wanted.is_file():
            return wanted
        if found:
            raise ValueError(f"{conventions.source} expects {wanted.relative_to(checkpoint_dir)}, the checkpoint "
                             f"has the statistics of {ids}")
        return None
    if len(found) > 1:
        raise ValueError(f"{assets} holds the statistics of {ids}: set the parameter conventions (or "
                         "norm_stats_path) to say which")
    return found[0] if found else None


def find_norm_stats(checkpoint_dir: str | Path, conventions: Conventions) -> tuple[dict[str, NormStats], str] | None:
    """The statistics a checkpoint directory carries and where they were read: a LeRobot directory's
    processor files (:func:`lerobot_norm_stats`), else an openpi ``assets/<asset>/norm_stats.json``
    (:func:`openpi_norm_stats_path`); None when it carries none.

    Raises:
        ValueError: unreadable or ambiguous statistics (see the two functions).
    """
    from .config import load_norm_stats

    found = lerobot_norm_stats(checkpoint_dir)
    if found is not None:
        return found
    path = openpi_norm_stats_path(checkpoint_dir, conventions)
    return None if path is None else (load_norm_stats(path), str(path))


# ---- resolution and explicit settings ---------------------------------------------------------------

def resolve_conventions(variant: str, action_horizon: int, max_token_len: int, checkpoint_dir: str | None,
                        family: str | None) -> Conventions:
    """The conventions of a checkpoint: its own files (LeRobot), else the named family, else the
    variant's defaults (with the preset's ``action_horizon`` and ``max_token_len``).

    Raises:
        ValueError: a named family that contradicts the checkpoint's files or the preset's variant, an
            unknown family, or a LeRobot configuration that cannot be served; one line naming both values.
    """
    from_checkpoint = lerobot_conventions(checkpoint_dir) if checkpoint_dir else None
    if from_checkpoint is not None:
        if family and family != from_checkpoint.name:
            raise ValueError(f"parameter conventions is {family!r} but {from_checkpoint.source} says "
                             f"{from_checkpoint.name!r}")
        conventions = from_checkpoint
    elif family:
        conventions = get_conventions(family)
    else:
        return variant_defaults(variant, action_horizon, max_token_len)
    if conventions.variant != variant:
        raise ValueError(f"the preset's variant is {variant!r} but {conventions.source} says {conventions.variant!r}")
    return conventions


def apply_settings(conventions: Conventions, labels: dict[str, str] | None = None, **settings) -> Conventions:
    """Apply explicit settings (None = not set) to ``conventions``.

    Settings: ``norm_mode`` (both keys), ``action_horizon``, ``state_dim``, ``action_dim``,
    ``action_dt_s``. Binding conventions are only confirmed: a setting that differs from them raises;
    non-binding defaults are overridden. ``labels`` names a setting in messages (e.g. ``state_dim`` →
    ``joint_names (number of joints)``); default ``parameter <name>``.

    Raises:
        ValueError: ``parameter <name> is <value> but <source> says <value>`` (one line), or an
            invalid value.
    """
    current = {"norm_mode": conventions.norm_mode, "action_horizon": conventions.action_horizon,
               "state_dim": conventions.state_dim, "action_dim": conventions.action_dim,
               "action_dt_s": conventions.action_dt_s}
    changes = {}
    for name, value in settings.items():
        if name not in current:
            raise TypeError(f"unknown setting {name!r}")
        if value is None:
            continue
        have = current[name]
        same = have is not None and (math.isclose(value, have, rel_tol=1e-4) if name == "action_dt_s"
                                     else value == have)
        if same:
            continue
        if conventions.binding and have is not None:
            label = (labels or {}).get(name, f"parameter {name}")
            raise ValueError(f"{label} is {value!r} but {conventions.source} says {have!r}")
        if name == "norm_mode":
            _check(value, NORM_MODES, "norm_mode")
            changes["state_norm"] = dataclasses.replace(conventions.state_norm, mode=value)
            changes["action_norm"] = dataclasses.replace(conventions.action_norm, mode=value)
        else:
            changes[name] = value
    return conventions.replace(**changes) if changes else conventions
