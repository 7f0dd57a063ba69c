"""A simulated ALOHA robot for the demo: gym-aloha's bimanual ViperX scene in MuJoCo, rendered on the CPU.

The scene is the PyPI package gym-aloha's ``assets/bimanual_viperx_transfer_cube.xml`` (two ViperX 300s
arms, a red cube on the table). The node behaves like the real robot's drivers:

* publishes the cameras ``top``, ``left_wrist`` and ``right_wrist`` (or the subset ``cameras`` names) as
  ``sensor_msgs/Image`` (rgb8) on ``cameras/<camera>/image_raw`` (sensor-data QoS), stamped with the node
  clock when the image was rendered. Rendering costs ~70-160 ms per image on a laptop-class CPU whatever
  the resolution, so the cameras are rendered round robin at a modest ``camera_rate_hz`` each, on a thread
  of their own;
* publishes the 14 joint states on ``joint_states`` at ``joint_state_rate_hz``, named and scaled as
  gym-aloha's ``JOINTS``: per arm 6 joint positions [rad] and the gripper's normalised opening
  (0 closed, 1 open), velocities in [rad/s] and [1/s];
* executes the action chunks it receives on ``action_chunk_topic`` (``oxygen_ros/msg/ActionChunk``):
  action i of a chunk is applied at ``header.stamp + i * dt`` (the newest chunk wins, the last action
  is held after a chunk runs out; with ``temporal_ensemble_m`` ≠ 0 the predictions of all overlapping
  chunks for the step are averaged instead, ACT's temporal ensembling:
  :class:`~oxygen_ros.tools.chunk_execution.ChunkExecutor`), as absolute joint position targets for the scene's position
  actuators — 6 joints [rad] and the normalised gripper per arm, matched by ``action_names`` when they
  name gym-aloha's joints, else the first 14 dimensions in that order — clipped to the actuators'
  control ranges, and rate-limited (each actuator's target moves at most its control range per
  ``MIN_TRAVERSE_S``), so that jumps between chunks (random weights) cannot destabilise the physics. The
  physics runs in real time (2 ms MuJoCo steps, ``control_period_s`` per action). Should it still go
  unstable (NaN / Inf / huge accelerations), the scene is reset to the start pose and the reset counted
  (``AlohaScene.resets``, logged); MuJoCo's warnings go to the ROS log, not to ``MUJOCO_LOG.TXT``;
* tracks the task's phases after every control step (:func:`oxygen_ros.demo_task.phase_flags`:
  reached, grasped, lifted, transferred; from 0.2 s on, once the cube has settled) and publishes the
  outcome so far on ``task_outcome`` (``std_msgs/String``, JSON, reliable and transient local, so the last
  one reaches late joiners and the recorder): ``{"seed", "sim_time_s", "steps", "reached", "grasped",
  "lifted", "transferred", "now": {phase: bool}}`` — a phase is true once it held at some step, except
  ``transferred``, which is whether it holds now (the data's and the evaluation's definitions). Published
  when the outcome or the current flags change, and once per second.

Rendering needs an OpenGL: ``MUJOCO_GL=osmesa`` (set here when unset; ``libosmesa6``, installed by
``scripts/setup_env.sh``). Command line: ``python -m oxygen_ros.tools.sim_robot [--ros-args ...]``.
"""

from __future__ import annotations

import os

# MuJoCo picks its OpenGL backend when it is imported: OSMesa is the one that works without a display.
os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import rclpy  # noqa: E402
from gym_aloha.constants import (ASSETS_DIR, JOINTS, START_ARM_POSE,  # noqa: E402
                                 normalize_puppet_gripper_position, normalize_puppet_gripper_velocity,
                                 unnormalize_puppet_gripper_position)
from gym_aloha.utils import sample_box_pose  # noqa: E402
from rclpy._rclpy_pybind11 import RCLError  # noqa: E402
from rclpy.executors import ExternalShutdownException  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros import demo_task  # noqa: E402
from oxygen_ros.msg import ActionChunk  # noqa: E402
from oxygen_ros.tools.chunk_execution import ChunkExecutor  # noqa: E402

SCENE = ASSETS_DIR / "bimanual_viperx_transfer_cube.xml"
CAMERAS = ("top", "left_wrist", "right_wrist")
# qpos / ctrl layout of the scene: per arm 6 joints then the two gripper fingers (left +, right -).
_ARM_QPOS = (slice(0, 6), slice(8, 14))
_FINGER_QPOS = (6, 14)
_GRIPPER_INDEX = (6, 13)  # in the 14-vector of JOINTS
MIN_TRAVERSE_S = 1.0      # an actuator's target crosses its whole control range in no less than this [s]
OUTCOME_TOPIC = "task_outcome"


class OutcomeTracker:
    """The task's phases over an episode (:mod:`oxygen_ros.demo_task`'s definitions), from the simulator state after
    each control step. The cube's rest height is read at the first update at or after ``settle_s`` of sim time;
    earlier updates are ignored (the cube is still dropping onto the table)."""

    def __init__(self, seed: int, settle_s: float = demo_task.SETTLE_S):
        self.seed = seed
        self.settle_s = settle_s
        self.rest_height: float | None = None
        self.steps = 0
        self.sim_time_s = 0.0
        self.ever = np.zeros(len(demo_task.PHASES), bool)
        self.now = np.zeros(len(demo_task.PHASES), bool)

    def update(self, state: "demo_task.SceneState", sim_time_s: float) -> bool:
        """Fold in the state after a control step; True when the outcome or the current flags changed."""
        if sim_time_s < self.settle_s - 1e-9:
            return False
        if self.rest_height is None:
            self.rest_height = float(state.cube[2])
        flags = np.asarray(demo_task.phase_flags(state, self.rest_height), bool)
        before = (self.ever.copy(), self.now.copy())
        self.ever |= flags
        self.now = flags
        self.steps += 1
        self.sim_time_s = sim_time_s
        return not (np.array_equal(before[0], self.ever) and np.array_equal(before[1], self.now))

    def outcome(self) -> dict[str, bool]:
        """Per phase: held at some step; ``transferred``: holds now."""
        result = dict(zip(demo_task.PHASES, map(bool, self.ever)))
        result["transferred"] = bool(self.now[demo_task.PHASES.index("transferred")])
        return result

    def to_json(self) -> str:
        """The message's JSON (see the module docstring)."""
        return json.dumps({"seed": self.seed, "sim_time_s": round(self.sim_time_s, 3), "steps": self.steps,
                           **self.outcome(), "now": dict(zip(demo_task.PHASES, map(bool, self.now)))})


class AlohaScene:
    """gym-aloha's transfer-cube scene in MuJoCo, without ROS: state, actions, physics, rendering.

    Thread-safety: :meth:`step`, :meth:`set_action`, :meth:`joint_state` and :meth:`render` may be called
    from different threads; a lock guards the MuJoCo data, and the costly rasterisation in
    :meth:`render` runs outside it.

    Args:
        width, height: camera image size [px].
        seed: seed of the cube's random start pose.
    """

    def __init__(self, width: int = 320, height: int = 240, seed: int = 0):
        self.model = mujoco.MjModel.from_xml_path(str(SCENE))
        self.data = mujoco.MjData(self.model)
        self._box_pose = sample_box_pose(seed)
        self._ctrl_low, self._ctrl_high = self.model.actuator_ctrlrange.T.copy()
        self._target = np.asarray(START_ARM_POSE, dtype=np.float64).copy()
        self.resets = 0     # resets after the physics went unstable
        self._reset_pose()
        self._renderer = mujoco.Renderer(self.model, height, width)
        self._lock = threading.Lock()

    def _reset_pose(self) -> None:
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[:16] = START_ARM_POSE
        self.data.qpos[-7:] = self._box_pose
        self.data.ctrl[:] = START_ARM_POSE
        self._target[:] = START_ARM_POSE
        mujoco.mj_forward(self.model, self.data)

    @property
    def physics_dt(self) -> float:
        """MuJoCo step [s] (2 ms in this scene)."""
        return float(self.model.opt.timestep)

    @property
    def sim_time(self) -> float:
        """Simulated time since the start [s]."""
        return float(self.data.time)

    def set_action(self, action: np.ndarray) -> None:
        """Set position targets from a float ``[14]`` action in gym-aloha's ``JOINTS`` order and units.

        Arm joints in [rad], grippers normalised (0 closed, 1 open); clipped to the actuator ranges.
        """
        action = np.asarray(action, dtype=np.float64)
        ctrl = np.empty(self.model.nu)
        for arm in range(2):
            ctrl[_ARM_QPOS[arm]] = action[7 * arm: 7 * arm + 6]
            finger = unnormalize_puppet_gripper_position(float(np.clip(action[7 * arm + 6], 0.0, 1.0)))
            ctrl[_FINGER_QPOS[arm]] = finger
            ctrl[_FINGER_QPOS[arm] + 1] = -finger
        ctrl = np.clip(np.nan_to_num(ctrl), self._ctrl_low, self._ctrl_high)
        with self._lock:
            self._target[:] = ctrl

    def step(self, duration_s: float) -> bool:
        """Advance the physics by ``duration_s`` [s] (rounded to whole MuJoCo steps), moving the actuators'
        targets toward the action at most their range per ``MIN_TRAVERSE_S``. Returns False when the
        physics went unstable (non-finite state or MuJoCo's bad qpos/qvel/qacc warnings): the scene was then
        reset to the start pose and :attr:`resets` counts it."""
        n = max(1, round(duration_s / self.physics_dt))
        max_delta = (self._ctrl_high - self._ctrl_low) * (n * self.physics_dt / MIN_TRAVERSE_S)
        with self._lock:
            bad_before = self._bad_state_warnings()
            ctrl = self.data.ctrl
            ctrl[:] = ctrl + np.clip(self._target - ctrl, -max_delta, max_delta)
            mujoco.mj_step(self.model, self.data, nstep=n)
            stable = (self._bad_state_warnings() == bad_before
                      and np.all(np.isfinite(self.data.qpos)) and np.all(np.isfinite(self.data.qvel)))
            if not stable:
                self.resets += 1
                self._reset_pose()
        return stable

    def _bad_state_warnings(self) -> int:
        """MuJoCo's count of NaN / Inf / huge values in qpos, qvel or qacc (on each it resets the data)."""
        return sum(int(self.data.warning[w].number) for w in
                   (mujoco.mjtWarning.mjWARN_BADQPOS, mujoco.mjtWarning.mjWARN_BADQVEL, mujoco.mjtWarning.mjWARN_BADQACC))

    def joint_state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(position, velocity)``, float64 ``[14]`` each, in gym-aloha's ``JOINTS`` order.

        Arm joints: [rad], [rad/s]; grippers: normalised opening (0..1) and its rate [1/s].
        """
        with self._lock:
            qpos, qvel = self.data.qpos.copy(), self.data.qvel.copy()
        position, velocity = np.empty(14), np.empty(14)
        for arm in range(2):
            position[7 * arm: 7 * arm + 6] = qpos[_ARM_QPOS[arm]]
            velocity[7 * arm: 7 * arm + 6] = qvel[_ARM_QPOS[arm]]
            position[_GRIPPER_INDEX[arm]] = normalize_puppet_gripper_position(qpos[_FINGER_QPOS[arm]])
            velocity[_GRIPPER_INDEX[arm]] = normalize_puppet_gripper_velocity(qvel[_FINGER_QPOS[arm]])
        return position, velocity

    def read(self, fn):
        """``fn(model, data)`` under the scene's lock (a consistent read of the simulator state, e.g.
        contacts for scoring); returns its result. ``fn`` must not step the physics or render."""
        with self._lock:
            return fn(self.model, self.data)

    def render(self, camera: str) -> np.ndarray:
        """The image of ``camera`` now: uint8 ``[height, width, 3]`` RGB."""
        with self._lock:
            self._renderer.update_scene(self.data, camera=camera)
        return self._renderer.render()

    def close(self) -> None:
        """Free the renderer's OpenGL context."""
        self._renderer.close()


def _chunk_to_aloha(msg: ActionChunk) -> np.ndarray:
    """ActionChunk -> float64 ``[H, 14]`` in gym-aloha's ``JOINTS`` order.

    Raises:
        ValueError: the chunk has fewer than 14 dimensions or inconsistent sizes.
    """
    horizon, dim = int(msg.horizon), int(msg.action_dim)
    actions = np.asarray(msg.actions, dtype=np.float64)
    if horizon == 0 or actions.size != horizon * dim:
        raise ValueError(f"{actions.size} values for horizon {horizon} x dimension {dim}")
    actions = actions.reshape(horizon, dim)
    names = list(msg.action_names)
    if set(JOINTS) <= set(names):
        return actions[:, [names.index(joint) for joint in JOINTS]]
    if dim < len(JOINTS):
        raise ValueError(f"{dim} action dimensions; ALOHA needs {len(JOINTS)}")
    return actions[:, :len(JOINTS)]


class SimRobot(Node):
    """ROS 2 node around :class:`AlohaScene` (topics and parameters: see the module docstring).

    Parameters (read at start): ``camera_rate_hz`` (images per second per camera, default 1.0),
    ``cameras`` (the cameras rendered and published, round robin in this order; default all of :data:`CAMERAS`),
    ``width`` / ``height`` [px] (default 320 x 240), ``joint_state_rate_hz`` (default 50.0),
    ``control_period_s`` (physics update period, default 0.02 s, gym-aloha's 50 Hz),
    ``action_chunk_topic`` (default ``oxygen_node/action_chunk``), ``seed`` (cube pose, default 0),
    ``temporal_ensemble_m`` (ACT's temporal-ensembling coefficient m [1 / control step]; default 0.0: off,
    the newest chunk wins; e.g. 0.01 = ACT's) and ``temporal_ensemble_max_chunks`` (chunks kept for it,
    default 16) — :class:`~oxygen_ros.tools.chunk_execution.ChunkExecutor` with the ``floor`` index rule.

    Raises:
        ValueError: ``temporal_ensemble_m`` not finite, ``temporal_ensemble_max_chunks`` < 1, or ``cameras``
            empty, repeated or not among :data:`CAMERAS`.

    Args:
        node_name: the node's name.
        **kwargs: forwarded to ``rclpy.node.Node`` (``context=``, ``parameter_overrides=`` ...).

    Threads: the physics loop and the camera loop run on their own threads (started here, ended by
    :meth:`close`, which ``destroy_node`` calls); executor callbacks only store the newest chunk.
    """

    def __init__(self, node_name: str = "aloha_sim", **kwargs):
        super().__init__(node_name, **kwargs)
        self.camera_rate_hz = self.declare_parameter("camera_rate_hz", 1.0).value
        self.cameras = tuple(self.declare_parameter("cameras", list(CAMERAS)).value)
        width = self.declare_parameter("width", 320).value
        height = self.declare_parameter("height", 240).value
        self.joint_state_rate_hz = self.declare_parameter("joint_state_rate_hz", 50.0).value
        self.control_period_s = self.declare_parameter("control_period_s", 0.02).value
        chunk_topic = self.declare_parameter("action_chunk_topic", "oxygen_node/action_chunk").value
        seed = self.declare_parameter("seed", 0).value
        ensemble_m = self.declare_parameter("temporal_ensemble_m", 0.0).value
        ensemble_max_chunks = self.declare_parameter("temporal_ensemble_max_chunks", 16).value
        # Validated before the scene and the threads exist: a bad value fails here, with only the node to free.
        try:
            self._executor = ChunkExecutor(ensemble_m, ensemble_max_chunks, index_rule="floor")
        except ValueError as err:
            Node.destroy_node(self)
            raise ValueError(f"temporal_ensemble_m / temporal_ensemble_max_chunks: {err}") from None
        if not self.cameras or len(set(self.cameras)) != len(self.cameras) or not set(self.cameras) <= set(CAMERAS):
            Node.destroy_node(self)
            raise ValueError(f"cameras must be distinct names of {CAMERAS}, got {list(self.cameras)}")

        # MuJoCo's warnings (e.g. "Nan, Inf or huge value in QACC") into the ROS log: by default MuJoCo
        # appends them to MUJOCO_LOG.TXT in the current directory.
        logger = self.get_logger()
        mujoco.set_mju_user_warning(lambda text: logger.warning(f"MuJoCo: {text}", throttle_duration_sec=5.0))
        self.scene = AlohaScene(width=width, height=height, seed=seed)
        self._image_pubs = {camera: self.create_publisher(Image, f"cameras/{camera}/image_raw",
                                                          qos_profile_sensor_data)
                            for camera in self.cameras}
        self._joint_pub = self.create_publisher(JointState, "joint_states", 10)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self._outcome_pub = self.create_publisher(String, OUTCOME_TOPIC, latched)
        self.outcome = OutcomeTracker(seed)
        self._geoms = demo_task.SceneGeoms(self.scene.model)
        self.create_subscription(ActionChunk, chunk_topic, self._on_chunk, 10)

        self._chunk_lock = threading.Lock()     # guards self._executor (the chunks received)
        self.chunks_received = 0
        self.chunks_rejected = 0
        # per chunk that replaced or joined kept ones: the largest jump over the 12 arm joints of the command [rad]
        # and of its velocity [rad/s] at receipt (ChunkExecutor.seam)
        self.seams: list[tuple[float, float]] = []
        self.images_published = {camera: 0 for camera in self.cameras}
        self.actions_applied = 0
        self._stop = threading.Event()
        self._closed = False
        # The context can be shut down (SIGINT / SIGTERM) before destroy_node joins the threads: stop them
        # first, and treat a publish on the shut-down context as the end of the loop, not an error.
        self.context.on_shutdown(self._stop.set)
        self._threads = [threading.Thread(target=self._physics_loop, name="aloha_physics", daemon=True),
                         threading.Thread(target=self._camera_loop, name="aloha_cameras", daemon=True)]
        for thread in self._threads:
            thread.start()
        self.get_logger().info(
            f"ALOHA scene {SCENE.name}: cameras {', '.join(self.cameras)} at {self.camera_rate_hz:g} Hz each "
            f"({width}x{height}), 14 joint states at {self.joint_state_rate_hz:g} Hz, actions from {chunk_topic}"
            + (f", temporal ensembling m = {ensemble_m:g} over up to {ensemble_max_chunks} chunks"
               if self._executor.ensembling else ""))

    def _now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_chunk(self, msg: ActionChunk) -> None:
        try:
            actions = _chunk_to_aloha(msg)
        except ValueError as err:
            self.chunks_rejected += 1
            self.get_logger().warning(f"action chunk rejected: {err}", throttle_duration_sec=5.0)
            return
        stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        dt = msg.dt if msg.dt > 0 else self.control_period_s
        try:
            with self._chunk_lock:
                # the switch the robot makes at its next tick: the command's and its velocity's jump (arm joints)
                seam = self._executor.seam(self._now_s(), stamp, dt, actions)
                self._executor.add(stamp, dt, actions)
        except ValueError as err:       # non-finite actions (or a dimension change while ensembling)
            self.chunks_rejected += 1
            self.get_logger().warning(f"action chunk rejected: {err}", throttle_duration_sec=5.0)
            return
        self.chunks_received += 1
        if seam is not None:
            arm = np.ones(len(JOINTS), bool)
            arm[list(_GRIPPER_INDEX)] = False
            self.seams.append((float(np.abs(seam[0][arm]).max()), float(np.abs(seam[1][arm]).max())))

    def _current_action(self, now_s: float) -> np.ndarray | None:
        """The action due now (:meth:`ChunkExecutor.action_at`): index ``floor((now - stamp) / dt)`` of the
        newest chunk, clamped; with temporal ensembling, the weighted average over the chunks covering now."""
        with self._chunk_lock:
            return self._executor.action_at(now_s)

    def _physics_loop(self) -> None:
        period = self.control_period_s
        joint_period = 1.0 / self.joint_state_rate_hz
        next_tick = next_joint = next_outcome = time.monotonic()
        while not self._stop.is_set():
            action = self._current_action(self._now_s())
            if action is not None:
                self.scene.set_action(action)
                self.actions_applied += 1
            if not self.scene.step(period):
                with self._chunk_lock:
                    self._executor.clear()  # do not drive straight back into the same state
                self.get_logger().warning(f"the physics went unstable: scene reset to the start pose "
                                          f"({self.scene.resets} resets so far)", throttle_duration_sec=5.0)
            state = self.scene.read(lambda model, data: demo_task.scene_state(model, data, self._geoms))
            now = time.monotonic()
            if self.outcome.update(state, self.scene.sim_time) or now >= next_outcome:
                message = String(data=self.outcome.to_json())
                if not self._publish(lambda: self._outcome_pub.publish(message)):
                    return
                next_outcome = now + 1.0
            if now >= next_joint:
                if not self._publish(self._publish_joint_state):
                    return
                next_joint += joint_period * max(1, int((now - next_joint) // joint_period) + 1)
            next_tick += period
            # Real time: sleep to the next tick; after a stall (CPU contention) skip ahead, not catch up.
            delay = next_tick - time.monotonic()
            if delay < -10 * period:
                next_tick = time.monotonic()
            self._stop.wait(max(0.0, delay))

    def _publish_joint_state(self) -> None:
        position, velocity = self.scene.joint_state()
        msg = JointState(name=list(JOINTS), position=position.tolist(), velocity=velocity.tolist())
        msg.header.stamp = self.get_clock().now().to_msg()
        self._joint_pub.publish(msg)

    def _camera_loop(self) -> None:
        period = 1.0 / (self.camera_rate_hz * len(self.cameras))
        next_render = time.monotonic()
        index = 0
        while not self._stop.is_set():
            camera = self.cameras[index % len(self.cameras)]
            stamp = self.get_clock().now()
            pixels = self.scene.render(camera)
            msg = Image(height=pixels.shape[0], width=pixels.shape[1], encoding="rgb8",
                        is_bigendian=0, step=pixels.shape[1] * 3, data=pixels.tobytes())
            msg.header.stamp = stamp.to_msg()
            msg.header.frame_id = f"{camera}_camera"
            if not self._publish(lambda: self._image_pubs[camera].publish(msg)):
                return
            self.images_published[camera] += 1
            index += 1
            next_render = max(next_render + period, time.monotonic())
            self._stop.wait(max(0.0, next_render - time.monotonic()))

    def _publish(self, publish) -> bool:
        """Run ``publish()``; False (the loop ends) when the node is stopping or the context is shut down."""
        if self._stop.is_set():
            return False
        try:
            publish()
        except RCLError:
            if self._stop.is_set() or not self.context.ok():
                return False
            raise
        return True

    def close(self) -> None:
        """Stop the physics and camera threads and free the renderer; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self.scene.close()

    def destroy_node(self) -> None:
        self.close()
        super().destroy_node()


def main(args: list[str] | None = None) -> int:
    """``python -m oxygen_ros.tools.sim_robot``: run the simulated robot until Ctrl-C or SIGTERM."""
    rclpy.init(args=args)
    robot = SimRobot()
    try:
        rclpy.spin(robot)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        robot.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
