"""Scripted demonstrations of gym-aloha's bimanual transfer-cube task, for training the demo policy.

Recipe (docs/demo-policy.md):

1. **Expert in end-effector space.** The cube's start pose is drawn with gym-aloha's
   ``sample_box_pose(seed)`` (x ∈ [0, 0.2] m, y ∈ [0.4, 0.6] m). A waypoint script written from the
   task geometry moves the grippers of the *mocap* variant of the scene (gym-aloha's
   ``bimanual_viperx_end_effector_transfer_cube.xml``: each gripper welded to a mocap body, so MuJoCo's
   constraint solver does the inverse kinematics): the right gripper reaches above the cube, descends,
   closes, lifts the cube to a hand-over point above the table's centre; the left gripper comes from the
   other side and closes on the cube's free half; the right gripper opens and backs off. The arms' joint
   positions are recorded at every control step (50 Hz, gym-aloha's ``DT``).
2. **Replay in the joint-space scene.** The recorded joint positions and the scripted gripper openings
   become the 14 absolute position targets (gym-aloha's ``JOINTS`` order and units: 6 joint angles
   [rad] and the normalised gripper opening per arm) executed by the demo's own simulated robot
   (:class:`oxygen_ros.tools.sim_robot.AlohaScene`: same scene, actuators, target rate limit, 2 ms
   physics steps, 20 ms control period). The replay renders the demo's cameras (``top``,
   ``left_wrist``, ``right_wrist``, 320 x 240 by default) and is what gets stored and scored.
3. **Labels.** Each step carries the subtask of the script segment it belongs to
   (:data:`SUBTASKS`) and a scene caption computed from the replay's simulator state
   (:func:`scene_caption`: where the cube is, which gripper holds it).

Rendering with OSMesa costs ~70-160 ms per image on these CPUs whatever the resolution, so images are
rendered every ``image_every`` control steps (default 5: 10 Hz, 3 cameras) while the joint states and
actions are kept at 50 Hz; a training sample is an image step with the 50 Hz action chunk after it.

The task's definition (instruction, subtasks, phases, cameras), its ground truth (:func:`scene_state`,
:func:`phase_flags`, :func:`state_subtask`, :func:`scene_caption`) and the episode file (one HDF5 file per
episode in the ALOHA/ACT layout, :func:`write_episode`) live in :mod:`oxygen_ros.demo_task`; this module is
the expert and the generation of episodes and datasets.

Command line: ``python -m oxygen_ros.tools.demo_data --episodes 100 --out runs/demo-data`` (``--help``).
"""

from __future__ import annotations

import os

# MuJoCo picks its OpenGL backend when it is imported: OSMesa works without a display.
os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from gym_aloha.constants import ASSETS_DIR, START_ARM_POSE, unnormalize_puppet_gripper_position  # noqa: E402
from gym_aloha.utils import sample_box_pose  # noqa: E402

from oxygen_ros.demo_task import (ARMS, CAMERAS, DT, GRASP_OFFSET, IMAGE_HEIGHT, IMAGE_WIDTH,  # noqa: E402
                                  INSTRUCTION, PHASES, SETTLE_S, SUBTASKS, Episode, SceneGeoms, grasp_pose,
                                  phase_flags, quat_rotate, scene_caption, scene_state, state_subtask,
                                  write_episode)

EE_SCENE = ASSETS_DIR / "bimanual_viperx_end_effector_transfer_cube.xml"
_QPOS_ARM = (slice(0, 6), slice(8, 14))    # per arm: 6 joints, then two finger slides
# Gripper commands (normalised opening, 0 closed .. 1 open).
_OPEN, _CLOSED = 1.0, 0.0
# Torsional spring on each forearm_roll joint of the mocap scene [N·m/rad], rest angle 0. With the wrist
# straight the forearm roll and the wrist rotate turn about one axis, so the weld leaves their split free and
# the solver let it drift anywhere from -1.8/+2.0 to +1.8/-2.0 rad from episode to episode: equal gripper
# poses, opposite joint targets — a mode the images cannot tell, which a policy trained on it averages. The
# spring keeps the roll within ~0.1 rad without moving the gripper (the expert's success is unchanged).
_ROLL_STIFFNESS = 50.0


# ---------------------------------------------------------------------------------------------------
# quaternions (w, x, y, z), MuJoCo's convention


def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty(4)
    mujoco.mju_mulQuat(out, np.asarray(a, float), np.asarray(b, float))
    return out


def _quat_axis(axis, angle: float) -> np.ndarray:
    out = np.empty(4)
    mujoco.mju_axisAngle2Quat(out, np.asarray(axis, float), float(angle))
    return out


def _quat_inverse(q: np.ndarray) -> np.ndarray:
    out = np.empty(4)
    mujoco.mju_negQuat(out, np.asarray(q, float))
    return out


def _slerp(a: np.ndarray, b: np.ndarray, s: float) -> np.ndarray:
    a, b = np.asarray(a, float), np.asarray(b, float)
    dot = float(a @ b)
    if dot < 0.0:
        b, dot = -b, -dot
    if dot > 0.9995:
        q = a + s * (b - a)
        return q / np.linalg.norm(q)
    theta = math.acos(dot)
    return (math.sin((1 - s) * theta) * a + math.sin(s * theta) * b) / math.sin(theta)


def gripper_quat(arm: str, pitch: float) -> np.ndarray:
    """Orientation of ``arm``'s gripper_link pointing toward the other arm, tipped down by ``pitch`` [rad].

    The left gripper's x axis points along +x (world) at zero pitch, the right one's along -x (its base
    is turned by π about z); pitch rotates about the gripper's own y axis, which tips its x axis down.
    """
    yaw = _quat_axis([0, 0, 1], 0.0 if arm == "left" else math.pi)
    return _quat_mul(yaw, _quat_axis([0, 1, 0], pitch))


# ---------------------------------------------------------------------------------------------------
# the expert's plan


def _smoothstep(u: float) -> float:
    """3u² − 2u³: from 0 to 1 over u in [0, 1] with zero slope at both ends (no velocity step)."""
    return u * u * (3.0 - 2.0 * u)


def _interpolate(a: tuple, b: tuple, s: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The pose ``s`` of the way from ``a`` to ``b`` (each ``(grasp point, quaternion, opening)``): linear
    position and opening, spherical orientation."""
    return a[0] + s * (b[0] - a[0]), _slerp(a[1], b[1], s), a[2] + s * (b[2] - a[2])


@dataclasses.dataclass(frozen=True)
class Waypoint:
    """One key pose of one arm's gripper; poses between waypoints are interpolated (:meth:`Plan.pose`).

    Attributes:
        t: time since the episode start [s].
        pos: grasp point (centre between the fingertips) in the world [m], float ``[3]``.
        quat: gripper_link orientation (w, x, y, z), float ``[4]``.
        grip: commanded normalised gripper opening (0 closed, 1 open).
        via: the arm passes this pose's neighbourhood without stopping (a control point of the curve from
            the previous stop to the next; its ``t`` is then unused); False: the arm stops here.
    """

    t: float
    pos: np.ndarray
    quat: np.ndarray
    grip: float
    via: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """The expert's script for one episode.

    Attributes:
        left, right: each arm's waypoints, increasing in ``t``, the first at t = 0; the first and the last
            are stops, and at most one via waypoint lies between two stops.
        segments: ``(start time [s], index into SUBTASKS)``, increasing; a step belongs to the last
            segment started at or before it.
        duration: episode length [s].

    Raises:
        ValueError: a via waypoint first, last or next to another via waypoint.
    """

    left: tuple[Waypoint, ...]
    right: tuple[Waypoint, ...]
    segments: tuple[tuple[float, int], ...]
    duration: float

    def __post_init__(self):
        for arm, points in (("left", self.left), ("right", self.right)):
            via = [w.via for w in points]
            if via[0] or via[-1] or any(x and y for x, y in zip(via, via[1:])):
                raise ValueError(f"{arm} arm: a via waypoint must lie between two stops, one at most")

    def pose(self, arm: str, t: float) -> tuple[np.ndarray, np.ndarray, float]:
        """``(grasp point [3], quaternion [4], gripper opening)`` of ``arm`` at time ``t`` [s].

        Between two stops the progress is the smoothstep s = 3u² − 2u³ of the time fraction u, so the arm
        starts and stops with zero velocity. Without a via waypoint between them the grasp point moves on
        the straight line, the orientation by slerp and the opening linearly in s. With one via waypoint V
        from stop A to stop B the grasp point follows the cubic Bézier curve with both inner control points
        at V: (1 − s)³A + (1 − (1 − s)³ − s³)V + s³B. It never stops near V, leaves A towards V and arrives
        at B from V's direction (a descent from above stays vertical at its end). The orientation and the
        opening go A → V → B by the same weights (V's once 1 − (1 − s)³ is reached, then on to B by s³).
        """
        points = self.left if arm == "left" else self.right
        stops = [i for i, w in enumerate(points) if not w.via]
        if t <= points[0].t:
            w = points[0]
            return w.pos, w.quat, w.grip
        for i, j in zip(stops, stops[1:]):
            a, b = points[i], points[j]
            if t <= b.t:
                s = _smoothstep((t - a.t) / (b.t - a.t))
                if j == i + 1:
                    return _interpolate((a.pos, a.quat, a.grip), (b.pos, b.quat, b.grip), s)
                v = points[i + 1]
                wa, wb = (1.0 - s) ** 3, s ** 3
                pos = wa * a.pos + (1.0 - wa - wb) * v.pos + wb * b.pos
                quat = _slerp(_slerp(a.quat, v.quat, 1.0 - wa), b.quat, wb)
                grip = (1.0 - wb) * (wa * a.grip + (1.0 - wa) * v.grip) + wb * b.grip
                return pos, quat, grip
        w = points[-1]
        return w.pos, w.quat, w.grip

    def subtask(self, t: float) -> int:
        """Index into :data:`SUBTASKS` of the segment running at time ``t`` [s]."""
        index = self.segments[0][1]
        for start, which in self.segments:
            if t + 1e-9 >= start:
                index = which
        return index


# Geometry and timing of the script [m, rad, s] (chosen on the scene: see docs/demo-policy.md).
_APPROACH_HEIGHT = 0.10    # above the cube before descending
_GRASP_HEIGHT = 0.005      # the right fingertips this far above the cube centre when closing: the pads
#                            hold the cube's upper right quarter, its lower left stays free
_GRASP_PITCH = 1.0         # the right gripper tipped down by ~57°; kept until the release, so the cube
#                            stays upright for the left gripper
_HANDOVER = np.array([0.0, 0.5, 0.22])   # where the right gripper brings the cube
_LEFT_REACH = 0.004        # the left fingertips stop this far short of the cube centre (x)
_PRE_HANDOVER = 0.12       # the left gripper passes this much further left on its way in (a via point)
_HANDOVER_TIME = 6.4       # the cube has settled at the hand-over point; the left approach is planned then
_REPLAN_BLEND = 0.4        # the left arm's pose blends from the first plan into the re-planned one over this
_DURATION = 10.6


def plan_transfer(cube: np.ndarray, start: dict[str, tuple[np.ndarray, np.ndarray]],
                  handover_cube: np.ndarray | None = None) -> Plan:
    """The expert's waypoints for a cube resting at ``cube`` (centre, world [m]).

    The right gripper, tipped down, picks the cube off the table from above with its fingertips (their
    pads on the upper right of the cube's side faces) and carries it to the hand-over point; the left
    gripper, level, comes in from the left and closes on the free left half of the side faces; the
    right gripper opens and backs off along its approach. Neither arm stops on its way to the cube: the
    right one curves from its start pose over the cube (10 cm above it, a via waypoint) down onto it and,
    once it holds the cube, from the lift (12 cm up) on into the carry; the left one from its start pose
    past a point 12 cm left of the hand-over into it; each stops only where its gripper closes (a pause
    on the way is a state from which the demonstrations both wait and go on).

    Args:
        cube: float ``[3]`` cube centre at rest.
        start: per arm, the ``(grasp point, quaternion)`` of the gripper at the start pose.
        handover_cube: the cube centre observed at ``_HANDOVER_TIME`` (the expert re-plans the left
            arm's approach on where the cube really sits in the right gripper, and blends into the new
            plan over ``_REPLAN_BLEND``); None = the plan's hand-over point.

    Returns:
        the :class:`Plan` (10.6 s).
    """
    cube = np.asarray(cube, dtype=float)
    down = gripper_quat("right", _GRASP_PITCH)
    left_level = gripper_quat("left", 0.0)
    above = cube + [0.0, 0.0, _APPROACH_HEIGHT]
    at_cube = cube + [0.0, 0.0, _GRASP_HEIGHT]
    lifted = cube + [0.0, 0.0, 0.12]
    x = np.array([1.0, 0.0, 0.0])
    # where the right grasp point must go for the cube to reach the hand-over point
    right_hold = _HANDOVER + (at_cube - cube)
    held = _HANDOVER if handover_cube is None else np.asarray(handover_cube, dtype=float)
    left_hold = held - _LEFT_REACH * x
    backoff = right_hold - 0.08 * quat_rotate(down, x)
    r0, l0 = start["right"], start["left"]
    right = (
        Waypoint(0.0, r0[0], r0[1], _OPEN),
        Waypoint(1.5, above, down, _OPEN, via=True),
        Waypoint(2.1, at_cube, down, _OPEN),
        Waypoint(3.1, at_cube, down, _CLOSED),
        Waypoint(3.3, at_cube, down, _CLOSED),
        Waypoint(4.3, lifted, down, _CLOSED, via=True),
        Waypoint(5.8, right_hold, down, _CLOSED),
        Waypoint(8.4, right_hold, down, _CLOSED),
        Waypoint(9.4, right_hold, down, _OPEN),
        Waypoint(10.2, backoff, down, _OPEN),
        Waypoint(_DURATION, backoff, down, _OPEN),
    )
    left = (
        Waypoint(0.0, l0[0], l0[1], _OPEN),
        Waypoint(4.3, l0[0], l0[1], _OPEN),
        Waypoint(5.8, left_hold - _PRE_HANDOVER * x, left_level, _OPEN, via=True),
        Waypoint(7.2, left_hold, left_level, _OPEN),
        Waypoint(8.2, left_hold, left_level, _CLOSED),
        Waypoint(_DURATION, left_hold, left_level, _CLOSED),
    )
    segments = ((0.0, 0), (2.1, 1), (3.3, 2), (4.3, 3), (8.4, 4))
    return Plan(left, right, segments, _DURATION)


_TRACK_GAIN = 0.1
_TRACK_LIMIT = 0.08


class EndEffectorScene:
    """gym-aloha's mocap transfer-cube scene: each gripper_link welded to a mocap body.

    The weld keeps the pose of the gripper relative to its mocap body that the two had in the model's
    reference configuration (MuJoCo's weld ``relpose`` default), read from ``eq_data``; :meth:`command`
    places the mocap bodies so that the grippers' grasp points reach the requested poses.

    Args:
        cube_pose: float ``[7]`` cube position and quaternion (``sample_box_pose``).
    """

    def __init__(self, cube_pose: np.ndarray):
        self.model = mujoco.MjModel.from_xml_path(str(EE_SCENE))
        self.data = mujoco.MjData(self.model)
        self._relpose = {}
        for i in range(self.model.neq):
            mocap = self.model.body(self.model.eq_obj1id[i]).name
            arm = mocap.removeprefix("mocap_")
            self._relpose[arm] = (self.model.eq_data[i, 3:6].copy(), self.model.eq_data[i, 6:10].copy())
        self._mocap = {arm: self.model.body(f"mocap_{arm}").mocapid[0] for arm in ARMS}
        self._gripper = {arm: self.model.body(f"vx300s_{arm}/gripper_link").id for arm in ARMS}
        for arm in ARMS:
            self.model.jnt_stiffness[self.model.joint(f"vx300s_{arm}/forearm_roll").id] = _ROLL_STIFFNESS
        self.data.qpos[:16] = START_ARM_POSE
        self.data.qpos[16:23] = cube_pose
        mujoco.mj_forward(self.model, self.data)
        for arm in ARMS:
            pos, quat = self.grasp_pose(arm)
            self._place(arm, pos, quat)
        self.data.ctrl[:] = self._finger_ctrl(_OPEN, _OPEN)
        self._lead = {arm: np.zeros(3) for arm in ARMS}

    def grasp_pose(self, arm: str) -> tuple[np.ndarray, np.ndarray]:
        """``(grasp point [3], gripper_link quaternion [4])`` of ``arm`` now."""
        return grasp_pose(self.data, self._gripper[arm])

    def _place(self, arm: str, pos: np.ndarray, quat: np.ndarray) -> None:
        relpos, relquat = self._relpose[arm]
        mocap_quat = _quat_mul(quat, _quat_inverse(relquat))
        link_pos = np.asarray(pos, float) - quat_rotate(quat, GRASP_OFFSET)
        self.data.mocap_quat[self._mocap[arm]] = mocap_quat
        self.data.mocap_pos[self._mocap[arm]] = link_pos - quat_rotate(mocap_quat, relpos)

    @staticmethod
    def _finger_ctrl(left: float, right: float) -> np.ndarray:
        lf = unnormalize_puppet_gripper_position(float(np.clip(left, 0.0, 1.0)))
        rf = unnormalize_puppet_gripper_position(float(np.clip(right, 0.0, 1.0)))
        return np.array([lf, -lf, rf, -rf])

    def command(self, poses: dict[str, tuple[np.ndarray, np.ndarray, float]]) -> None:
        """Target ``(grasp point, quaternion, opening)`` per arm for the next :meth:`step`.

        The weld is soft (the arms sag under gravity and lag behind the mocap bodies by a few cm), so the
        mocap bodies are led by an integral of the grasp points' position error (gain ``_TRACK_GAIN`` per
        step, at most ``_TRACK_LIMIT`` m): the grasp points settle on their targets.
        """
        for arm in ARMS:
            error = np.asarray(poses[arm][0], float) - self.grasp_pose(arm)[0]
            lead = self._lead[arm] + _TRACK_GAIN * error
            norm = float(np.linalg.norm(lead))
            self._lead[arm] = lead if norm <= _TRACK_LIMIT else lead * (_TRACK_LIMIT / norm)
            self._place(arm, np.asarray(poses[arm][0], float) + self._lead[arm], poses[arm][1])
        self.data.ctrl[:] = self._finger_ctrl(poses["left"][2], poses["right"][2])

    def step(self, duration_s: float) -> None:
        """Advance the physics by ``duration_s`` [s] in 2 ms steps."""
        mujoco.mj_step(self.model, self.data, nstep=max(1, round(duration_s / self.model.opt.timestep)))

    def arm_joints(self) -> np.ndarray:
        """float ``[12]``: the left then the right arm's 6 joint angles [rad]."""
        return np.concatenate([self.data.qpos[_QPOS_ARM[0]], self.data.qpos[_QPOS_ARM[1]]])

    def cube_position(self) -> np.ndarray:
        return self.data.qpos[16:19].copy()


def expert_joint_trajectory(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the expert in the end-effector scene for the cube of ``seed``.

    Returns:
        ``(actions float32 [T, 14], subtask int8 [T], expert phases bool [4])``: the arm joint angles
        reached after each control step and the commanded gripper openings, in ``JOINTS`` order.
    """
    scene = EndEffectorScene(sample_box_pose(seed))
    scene.step(SETTLE_S)
    cube = scene.cube_position()
    start = {arm: scene.grasp_pose(arm) for arm in ARMS}
    plan = plan_transfer(cube, start)
    geoms = SceneGeoms(scene.model)
    steps = int(round(plan.duration / DT))
    actions = np.empty((steps, 14), np.float32)
    subtask = np.empty(steps, np.int8)
    reached = np.zeros(4, bool)
    first = plan
    for k in range(steps):
        t = k * DT
        if abs(t - _HANDOVER_TIME) < DT / 2:
            plan = plan_transfer(cube, start, scene.cube_position())
        poses = {arm: plan.pose(arm, t) for arm in ARMS}
        if plan is not first and t < _HANDOVER_TIME + _REPLAN_BLEND:
            # the left arm is moving when it re-plans: blend from the first plan's pose into the new one
            w = _smoothstep((t - _HANDOVER_TIME) / _REPLAN_BLEND)
            poses["left"] = _interpolate(first.pose("left", t), poses["left"], w)
        scene.command(poses)
        scene.step(DT)
        joints = scene.arm_joints()
        actions[k] = np.concatenate([joints[:6], [poses["left"][2]], joints[6:], [poses["right"][2]]])
        subtask[k] = plan.subtask(t)
        flags = phase_flags(scene_state(scene.model, scene.data, geoms), cube[2])
        reached |= flags
    reached[3] = bool(flags[3])
    return actions, subtask, reached


# DART-style noise injection (Laskey et al. 2017, "DART: Noise Injection for Robust Imitation Learning"):
# the replay executes the expert's targets plus smooth noise on the 12 arm joints, so the recorded states
# leave the nominal path; the labels stay the expert's targets (absolute positions, so they lead back).
PERTURB_SIGMA = 0.08          # default stationary std of the noise per arm joint [rad] (before the episode's scale)
_PERTURB_TAU = 0.3            # correlation time of the noise (Ornstein-Uhlenbeck) [s]
_PERTURB_WINDOWS = ((0.0, 1.7, 1.0), (1.5, 2.0, 0.5), (3.7, 5.6, 0.5))   # (start [s], end [s], gain):
#                                                  approach; descent to the cube (softer); lift and carry
_PERTURB_FADE = 0.2           # the gain ramps in and out over this [s] (no step in the targets)
_ARM_JOINTS = np.r_[0:6, 7:13]
_PROJECT_WINDOW = 25          # labels may come from up to this many steps before or after the step
_PROJECT_TIME_COST = 2e-5     # [rad^2 per step^2]: ties (a static arm) go to the step's own time
_PERTURB_RETRIES = (1.0, 0.5, 0.25)   # scales tried in turn until the perturbed replay still transfers; else none


def perturbation(seed: int, steps: int, sigma: float) -> np.ndarray:
    """The noise added to the executed targets of episode ``seed``: float ``[steps, 14]`` [rad].

    An Ornstein-Uhlenbeck process per arm joint (stationary std ``sigma`` × the episode's scale, correlation
    time ``_PERTURB_TAU``), multiplied by the largest gain of ``_PERTURB_WINDOWS`` at each step's time (each
    window ramps in and out over ``_PERTURB_FADE``): full during the approach, half during the descent to the
    cube (so the data hold states beside the descent, labelled down to the cube), zero from 2.0 s while the
    gripper closes and from 5.6 s around the hand-over, where a push would knock the cube and make the
    expert's targets wrong; zero on the grippers. The episode's scale is uniform in [0, 1) (from ``seed``),
    so the data also cover small deviations. ``sigma`` = 0 gives zeros.
    """
    noise = np.zeros((steps, 14))
    if sigma <= 0:
        return noise
    rng = np.random.default_rng([seed, 0xDA27])
    scale = rng.uniform()
    a = math.exp(-DT / _PERTURB_TAU)
    x = rng.normal(0.0, sigma, len(_ARM_JOINTS))
    for k in range(steps):
        t = k * DT
        gain = 0.0
        for start, end, g in _PERTURB_WINDOWS:
            ramp = min(t - start, end - t) / _PERTURB_FADE
            gain = max(gain, g * min(1.0, max(0.0, ramp)) if start <= t <= end else 0.0)
        noise[k, _ARM_JOINTS] = scale * gain * x
        x = a * x + math.sqrt(1.0 - a * a) * rng.normal(0.0, sigma, len(_ARM_JOINTS))
    return noise


def _executed_targets(actions: np.ndarray, noise: np.ndarray, scale: float) -> np.ndarray:
    """The targets a (perturbed) replay executes: the expert's ``actions`` plus ``scale`` × ``noise``
    (:func:`perturbation`), float32 ``[T, 14]`` — one expression for the generator and the relabelling, so
    that a relabelled file's replay executes bit for bit what its generation executed."""
    return (actions + scale * noise).astype(np.float32)


def project_labels(qpos: np.ndarray, nominal_qpos: np.ndarray, perturbed: np.ndarray,
                   own: np.ndarray | None = None) -> np.ndarray:
    """For each step, the step of the nominal (unperturbed) replay whose joint state is nearest: int ``[T]``.

    Searched within ±``_PROJECT_WINDOW`` steps of the step's own time, with a small cost per step of time
    shift (``_PROJECT_TIME_COST``), over all 14 joint-state dimensions (the gripper openings are the clock
    while the arms stand). Steps with ``perturbed`` False (and no deviation) map to their own time. This makes
    the labels a function of the state rather than of the script's clock: an arm pushed ahead along its path
    is labelled with the expert's later targets, not told to go back.

    Args:
        qpos: float ``[T, 14]`` the perturbed replay's states; nominal_qpos: float ``[N, 14]`` the nominal
            replay's; perturbed: bool ``[T]`` steps whose state may be off the nominal path.
        own: int ``[T]`` the nominal step of each step's time, in ``0 .. N − 1`` (default ``0 .. T − 1``, N = T;
            a near-miss replay that holds the arm is longer than the nominal one: :func:`miss_targets`).
    """
    steps, nominal_steps = len(qpos), len(nominal_qpos)
    index = np.arange(steps) if own is None else np.asarray(own, dtype=np.int64).copy()
    for k in np.flatnonzero(perturbed):
        centre = int(index[k])
        lo, hi = max(0, centre - _PROJECT_WINDOW), min(nominal_steps, centre + _PROJECT_WINDOW + 1)
        cand = np.arange(lo, hi)
        cost = ((nominal_qpos[lo:hi] - qpos[k]) ** 2).sum(axis=1) + _PROJECT_TIME_COST * (cand - centre) ** 2
        index[k] = cand[int(np.argmin(cost))]
    return index


# Near-miss demonstrations: the right arm first comes down beside the cube, hovers there with the gripper
# open, then moves onto it and the expert's script goes on. The states of a policy that misses (the open
# gripper 3-5 cm beside the cube) are rare in the expert's own episodes; these put them in the data, with the
# expert's targets of the nearest nominal state as labels (as for the DART noise: they lead onto the cube) and
# the state rule's subtask ("move the right arm to the cube" until the grasp point is within 3 cm).
MISS_AT_S = 2.1                 # the script's stop with the open gripper at the cube: the miss replaces it
MISS_DISTANCE = (0.035, 0.06)   # horizontal distance of the grasp point from where it should be [m]
MISS_RISE = (0.0, 0.02)         # and this much higher [m]
MISS_IN_S = 0.6                 # the offset grows over the descent's last this-many seconds
MISS_HOLD_S = (0.4, 1.2)        # the arm hovers at the miss this long
MISS_CORRECT_S = 0.6            # then moves onto the cube in this long
_MISS_TRIES = 4                 # offsets drawn in turn until the replay stays a miss and still transfers


_IK_DAMPING = 1e-3   # [m²]: the forearm roll and the wrist rotation are nearly coaxial at the grasp pose
_IK_TURN_WEIGHT = 0.05   # [m/rad]: orientation rows' weight; the grasp point's offset is met, the orientation
#                          nearly (a turn of the waist yaws the gripper a little, as a real miss would)


def right_arm_offset(joints: np.ndarray, offset: np.ndarray, iterations: int = 30) -> np.ndarray:
    """Right-arm joint angles whose grasp point lies ``offset`` away from that of ``joints``, at nearly the same
    orientation.

    Damped least squares on the joint-space scene's kinematics (MuJoCo's ``mj_jac`` at the grasp point,
    position rows and orientation rows weighted by ``_IK_TURN_WEIGHT``, damped by ``_IK_DAMPING`` so that the near-singular wrist stays put),
    ``iterations`` Gauss-Newton steps; no physics, no joint limits (the scene's
    actuators clip the targets).

    Args:
        joints: float ``[6]`` right-arm joint angles [rad] (``JOINTS`` 7..12).
        offset: float ``[3]`` world-frame displacement of the grasp point [m].

    Returns:
        float64 ``[6]`` joint angles [rad].
    """
    from oxygen_ros.tools.sim_robot import _ARM_QPOS, SCENE

    model = mujoco.MjModel.from_xml_path(str(SCENE))
    data = mujoco.MjData(model)
    body = SceneGeoms(model).right_gripper
    addresses = np.arange(model.nq)[_ARM_QPOS[1]]
    dofs = np.asarray([model.jnt_dofadr[np.flatnonzero(model.jnt_qposadr == a)[0]] for a in addresses])

    def pose(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        data.qpos[addresses] = q
        mujoco.mj_kinematics(model, data)
        return grasp_pose(data, body)

    q = np.asarray(joints, dtype=np.float64).copy()
    start, quat = pose(q)
    goal = start + np.asarray(offset, dtype=np.float64)
    jacp, jacr = np.zeros((3, model.nv)), np.zeros((3, model.nv))
    for _ in range(iterations):
        point, now = pose(q)
        turn = _quat_mul(quat, _quat_inverse(now))           # world-frame rotation still to go
        error = np.concatenate([goal - point, _IK_TURN_WEIGHT * 2.0 * np.sign(turn[0] or 1.0) * turn[1:]])
        mujoco.mj_comPos(model, data)                        # pose() ran the kinematics of q
        mujoco.mj_jac(model, data, jacp, jacr, point, body)
        jac = np.vstack([jacp[:, dofs], _IK_TURN_WEIGHT * jacr[:, dofs]])
        q += jac.T @ np.linalg.solve(jac @ jac.T + _IK_DAMPING * np.eye(6), error)
    return q


def miss_targets(actions: np.ndarray, at: int, delta: np.ndarray, hold: int, correct: int,
                 ramp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The executed targets of a near-miss replay of the expert's ``actions``.

    Steps ``0 .. at − 1`` are the expert's, plus ``delta`` on the right arm growing by smoothstep over the last
    ``ramp`` of them; then ``hold`` steps at the expert's step ``at`` plus ``delta``; then ``correct`` steps
    from there to the expert's step ``at`` (``delta`` shrinking by smoothstep); then the expert's steps ``at``
    onwards. The grippers always follow the expert (open until ``at``).

    Args:
        actions: float ``[T, 14]`` the expert's targets; at: the step the miss replaces (0 < at < T);
        delta: float ``[6]`` the right arm's joint offset of the miss [rad]; hold, correct, ramp: steps (≥ 1).

    Returns:
        ``(targets float32 [T + hold + correct, 14], own int64 [same], off bool [same])``: own is the
        expert's step of each step's time (:func:`project_labels`), off marks the steps with an offset.
    """
    if not 0 < at < len(actions) or min(hold, correct, ramp) < 1:
        raise ValueError(f"need 0 < at < {len(actions)} and hold, correct, ramp >= 1; got {at}, {hold}, "
                         f"{correct}, {ramp}")
    steps = len(actions) + hold + correct
    own = np.concatenate([np.arange(at), np.full(hold + correct, at), np.arange(at, len(actions))])
    weight = np.zeros(steps)
    for k in range(max(0, at - ramp), at):
        weight[k] = _smoothstep((k - (at - ramp) + 1) / ramp)
    weight[at:at + hold] = 1.0
    for j in range(correct):
        weight[at + hold + j] = 1.0 - _smoothstep((j + 1) / correct)
    targets = actions[own].astype(np.float64)
    targets[:, 7:13] += weight[:, None] * np.asarray(delta, dtype=np.float64)[None, :]
    return targets.astype(np.float32), own, weight > 0


@dataclasses.dataclass
class _Replay:
    qpos: np.ndarray
    qvel: np.ndarray
    phases: np.ndarray
    captions: list[str]
    images: dict[str, np.ndarray]
    image_steps: np.ndarray
    rest: np.ndarray
    state_subtask: np.ndarray


def _replay(seed: int, targets: np.ndarray, image_every: int, width: int, height: int,
            cameras: tuple[str, ...], stop: int | None = None) -> _Replay:
    """Execute ``targets`` (float ``[T, 14]``) in the joint-space scene; render ``cameras`` (none: physics only).
    ``stop``: record only the states before the first ``stop`` actions (default all T)."""
    from oxygen_ros.tools.sim_robot import AlohaScene

    scene = AlohaScene(width=width, height=height, seed=seed)
    try:
        scene.step(SETTLE_S)
        geoms = SceneGeoms(scene.model)
        rest = scene_state(scene.model, scene.data, geoms).cube
        steps = len(targets) if stop is None else stop
        qpos = np.empty((steps, 14), np.float32)
        qvel = np.empty((steps, 14), np.float32)
        phases = np.empty((steps, 4), bool)
        labels = np.empty(steps, np.int8)
        captions = []
        image_steps = np.arange(0, steps, image_every, dtype=np.int32)
        images = {camera: np.empty((len(image_steps), height, width, 3), np.uint8) for camera in cameras}
        for k in range(steps):
            position, velocity = scene.joint_state()
            qpos[k], qvel[k] = position, velocity
            state = scene_state(scene.model, scene.data, geoms)
            captions.append(scene_caption(state))
            labels[k] = state_subtask(state, rest[2], position)
            if k % image_every == 0:
                for camera in cameras:
                    images[camera][k // image_every] = scene.render(camera)
            scene.set_action(targets[k])
            scene.step(DT)
            phases[k] = phase_flags(scene_state(scene.model, scene.data, geoms), rest[2])
        if scene.resets:
            raise RuntimeError(f"episode {seed}: the physics went unstable during the replay")
    finally:
        scene.close()
    return _Replay(qpos, qvel, phases, captions, images, image_steps, rest, labels)


def _check_render_settings(image_every: int, cameras: tuple[str, ...]) -> None:
    """Raise ValueError for ``image_every`` < 1 or a camera the scene does not have."""
    if image_every < 1:
        raise ValueError(f"image_every must be >= 1, got {image_every}")
    unknown = set(cameras) - set(CAMERAS)
    if unknown:
        raise ValueError(f"unknown cameras {sorted(unknown)}; the scene's are {CAMERAS}")


def generate_episode(seed: int, image_every: int = 5, width: int = IMAGE_WIDTH, height: int = IMAGE_HEIGHT,
                     cameras: tuple[str, ...] = CAMERAS, perturb: float = 0.0) -> Episode:
    """One demonstration: the expert's joint trajectory replayed in the demo robot's joint-space scene.

    Args:
        seed: cube pose seed (same seed ⇒ identical arrays on one machine and MuJoCo build).
        image_every: render the cameras every this many control steps (≥ 1).
        width, height: image size [px] (the demo robot's default 320 x 240).
        cameras: which cameras to render (empty: none).
        perturb: DART noise std per arm joint [rad] (:func:`perturbation`; 0: the nominal replay). With
            noise, the executed targets are the expert's plus the noise, the recorded ``action`` and
            ``subtask`` are the expert's at the nominal step nearest each recorded state
            (:func:`project_labels`); if the perturbed replay no longer transfers the cube, the noise is
            scaled by 1/2, then 1/4, then dropped (``Episode.perturb_scale`` says which was kept).

    Raises:
        ValueError: ``image_every`` < 1, ``perturb`` < 0 or not finite, or an unknown camera.
        RuntimeError: the replay's physics went unstable (the scene reset itself; never seen with this
            expert, but such an episode must not be stored).
    """
    _check_render_settings(image_every, cameras)
    if not 0 <= perturb < math.inf:
        raise ValueError(f"perturb must be finite and >= 0, got {perturb}")
    actions, subtask, expert = expert_joint_trajectory(seed)
    labels, label_subtask, scale = actions, subtask, 0.0
    targets = actions
    if perturb > 0:
        nominal = _replay(seed, actions, len(actions), width, height, ())
        noise = perturbation(seed, len(actions), perturb)
        for scale in _PERTURB_RETRIES:
            targets = _executed_targets(actions, noise, scale)
            trial = _replay(seed, targets, len(actions), width, height, ())
            if trial.phases[-1, 3]:
                break
        else:       # no noisy replay transfers: the nominal one (already run) is the episode
            scale, targets = 0.0, actions
        if scale > 0:
            deviated = np.abs(trial.qpos - nominal.qpos).max(axis=1) > 1e-6
            index = project_labels(trial.qpos, nominal.qpos, deviated)
            labels, label_subtask = actions[index], subtask[index]
    run = _replay(seed, targets, image_every, width, height, cameras)
    return Episode(seed=seed, qpos=run.qpos, qvel=run.qvel, action=np.ascontiguousarray(labels, np.float32),
                   images=run.images, image_steps=run.image_steps, subtask=label_subtask, caption=run.captions,
                   phases=run.phases, expert_phases=expert, cube_start=run.rest, perturb_scale=scale,
                   state_subtask=run.state_subtask)


def generate_miss_episode(seed: int, image_every: int = 5, width: int = IMAGE_WIDTH, height: int = IMAGE_HEIGHT,
                          cameras: tuple[str, ...] = CAMERAS) -> Episode:
    """One near-miss demonstration: the expert's trajectory for cube ``seed`` with the right arm first coming
    down beside the cube (:func:`miss_targets`), replayed in the joint-space scene.

    The miss (from ``seed``): the grasp point ``MISS_DISTANCE`` away horizontally in a uniform direction and
    ``MISS_RISE`` higher than the script's stop at the cube (``MISS_AT_S``), reached over ``MISS_IN_S``, held
    ``MISS_HOLD_S``, left over ``MISS_CORRECT_S``. An offset is kept when the replay is still a miss at the end
    of the hover (the grasp point ≥ 3 cm from the cube: not ``reached``) and still transfers the cube; else the
    next one is drawn, ``_MISS_TRIES`` in all, then the episode is the expert's nominal replay
    (``Episode.miss_offset`` None). Labels: the expert's targets and script subtask at the nominal step nearest
    each state around its own time (:func:`project_labels`); the state labels from the replay. No DART noise.

    Args and Raises: as :func:`generate_episode` (without ``perturb``).
    """
    _check_render_settings(image_every, cameras)
    actions, subtask, expert = expert_joint_trajectory(seed)
    at = int(round(MISS_AT_S / DT))
    ramp, correct = int(round(MISS_IN_S / DT)), int(round(MISS_CORRECT_S / DT))
    nominal = _replay(seed, actions, len(actions), width, height, ())
    rng = np.random.default_rng([seed, 0x4D155])
    chosen = None
    for _ in range(_MISS_TRIES):
        angle, distance = rng.uniform(0.0, 2.0 * math.pi), rng.uniform(*MISS_DISTANCE)
        offset = np.array([distance * math.cos(angle), distance * math.sin(angle), rng.uniform(*MISS_RISE)])
        hold = int(round(rng.uniform(*MISS_HOLD_S) / DT))
        delta = right_arm_offset(actions[at, 7:13], offset) - actions[at, 7:13]
        targets, own, off = miss_targets(actions, at, delta, hold, correct, ramp)
        trial = _replay(seed, targets, len(targets), width, height, ())
        if trial.phases[-1, 3] and not trial.phases[at + hold - 1, 0]:
            chosen = offset, hold, targets, own, trial
            break
    if chosen is None:
        labels, label_subtask, targets, miss, steps = actions, subtask, actions, None, None
    else:
        offset, hold, targets, own, trial = chosen
        deviated = np.abs(trial.qpos - nominal.qpos[own]).max(axis=1) > 1e-6
        index = project_labels(trial.qpos, nominal.qpos, deviated, own)
        labels, label_subtask = actions[index], subtask[index]
        miss, steps = offset, np.array([at, hold, correct, ramp])
    run = _replay(seed, targets, image_every, width, height, cameras)
    return Episode(seed=seed, qpos=run.qpos, qvel=run.qvel, action=np.ascontiguousarray(labels, np.float32),
                   images=run.images, image_steps=run.image_steps, subtask=np.asarray(label_subtask, np.int8),
                   caption=run.captions, phases=run.phases, expert_phases=expert, cube_start=run.rest,
                   perturb_scale=0.0, state_subtask=run.state_subtask, miss_offset=miss, miss_steps=steps)


def relabel_episode(path: str | Path, perturb: float) -> Path:
    """Add the state labels (``/subtask_state``, :func:`state_subtask`) to an episode file written without
    them, by replaying its executed targets in the joint-space scene without cameras.

    The executed targets are rebuilt from the file's seed and ``perturb_scale`` (the expert's trajectory plus
    that fraction of :func:`perturbation` at std ``perturb``), and the replay runs only up to the file's last
    image step (training reads no other step); ``/subtask_state`` is -1 after it. Only the steps before the
    first action (start frames: one image at step 0) need no expert run.

    Args:
        path: an episode file (:func:`write_episode`); rewritten in place (the labels dataset only).
        perturb: the DART noise std [rad] the directory was generated with (its ``dataset.json`` ``perturb``).

    Raises:
        RuntimeError: the replayed joint states differ from the file's (another ``perturb``, another MuJoCo
            build): the labels would not belong to the recorded states.
    """
    import h5py

    path = Path(path)
    with h5py.File(path, "r") as f:
        seed, scale = int(f.attrs["seed"]), float(f.attrs.get("perturb_scale", 0.0))
        if "miss_offset" in f.attrs:
            raise RuntimeError(f"{path}: a near-miss episode; its generator writes its state labels (regenerate it)")
        qpos, image_steps = f["observations/qpos"][()], f["observations/image_steps"][()]
    steps = len(qpos)
    stop = int(image_steps.max()) + 1 if len(image_steps) else 1
    if stop > 1:
        targets, _, _ = expert_joint_trajectory(seed)
        if len(targets) != steps:
            raise RuntimeError(f"{path}: the expert's trajectory for seed {seed} has {len(targets)} steps, "
                               f"the file {steps}")
        if scale > 0:
            targets = _executed_targets(targets, perturbation(seed, steps, perturb), scale)
    else:
        targets = qpos[:1]           # executed after the only recorded state: it does not matter which
    run = _replay(seed, targets, steps, IMAGE_WIDTH, IMAGE_HEIGHT, (), stop=stop)   # no camera: any size
    if not np.array_equal(run.qpos, qpos[:stop]):
        raise RuntimeError(f"{path}: the replay's joint states differ from the file's (max "
                           f"{np.abs(run.qpos - qpos[:stop]).max():.3g}); generated with another --perturb "
                           f"than {perturb} or another MuJoCo build: regenerate it")
    labels = np.full(steps, -1, np.int8)
    labels[:stop] = run.state_subtask
    with h5py.File(path, "r+") as f:
        if "subtask_state" in f:
            del f["subtask_state"]
        f.create_dataset("subtask_state", data=labels)
    return path


_RELABEL_NEEDS = ("observations/qpos", "observations/image_steps")   # read by relabel_episode (and attr "seed")


def relabel_dataset(data_dir: str | Path, workers: int = 1, progress: bool = True) -> int:
    """:func:`relabel_episode` on every ``episode_<i>.hdf5`` of ``data_dir`` that has no state labels yet,
    with the directory's ``perturb`` (from its ``dataset.json``; 0 when absent). Returns how many were
    relabelled. Raises FileNotFoundError for a missing directory or one without episodes, RuntimeError as
    :func:`relabel_episode` and for a file that is not a readable episode."""
    import h5py
    from tqdm import tqdm

    directory = Path(data_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"no data directory {directory}")
    record = directory / "dataset.json"
    perturb = float(json.loads(record.read_text()).get("perturb", 0.0)) if record.is_file() else 0.0
    files = sorted(directory.glob("episode_*.hdf5"))
    if not files:
        raise FileNotFoundError(f"no episode_*.hdf5 in {directory}")
    todo = []
    for path in files:
        try:
            with h5py.File(path, "r") as f:
                missing = [name for name in _RELABEL_NEEDS if name not in f]
                missing += [] if "seed" in f.attrs else ["attribute seed"]
                if missing:
                    raise RuntimeError(f"{path}: not an episode of this generator (no {', '.join(missing)}); "
                                       "regenerate it or remove it")
                if "subtask_state" not in f:
                    todo.append(path)
        except OSError as error:                    # truncated or not HDF5
            raise RuntimeError(f"{path}: not a readable episode ({error}); regenerate it or remove it") from None
    jobs = [(path, perturb) for path in todo]
    for _ in tqdm(_in_processes(_relabel_job, jobs, workers), total=len(jobs), desc="state labels",
                  unit="episode", disable=not progress):
        pass
    return len(todo)


def _in_processes(function, jobs: list, workers: int):
    """Yield ``function(job)`` for each of ``jobs``, in order: in this process when ``workers`` <= 1 or
    there is one job, else in a pool of ``min(workers, len(jobs))`` spawned processes (not forked: MuJoCo's
    GL context does not survive a fork), terminated when the caller stops iterating or an error escapes."""
    if workers <= 1 or len(jobs) <= 1:
        yield from map(function, jobs)
        return
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)))
    try:
        yield from pool.imap(function, jobs)
    finally:
        pool.terminate()


def _relabel_job(job: tuple) -> Path:
    return relabel_episode(*job)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate (Wilson 1927); ``(0, 1)`` for no trials."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def _generate_and_write(job: tuple) -> dict:
    """One episode: generate, write, return its ``dataset.json`` record (a pool worker's unit of work)."""
    i, seed, image_every, width, height, out, perturb, near_miss = job
    start = time.perf_counter()
    if near_miss:
        episode = generate_miss_episode(seed, image_every=image_every, width=width, height=height)
    else:
        episode = generate_episode(seed, image_every=image_every, width=width, height=height, perturb=perturb)
    write_episode(episode, Path(out) / f"episode_{i}.hdf5")
    miss = {}
    if near_miss:     # None: no offset kept its miss, the nominal replay was stored
        kept = episode.miss_offset is not None
        miss["miss_offset_m"] = [round(float(x), 4) for x in episode.miss_offset] if kept else None
        if kept:
            miss["miss_hold_s"] = round(float(episode.miss_steps[1]) * DT, 3)
    return {"file": f"episode_{i}.hdf5", "seed": seed, "steps": len(episode.action),
            "images_per_camera": len(episode.image_steps),
            "outcome": dict(zip(PHASES, map(bool, episode.outcome))),
            "expert_outcome": dict(zip(PHASES, map(bool, episode.expert_phases))),
            "perturb_scale": episode.perturb_scale,
            **miss,
            "seconds": round(time.perf_counter() - start, 3)}


def generate_dataset(out_dir: str | Path, episodes: int, seed: int = 0, image_every: int = 5,
                     width: int = IMAGE_WIDTH, height: int = IMAGE_HEIGHT, progress: bool = True, workers: int = 1,
                     perturb: float = 0.0, near_miss: bool = False) -> dict:
    """Generate ``episodes`` demonstrations (cube seeds ``seed .. seed + episodes - 1``) into ``out_dir``
    as ``episode_<i>.hdf5`` plus ``dataset.json`` (the recipe, each episode's outcome, the expert's
    success rate per phase with its 95 % Wilson interval, and the measured seconds per episode).
    ``perturb``: DART noise std per arm joint [rad] (:func:`generate_episode`; 0: nominal replays).
    ``near_miss``: near-miss episodes instead (:func:`generate_miss_episode`; ``perturb`` must then be 0).

    Returns:
        the content of ``dataset.json``.

    Raises:
        ValueError: ``episodes`` < 1, ``workers`` < 1, ``image_every`` < 1, or ``near_miss`` with ``perturb``.
    """
    from tqdm import tqdm

    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if near_miss and perturb:
        raise ValueError(f"near-miss episodes carry no DART noise: perturb must be 0, got {perturb}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    jobs = [(i, seed + i, image_every, width, height, str(out), perturb, near_miss) for i in range(episodes)]
    bar = tqdm(total=episodes, desc="demonstrations", unit="episode", disable=not progress)
    # Each episode depends only on its own seed, so a pool of processes gives the same files as one
    # process (rendering is single-threaded: one worker per core).
    try:
        for record in _in_processes(_generate_and_write, jobs, workers):
            records.append(record)
            bar.update(1)
            done = sum(r["outcome"]["transferred"] for r in records)
            bar.set_postfix(transferred=f"{done}/{len(records)}")
    finally:
        bar.close()
    success = {}
    for phase in PHASES:
        k = sum(r["outcome"][phase] for r in records)
        low, high = wilson_interval(k, len(records))
        success[phase] = {"successes": k, "episodes": len(records), "rate": k / len(records),
                          "ci95": [round(low, 4), round(high, 4)]}
    summary = {"instruction": INSTRUCTION, "subtasks": list(SUBTASKS), "cameras": list(CAMERAS),
               "width": width, "height": height, "dt": DT, "image_every": image_every, "seed": seed,
               "perturb": perturb, "near_miss": near_miss,
               "success": success, "seconds_per_episode": round(float(np.mean([r["seconds"] for r in records])), 3),
               "episodes": records}
    (out / "dataset.json").write_text(json.dumps(summary, indent=2))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.tools.demo_data",
                                     description="Scripted transfer-cube demonstrations in gym-aloha's scene "
                                                 "(per-episode HDF5, ALOHA/ACT layout).")
    parser.add_argument("--episodes", type=int, default=100,
                        help="number of episodes (default 100, the shipped demo policy's data)")
    parser.add_argument("--seed", type=int, default=0, help="cube seed of the first episode (default 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo-data"), help="output directory (default runs/demo-data)")
    parser.add_argument("--image-every", type=int, default=5,
                        help="render the cameras every N control steps of 20 ms (default 5: 10 Hz)")
    parser.add_argument("--width", type=int, default=IMAGE_WIDTH,
                        help=f"image width [px] (default {IMAGE_WIDTH}, the demo robot's)")
    parser.add_argument("--height", type=int, default=IMAGE_HEIGHT, help=f"image height [px] (default {IMAGE_HEIGHT})")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="episodes generated in parallel processes (default: the number of CPUs; "
                             "the files do not depend on it)")
    parser.add_argument("--relabel", type=Path, default=None, metavar="DIR",
                        help="instead of generating: add the state labels (/subtask_state) to the episodes of DIR "
                             "written without them, replaying their physics without cameras")
    parser.add_argument("--perturb", type=float, default=None,
                        help="DART noise on the executed arm targets, std per joint [rad] (default "
                             f"{PERTURB_SIGMA}, 0 with --near-miss; 0: the expert's nominal replay)")
    parser.add_argument("--near-miss", action="store_true",
                        help="near-miss episodes: the right arm first comes down 3.5-6 cm beside the cube, hovers, "
                             "then grasps and the script goes on (no DART noise; docs/demo-policy.md)")
    args = parser.parse_args(argv)
    for name in ("episodes", "image_every", "width", "height", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.near_miss and args.perturb:
        parser.error("--near-miss episodes carry no DART noise: leave out --perturb")
    if args.perturb is None:
        args.perturb = 0.0 if args.near_miss else PERTURB_SIGMA
    if not 0.0 <= args.perturb < math.inf:
        parser.error(f"--perturb must be finite and >= 0, got {args.perturb}")
    problem = seed_range_problem("--seed", args.seed, args.episodes)
    if problem:
        parser.error(problem)
    return args


def seed_range_problem(option: str, first: int, count: int) -> str | None:
    """Why ``count`` cube seeds from ``first`` cannot be sampled (gym-aloha seeds NumPy: unsigned 32-bit),
    naming ``option``; None when they can."""
    if 0 <= first and first + count <= 2 ** 32:
        return None
    return f"{option} must be >= 0 and the last seed < 2**32 (cube seeds are unsigned 32-bit), got {first}"


def main(argv: list[str] | None = None) -> int:
    """Generate the dataset and print the expert's success rate per phase."""
    args = parse_args(argv)
    if args.relabel is not None:
        try:
            count = relabel_dataset(args.relabel, workers=args.workers)
        except (FileNotFoundError, RuntimeError) as error:
            raise SystemExit(f"demo_data: {error}") from None
        print(f"added state labels to {count} episodes of {args.relabel}")
        return 0
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"demo_data: cannot create the output directory {args.out}: {error.strerror}") from None
    summary = generate_dataset(args.out, args.episodes, args.seed, args.image_every, args.width, args.height,
                               workers=args.workers, perturb=args.perturb, near_miss=args.near_miss)
    for phase, s in summary["success"].items():
        print(f"expert {phase:11s} {s['successes']}/{s['episodes']} = {s['rate']:.0%} "
              f"(95 % CI {s['ci95'][0]:.0%}-{s['ci95'][1]:.0%})")
    print(f"{summary['seconds_per_episode']:.1f} s per episode; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
