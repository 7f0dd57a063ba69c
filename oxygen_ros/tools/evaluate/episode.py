"""The simulated episode of the evaluation (no ROS): gym-aloha's joint-space scene run as the data was, with
the ground truth recorded at every observation and the phase flags after every control step."""

from __future__ import annotations

import dataclasses

import numpy as np

from oxygen_ros.demo_task import (CAMERAS, DT, SETTLE_S, SceneGeoms, SceneState, phase_flags, scene_caption,
                                  scene_state)
# The ground truth the published speech is scored against: the state rule the data generator also records
# per step as its state labels (demo_task.state_subtask; docs/demo-policy.md, "Ground-truth subtask").
from oxygen_ros.demo_task import state_subtask as ground_truth_subtask

EPISODE_STEPS = 530                  # 10.6 s at 50 Hz, as the demonstrations
SHEET_TIMES_S = (0.0, 2.0, 4.0, 6.0, 8.0, 10.4)   # contact sheet frames of a default episode, after the settle [s]
ENSEMBLE_MAX_CHUNKS = 64             # --ensemble: chunks kept; ≥ ceil(H / execute_steps) for H ≤ 64 at any schedule


def sheet_times(max_steps: int = EPISODE_STEPS) -> tuple[float, ...]:
    """The contact sheet's frame times [s after the settle] for an episode of ``max_steps`` control steps: up to
    five from 0 every 2 s × the episode's length in default episodes (rounded, at least 1), those before its last
    0.2 s, then 0.2 s before its end — :data:`SHEET_TIMES_S` for the default 530 steps (10.6 s); 990 steps (19.8 s):
    0, 4, 8, 12, 16, 19.6 s; 300 steps (6 s): 0, 2, 4, 5.8 s."""
    end = max_steps * DT
    spacing = 2.0 * max(1, round(end / (EPISODE_STEPS * DT)))
    return tuple(k * spacing for k in range(5) if k * spacing < end - 0.2 - 1e-9) + (round(max(0.0, end - 0.2), 6),)


@dataclasses.dataclass
class Observed:
    """One observation of an episode: what the policy got and what the simulator said at that instant."""

    t: float                  # sim time (clock) of the observation [s]
    subtask: int              # ground truth (index into SUBTASKS)
    caption: str              # demo_task.scene_caption of the state
    flags: list[bool]         # phase_flags at that instant


class EpisodeSim:
    """gym-aloha's joint-space scene (:class:`~oxygen_ros.tools.sim_robot.AlohaScene`) run as the data was:
    0.2 s of settling, then control steps of 20 ms; records the phase flags after every step and the ground
    truth at every observation.

    Args:
        seed: cube pose seed; clock_offset_s: the sim clock at the scene's time 0 [s];
        width, height: camera image size [px]; max_steps: the episode's length in control steps (the contact
        sheet's frame times, :func:`sheet_times`).
    """

    def __init__(self, seed: int, clock_offset_s: float = 0.0, width: int = 320, height: int = 240,
                 max_steps: int = EPISODE_STEPS):
        from oxygen_ros.tools.sim_robot import AlohaScene

        self.sheet_times = sheet_times(max_steps)
        self.seed = seed
        self.clock_offset_s = clock_offset_s
        self.scene = AlohaScene(width=width, height=height, seed=seed)
        self._geoms = SceneGeoms(self.scene.model)
        self.scene.step(SETTLE_S)
        self.rest_height = float(self._state().cube[2])
        self.flags: list[list[bool]] = []
        self.right_distance: list[float] = []   # per step: right grasp point to cube centre [m]
        self.observed: list[Observed] = []
        self.sheet: list[tuple[float, np.ndarray, int, list[bool]]] = []    # (t after settle, top image, gt, flags)

    def _state(self) -> SceneState:
        return scene_state(self.scene.model, self.scene.data, self._geoms)

    @property
    def step_index(self) -> int:
        return len(self.flags)

    @property
    def now_s(self) -> float:
        """The sim clock [s]."""
        return self.clock_offset_s + self.scene.sim_time

    def observe(self, cameras: tuple[str, ...] = CAMERAS) -> tuple[dict[str, np.ndarray], np.ndarray, float]:
        """Render ``cameras`` and read the joint state now; records the ground truth (and a contact sheet
        frame when one is due). Returns ``(images camera -> uint8 [H, W, 3], position float64 [14], t [s])``."""
        state = self._state()
        flags = phase_flags(state, self.rest_height)
        t = self.now_s
        position, _ = self.scene.joint_state()
        record = Observed(t, ground_truth_subtask(state, self.rest_height, position), scene_caption(state),
                          [bool(f) for f in flags])
        self.observed.append(record)
        images = {camera: self.scene.render(camera) for camera in cameras}
        since = self.scene.sim_time - SETTLE_S
        due = [s for s in self.sheet_times if s <= since + 1e-9]
        if len(due) > len(self.sheet):
            top = images["top"] if "top" in images else self.scene.render("top")
            self.sheet.append((since, top[::2, ::2].copy(), record.subtask, record.flags))
        return images, position, t

    def execute(self, action: np.ndarray) -> None:
        """One control step of 20 ms with ``action`` (float [14], JOINTS order) as the position targets."""
        self.scene.set_action(action)
        self.scene.step(DT)
        state = self._state()
        self.flags.append([bool(f) for f in phase_flags(state, self.rest_height)])
        self.right_distance.append(round(float(state.right_distance), 6))

    def trace(self) -> dict:
        """The episode's record: phase flags per step, observations, sheet frames (images as lists)."""
        return {"seed": self.seed, "rest_height": self.rest_height, "flags": self.flags,
                "right_distance": self.right_distance,
                "final_position": self.scene.joint_state()[0].tolist(),
                "observed": [dataclasses.asdict(o) for o in self.observed],
                "resets": self.scene.resets}

    def close(self) -> None:
        self.scene.close()
