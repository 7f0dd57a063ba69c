"""Train the project's π0.5 (:class:`oxygen_ros.models.vla.VLAModel`) end to end on the demo's episodes.

π0.5's co-training recipe at demo scale, on one shared image encoding per sample:

* **actions** — flow matching on the action chunk after the action prompt (the family's
  ``"Task: {instruction}, State: {state};\\nAction: "``): with ``a`` the normalised chunk (zero-padded
  to 32 dimensions), ``ε ~ N(0, I)`` and ``t = 0.001 + 0.999·Beta(1.5, 1)``, the expert sees
  ``x_t = t·ε + (1 − t)·a`` and regresses the velocity ``u = ε − a`` (mean squared error over all 32
  dimensions). This is the convention of the model's sampler (:meth:`VLAModel.denoise`: t = 1 is
  noise, Euler steps with dt = −1/S integrate ``x ← x + dt·v``); the Beta(1.5, 1) time distribution is
  openpi's (``pi0.py``, ``sample_beta``).
* **subtask** — cross-entropy on the subtask's tokens and EOS after :data:`SUBTASK_PROMPT` (π0.5's
  high-level inference: what the speech task decodes);
* **caption** — cross-entropy on the scene caption's tokens and EOS after :data:`CAPTION_PROMPT` (what the
  memory task decodes).

* **cube location** (auxiliary, training only) — cross-entropy on ``"x <cm> y <cm>"``, the cube's position on
  the table in whole centimetres of the world frame, after :data:`LOCATE_PROMPT`, on samples whose caption says
  the cube still lies on the table (:func:`locate_target`). Like the localisation data π0.5's VLM is co-trained
  on, it gives the image encoder a direct signal for *where* the cube is; without it the flow-matching loss alone
  left the approach at the demonstrations' mean (measured: across training episodes the predicted right-arm
  waist angle at the end of an early chunk did not correlate with the expert's, docs/demo-policy.md). The tiny
  tokenizer holds ``▁0`` … ``▁255`` as single tokens, so each coordinate is one classification over centimetres.

Each sample contributes its action loss and one language loss: a sample whose cube lies on the table draws
the location with probability ``locate`` (default 1/3), otherwise the subtask or the caption with equal
probability. Samples of the first two subtasks (reaching and grasping, where the cube's position decides the
motion) appear ``approach_repeat`` times (default 2) in each pass over the training samples. The prefix is one bidirectional block (images + prompt) and the target text tokens are
causal blocks after it, exactly the masks the engine's prefill and decode steps use. With ``realtime_views`` p, a
drawn sample past the start pose is seen with probability p as the node sees the demo's real-time robot (cameras
rendered round robin, so of different ages; a newer joint state): :meth:`Batches.views`. Gradients reach
every weight: the SigLIP tower, the projector, the VLM and its tied embedding, the action expert.

Output (``--out``, default ``runs/train-demo``): ``checkpoint/`` in the openpi layout the loader reads
(``model.safetensors``, ``oxygen_config.json``, ``assets/aloha_sim/norm_stats.json``, ``demo_policy.json``
with the prompts and settings the node needs), ``loss_curve.png`` and ``train_log.json``.

Command line: ``python -m oxygen_ros.training.train --data runs/demo-data`` (``--help``); ``make train-demo``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from oxygen_ros.assets import NORM_STATS_ASSET, in_slot_order, norm_stats_file, read_policy_file
# ON_TABLE_CAPTION starts the captions of a cube lying untouched on the table: there it is still at its start
# position, the location target's ground truth.
from oxygen_ros.demo_task import DT, INSTRUCTION, JOINTS, ON_TABLE_CAPTION, RENDER_RATE_HZ, SUBTASKS
from oxygen_ros.engine.model_io import ProcessorIO
from oxygen_ros.models import RobotConfig, get_preset, load_model
from oxygen_ros.models.reference import joint_forward, reference_actions, reference_generate
from oxygen_ros.models.checkpoint import checkpoint_overrides, save_checkpoint
from oxygen_ros.models.config import VLAConfig, check_image_crop, load_norm_stats, save_norm_stats
from oxygen_ros.models.conventions import Conventions, variant_defaults
from oxygen_ros.models.gemma import AdaRMSNorm, RMSNorm
from oxygen_ros.models.processing import Processor, pad_to
from oxygen_ros.models.tokenizer import load_tokenizer
from oxygen_ros.models.vla import VLAModel
from oxygen_ros.training.data import (CAMERA_SLOTS, SUBTASK_LABELS, DataMismatchError, DemoSamples,
                                      compute_norm_stats, episode_files, load_samples)

SUBTASK_PROMPT = "Task: {instruction}, State: {state};\nSubtask: "
CAPTION_PROMPT = "Task: {instruction}, State: {state};\nScene: "
LOCATE_PROMPT = "Task: {instruction}, State: {state};\nCube: "
# Subtask indices whose samples the training pool repeats (reaching and grasping: SUBTASKS[0], SUBTASKS[1]).
APPROACH_SUBTASKS = (0, 1)
# The action prompt with the latest subtask (π0.5's low-level inference on the high-level output), used
# for a fraction --subtask-in-action-prompt of the action samples; {subtask} is filled in here.
ACTION_SUBTASK_PROMPT = "Task: {instruction}, Subtask: {subtask}, State: {state};\nAction: "


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run (the command line's options; see :func:`parse_args`)."""

    data: Path
    out: Path = Path("runs/train-demo")
    extra_data: tuple[Path, ...] = ()
    preset: str = "pi05_demo"
    steps: int = 5000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    text_weight: float = 1.0
    subtask_in_action_prompt: float = 0.5
    locate: float = 1.0 / 3.0
    start_locate: float | None = None
    approach_repeat: int = 2
    start_repeat: int = 1
    subtask_labels: str = "script"
    realtime_views: float = 0.0
    init_from: Path | None = None
    image_stride: int = 1
    cameras: tuple[str, ...] = tuple(CAMERA_SLOTS)
    image_size: int = 0
    crops: tuple[tuple[str, float, float, float, float], ...] = ()
    val_episodes: int = 2
    eval_samples: int = 16
    seed: int = 0
    device: str = "cpu"
    log_every: int = 10
    save_every: int = 500
    progress: bool = True

    def __post_init__(self) -> None:
        # The model sees its cameras in slot order (the node orders its slots so, whatever the order of its
        # camera parameters): train them in that order too.
        self.cameras = in_slot_order(self.cameras)

    def check(self) -> None:
        """Raise ValueError naming the first setting out of its range (what does not depend on the data)."""
        if not 0.0 <= self.locate <= 1.0:
            raise ValueError(f"locate must be in [0, 1], got {self.locate}")
        if self.start_locate is not None and not 0.0 <= self.start_locate <= 1.0:
            raise ValueError(f"start_locate must be in [0, 1], got {self.start_locate}")
        if not 0.0 <= self.realtime_views <= 1.0:
            raise ValueError(f"realtime_views must be in [0, 1], got {self.realtime_views}")
        if self.subtask_labels not in SUBTASK_LABELS:
            raise ValueError(f"subtask_labels must be one of {SUBTASK_LABELS}, got {self.subtask_labels!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("steps", "batch_size", "approach_repeat", "start_repeat", "log_every", "image_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        directories = [Path(d).resolve() for d in (self.data, *self.extra_data)]
        if len(set(directories)) != len(directories):
            raise ValueError(f"extra_data must name directories other than data and each other once, got data "
                             f"{self.data} and extra_data {[str(d) for d in self.extra_data]}")
        unknown = [c for c in self.cameras if c not in CAMERA_SLOTS]
        if unknown or not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"cameras must be distinct names of {tuple(CAMERA_SLOTS)}, got {tuple(self.cameras)}")
        for crop in self.crops:
            if crop[0] not in self.cameras:
                raise ValueError(f"crop of camera {crop[0]!r}, which the model does not see (cameras "
                                 f"{','.join(self.cameras)})")
            check_image_crop(crop)                        # its box, named by camera as the user typed it
        patch = get_preset(self.preset).patch_size       # (an unknown preset raises ValueError naming it)
        if self.image_size % patch:
            raise ValueError(f"image_size must be 0 (the preset's) or a multiple of {self.preset}'s patch size "
                             f"{patch}, got {self.image_size}")
        for name in ("val_episodes", "eval_samples", "warmup", "save_every", "image_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        model_config = self.model_config()
        if self.init_from is not None:
            self.check_init_from(model_config)

    def check_init_from(self, model_config: VLAConfig) -> None:
        """Raise ValueError unless :attr:`init_from` is a checkpoint directory of this training's preset with the
        same model settings (image size, crops), the same cameras (its ``demo_policy.json``) and normalisation
        statistics to keep."""
        directory = Path(self.init_from)
        if not (directory / "model.safetensors").is_file():
            raise ValueError(f"init_from must be a checkpoint directory with model.safetensors (e.g. "
                             f"runs/train-demo/checkpoint), got {directory}")
        if not norm_stats_file(directory).is_file():
            raise ValueError(f"init_from {directory} has no assets/{NORM_STATS_ASSET}/norm_stats.json: a training "
                             "continued from it keeps its normalisation")
        # the model the loader builds for it (ValueError for another preset) against the one this training builds
        trained = get_preset(self.preset, **checkpoint_overrides(directory, self.preset))
        trained_cameras = _policy_record(directory).get("cameras")
        if isinstance(trained_cameras, dict) and tuple(trained_cameras) != tuple(self.cameras):
            raise ValueError(f"init_from {directory} was trained on cameras {','.join(trained_cameras)}, this training "
                             f"on {','.join(self.cameras)}: pass the same --cameras")
        differ = [f.name for f in dataclasses.fields(model_config)
                  if getattr(trained, f.name) != getattr(model_config, f.name)]
        if differ:
            raise ValueError(f"init_from {directory} was trained with other model settings {differ} (its "
                             f"{ {k: getattr(trained, k) for k in differ} } against this training's "
                             f"{ {k: getattr(model_config, k) for k in differ} }): pass the same --image-size and --crop")

    def model_config(self) -> VLAConfig:
        """The preset with this training's image size and crops (``crops`` keyed by camera → the model's slots);
        the cameras are those :meth:`check` accepted.

        Raises:
            ValueError: an unknown preset, a crop box outside the frame.
        """
        changes = {"image_crops": tuple((CAMERA_SLOTS[c[0]], *c[1:]) for c in self.crops)}
        if self.image_size:
            changes["image_size"] = self.image_size
        return get_preset(self.preset, **changes)


def init_training_weights(model: VLAModel, seed: int) -> VLAModel:
    """Deterministic initialisation for training from scratch (same seed ⇒ same weights).

    Matrices and the SigLIP patch / position embeddings ~ N(0, 0.02²); the token embedding ~ N(0, 1/W)
    (it is scaled by √W on the way in and tied to the LM head, so both start at unit scale); biases 0;
    SigLIP LayerNorms weight 1, bias 0; Gemma RMSNorm weights 0 (the norm multiplies by 1 + w); every
    adaRMSNorm's Dense zero (π0.5: the expert starts as a plain, unmodulated Gemma; docs/models.md, "Gemma formulas").
    """
    gen = torch.Generator().manual_seed(seed)
    zero_modules = {id(m.dense) for m in model.modules() if isinstance(m, AdaRMSNorm)}
    rms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    layer_norms = {id(p): n for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
                   for n, p in m.named_parameters()}
    zero_params = {id(p) for m in model.modules() if id(m) in zero_modules for p in m.parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in zero_params or id(param) in rms:
                param.zero_()
            elif id(param) in layer_norms:
                param.fill_(1.0 if layer_norms[id(param)] == "weight" else 0.0)
            elif name == "token_embedding.weight":
                param.copy_(torch.randn(param.shape, generator=gen) * model.config.vlm_width ** -0.5)
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            else:
                param.zero_()
    return model


def locate_target(cube: np.ndarray) -> str:
    """The location text of a cube at world position ``cube`` ``[3]`` [m]: ``"x <cm> y <cm>"`` (rounded).

    >>> locate_target(np.array([0.1097, 0.543, 0.02]))
    'x 11 y 54'
    """
    return f"x {int(round(float(cube[0]) * 100))} y {int(round(float(cube[1]) * 100))}"


def training_pool(samples: DemoSamples, pool: np.ndarray, approach_repeat: int, start_repeat: int = 1
                  ) -> np.ndarray:
    """``pool`` with the samples of :data:`APPROACH_SUBTASKS` repeated ``approach_repeat`` times in all, then the
    start-pose samples (``samples.step`` 0) of that pool ``start_repeat`` times as often (each start sample is also a
    reaching one, so it appears ``approach_repeat · start_repeat`` times).

    Raises:
        ValueError: ``approach_repeat`` or ``start_repeat`` < 1.
    """
    if approach_repeat < 1 or start_repeat < 1:
        raise ValueError(f"approach_repeat and start_repeat must be >= 1, got {approach_repeat}, {start_repeat}")
    approach = pool[np.isin(samples.subtask[pool], APPROACH_SUBTASKS)]
    repeated = np.concatenate([pool] + [approach] * (approach_repeat - 1))
    starts = repeated[samples.step[repeated] == 0]
    return np.concatenate([repeated] + [starts] * (start_repeat - 1))


@dataclasses.dataclass
class Views:
    """How the samples of one batch are seen (:meth:`Batches.views`).

    Attributes:
        rows: int ``[B, C]`` per sample and camera, the sample whose image of that camera it sees (itself
            for a sample seen as recorded).
        state: float64 ``[B, 14]`` the joint state its prompts carry.
        realtime: bool ``[B]`` whether it is seen with the real-time robot's timing.
        action_ids: per sample, the action prompt's token ids.
    """

    rows: np.ndarray
    state: np.ndarray
    realtime: np.ndarray
    action_ids: list[list[int]]


class Batches:
    """Tokenised, normalised tensors of every sample, and seeded batches of them.

    Prompts are built by the engine's own :class:`~oxygen_ros.engine.model_io.ProcessorIO` from the conventions the checkpoint
    will be served with, so the tokens match the node's byte for byte.

    ``realtime_views`` (0 .. 1) is the probability that a drawn sample past the start pose is seen as the node
    sees the demo's real-time robot (:meth:`views`).

    Raises:
        ValueError: ``realtime_views`` > 0 on samples without ``state_start`` (every step's joint state).
    """

    def __init__(self, samples: DemoSamples, processor: Processor, seed: int, subtask_in_action_prompt: float,
                 locate: float = 0.0, start_locate: float | None = None, realtime_views: float = 0.0):
        self.samples = samples
        self.processor = processor
        mp = ProcessorIO(processor)
        self._io = mp
        if realtime_views > 0 and samples.state_start is None:
            raise ValueError("realtime_views needs every step's joint state (DemoSamples.state_start)")
        self.realtime_views = realtime_views
        # per episode its samples' rows, in step order (load_samples appends an episode's image steps in order);
        # only the real-time views read them
        self._episode_rows = [np.flatnonzero(samples.episode == e) for e in range(int(samples.episode.max()) + 1)] \
            if realtime_views > 0 and len(samples) else []
        conv = processor.conventions
        rng = np.random.default_rng(seed)
        tokenizer = processor.tokenizer
        eos = tokenizer.eos_id
        n = len(samples)
        action_template = conv.action_prompt.template
        self.action_ids, self.action_template = [], []
        for i in range(n):
            template = action_template
            if rng.random() < subtask_in_action_prompt:
                template = ACTION_SUBTASK_PROMPT.replace("{subtask}", SUBTASKS[samples.subtask[i]])
            self.action_template.append(template)
            self.action_ids.append(mp.prompt_ids(template, INSTRUCTION, samples.state[i]))
        self.subtask_prompt = [mp.prompt_ids(SUBTASK_PROMPT, INSTRUCTION, s) for s in samples.state]
        self.caption_prompt = [mp.prompt_ids(CAPTION_PROMPT, INSTRUCTION, s) for s in samples.state]
        self.subtask_target = [tokenizer.encode(SUBTASKS[k]) + [eos] for k in samples.subtask]
        self.caption_target = [tokenizer.encode(c) + [eos] for c in samples.caption]
        self.locate = locate
        # per sample: the probability of the location target (start-pose samples: start_locate when given)
        self.locate_p = np.full(n, locate)
        if start_locate is not None:
            self.locate_p[samples.step == 0] = start_locate
        self.locate_prompt = [mp.prompt_ids(LOCATE_PROMPT, INSTRUCTION, s) for s in samples.state]
        self.locate_text = [locate_target(c) if cap.startswith(ON_TABLE_CAPTION) else None
                            for c, cap in zip(samples.cube_start, samples.caption)]
        self.locate_target = [tokenizer.encode(t) + [eos] if t is not None else None for t in self.locate_text]
        # the longest label in tokens, EOS included: enough decode steps for any label of this data
        self.max_target = max(len(t) for t in self.subtask_target + self.caption_target
                              + [t for t in self.locate_target if t is not None])
        dim = processor.config.action_dim
        normed = conv.action_norm.normalize(samples.actions, processor.norm_stats["actions"])
        self.actions = torch.as_tensor(pad_to(normed, dim), dtype=torch.float32)     # [N, H, 32]
        self._rng = np.random.default_rng(seed + 1)
        self._order: list[int] = []

    def indices(self, batch_size: int, pool: np.ndarray) -> np.ndarray:
        """The next ``batch_size`` sample indices of ``pool`` (reshuffled each pass, seeded)."""
        out = []
        while len(out) < batch_size:
            if not self._order:
                self._order = list(self._rng.permutation(pool))
            out.append(self._order.pop())
        return np.asarray(out)

    def views(self, idx: np.ndarray, rng: np.random.Generator) -> Views:
        """How each sample of ``idx`` is seen in this draw: as recorded, or — with probability
        ``realtime_views``, for samples past the start pose — with the timing the node gets from the demo's
        real-time robot (``tools/sim_robot.py``; the real-time evaluation and ``make demo``).

        That robot renders its C cameras round robin, ``RENDER_RATE_HZ`` images per second in all, and publishes
        the joint state at 50 Hz; the node stamps an observation with its newest frame and feeds the newest joint
        state. So at stamp t (this sample's step: its actions and labels stay the sample's) the cameras' frames
        are 0, 1, …, C − 1 render periods (1 / ``RENDER_RATE_HZ`` s) old, in an order drawn at random here, and
        the joint state is up to one render period newer than t (uniform, in control steps). A camera's frame is
        the episode's latest rendered image at or before its age (images are rendered every few control steps, so
        up to one image period older; the episode's first image before its first). Random draws come from
        ``rng`` only when ``realtime_views`` > 0, so the batches of a training without it are unchanged.
        """
        samples = self.samples
        cameras = samples.pixels.shape[1]
        rows = np.repeat(np.asarray(idx)[:, None], cameras, axis=1)
        state = samples.state[idx].copy()
        realtime = np.zeros(len(idx), bool)
        if self.realtime_views > 0:
            period = 1.0 / (RENDER_RATE_HZ * DT)                    # control steps between two renders
            for b, i in enumerate(idx):
                if samples.step[i] == 0 or rng.random() >= self.realtime_views:
                    continue
                realtime[b] = True
                episode, step = samples.episode[i], samples.step[i]
                episode_rows = self._episode_rows[episode]
                steps = samples.step[episode_rows]
                ages = rng.permutation(cameras) * period
                for c in range(cameras):
                    j = int(np.searchsorted(steps, step - ages[c], side="right")) - 1
                    rows[b, c] = episode_rows[max(j, 0)]
                newer = int(rng.integers(0, int(period) + 1))
                first, end = samples.state_start[episode], samples.state_start[episode + 1]
                state[b] = samples.all_states[min(first + step + newer, end - 1)]
        action_ids = [self._io.prompt_ids(self.action_template[i], INSTRUCTION, state[b]) if realtime[b]
                      else self.action_ids[i] for b, i in enumerate(idx)]
        return Views(rows=rows, state=state, realtime=realtime, action_ids=action_ids)

    def pixels(self, idx: np.ndarray, device, rows: np.ndarray | None = None) -> torch.Tensor:
        """float ``[B·C, 3, S, S]`` in [-1, 1] (per sample the trained cameras, in slot order); ``rows`` (int
        ``[B, C]``, :attr:`Views.rows`): the sample whose image each camera shows (default: the sample's own)."""
        if rows is None:
            x = torch.from_numpy(self.samples.pixels[idx]).to(device)    # [B, C, S, S, 3] uint8
        else:
            cameras = np.arange(self.samples.pixels.shape[1])[None, :]
            x = torch.from_numpy(self.samples.pixels[rows, cameras]).to(device)
        b, c, s = x.shape[:3]
        return (x.float() / 255.0 * 2.0 - 1.0).permute(0, 1, 4, 2, 3).reshape(b * c, 3, s, s)

    def language(self, idx: np.ndarray, rng: np.random.Generator, views: Views | None = None
                 ) -> tuple[list[list[int]], list[list[int]], list[bool]]:
        """Per sample: the prompt, the target tokens and whether it is the subtask (else the caption or,
        where the cube lies on the table, with probability ``locate`` — ``start_locate`` at the start pose — the
        cube's location). With ``views``, a sample seen in real time has its prompt carry the view's state."""
        prompts, targets, is_subtask = [], [], []
        for b, i in enumerate(idx):
            realtime = views is not None and views.realtime[b]

            def prompt(template: str, recorded: list[int]) -> list[int]:
                return self._io.prompt_ids(template, INSTRUCTION, views.state[b]) if realtime else recorded

            if self.locate_target[i] is not None and rng.random() < self.locate_p[i]:
                prompts.append(prompt(LOCATE_PROMPT, self.locate_prompt[i]))
                targets.append(self.locate_target[i])
                is_subtask.append(False)
                continue
            sub = bool(rng.random() < 0.5)
            prompts.append(prompt(SUBTASK_PROMPT, self.subtask_prompt[i]) if sub
                           else prompt(CAPTION_PROMPT, self.caption_prompt[i]))
            targets.append(self.subtask_target[i] if sub else self.caption_target[i])
            is_subtask.append(sub)
        return prompts, targets, is_subtask


def _prefix(model: VLAModel, image_tokens: torch.Tensor, prompts: list[list[int]],
            targets: list[list[int]] | None = None):
    """Prefix embeddings ``[B, Ci + L, W]``, valid mask, block starts and the prompt lengths.

    Row b is ``[image tokens, prompt_b, target_b, padding]``; images and prompt form one bidirectional
    block, each target token starts its own (causal) block; padding is invalid.
    """
    b, ci, w = image_tokens.shape
    targets = targets or [[] for _ in prompts]
    length = max(len(p) + len(t) for p, t in zip(prompts, targets))
    ids = torch.zeros(b, length, dtype=torch.long)
    valid = torch.zeros(b, length, dtype=torch.bool)
    starts = torch.zeros(b, length, dtype=torch.bool)
    for r, (p, t) in enumerate(zip(prompts, targets)):
        ids[r, :len(p) + len(t)] = torch.tensor(p + t)
        valid[r, :len(p) + len(t)] = True
        starts[r, len(p):len(p) + len(t)] = True
    device = image_tokens.device
    text = model.token_embedding(ids.to(device)) * math.sqrt(model.config.vlm_width)
    prefix = torch.cat((image_tokens, text.to(image_tokens.dtype)), dim=1)
    ones = torch.ones(b, ci, dtype=torch.bool)
    return (prefix, torch.cat((ones, valid), 1).to(device), torch.cat((torch.zeros_like(ones), starts), 1).to(device),
            [len(p) for p in prompts])


def _per_sample_conditioning(model: VLAModel, times: torch.Tensor) -> dict:
    """The model's time conditioning for one time per row (``times [B]``), shaped so that
    ``joint_forward(..., step=0)`` modulates row b with its own time."""
    cond = model._time_conditioning(times)
    return {"layers": [(a[None, :, None, :], b[None, :, None, :]) for a, b in cond["layers"]],
            "final": cond["final"][None, :, None, :]}


def flow_matching_loss(model: VLAModel, image_tokens: torch.Tensor, prompts: list[list[int]],
                       actions: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """π0.5's flow-matching loss (module docstring) of normalised chunks ``actions [B, H, 32]``."""
    b, horizon, dim = actions.shape
    device = image_tokens.device
    noise = torch.randn(actions.shape, generator=generator).to(device)
    # Beta(1.5, 1) from the seeded generator by its inverse CDF: F(x) = x^1.5, so x = u^(1/1.5).
    times = (torch.rand(b, generator=generator) ** (1.0 / 1.5)).to(device) * 0.999 + 0.001
    x_t = times[:, None, None] * noise + (1.0 - times[:, None, None]) * actions
    target = noise - actions
    prefix, valid, starts, _ = _prefix(model, image_tokens, prompts)
    suffix = model.action_in_proj(x_t.to(model.dtype))
    suffix_start = torch.zeros(1, horizon, dtype=torch.bool, device=device)
    suffix_start[0, 0] = True
    _, out = joint_forward(model, prefix, valid, starts, suffix, suffix_start,
                                  _per_sample_conditioning(model, times), 0)
    velocity = model.action_out_proj(out).float()
    return F.mse_loss(velocity, target)


def text_loss(model: VLAModel, image_tokens: torch.Tensor, prompts: list[list[int]],
              targets: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the target tokens (teacher forcing) after their prompts; returns the mean loss
    and the per-token correctness (bool ``[tokens]``) of the argmax."""
    prefix, valid, starts, prompt_lens = _prefix(model, image_tokens, prompts, targets)
    hidden, _ = joint_forward(model, prefix, valid, starts, None, None)
    ci = image_tokens.shape[1]
    rows, positions, labels = [], [], []
    for r, (p, t) in enumerate(zip(prompt_lens, targets)):
        for k, token in enumerate(t):
            rows.append(r)
            positions.append(ci + p + k - 1)      # the token before target k predicts it
            labels.append(token)
    device = image_tokens.device
    logits = model._lm_logits(hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)])
    labels_t = torch.tensor(labels, device=device)
    return F.cross_entropy(logits, labels_t), logits.argmax(-1) == labels_t


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to 10 % of ``lr`` at ``steps``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def build_processor(config: VLAConfig, norm_stats, cameras: tuple[str, ...] = tuple(CAMERA_SLOTS)) -> Processor:
    """The processor the node will build for this checkpoint: the π0.5 defaults (openpi's base
    conventions: quantile normalisation, state in the prompt, PIL bilinear resize) with the preset's
    horizon and prompt budget, the demo robot's 14 joints and the slots of ``cameras`` (default all three)."""
    robot = RobotConfig("aloha_sim", state_dim=len(JOINTS), action_dim=len(JOINTS),
                        camera_slots=tuple(CAMERA_SLOTS[c] for c in cameras))
    conventions = variant_defaults(config.variant, config.action_horizon, config.max_token_len)
    return Processor(config, robot, load_tokenizer(config), norm_stats, conventions)


def greedy_text(model: VLAModel, image_tokens: torch.Tensor, prompt: list[int], eos: int, max_tokens: int
                ) -> list[int]:
    """Greedy decoding of one sample through the model's cache-free reference path (inference)."""
    with torch.inference_mode():
        embeds = torch.cat((image_tokens[None], model.embed_tokens(torch.tensor([prompt])).to(image_tokens.dtype)), 1)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
        out = reference_generate(model, embeds, mask, max_tokens)[0].tolist()
    return out[:out.index(eos)] if eos in out else out


def evaluate(model: VLAModel, batches: Batches, idx: np.ndarray, seed: int) -> dict:
    """On samples ``idx`` through the model's inference paths (:meth:`VLAModel.encode_images`,
    :func:`~oxygen_ros.models.reference.reference_actions`, :func:`~oxygen_ros.models.reference.reference_generate`): the action chunk's mean
    squared error in normalised units (10 Euler steps from seeded noise), and the exact-match accuracy
    of the greedily decoded subtask and caption."""
    model.eval()
    tok = batches.processor.tokenizer
    gen = torch.Generator().manual_seed(seed)
    mse, sub_ok, cap_ok, loc_err = [], 0, 0, []
    with torch.inference_mode():
        for i in idx:
            pixels = batches.pixels(np.array([i]), model.device)
            tokens = model.encode_images(pixels).reshape(1, -1, model.config.vlm_width)
            ids = torch.tensor([batches.action_ids[i]])
            embeds = torch.cat((tokens, model.embed_tokens(ids).to(tokens.dtype)), 1)
            noise = torch.randn((1, model.config.action_horizon, model.config.action_dim), generator=gen)
            pred = reference_actions(model, embeds, torch.ones(embeds.shape[:2], dtype=torch.bool), noise)
            mse.append(float(((pred[0].cpu() - batches.actions[i]) ** 2)[:, :len(JOINTS)].mean()))
            sub = tok.decode(greedy_text(model, tokens[0], batches.subtask_prompt[i], tok.eos_id, batches.max_target))
            cap = tok.decode(greedy_text(model, tokens[0], batches.caption_prompt[i], tok.eos_id, batches.max_target))
            sub_ok += sub.strip() == SUBTASKS[batches.samples.subtask[i]]
            cap_ok += cap.strip() == batches.samples.caption[i]
            if batches.locate_text[i] is not None:
                loc = tok.decode(greedy_text(model, tokens[0], batches.locate_prompt[i], tok.eos_id,
                                             batches.max_target)).split()
                truth = batches.locate_text[i].split()
                try:
                    loc_err.append(math.hypot(float(loc[1]) - float(truth[1]), float(loc[3]) - float(truth[3])))
                except (IndexError, ValueError):
                    loc_err.append(float("nan"))      # not of the form "x <cm> y <cm>"
    model.train()
    n = max(1, len(idx))
    return {"samples": int(len(idx)), "action_mse": float(np.mean(mse)) if mse else None,
            "subtask_accuracy": sub_ok / n, "caption_accuracy": cap_ok / n,
            # cube location (samples whose cube lies on the table): mean error [cm], nan if any was unreadable
            "locate_samples": len(loc_err), "locate_error_cm": float(np.mean(loc_err)) if loc_err else None}


def plot_losses(history: list[dict], path: Path) -> None:
    """The loss curves (total, flow matching, text) against the step, as a PNG (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("loss", "total"), ("flow", "flow matching (MSE)"), ("text", "text (cross-entropy)")):
        ax.plot(steps, [h[key] for h in history], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the logging window)")
    ax.set_title("π0.5 demo policy: training loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_checkpoint(model: VLAModel, processor: Processor, out: Path, extra: dict,
                     cameras: tuple[str, ...] = tuple(CAMERA_SLOTS)) -> Path:
    """The checkpoint directory the loader reads: openpi layout ``model.safetensors`` +
    ``oxygen_config.json`` (:func:`save_checkpoint`), ``assets/aloha_sim/norm_stats.json`` (openpi's
    format, found by :func:`oxygen_ros.models.conventions.find_norm_stats`) and ``demo_policy.json``
    (preset, conventions, the robot's cameras → their slots for ``cameras``, prompts for the node's speech and
    memory tasks, training facts)."""
    directory = out / "checkpoint"
    save_checkpoint(model, directory, layout="openpi")
    norm_stats_file(directory).parent.mkdir(parents=True, exist_ok=True)
    save_norm_stats(processor.norm_stats, norm_stats_file(directory))
    conv: Conventions = processor.conventions
    policy = {
        "preset": model.config.name,
        "conventions": f"{conv.name} defaults (preset horizon {conv.action_horizon}, prompt budget "
                       f"{conv.max_token_len}; leave the node's 'conventions' parameter empty)",
        "tokenizer": f"{model.config.tokenizer} (built from the preset's vocab_size {model.config.vocab_size}; "
                     "oxygen_ros/models/tokenizer.py)",
        "joint_names": list(JOINTS), "action_dt_s": 0.02,
        "cameras": {camera: CAMERA_SLOTS[camera] for camera in cameras},
        "instruction": INSTRUCTION,
        "action_prompt": conv.action_prompt.template,
        "speech_prompt": SUBTASK_PROMPT, "memory_prompt": CAPTION_PROMPT,
        "action_subtask_prompt": ACTION_SUBTASK_PROMPT,
        "subtasks": list(SUBTASKS), **extra}
    (directory / "demo_policy.json").write_text(json.dumps(policy, indent=2))
    return directory


def train(config: TrainConfig) -> dict:
    """Run one training (see the module docstring); returns the summary written to ``train_log.json``.

    Raises:
        FileNotFoundError: no episodes in ``config.data`` or in a directory of ``config.extra_data``.
        ValueError: bad settings (:meth:`TrainConfig.check`).
        DataMismatchError: settings that do not fit the episodes (fewer than ``val_episodes`` + 1, a camera of
            ``cameras`` not recorded).
    """
    from tqdm import tqdm

    config.check()
    torch.manual_seed(config.seed)
    files = episode_files(config.data)
    if len(files) <= config.val_episodes:
        raise DataMismatchError(f"{len(files)} episodes cannot hold {config.val_episodes} validation episodes and "
                                "training")
    # --extra-data: episodes that only train (e.g. start frames), before --data's so that the held-out
    # episodes stay the last of --data
    extra = [f for directory in config.extra_data for f in episode_files(directory)]
    files = extra + files
    model_config = config.model_config()
    samples = load_samples(files, model_config.image_size, model_config.action_horizon, every=config.image_stride,
                           cameras=config.cameras, crops={c[0]: tuple(c[1:]) for c in config.crops},
                           labels=config.subtask_labels)
    # Continued from a checkpoint: its normalisation stays (the weights were fitted to it).
    stats = compute_norm_stats(samples) if config.init_from is None else load_norm_stats(norm_stats_file(config.init_from))
    processor = build_processor(model_config, stats, config.cameras)
    batches = Batches(samples, processor, config.seed, config.subtask_in_action_prompt, config.locate,
                      config.start_locate, config.realtime_views)
    val_files = set(range(len(files) - config.val_episodes, len(files)))
    is_val = np.isin(samples.episode, list(val_files))
    train_pool, val_pool = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    sampled_pool = training_pool(samples, train_pool, config.approach_repeat, config.start_repeat)

    model = load_model(model_config, config.init_from, dtype="float32", device=config.device, seed=config.seed,
                       trainable=True)
    if config.init_from is None:
        init_training_weights(model, config.seed)
    init_training = _training_facts(config.init_from)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(config.seed + 2)
    lang_rng = np.random.default_rng(config.seed + 3)
    view_rng = np.random.default_rng(config.seed + 5)
    history, window = [], []
    config.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc="training", unit="step", disable=not config.progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        idx = batches.indices(config.batch_size, sampled_pool)
        views = batches.views(idx, view_rng)
        image_tokens = model._encode(batches.pixels(idx, model.device, views.rows)).reshape(
            len(idx), -1, model_config.vlm_width)
        flow = flow_matching_loss(model, image_tokens, views.action_ids, batches.actions[idx].to(model.device), gen)
        prompts, targets, _ = batches.language(idx, lang_rng, views)
        text, correct = text_loss(model, image_tokens, prompts, targets)
        loss = flow + config.text_weight * text
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss is {float(loss)} (flow {float(flow)}, text {float(text)})")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        window.append((loss.item(), flow.item(), text.item(), correct.float().mean().item()))
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            mean = np.mean(window, axis=0)
            history.append({"step": step + 1, "loss": mean[0], "flow": mean[1], "text": mean[2],
                            "token_accuracy": mean[3], "lr": learning_rate(step, config),
                            "seconds": round(time.perf_counter() - start, 2)})
            bar.set_postfix(loss=f"{mean[0]:.4f}", flow=f"{mean[1]:.4f}", text=f"{mean[2]:.3f}")
            window = []
        if config.save_every > 0 and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
            # A usable checkpoint part-way (a long CPU run can be stopped and still served); the final
            # one below overwrites it.
            write_checkpoint(model, processor, config.out, {"training": {
                "partial": True, "step": step + 1, "seconds": round(time.perf_counter() - start, 1),
                "final": history[-1] if history else None}}, config.cameras)
            model.train()
    seconds = time.perf_counter() - start
    model.eval()
    evaluation = {}
    if config.eval_samples > 0:
        eval_rng = np.random.default_rng(config.seed + 4)
        for name, pool in (("train", train_pool), ("validation", val_pool)):
            if len(pool):
                chosen = eval_rng.choice(pool, size=min(config.eval_samples, len(pool)), replace=False)
                evaluation[name] = evaluate(model, batches, np.sort(chosen), config.seed)
    summary = {
        "config": {k: _json_value(v) for k, v in dataclasses.asdict(config).items()},
        "episodes": len(files), "extra_episodes": len(extra), "train_samples": int(len(train_pool)),
        "validation_samples": int(len(val_pool)), "start_samples": int(np.sum(samples.step[train_pool] == 0)),
        "init_from": init_training,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "seconds": round(seconds, 1), "seconds_per_step": round(seconds / max(1, config.steps), 4),
        "final": history[-1] if history else None, "evaluation": evaluation, "history": history}
    directory = write_checkpoint(model, processor, config.out, {
        "subtask_in_action_prompt": config.subtask_in_action_prompt,
        "locate_prompt": LOCATE_PROMPT, "locate": config.locate, "start_locate": config.start_locate,
        "approach_repeat": config.approach_repeat, "start_repeat": config.start_repeat,
        "subtask_labels": config.subtask_labels, "realtime_views": config.realtime_views,
        "training": {k: summary[k] for k in ("episodes", "extra_episodes", "train_samples", "start_samples",
                                             "init_from", "parameters", "seconds", "seconds_per_step", "final",
                                             "evaluation")}}, config.cameras)
    summary["checkpoint"] = str(directory)
    if history:
        plot_losses(history, config.out / "loss_curve.png")
    (config.out / "train_log.json").write_text(json.dumps(summary, indent=2))
    return summary


def _training_facts(checkpoint: Path | None) -> dict | None:
    """What a continued training started from: the checkpoint's path and its ``demo_policy.json`` record (its
    settings and its own ``training`` facts, which name where *it* started), or None for a fresh start."""
    if checkpoint is None:
        return None
    policy = _policy_record(checkpoint)
    return {"checkpoint": str(checkpoint), **{k: policy[k] for k in ("locate", "start_locate", "approach_repeat",
                                                                     "start_repeat", "subtask_in_action_prompt",
                                                                     "subtask_labels", "training") if k in policy}}


def _policy_record(checkpoint: Path) -> dict:
    """A checkpoint's ``demo_policy.json`` (:func:`~oxygen_ros.assets.read_policy_file`), or ``{}`` when it has none,
    unreadable JSON or not a JSON object: a record to consult, never a reason to fail."""
    try:
        policy = read_policy_file(checkpoint)
    except (OSError, ValueError):
        return {}
    return policy if isinstance(policy, dict) else {}


def _json_value(value):
    """A :class:`TrainConfig` value as JSON holds it (paths as strings)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.training.train", description=__doc__.split("\n")[0])
    d = TrainConfig(data=Path("runs/demo-data"))
    parser.add_argument("--data", type=Path, default=d.data, help="episode directory (default runs/demo-data)")
    parser.add_argument("--out", type=Path, default=d.out, help="output directory (default runs/train-demo)")
    parser.add_argument("--extra-data", type=Path, action="append", default=[], metavar="DIR",
                        help="more episodes that only train, never held out (e.g. start frames, docs/demo-policy.md); "
                             "repeatable (default none)")
    parser.add_argument("--preset", default=d.preset, help="model preset (default pi05_demo)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help=f"samples per step (default {d.batch_size})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    parser.add_argument("--warmup", type=int, default=d.warmup, help=f"warm-up steps (default {d.warmup})")
    parser.add_argument("--text-weight", type=float, default=d.text_weight,
                        help="weight of the cross-entropy against the flow-matching loss (default 1)")
    parser.add_argument("--subtask-in-action-prompt", type=float, default=d.subtask_in_action_prompt,
                        help="fraction of action samples whose prompt carries the subtask "
                             f"(default {d.subtask_in_action_prompt})")
    parser.add_argument("--locate", type=float, default=d.locate,
                        help="probability that a sample whose cube lies on the table trains the cube's location "
                             "text instead of the subtask or caption (default 1/3; 0: off)")
    parser.add_argument("--start-locate", type=float, default=None,
                        help="the same probability for start-pose samples (step 0: the state is the same in every "
                             "episode, only the image says where the cube is; default: --locate's)")
    parser.add_argument("--approach-repeat", type=int, default=d.approach_repeat,
                        help="times each reaching/grasping sample appears per pass (default 2; 1: uniform)")
    parser.add_argument("--start-repeat", type=int, default=d.start_repeat,
                        help="start-pose samples appear this many times as often in all (default 1: unchanged)")
    parser.add_argument("--subtask-labels", choices=SUBTASK_LABELS, default=d.subtask_labels,
                        help="the subtask labels trained on: script (the expert's, default) or state (the "
                             "evaluation's ground-truth rule on each recorded state, /subtask_state; older data: "
                             "python -m oxygen_ros.tools.demo_data --relabel DIR)")
    parser.add_argument("--realtime-views", type=float, default=d.realtime_views,
                        help="probability that a sample past the start pose is seen with the real-time robot's "
                             "timing: cameras rendered round robin (frames 0, 1, 2 render periods old), the joint "
                             "state up to a period newer (default 0: as recorded)")
    parser.add_argument("--init-from", type=Path, default=None, metavar="CHECKPOINT",
                        help="continue training from this checkpoint directory's weights and normalisation "
                             "statistics (same preset, --image-size, --crop and --cameras; default: a fresh start)")
    parser.add_argument("--image-stride", type=int, default=d.image_stride,
                        help="use every N-th rendered image step (default 1: all)")
    parser.add_argument("--cameras", default=",".join(d.cameras),
                        help="comma-separated cameras the model sees, any order: it sees them in slot order "
                             f"(default {','.join(d.cameras)})")
    parser.add_argument("--image-size", type=int, default=d.image_size,
                        help="image side [px] the model is built for, a multiple of the preset's patch size "
                             "(default 0: the preset's)")
    parser.add_argument("--crop", action="append", default=[], metavar="CAMERA=TOP,LEFT,HEIGHT,WIDTH",
                        help="the region of a camera's frame the model sees, as fractions of the frame's height "
                             "(TOP, HEIGHT) and width (LEFT, WIDTH), cut out before the resize and recorded in the "
                             "checkpoint (the node crops alike); repeat per camera (default: whole frames)")
    parser.add_argument("--val-episodes", type=int, default=d.val_episodes,
                        help="last N episodes held out for evaluation (default 2)")
    parser.add_argument("--eval-samples", type=int, default=d.eval_samples,
                        help="samples evaluated after training per split (default 16; 0: none)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed (default 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--log-every", type=int, default=d.log_every, help="steps per logged loss (default 10)")
    parser.add_argument("--save-every", type=int, default=d.save_every,
                        help=f"steps between part-way checkpoints, 0 = only at the end (default {d.save_every})")
    args = parser.parse_args(argv)
    crops = []
    for text in args.crop:
        camera, _, box = text.partition("=")
        try:
            crops.append((camera.strip(), *(float(v) for v in box.split(","))))
        except ValueError:
            parser.error(f"--crop {text!r}: expected CAMERA=TOP,LEFT,HEIGHT,WIDTH with numbers")
        if len(crops[-1]) != 5:
            parser.error(f"--crop {text!r}: expected CAMERA=TOP,LEFT,HEIGHT,WIDTH (four fractions)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = TrainConfig(data=args.data, out=args.out, extra_data=tuple(args.extra_data), preset=args.preset,
                         steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, text_weight=args.text_weight,
                         subtask_in_action_prompt=args.subtask_in_action_prompt, locate=args.locate,
                         start_locate=args.start_locate, approach_repeat=args.approach_repeat,
                         start_repeat=args.start_repeat, subtask_labels=args.subtask_labels,
                         realtime_views=args.realtime_views,
                         init_from=args.init_from, image_stride=args.image_stride,
                         cameras=tuple(c.strip() for c in args.cameras.split(",") if c.strip()),
                         image_size=args.image_size, crops=tuple(crops),
                         val_episodes=args.val_episodes, eval_samples=args.eval_samples, seed=args.seed,
                         device=device, log_every=args.log_every,
                         save_every=args.save_every)
    try:
        config.check()
    except ValueError as error:
        parser.error(str(error))          # names the setting: its option is --<name> with - for _
    return config


def main(argv: list[str] | None = None) -> int:
    """Train and print where the checkpoint went, the final losses and the evaluation."""
    config = parse_args(argv)
    for directory in (config.data, *config.extra_data):
        if not any(Path(directory).glob("episode_*.hdf5")):
            raise SystemExit(f"no episodes (episode_*.hdf5) in {directory}: generate them first (make demo-data, "
                             "python -m oxygen_ros.tools.demo_data) or pass --data / --extra-data")
    try:
        summary = train(config)
    except DataMismatchError as error:      # settings that do not fit the data (e.g. --val-episodes, --cameras)
        raise SystemExit(f"train: {error}") from None
    final = summary["final"] or {}
    print(f"{summary['seconds']:.0f} s ({summary['seconds_per_step']:.3f} s/step); final loss "
          f"{final.get('loss', float('nan')):.4f} (flow {final.get('flow', float('nan')):.4f}, "
          f"text {final.get('text', float('nan')):.4f})")
    for split, result in summary["evaluation"].items():
        print(f"{split}: {result}")
    print(f"checkpoint {summary['checkpoint']}; loss curve {config.out / 'loss_curve.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
