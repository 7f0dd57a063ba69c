"""The demo task: gym-aloha's bimanual transfer-cube task as the demo, its data and its evaluation define it.

One module that the data tool (``oxygen_ros/tools/demo_data.py``), the simulated robot
(``tools/sim_robot.py``), the closed-loop evaluation (``tools/evaluate/``) and the trainer (``training/``)
import; it imports none of them.

* **Constants**: the instruction, the subtasks in the expert's order, the phases, the cameras and their
  default image size, the demo robot's render rate, the cube's settling time.
* **Ground truth** read from the simulator (no policy, no script): :class:`SceneState` (contacts and the cube's
  position, :func:`scene_state`), the phase flags (:func:`phase_flags`), the subtask the state shows
  (:func:`state_subtask`) and a caption of the scene (:func:`scene_caption`).
* **The episode file**: :class:`Episode` and its HDF5 layout (ALOHA/ACT: ``/observations/qpos`` [T, 14],
  ``/observations/qvel`` [T, 14], ``/action`` [T, 14], ``/observations/images/<camera>``), with the images
  only at the rendered steps (``/observations/image_steps`` [N] gives their step indices), the labels as
  UTF-8 strings (``/subtask`` [T], ``/caption`` [T]), the simulator's phase flags per step (``/phases``
  [T, 4]: reached, grasped, lifted, transferred) and the episode's outcome as attributes
  (:func:`write_episode`, :func:`read_episode`).

Joint vectors are 14 values in gym-aloha's ``JOINTS`` order (per arm 6 joint angles [rad], then the normalised
gripper opening, 0 closed .. 1 open); positions are in the world frame [m]; quaternions (w, x, y, z), MuJoCo's
convention. The recipe of the demonstrations and the evaluation: docs/demo-policy.md.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

# MuJoCo picks its OpenGL backend when it is imported: OSMesa works without a display.
os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from gym_aloha.constants import DT, JOINTS  # noqa: E402,F401  (re-exported: the task's control period and joints)

CAMERAS = ("top", "left_wrist", "right_wrist")   # the demo's simulated robot's (sim_robot.CAMERAS)
IMAGE_WIDTH, IMAGE_HEIGHT = 320, 240                # [px], the demo robot's default camera size
# Images per second the demo's real-time robot renders in all (each ~110 ms of CPU), shared round robin by the
# cameras the policy sees: 1 Hz each for three cameras (the demo's and the real-time evaluation's default).
RENDER_RATE_HZ = 3.0
ARMS = ("left", "right")
INSTRUCTION = "transfer the cube to the left arm"
# Subtasks in the order the expert performs them (π0.5's high-level labels for this task).
SUBTASKS = ("move the right arm to the cube", "grasp the cube", "lift the cube",
            "hand the cube to the left arm", "release the cube")
PHASES = ("reached", "grasped", "lifted", "transferred")
REACH_TOLERANCE = 0.03                      # grasp point within this of the cube centre: "reached" [m]
_LIFT_HEIGHT = 0.03                         # cube centre this far above its rest height: "lifted" [m]
OFF_TABLE = 0.005                           # cube centre this far above its rest height: off the table [m]
GRIPPER_OPEN = 0.95                         # normalised opening at or above which a gripper counts as open
HANDOVER_HEIGHT = 0.10                      # cube this far above its rest height, held by the right: "hand over" [m]
# The grasp point (between the fingertips' pads) in the gripper_link frame [m] (measured on the scene: the
# finger geoms' centres lie 0.093 m along the gripper's x axis, the fingers reach ~0.05 m beyond).
GRASP_OFFSET = np.array([0.125, 0.0, 0.0])
SETTLE_S = 0.2                              # [s] the cube drops from gym-aloha's sampled z = 0.05 m onto the table


def quat_rotate(q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``v`` (float ``[3]``) rotated by the unit quaternion ``q`` (float ``[4]``, w x y z); a new float64 ``[3]``."""
    out = np.empty(3)
    mujoco.mju_rotVecQuat(out, np.asarray(v, float), np.asarray(q, float))
    return out


def grasp_pose(data: mujoco.MjData, body: int) -> tuple[np.ndarray, np.ndarray]:
    """``(grasp point [3], quaternion [4])`` of gripper_link ``body`` in ``data``'s current kinematics: the point
    ``GRASP_OFFSET`` along the link between the fingertips (copies)."""
    quat = data.xquat[body].copy()
    return data.xpos[body] + quat_rotate(quat, GRASP_OFFSET), quat


# ---------------------------------------------------------------------------------------------------
# what the simulator says: contacts, phases, captions


@dataclasses.dataclass(frozen=True)
class SceneState:
    """The task-relevant facts of one simulator state (either scene: the geoms have the same names).

    Attributes:
        cube: cube centre in the world [m], float ``[3]``.
        right_fingers, left_fingers: how many of the gripper's two fingers touch the cube (0-2).
        on_table: whether the cube touches the table.
        right_distance: distance from the right gripper's grasp point to the cube centre [m].
        left_on_right: whether a left finger touches a right finger (the left gripper closing on the cube
            the right one holds meets the right fingers first).
    """

    cube: np.ndarray
    right_fingers: int
    left_fingers: int
    on_table: bool
    right_distance: float
    left_on_right: bool = False

    @property
    def right_holds(self) -> bool:
        return self.right_fingers == 2

    @property
    def left_holds(self) -> bool:
        return self.left_fingers == 2


class SceneGeoms:
    """Geom ids of the cube, the table and each gripper's fingers in one model."""

    def __init__(self, model: mujoco.MjModel):
        self.cube = model.geom("red_box").id
        self.table = model.geom("table").id
        self.fingers = {arm: {model.geom(f"vx300s_{arm}/10_{side}_gripper_finger").id for side in ARMS}
                        for arm in ARMS}
        self.right_gripper = model.body("vx300s_right/gripper_link").id


def scene_state(model: mujoco.MjModel, data: mujoco.MjData, geoms: SceneGeoms | None = None) -> SceneState:
    """The :class:`SceneState` of ``data`` (contacts of the last physics step)."""
    g = geoms or SceneGeoms(model)
    touching: set[int] = set()
    left_on_right = False
    for i in range(data.ncon):
        a, b = int(data.contact[i].geom1), int(data.contact[i].geom2)
        if a == g.cube:
            touching.add(b)
        elif b == g.cube:
            touching.add(a)
        left, right = g.fingers["left"], g.fingers["right"]
        left_on_right |= (a in left and b in right) or (a in right and b in left)
    cube = data.geom_xpos[g.cube].copy()
    grasp, _ = grasp_pose(data, g.right_gripper)
    return SceneState(cube=cube, right_fingers=len(touching & g.fingers["right"]),
                      left_fingers=len(touching & g.fingers["left"]), on_table=g.table in touching,
                      right_distance=float(np.linalg.norm(grasp - cube)), left_on_right=left_on_right)


def phase_flags(state: SceneState, rest_height: float) -> np.ndarray:
    """bool ``[4]`` over :data:`PHASES` for one state (an episode's outcome is the running OR):

    * reached: the right grasp point within 3 cm of the cube centre;
    * grasped: both right fingers touch the cube;
    * lifted: grasped, the cube off the table and ≥ 3 cm above ``rest_height`` (its resting centre);
    * transferred: both left fingers hold the cube, no right finger touches it, and it is off the table
      (gym-aloha's top reward, with the right gripper's release added).
    """
    reached = state.right_distance < REACH_TOLERANCE
    lifted = state.right_holds and not state.on_table and state.cube[2] > rest_height + _LIFT_HEIGHT
    transferred = state.left_holds and state.right_fingers == 0 and not state.on_table
    return np.array([reached, state.right_holds, lifted, transferred])


def state_subtask(state: SceneState, rest_height: float, position: np.ndarray) -> int:
    """The subtask (index into :data:`SUBTASKS`) that the simulator's state says is under way.

    Args:
        state: the scene's facts (:func:`scene_state`).
        rest_height: the cube centre's height at rest [m].
        position: float ``[14]`` joint state in gym-aloha's ``JOINTS`` order (grippers: normalised opening,
            0 closed .. 1 open, at indices 6 (left) and 13 (right)).

    The first rule that holds, in this order ("off the table": no contact with the table and the cube centre
    ≥ 5 mm above its rest height; a gripper is "open" at an opening ≥ 0.95, it reads 0.97-1.0 open and
    ~0.6 closed on the cube):

    1. the cube is off the table and the left gripper is closing on, or holding, the cube: it is not open,
       or a left finger touches the cube or a right finger (closing on the cube the right gripper holds, the
       left fingers meet the right ones, and may stop while still reading "open") → ``release the cube``;
    2. the cube is off the table and ≥ ``HANDOVER_HEIGHT`` (10 cm) above its rest height →
       ``hand the cube to the left arm``;
    3. the cube is off the table, lower, and the right gripper closed (opening < 0.9) or a right finger
       touching it → ``lift the cube``;
    4. the right grasp point is within 3 cm of the cube centre (``reached``) or a right finger touches the
       cube → ``grasp the cube``;
    5. otherwise → ``move the right arm to the cube`` (also after a drop: the cube must be fetched again).

    Finger contacts flicker while the cube is carried, and the left gripper's fingers close on the cube only
    once the right ones let go, so the rules read where the cube is and the grippers' openings rather than
    two-finger contact. The evaluation scores the published speech against this rule
    (``oxygen_ros.tools.evaluate``); the expert's script labels by time, and on the expert's own episodes
    the two differ around the segment boundaries (docs/demo-policy.md), so the generator also records this
    rule per step (``Episode.state_subtask``) for training on labels that read the state.
    """
    left_open, right_open = float(position[6]), float(position[13])
    if not state.on_table and state.cube[2] >= rest_height + OFF_TABLE:
        if left_open < GRIPPER_OPEN or state.left_fingers > 0 or state.left_on_right:
            return 4
        if state.cube[2] >= rest_height + HANDOVER_HEIGHT:
            return 3
        if right_open < 0.9 or state.right_fingers > 0:
            return 2
    if state.right_distance < REACH_TOLERANCE or state.right_fingers > 0:
        return 1
    return 0


# The start of scene_caption's caption for a cube lying on the table, held by neither gripper (training's
# cube-location target is taken on exactly these samples: oxygen_ros/training/train.py).
ON_TABLE_CAPTION = "the cube is on the "


def scene_caption(state: SceneState) -> str:
    """A short caption of the scene for memory: where the cube is and which gripper holds it."""
    if state.left_holds and state.right_holds:
        return "both grippers hold the cube"
    holder = "the right gripper" if state.right_holds else "the left gripper" if state.left_holds else None
    if holder is None:
        if not state.on_table:
            return "the cube is in the air"
        side = "left" if state.cube[0] < -0.05 else "right" if state.cube[0] > 0.05 else "middle"
        return f"{ON_TABLE_CAPTION}{side} of the table"
    return f"{holder} holds the cube " + ("on the table" if state.on_table else "in the air")


# ---------------------------------------------------------------------------------------------------
# episodes


@dataclasses.dataclass
class Episode:
    """One demonstration, replayed in the joint-space scene (all arrays over T control steps of DT).

    Attributes:
        seed: seed of the cube's start pose (``sample_box_pose(seed)``).
        qpos, qvel: float32 ``[T, 14]`` joint state before each action (gym-aloha ``JOINTS`` order: 6 joint
            angles [rad] and the normalised gripper opening per arm; velocities [rad/s], [1/s]).
        action: float32 ``[T, 14]`` absolute position targets, same order and units.
        images: per camera uint8 ``[N, height, width, 3]`` rendered at ``image_steps``.
        image_steps: int32 ``[N]`` the steps the images were rendered at (before that step's action).
        subtask: ``[T]`` indices into :data:`SUBTASKS`; caption: ``[T]`` strings (:func:`scene_caption`).
        phases: bool ``[T, 4]`` :func:`phase_flags` after each step.
        expert_phases: bool ``[4]`` the phases the expert reached in the end-effector scene.
        cube_start: float ``[3]`` the cube's resting centre [m].
        perturb_scale: the fraction of the DART noise the replay executed (0: the nominal replay).
        state_subtask: int8 ``[T]`` the subtask the state before each action shows (:func:`state_subtask`,
            the evaluation's ground truth), or None for a file written before it was recorded
            (``tools/demo_data.py`` ``relabel_dataset`` adds it).
        miss_offset: float ``[3]`` a near-miss episode's offset of the right grasp point [m]
            (``tools/demo_data.py`` ``generate_miss_episode``), None for the others; miss_steps: int ``[4]`` its
            ``(at, hold, correct, ramp)`` steps (``tools/demo_data.py`` ``miss_targets``), None for the others.
    """

    seed: int
    qpos: np.ndarray
    qvel: np.ndarray
    action: np.ndarray
    images: dict[str, np.ndarray]
    image_steps: np.ndarray
    subtask: np.ndarray
    caption: list[str]
    phases: np.ndarray
    expert_phases: np.ndarray
    cube_start: np.ndarray
    perturb_scale: float = 0.0
    state_subtask: np.ndarray | None = None
    miss_offset: np.ndarray | None = None
    miss_steps: np.ndarray | None = None

    @property
    def outcome(self) -> np.ndarray:
        """bool ``[4]``: whether each phase was reached at some step; ``transferred`` at the last step."""
        out = self.phases.any(axis=0)
        out[3] = bool(self.phases[-1, 3])
        return out


def write_episode(episode: Episode, path: str | Path, compression: str | None = "gzip") -> Path:
    """Write ``episode`` as one HDF5 file in the ALOHA/ACT layout (module docstring), via h5py.

    Datasets: ``/observations/qpos``, ``/observations/qvel``, ``/action`` float32 ``[T, 14]``;
    ``/observations/images/<camera>`` uint8 ``[N, H, W, 3]`` (one chunk per image, ``compression``);
    ``/observations/image_steps`` int32 ``[N]``; ``/subtask`` and ``/caption`` UTF-8 strings ``[T]``;
    ``/subtask_index`` int8 ``[T]``; ``/subtask_state`` int8 ``[T]`` (the state labels, when the episode has
    them); ``/phases`` bool ``[T, 4]``. Attributes: ``sim`` (True), ``seed``,
    ``dt`` [s], ``instruction``, ``joint_names``, ``subtasks``, ``phase_names``, ``outcome`` and
    ``expert_outcome`` (bool ``[4]``), ``cube_start`` [m], ``image_every``, ``perturb_scale``; a near-miss
    episode also ``miss_offset`` [m] and ``miss_steps`` (:class:`Episode`).

    Returns:
        the path written.
    """
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        f.attrs.update({"sim": True, "seed": episode.seed, "dt": DT, "instruction": INSTRUCTION,
                        "joint_names": list(JOINTS), "subtasks": list(SUBTASKS), "phase_names": list(PHASES),
                        "outcome": episode.outcome, "expert_outcome": episode.expert_phases,
                        "cube_start": episode.cube_start, "perturb_scale": episode.perturb_scale,
                        "image_every": int(episode.image_steps[1] - episode.image_steps[0])
                        if len(episode.image_steps) > 1 else len(episode.action)})
        if episode.miss_offset is not None:
            f.attrs.update({"miss_offset": np.asarray(episode.miss_offset, np.float64),
                            "miss_steps": np.asarray(episode.miss_steps, np.int64)})
        obs = f.create_group("observations")
        obs.create_dataset("qpos", data=episode.qpos)
        obs.create_dataset("qvel", data=episode.qvel)
        obs.create_dataset("image_steps", data=episode.image_steps)
        images = obs.create_group("images")
        for camera, frames in episode.images.items():
            images.create_dataset(camera, data=frames, chunks=(1, *frames.shape[1:]) if len(frames) else None,
                                  compression=compression)
        f.create_dataset("action", data=episode.action)
        f.create_dataset("subtask", data=[SUBTASKS[i] for i in episode.subtask], dtype=text)
        f.create_dataset("subtask_index", data=episode.subtask)
        if episode.state_subtask is not None:
            f.create_dataset("subtask_state", data=np.asarray(episode.state_subtask, np.int8))
        f.create_dataset("caption", data=episode.caption, dtype=text)
        f.create_dataset("phases", data=episode.phases)
    return path


def read_episode(path: str | Path) -> Episode:
    """Read a file written by :func:`write_episode` back into an :class:`Episode`.

    Raises:
        FileNotFoundError: no such file.
        KeyError: a dataset of the layout is missing.
    """
    import h5py

    with h5py.File(path, "r") as f:
        index = {name: i for i, name in enumerate(f.attrs["subtasks"])}
        subtask = np.asarray([index[s.decode() if isinstance(s, bytes) else s] for s in f["subtask"][()]], np.int8)
        return Episode(
            seed=int(f.attrs["seed"]), qpos=f["observations/qpos"][()], qvel=f["observations/qvel"][()],
            action=f["action"][()], images={c: f["observations/images"][c][()] for c in f["observations/images"]},
            image_steps=f["observations/image_steps"][()], subtask=subtask,
            caption=[s.decode() if isinstance(s, bytes) else s for s in f["caption"][()]],
            phases=f["phases"][()], expert_phases=np.asarray(f.attrs["expert_outcome"], bool),
            cube_start=np.asarray(f.attrs["cube_start"]), perturb_scale=float(f.attrs.get("perturb_scale", 0.0)),
            state_subtask=f["subtask_state"][()] if "subtask_state" in f else None,
            miss_offset=np.asarray(f.attrs["miss_offset"]) if "miss_offset" in f.attrs else None,
            miss_steps=np.asarray(f.attrs["miss_steps"]) if "miss_steps" in f.attrs else None)
