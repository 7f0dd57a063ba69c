"""Training samples from the demo's HDF5 episodes, processed exactly as the node processes its inputs.

A sample is one rendered image step ``s`` of an episode: the chosen cameras (default all three) at ``s`` (cropped where
the training asks, then resized with
padding to the preset's ``image_size`` by the family's filter, :func:`oxygen_ros.models.processing.resize_with_pad`),
the joint state ``qpos[s]`` (normalised and discretised into the prompt by the engine's own
:class:`oxygen_ros.engine.model_io.ProcessorIO`), the action chunk ``action[s : s + H]`` (the last
action repeated past the episode's end), the subtask label and the scene caption at ``s``.

Normalisation statistics are computed from the data (:func:`compute_norm_stats`) in openpi's format.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.assets import DEMO_CAMERA_SLOTS
from oxygen_ros.models.config import NormStats
from oxygen_ros.models.processing import crop_image, resize_with_pad
from oxygen_ros.demo_task import CAMERAS, read_episode

# The demo robot's cameras → the model's camera slots (openpi's ALOHA image keys), as the demo and the evaluation use.
CAMERA_SLOTS = DEMO_CAMERA_SLOTS


class DataMismatchError(ValueError):
    """The episodes do not fit the training's settings (e.g. a camera the model should see was not recorded, or
    too few episodes for the held-out split): the data or the settings must change, not the code."""


# Quantile ranges narrower than this are widened around their middle, so that a joint the expert
# barely moves still normalises to finite values (check_norm_stats rejects q99 <= q01).
MIN_RANGE = 1e-3


@dataclasses.dataclass
class DemoSamples:
    """All samples of a set of episodes, in memory.

    Attributes:
        pixels: uint8 ``[N, C, S, S, 3]``, each camera resized with padding to ``S`` (the model's
            ``image_size``); ``pixels / 255 · 2 − 1`` is exactly the processor's output for the
            ``pil_bilinear`` filter.
        state: float64 ``[N, 14]`` joint state (gym-aloha ``JOINTS`` order and units).
        actions: float64 ``[N, H, 14]`` absolute position targets.
        subtask: int64 ``[N]`` indices into :data:`SUBTASKS`; caption: ``[N]`` strings.
        cube_start: float64 ``[N, 3]`` the cube's start position in the world frame [m] (its episode's
            ``/cube_start``; where the cube still is while the caption says it lies on the table).
        episode: int64 ``[N]`` index of each sample's episode (in ``files`` order).
        step: int64 ``[N]`` each sample's control step in its episode (0: the start pose, where the state is
            the same in every episode and only the images say where the cube is).
        files: the episode files read.
        all_states, all_actions: float64 ``[M, 14]`` every step of every episode (for statistics).
        state_start: int64 ``[E + 1]`` where each episode's steps begin in ``all_states`` (episode ``e``'s joint
            state at step ``k`` is ``all_states[state_start[e] + k]``, ``k < state_start[e + 1] − state_start[e]``);
            None when not known (samples built by hand).
    """

    pixels: np.ndarray
    state: np.ndarray
    actions: np.ndarray
    subtask: np.ndarray
    caption: list[str]
    cube_start: np.ndarray
    episode: np.ndarray
    step: np.ndarray
    files: list[Path]
    all_states: np.ndarray
    all_actions: np.ndarray
    state_start: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.state)


def episode_files(data_dir: str | Path) -> list[Path]:
    """The ``episode_<i>.hdf5`` files of ``data_dir``, in index order.

    Raises:
        FileNotFoundError: no such directory or no episode in it.
    """
    directory = Path(data_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"no data directory {directory} (make demo-data writes one)")
    files = sorted(directory.glob("episode_*.hdf5"), key=lambda p: int(p.stem.split("_")[1]))
    if not files:
        raise FileNotFoundError(f"no episode_*.hdf5 in {directory}")
    return files


SUBTASK_LABELS = ("script", "state")


def load_samples(files: list[Path], image_size: int, horizon: int, resize: str = "pil_bilinear",
                 every: int = 1, cameras: tuple[str, ...] = CAMERAS,
                 crops: dict[str, tuple[float, float, float, float]] | None = None,
                 labels: str = "script") -> DemoSamples:
    """Read ``files`` into :class:`DemoSamples` (every ``every``-th rendered image step of each).

    Args:
        files: episode files (:func:`episode_files`).
        image_size: the model's image side [px].
        horizon: action chunk length H.
        resize: the family's filter (``pil_bilinear`` for the openpi π0.5 defaults).
        every: keep every this many image steps (1 = all).
        cameras: the cameras the model sees, in slot order (a subset of :data:`CAMERAS`; default all three).
        crops: per camera, the ``(top, left, height, width)`` fractions of its frame the model sees
            (:func:`oxygen_ros.models.processing.crop_image`, as the node crops); default none.
        labels: which subtask labels the samples carry: ``script`` (the expert's script, by its clock and the
            nominal step nearest the state) or ``state`` (the evaluation's ground-truth rule on the recorded
            state, ``/subtask_state``: :func:`oxygen_ros.demo_task.state_subtask`).

    Raises:
        ValueError: an unknown camera or ``labels``.
        DataMismatchError: a file that is not a readable episode (truncated, another HDF5 layout), an episode
            without one of ``cameras`` or without images, a crop that covers no pixel of its frames, or
            ``labels="state"`` on an episode without state labels at its image steps.
    """
    if labels not in SUBTASK_LABELS:
        raise ValueError(f"labels must be one of {SUBTASK_LABELS}, got {labels!r}")
    unknown = [c for c in cameras if c not in CAMERAS]
    if unknown or not cameras:
        raise ValueError(f"cameras must be a non-empty subset of {CAMERAS}, got {tuple(cameras)}")
    pixels, state, actions, subtask, caption, episode, cube, step = [], [], [], [], [], [], [], []
    all_states, all_actions = [], []
    for index, path in enumerate(files):
        try:
            ep = read_episode(path)
        except FileNotFoundError:
            raise
        except (OSError, KeyError, ValueError, TypeError, IndexError) as error:   # truncated or foreign HDF5
            raise DataMismatchError(f"{path}: not a readable demo episode ({type(error).__name__}: {error}); "
                                    "regenerate it (python -m oxygen_ros.tools.demo_data) or remove it") from None
        missing = [c for c in cameras if c not in ep.images]
        if missing or len(ep.image_steps) == 0:
            raise DataMismatchError(f"{path}: cameras {missing} missing or no image rendered")
        episode_labels = ep.subtask
        if labels == "state":
            episode_labels = ep.state_subtask
            if episode_labels is None or np.any(episode_labels[ep.image_steps] < 0):
                raise DataMismatchError(f"{path}: no state labels (/subtask_state) at its image steps; add them "
                                        f"with python -m oxygen_ros.tools.demo_data --relabel {Path(path).parent}")
        all_states.append(ep.qpos.astype(np.float64))
        all_actions.append(ep.action.astype(np.float64))
        steps = ep.image_steps[::every]
        chosen = np.arange(0, len(ep.image_steps), every)
        resized = []
        for camera in cameras:
            frames = ep.images[camera][chosen]
            if crops and camera in crops:
                try:
                    frames = crop_image(frames, crops[camera])
                except ValueError as error:          # a box too small for these frames' resolution
                    raise DataMismatchError(f"{path}: {camera}: {error}") from None
            x = resize_with_pad(frames, image_size, resize)                     # [n, 3, S, S] in [-1, 1]
            resized.append(((x + 1.0) / 2.0 * 255.0).round().clamp(0, 255).to(torch.uint8)
                           .permute(0, 2, 3, 1).numpy())
        pixels.append(np.stack(resized, axis=1))
        last = len(ep.action) - 1
        for s in steps:
            idx = np.minimum(np.arange(s, s + horizon), last)
            state.append(ep.qpos[s].astype(np.float64))
            actions.append(ep.action[idx].astype(np.float64))
            subtask.append(int(episode_labels[s]))
            caption.append(ep.caption[s])
            cube.append(np.asarray(ep.cube_start, np.float64)[:3])
            episode.append(index)
            step.append(int(s))
    return DemoSamples(pixels=np.concatenate(pixels), state=np.stack(state), actions=np.stack(actions),
                       subtask=np.asarray(subtask, np.int64), caption=caption,
                       cube_start=np.asarray(cube, np.float64).reshape(-1, 3),
                       episode=np.asarray(episode, np.int64), step=np.asarray(step, np.int64), files=list(files),
                       all_states=np.concatenate(all_states), all_actions=np.concatenate(all_actions),
                       state_start=np.concatenate([[0], np.cumsum([len(x) for x in all_states])]).astype(np.int64))


def _stats(x: np.ndarray) -> NormStats:
    q01, q99 = np.quantile(x, 0.01, axis=0), np.quantile(x, 0.99, axis=0)
    narrow = q99 - q01 < MIN_RANGE
    middle = (q01 + q99) / 2.0
    q01 = np.where(narrow, middle - MIN_RANGE / 2.0, q01)
    q99 = np.where(narrow, middle + MIN_RANGE / 2.0, q99)
    return NormStats(mean=x.mean(0), std=np.maximum(x.std(0), 1e-6), q01=q01, q99=q99)


def compute_norm_stats(samples: DemoSamples) -> dict[str, NormStats]:
    """openpi-style statistics (mean, std, 1 % and 99 % quantiles per dimension) of every recorded
    joint state and action, ``{"state": ..., "actions": ...}``; quantile ranges narrower than
    :data:`MIN_RANGE` are widened to it around their middle."""
    return {"state": _stats(samples.all_states), "actions": _stats(samples.all_actions)}
