"""Closed-loop evaluation of the demo policy in the simulator: ``python -m oxygen_ros.tools.evaluate``.

Runs M episodes (default 20) of gym-aloha's transfer-cube task with fresh cube poses (seeds from
``--start-seed``, default 1000: disjoint from the training data's 0..99) under each condition and reports,
per condition, the success of each phase with its 95 % Wilson interval, the subtask accuracy of the
published speech and the caption accuracy of the memory entries against the simulator's ground truth, the
mean frame latency and the chunk rate; per episode a contact sheet PNG (docs/demo-policy.md, "Closed-loop
evaluation").

Conditions (``--conditions``, all by default):

* ``node-lockstep``: the oxygen node (``OxygenNode``, in this process, as ``tools/demo.py`` runs it) and a
  simulated robot in a child process, over DDS, on simulated time: the robot publishes ``/clock`` and the
  node runs with ``use_sim_time``. Lockstep: the robot renders the cameras at sim time t, publishes them
  and the joint state (stamped t), waits (wall clock) for an action chunk stamped ≥ t, executes
  ``--execute-steps`` of its actions (advancing ``/clock`` by 20 ms per step) and repeats. Physics is
  paused while the node computes. The node's code needs no change, only parameters: every input is
  subscribed reliably (the robot publishes each once per frame: a lost best-effort sample would never be
  replaced), and with ``staleness_limit_s`` below one control step and every camera required, a frame is
  usable only while ``/clock`` stands at its stamp, so the
  node's (wall-clock) cycle runs exactly once per complete fresh observation and skips otherwise
  (``no_observation``, ``clock_paused``); ``control_rate_hz`` only sets how often it looks.
* ``node-realtime``: the same node with the demo's robot (:class:`~oxygen_ros.tools.sim_robot.SimRobot`,
  real-time physics, cameras rendered round robin at ``--camera-rate``) and the demo's rates.
* ``sync``: the engine called synchronously, without ROS, in the lockstep schedule; built from the same
  node parameters by the node's own code (``read_settings``, ``model_loading.build_engine``, which uses
  :mod:`oxygen_ros.engine.factory`), fed the same images, state and stamps.
* ``random``: as ``sync`` with the preset's seeded random weights (no checkpoint; the checkpoint's
  normalisation statistics), the floor.
* ``expert``: demo_data's scripted expert (:func:`~oxygen_ros.tools.demo_data.expert_joint_trajectory`)
  replayed on the eval seeds in the lockstep schedule, the ceiling (its "speech" is its script's label,
  so its subtask accuracy is the agreement of the script with the ground-truth mapping).

Chunk execution (``--ensemble M``, every condition but ``expert``): 0 (default) executes the newest chunk
(in lockstep: each chunk's first ``--execute-steps`` actions); M ≠ 0 averages, at every control step, the
predictions of all the chunks that cover the step with ACT's temporal-ensembling weights ``exp(−M·i)``
(:mod:`oxygen_ros.tools.chunk_execution`; ``node-realtime``: the robot's ``temporal_ensemble_m``). In
lockstep a chunk arrives every ``--execute-steps`` steps, so up to ``ceil(H / execute_steps)`` overlap.

Output (``--out``, default ``runs/eval-<timestamp>``): ``eval.json`` (everything), ``eval.md`` (the table,
also printed), ``<condition>/episode_<seed>.png`` (contact sheets), ``node_params_<condition>.yaml``.

Command line: ``python -m oxygen_ros.tools.evaluate`` (the shipped policy; ``--checkpoint runs/train-demo/checkpoint`` for a retrained one; ``--help``);
``make eval-demo EVAL_ARGS="..."``.
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
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from oxygen_ros.tools import demo_data  # noqa: E402
from oxygen_ros.tools.chunk_execution import ChunkExecutor  # noqa: E402
from oxygen_ros.tools.child_process import package_pythonpath, start_child, stop_child  # noqa: E402
from oxygen_ros.tools.demo_data import (DT, INSTRUCTION, JOINTS, PHASES, SUBTASKS, phase_flags,  # noqa: E402
                                        scene_caption, scene_state, wilson_interval)
# The ground truth the published speech is scored against: the state rule the data generator also records
# per step as its state labels (demo_data.state_subtask; docs/demo-policy.md, "Ground-truth subtask").
from oxygen_ros.tools.demo_data import state_subtask as ground_truth_subtask  # noqa: E402

CONDITIONS = ("node-lockstep", "node-realtime", "sync", "random", "expert")
CAMERAS = demo_data.CAMERAS
NODE_NAME = "oxygen_node"
EPISODE_STEPS = 530                  # 10.6 s at 50 Hz, as the demonstrations
SETTLE_S = demo_data._SETTLE_S       # the cube drops onto the table first (as in the data)
SHEET_TIMES_S = (0.0, 2.0, 4.0, 6.0, 8.0, 10.4)   # contact sheet frames of a default episode, after the settle [s]
EPISODE_CLOCK_S = 1000.0             # node-lockstep: episode i's sim clock starts at (i + 1) x this [s]
ENSEMBLE_MAX_CHUNKS = 64             # --ensemble: chunks kept; ≥ ceil(H / execute_steps) for H ≤ 64 at any schedule


def sheet_times(max_steps: int = EPISODE_STEPS) -> tuple[float, ...]:
    """The contact sheet's frame times [s after the settle] for an episode of ``max_steps`` control steps: up to
    five from 0 every 2 s × the episode's length in default episodes (rounded, at least 1), those before its last
    0.2 s, then 0.2 s before its end — :data:`SHEET_TIMES_S` for the default 530 steps (10.6 s); 990 steps (19.8 s):
    0, 4, 8, 12, 16, 19.6 s; 300 steps (6 s): 0, 2, 4, 5.8 s."""
    end = max_steps * DT
    spacing = 2.0 * max(1, round(end / (EPISODE_STEPS * DT)))
    return tuple(k * spacing for k in range(5) if k * spacing < end - 0.2 - 1e-9) + (round(max(0.0, end - 0.2), 6),)


# ---------------------------------------------------------------------------------------------------
# ground truth


def text_matches(text: str, label: str) -> bool:
    """A decoded text is correct when, stripped of surrounding blanks, it equals the label."""
    return text.strip() == label


# ---------------------------------------------------------------------------------------------------
# the simulated episode (no ROS)


@dataclasses.dataclass
class Observed:
    """One observation of an episode: what the policy got and what the simulator said at that instant."""

    t: float                  # sim time (clock) of the observation [s]
    subtask: int              # ground truth (index into SUBTASKS)
    caption: str              # demo_data.scene_caption of the state
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
        self._geoms = demo_data._Geoms(self.scene.model)
        self.scene.step(SETTLE_S)
        self.rest_height = float(self._state().cube[2])
        self.flags: list[list[bool]] = []
        self.right_distance: list[float] = []   # per step: right grasp point to cube centre [m]
        self.observed: list[Observed] = []
        self.sheet: list[tuple[float, np.ndarray, int, list[bool]]] = []    # (t after settle, top image, gt, flags)

    def _state(self) -> demo_data.SceneState:
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


def outcome(flags) -> dict[str, bool]:
    """Per phase: reached at some step; ``transferred`` at the last step (demo_data's definition)."""
    flags = np.asarray(flags, bool).reshape(-1, len(PHASES))
    if len(flags) == 0:
        return {phase: False for phase in PHASES}
    result = flags.any(axis=0)
    result[3] = bool(flags[-1, 3])
    return dict(zip(PHASES, map(bool, result)))


def phase_times(flags) -> dict[str, float | None]:
    """Per phase: when the episode first got there [s after the start; control steps of ``DT``], ``None`` if
    it never did (:func:`outcome`'s success). ``transferred`` counts from the start of the final run of steps
    that hold it (it must hold at the end); the others from their first step."""
    flags = np.asarray(flags, bool).reshape(-1, len(PHASES))
    times: dict[str, float | None] = {}
    for i, phase in enumerate(PHASES):
        column = flags[:, i]
        if i == 3:
            if len(column) == 0 or not column[-1]:
                times[phase] = None
                continue
            off = np.flatnonzero(~column)
            first = int(off[-1]) + 1 if len(off) else 0
        else:
            if not column.any():
                times[phase] = None
                continue
            first = int(np.argmax(column))
        times[phase] = round(first * DT, 3)
    return times


# ---------------------------------------------------------------------------------------------------
# policies for the synchronous lockstep loop


class _ParameterView:
    """Just enough of an rclpy node for :func:`oxygen_ros.node.parameters.read_settings`: the declared
    defaults with ``params`` over them, and a logger."""

    class _Value:
        def __init__(self, value):
            self.value = value

    class _Logger:
        def info(self, message: str) -> None:
            pass

        def warning(self, message: str) -> None:
            print(f"warning: {message}", file=sys.stderr)

    def __init__(self, params: dict):
        from oxygen_ros.node.parameters import DECLARATIONS

        unknown = sorted(set(params) - set(DECLARATIONS) - {"use_sim_time"})
        if unknown:
            raise ValueError(f"unknown node parameters {unknown} (docs/parameters.md lists them)")
        self._values = {}
        for name, declaration in DECLARATIONS.items():
            default = declaration.default
            self._values[name] = params.get(name, default if not _is_type(default) else [])

    def get_parameter(self, name: str):
        return self._Value(self._values[name])

    def get_logger(self):
        return self._Logger()


def _is_type(value) -> bool:
    from rclpy.parameter import Parameter

    return isinstance(value, Parameter.Type)


@dataclasses.dataclass
class Step:
    """What a policy returns for one observation."""

    actions: np.ndarray                     # float [H, 14], JOINTS order, absolute targets
    latency_s: float                        # wall time from observation to chunk [s]
    speech: list[tuple[float, str]]         # completed utterances (observation stamp, text) that ended now
    memory: list[tuple[float, str]]         # completed memory entries (observation stamp, text)
    inference_latency_s: float = 0.0        # the engine's: cycle start to chunk ready [s]


class EnginePolicy:
    """The node's engine, called synchronously: built from node parameters exactly as ``oxygen_node``
    builds it (``read_settings`` → ``model_loading.build_engine`` → warm-up), fed
    :class:`~oxygen_ros.engine.types.Observation` objects as the node's inputs make them (camera slots,
    float32 state in ``joint_names`` order, the instruction, the observation stamp, seq from 1 per episode).

    Raises:
        ValueError, FileNotFoundError: bad parameters, checkpoint or statistics (as the node's configure).
    """

    def __init__(self, params: dict):
        from oxygen_ros.node import model_loading
        from oxygen_ros.node.parameters import read_settings

        self.settings = read_settings(_ParameterView(params))
        self.engine = model_loading.build_engine(self.settings)
        model_loading.warm_up(self.engine, self.settings)
        self.instruction = self.settings.default_instruction or INSTRUCTION
        self._slots = {topic_camera(c.topic): c.slot for c in self.settings.cameras}
        self.cameras = tuple(self._slots)     # the robot's cameras rendered for each observation
        self._seq = 0

    def start(self, seed: int) -> None:
        self._seq = 0

    def act(self, images: dict[str, np.ndarray], position: np.ndarray, t: float) -> Step:
        from oxygen_ros.engine.types import Observation, RequestStatus

        self._seq += 1
        state = np.asarray([position[JOINTS.index(n)] for n in self.settings.joint_names], np.float32)
        obs = Observation({self._slots[c]: image for c, image in images.items()}, self.instruction, state,
                          stamp=t, seq=self._seq)
        chunks = []
        start = time.perf_counter()
        ready: list[float] = []

        def on_action(chunk) -> None:
            chunks.append(chunk)
            ready.append(time.perf_counter())

        result = self.engine.run_cycle(obs, None, on_action)
        speech, memory = [], []
        for event in result.text_events:
            if not event.final or event.status != RequestStatus.COMPLETED:
                continue
            if event.kind == "memory":
                if event.memory is not None:
                    memory.append((event.stamp, event.memory.text))
            else:
                speech.append((event.stamp, event.text))
        if not chunks:
            raise RuntimeError(f"observation {self._seq}: the engine produced no action chunk")
        actions = np.asarray(chunks[0].actions, np.float64)
        names = list(self.settings.action_names)
        if set(JOINTS) <= set(names):
            actions = actions[:, [names.index(j) for j in JOINTS]]
        return Step(actions, ready[0] - start, speech, memory, float(chunks[0].latency_s))

    def finish(self) -> None:
        """End the episode: requests still running are cancelled (their text is not scored)."""
        for request in self.engine.active_requests:
            self.engine.cancel(request.request_id)
        self.engine.take_events()

    def close(self) -> None:
        self.engine.close()


class ExpertPolicy:
    """demo_data's scripted expert: its joint trajectory for the episode's seed, chunk by chunk; its
    "speech" is the script's subtask label at the observation."""

    cameras: tuple[str, ...] = ()      # renders none (the contact sheet renders its own frames)

    def __init__(self, horizon: int = 50):
        self.horizon = horizon
        self._actions = self._labels = None
        self._step = 0

    def start(self, seed: int) -> None:
        self._actions, self._labels, _ = demo_data.expert_joint_trajectory(seed)
        self._step = 0

    def act(self, images, position, t: float) -> Step:
        k = self._step
        index = np.minimum(np.arange(k, k + self.horizon), len(self._actions) - 1)
        return Step(self._actions[index].astype(np.float64), 0.0, [(t, SUBTASKS[int(self._labels[min(k, len(self._labels) - 1)])])], [])

    def advance(self, steps: int) -> None:
        self._step += steps

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_sync_episode(policy, seed: int, execute_steps: int, max_steps: int = EPISODE_STEPS,
                     width: int = 320, height: int = 240, ensemble_m: float = 0.0) -> dict:
    """One episode in the lockstep schedule with a synchronous ``policy`` (:class:`EnginePolicy` or
    :class:`ExpertPolicy`): observe, act, execute ``execute_steps`` control steps, repeat for ``max_steps``
    control steps. The chunk (stamped with the observation's clock, 20 ms per action) goes to a
    :class:`~oxygen_ros.tools.chunk_execution.ChunkExecutor` (``round`` index rule) that gives each step's
    action: with ``ensemble_m`` 0 (default) the chunk's actions 0 .. execute_steps − 1 in turn; otherwise
    ACT's temporal ensemble of every chunk covering the step. Returns the episode record (see
    :func:`score_episode`).

    Raises:
        ValueError: ``ensemble_m`` not finite.
    """
    chunk_executor = ChunkExecutor(ensemble_m, ENSEMBLE_MAX_CHUNKS, index_rule="round")
    sim = EpisodeSim(seed, 0.0, width, height, max_steps)
    policy.start(seed)
    speech, memory, latencies, inference = [], [], [], []
    wall = time.perf_counter()
    try:
        while sim.step_index < max_steps:
            images, position, t = sim.observe(policy.cameras)
            step = policy.act(images, position, t)
            latencies.append(step.latency_s)
            inference.append(step.inference_latency_s)
            speech += step.speech
            memory += step.memory
            chunk_executor.add(t, DT, step.actions)
            n = min(execute_steps, max_steps - sim.step_index, len(step.actions))
            for _ in range(n):
                sim.execute(chunk_executor.action_at(sim.now_s))
            if isinstance(policy, ExpertPolicy):
                policy.advance(n)
        policy.finish()
        seconds = time.perf_counter() - wall
        record = sim.trace()
        record.update(speech=speech, memory=memory, latencies=latencies, inference_latencies=inference,
                      chunks=len(latencies),
                      wall_s=seconds, sim_s=sim.step_index * DT, sheet=sim.sheet)
    finally:
        sim.close()
    return record


# ---------------------------------------------------------------------------------------------------
# the ROS conditions: the robot in a child process, the node here


def _lockstep_worker(spec: dict) -> int:
    """Child process of ``node-lockstep``: the simulated robot on simulated time (module docstring).

    Publishes ``/clock``, ``/cameras/<camera>/image_raw`` (rgb8, reliable), ``/joint_states``; takes
    ``/oxygen_node/action_chunk``. Writes the episode record to ``spec["out"]`` (pickle-free: JSON + npz).
    """
    import rclpy
    from builtin_interfaces.msg import Time
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from rosgraph_msgs.msg import Clock
    from sensor_msgs.msg import Image, JointState

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.sim_robot import _chunk_to_aloha

    rclpy.init(args=[])
    node = Node("aloha_lockstep_sim")
    reliable = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
    clock_pub = node.create_publisher(Clock, "/clock", 10)
    cameras = tuple(spec["cameras"])
    image_pubs = {c: node.create_publisher(Image, f"/cameras/{c}/image_raw", reliable) for c in cameras}
    joint_pub = node.create_publisher(JointState, "/joint_states", 10)
    chunks: list[tuple[float, float, np.ndarray, float]] = []   # (stamp, dt, actions, received wall)
    arrived = threading.Condition()

    def on_chunk(msg: ActionChunk) -> None:
        try:
            actions = _chunk_to_aloha(msg)
        except ValueError:
            return
        with arrived:
            chunks.append((msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, msg.dt or DT, actions,
                           time.perf_counter()))
            arrived.notify_all()

    node.create_subscription(ActionChunk, spec["chunk_topic"], on_chunk, 10)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()

    def stamp(t: float) -> Time:
        ns = round(t * 1e9)
        return Time(sec=ns // 10**9, nanosec=ns % 10**9)

    sim = EpisodeSim(spec["seed"], spec["clock_offset_s"], max_steps=spec["max_steps"])
    chunk_executor = ChunkExecutor(spec.get("ensemble_m", 0.0), ENSEMBLE_MAX_CHUNKS, index_rule="round")
    latencies, frames, aborted = [], [], None    # frames: (stamp t [s], frame to chunk [s], sends of the inputs)
    wall = time.perf_counter()
    try:
        # The node must see this episode's clock and the robot on the graph before the first frame.
        deadline = time.monotonic() + spec["connect_timeout_s"]
        while (node.count_publishers(spec["chunk_topic"]) == 0
               or any(image_pubs[c].get_subscription_count() == 0 for c in cameras)) and time.monotonic() < deadline:
            time.sleep(0.05)
        while sim.step_index < spec["max_steps"]:
            images, position, t = sim.observe(cameras)
            clock_pub.publish(Clock(clock=stamp(t)))
            msgs = {}
            for camera, pixels in images.items():
                msg = Image(height=pixels.shape[0], width=pixels.shape[1], encoding="rgb8", is_bigendian=0,
                            step=pixels.shape[1] * 3, data=pixels.tobytes())
                msg.header.stamp = stamp(t)
                msg.header.frame_id = f"{camera}_camera"
                msgs[camera] = msg
            joint = JointState(name=list(JOINTS), position=position.tolist())
            joint.header.stamp = stamp(t)
            sent = time.perf_counter()
            give_up = time.monotonic() + spec["chunk_timeout_s"]
            chunk = None
            sends = 0
            while chunk is None and time.monotonic() < give_up:
                sends += 1
                # (Re)send the clock, then the inputs: a frame taken in before the clock moved would look
                # stale to the node; the resend (every resend_s) makes the observation complete again.
                clock_pub.publish(Clock(clock=stamp(t)))
                time.sleep(0.02)
                joint_pub.publish(joint)
                for camera in cameras:
                    image_pubs[camera].publish(msgs[camera])
                with arrived:
                    arrived.wait_for(lambda: any(c[0] >= t - 1e-6 for c in chunks),
                                     timeout=max(0.0, min(spec["resend_s"], give_up - time.monotonic())))
                    fresh = [c for c in chunks if c[0] >= t - 1e-6]
                    if fresh:
                        chunk = fresh[0]
                        chunks.clear()
            if chunk is None:
                aborted = f"no action chunk within {spec['chunk_timeout_s']:g} s for the observation at {t:.3f} s"
                break
            latencies.append(chunk[3] - sent)
            frames.append((t, chunk[3] - sent, sends))
            try:
                chunk_executor.add(chunk[0], chunk[1], chunk[2])
            except ValueError as err:       # e.g. non-finite actions: never executed
                aborted = f"the action chunk for the observation at {t:.3f} s was rejected: {err}"
                break
            n = min(spec["execute_steps"], spec["max_steps"] - sim.step_index)
            for _ in range(n):
                sim.execute(chunk_executor.action_at(sim.now_s))
                clock_pub.publish(Clock(clock=stamp(sim.now_s)))
        record = sim.trace()
        record.update(latencies=latencies, frames=frames, chunks=len(latencies), wall_s=time.perf_counter() - wall,
                      sim_s=sim.step_index * DT, aborted=aborted)
        _write_record(record, sim.sheet, Path(spec["out"]))
    finally:
        sim.close()
        _end_worker(executor, spinner, node)
    return 0


def _end_worker(executor, spinner: threading.Thread, node) -> None:
    """A robot worker's teardown: the executor, then its spinner thread out of rclpy's wait (a robot child once
    aborted in its teardown without this join), then the node and the context."""
    import rclpy

    executor.shutdown()
    spinner.join(timeout=5.0)
    node.destroy_node()
    rclpy.try_shutdown()


def _realtime_worker(spec: dict) -> int:
    """Child process of ``node-realtime``: the demo's :class:`SimRobot` (unchanged), and a thread that
    samples the scene every 20 ms (wall) for the phase flags and the ground truth, stamped with the robot's
    clock; ends after 10.6 s of simulated time past the settle."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter import Parameter
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image

    from oxygen_ros.tools.sim_robot import SimRobot

    rclpy.init(args=[])
    robot = SimRobot(parameter_overrides=[
        Parameter("camera_rate_hz", value=float(spec["camera_rate_hz"])), Parameter("seed", value=spec["seed"]),
        Parameter("cameras", value=list(spec["cameras"])),
        Parameter("action_chunk_topic", value=spec["chunk_topic"]),
        Parameter("temporal_ensemble_m", value=float(spec.get("ensemble_m", 0.0))),
        Parameter("temporal_ensemble_max_chunks", value=ENSEMBLE_MAX_CHUNKS)])
    executor = SingleThreadedExecutor()
    executor.add_node(robot)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    scene = robot.scene
    geoms = demo_data._Geoms(scene.model)
    # The contact sheet takes the robot's own top camera frames (one renderer: never render here too).
    latest_top: list[np.ndarray] = []

    def on_top(msg) -> None:
        latest_top[:] = [np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.width, 3)]

    robot.create_subscription(Image, "/cameras/top/image_raw", on_top, qos_profile_sensor_data)
    flags, samples, sheet, distances = [], [], [], []
    rest = None
    end_s = SETTLE_S + spec["max_steps"] * DT
    times = sheet_times(spec["max_steps"])
    wall = time.perf_counter()
    chunks0 = robot.chunks_received
    try:
        while scene.sim_time < end_s:
            state = scene.read(lambda model, data: scene_state(model, data, geoms))
            position, _ = scene.joint_state()
            now = robot.get_clock().now().nanoseconds * 1e-9
            if scene.sim_time >= SETTLE_S:
                if rest is None:
                    rest = float(state.cube[2])
                f = [bool(x) for x in phase_flags(state, rest)]
                flags.append(f)
                distances.append(round(float(state.right_distance), 6))
                samples.append({"t": now, "subtask": ground_truth_subtask(state, rest, position),
                                "caption": scene_caption(state), "flags": f})
                since = scene.sim_time - SETTLE_S
                if len([s for s in times if s <= since + 1e-9]) > len(sheet) and latest_top:
                    sheet.append((since, latest_top[0][::2, ::2].copy(), samples[-1]["subtask"], f))
            time.sleep(DT)
        record = {"seed": spec["seed"], "rest_height": rest, "flags": flags, "right_distance": distances,
                  "observed": samples, "resets": scene.resets, "chunks": robot.chunks_received - chunks0,
                  "wall_s": time.perf_counter() - wall, "sim_s": scene.sim_time - SETTLE_S, "aborted": None}
        _write_record(record, sheet, Path(spec["out"]))
    finally:
        _end_worker(executor, spinner, robot)
    return 0


def _write_record(record: dict, sheet: list, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out.with_suffix(".npz"), *[frame for _, frame, _, _ in sheet])
    record["sheet_meta"] = [(t, gt, flags) for t, _, gt, flags in sheet]
    out.write_text(json.dumps(record))


def _read_record(out: Path) -> dict:
    record = json.loads(out.read_text())
    with np.load(out.with_suffix(".npz")) as frames:
        images = [frames[f"arr_{i}"] for i in range(len(frames.files))]
    record["sheet"] = [(t, image, gt, flags) for (t, gt, flags), image in zip(record.pop("sheet_meta"), images)]
    return record


def _worker_command(mode: str, spec: dict) -> list[str]:
    return [sys.executable, "-P", "-m", "oxygen_ros.tools.evaluate", "--worker", mode, json.dumps(spec)]


class _Follower:
    """Records the node's completed speech and memory (observation stamp, text, receipt wall time) and the
    action chunks (stamp, receipt wall time) — a plain rclpy node in the evaluation's executor."""

    def __init__(self, context):
        from rclpy.node import Node

        from oxygen_ros.msg import ActionChunk, MemoryEntry, Speech

        self.node = Node("eval_follower", context=context)
        self.speech, self.memory, self.chunks = [], [], []
        self._lock = threading.Lock()
        prefix = f"/{NODE_NAME}"

        def seconds(stamp) -> float:
            return stamp.sec + stamp.nanosec * 1e-9

        def on_speech(msg) -> None:
            if msg.final and msg.status == Speech.STATUS_COMPLETED:
                with self._lock:
                    self.speech.append((seconds(msg.header.stamp), msg.text))

        def on_memory(msg) -> None:
            with self._lock:
                self.memory.append((seconds(msg.header.stamp), msg.text))

        def on_chunk(msg) -> None:
            with self._lock:
                self.chunks.append((seconds(msg.header.stamp), time.time(), msg.inference_latency))

        self.node.create_subscription(Speech, f"{prefix}/speech", on_speech, 100)
        self.node.create_subscription(MemoryEntry, f"{prefix}/memory", on_memory, 100)
        self.node.create_subscription(ActionChunk, f"{prefix}/action_chunk", on_chunk, 100)

    def between(self, start_s: float, end_s: float) -> tuple[list, list, list]:
        """Speech, memory and chunks whose observation stamps lie in ``[start_s, end_s)``."""
        with self._lock:
            pick = lambda items: [x for x in items if start_s <= x[0] < end_s]  # noqa: E731
            return pick(self.speech), pick(self.memory), pick(self.chunks)


def run_node_condition(condition: str, params: dict, seeds: list[int], args, out_dir: Path, log) -> list[dict]:
    """Episodes of ``node-lockstep`` or ``node-realtime``: the oxygen node in this process (one
    multi-threaded executor, as tools/demo.py), the robot in a child process per episode."""
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter
    from rclpy.signals import SignalHandlerOptions

    from oxygen_ros.node.oxygen_node import OxygenNode

    context = Context()
    rclpy.init(args=[], context=context, signal_handler_options=SignalHandlerOptions.NO)
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    oxygen = follower = None
    records = []
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: _spin(executor, stop), daemon=True)
    try:
        oxygen = OxygenNode(NODE_NAME, context=context,
                            parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        follower = _Follower(context)
        executor.add_node(oxygen)
        executor.add_node(follower.node)
        spinner.start()
        deadline = time.monotonic() + args.startup_timeout
        while oxygen.lifecycle_state != "active":
            if oxygen.configure_error or oxygen.autostart_failed or time.monotonic() > deadline:
                raise RuntimeError(f"the oxygen node did not become active: {oxygen.configure_error or oxygen.autostart_failed}")
            time.sleep(0.1)
        cameras = tuple(topic_camera(topic) for topic in params["camera_topics"])   # what the node subscribes to
        for index, seed in enumerate(seeds):
            out = out_dir / condition / f"episode_{seed}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            spec = {"seed": seed, "max_steps": args.max_steps, "out": str(out), "cameras": list(cameras),
                    "chunk_topic": f"/{NODE_NAME}/action_chunk", "ensemble_m": args.ensemble}
            if condition == "node-lockstep":
                offset = EPISODE_CLOCK_S * (index + 1)
                spec.update(clock_offset_s=offset, execute_steps=args.execute_steps,
                            chunk_timeout_s=args.chunk_timeout, resend_s=args.resend, connect_timeout_s=30.0)
                command = _worker_command("lockstep", spec)
            else:
                spec.update(camera_rate_hz=args.camera_rate or demo_data.RENDER_RATE_HZ / len(cameras))
                command = _worker_command("realtime", spec)
            started = time.time()
            child = start_child(command, out_dir / condition / "robot.log", append=True,
                                env=package_pythonpath(os.environ))
            try:
                limit = args.max_steps * DT * 200 + 120 if condition == "node-lockstep" else args.max_steps * DT * 20 + 60
                child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                log(f"{condition} episode {seed}: the robot process ran past {limit:.0f} s; stopped")
            finally:
                stop_child(child)
            if not out.is_file():
                raise RuntimeError(f"{condition} episode {seed}: the robot process failed (exit {child.returncode}); "
                                   f"see {out_dir / condition / 'robot.log'}")
            record = _read_record(out)
            # The record is written once the episode has run to its end; a process that fails after it (seen: an
            # abort in the robot's teardown) leaves a whole episode: scored, the failure logged and counted.
            record["robot_exit"] = child.returncode
            if child.returncode != 0:
                log(f"{condition} episode {seed}: the robot process exited {child.returncode} after writing its "
                    f"record (teardown); episode kept; see {out_dir / condition / 'robot.log'}")
            # the episode's last utterances (in real time, requests of frames the node could not process before
            # the robot stopped never finish: a short wait)
            _wait_for_language(oxygen, follower, args.chunk_timeout if condition == "node-lockstep" else 5.0)
            if condition == "node-lockstep":
                lo, hi = offset, offset + EPISODE_CLOCK_S
            else:
                lo, hi = started, time.time()
            speech, memory, chunks = follower.between(lo, hi)
            record.update(speech=speech, memory=memory,
                          inference_latencies=[latency for _, _, latency in chunks])
            if condition == "node-lockstep":
                # Per frame the engine's inference latency of the first chunk computed from it (a frame whose
                # inputs were re-sent while the node computed may have a second chunk): frame to chunk minus
                # it is the time the frame waited before the engine took it, plus delivery.
                first = {}
                for stamp, _, latency in chunks:
                    first.setdefault(round(stamp, 6), latency)
                record["inference_latencies"] = [first.get(round(t, 6)) for t, _, _ in record["frames"]]
            if condition == "node-realtime":
                record["latencies"] = [received - stamp for stamp, received, _ in chunks]
                record["chunks"] = len(chunks)
            records.append(record)
            log(f"{condition} episode {seed}: {_episode_line(record)}")
    finally:
        stop.set()
        spinner.join(timeout=5.0)
        executor.shutdown(timeout_sec=5.0)
        if oxygen is not None:
            oxygen.release()
            oxygen.destroy_node()
        if follower is not None:
            follower.node.destroy_node()
        context.try_shutdown()
        context.destroy()
    return records


def _wait_for_language(oxygen, follower: "_Follower", timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the node has no language request running and no further speech or
    memory message arrived for 0.5 s: the episode's last utterances are in."""
    deadline = time.monotonic() + timeout_s
    last, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        engine = oxygen.engine
        busy = engine is not None and bool(engine.active_requests)
        counts = (len(follower.speech), len(follower.memory))
        if counts != last or busy:
            last, quiet_since = counts, time.monotonic()
        elif time.monotonic() - quiet_since >= 0.5:
            return
        time.sleep(0.05)


def _spin(executor, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            executor.spin_once(timeout_sec=0.1)
        except Exception:   # the context going down at the end
            if stop.is_set():
                return
            raise


# ---------------------------------------------------------------------------------------------------
# node parameters


def topic_camera(topic: str) -> str:
    """The robot's camera of an image topic ``/cameras/<camera>/image_raw``."""
    return topic.rstrip("/").rsplit("/")[-2]


def label_tokens(preset: str) -> int:
    """Tokens of the longest subtask label or caption of the preset's tokenizer, plus EOS."""
    from oxygen_ros.models import get_preset
    from oxygen_ros.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(get_preset(preset))
    captions = ["both grippers hold the cube", "the cube is in the air"] + \
        [f"the cube is on the {side} of the table" for side in ("left", "middle", "right")] + \
        [f"{g} holds the cube {w}" for g in ("the right gripper", "the left gripper") for w in ("on the table", "in the air")]
    return max(len(tokenizer.encode(text)) for text in list(SUBTASKS) + captions) + 1


def node_parameters(condition: str, args, checkpoint: str) -> dict:
    """The oxygen node's parameters for ``condition`` (also what ``sync`` / ``random`` build the engine
    from), then ``--param`` overrides.

    Lockstep (``node-lockstep``, ``sync``, ``random``): ``use_sim_time``; ``staleness_limit_s`` 0.01 (below
    one 20 ms control step: a frame is fresh only while the clock stands at its stamp); every camera
    required and reliable, and the joint state reliable (``joint_states_reliability``); ``control_rate_hz`` ``--poll-rate`` (how often the node looks for a complete
    observation); speech and memory on every ``--language-every`` th frame, decoded to the end in the cycle
    (``engine.scheduling`` fixed_k with k = the longest label). Real time (``node-realtime``): the demo's
    settings (tools/demo.py), speech and memory prompts from the checkpoint.
    """
    from oxygen_ros.assets import policy_cameras, read_policy_file

    policy = read_policy_file(checkpoint)
    cameras = policy_cameras(policy)
    tokens = label_tokens(args.preset)
    params = {
        "preset": args.preset, "checkpoint": checkpoint, "device": args.device, "dtype": args.dtype,
        "conventions": "",
        "joint_names": list(JOINTS), "action_dim": len(JOINTS), "action_names": list(JOINTS),
        "action_dt_s": DT,
        "camera_topics": [f"/cameras/{camera}/image_raw" for camera in cameras],
        "camera_slots": list(cameras.values()),
        "camera_transports": ["raw"] * len(cameras),
        "instruction_topic": "/instruction", "joint_states_topic": "/joint_states",
        "default_instruction": policy.get("instruction", INSTRUCTION),
        "speech.max_new_tokens": tokens, "memory.max_new_tokens": tokens,
    }
    if "speech_prompt" in policy:
        params["speech.prompt_template"] = policy["speech_prompt"]
        params["memory.prompt_template"] = policy["memory_prompt"]
    if condition == "node-realtime":
        params.update({
            "camera_reliability": ["best_effort"] * len(cameras),
            "camera_required": [True] + [False] * (len(cameras) - 1),
            "staleness_limit_s": args.staleness, "control_rate_hz": args.control_rate,
            "speech.trigger.every_s": args.speech_every, "memory.trigger.every_s": args.memory_every})
    else:
        params.update({
            "use_sim_time": True,
            # Reliable inputs: the lockstep robot publishes each frame's inputs once; a best-effort sample lost
            # in transport (the joint state, sent with 690 kB of images, was lost on a loaded machine) is
            # never replaced, and the frame could not be completed (the "stale joint state" stall).
            "camera_reliability": ["reliable"] * len(cameras), "joint_states_reliability": "reliable",
            "camera_required": [True] * len(cameras),
            "staleness_limit_s": 0.01, "control_rate_hz": args.poll_rate,
            "speech.trigger.every_n_frames": args.language_every, "speech.trigger.every_s": 0.0,
            "memory.trigger.every_n_frames": args.language_every, "memory.trigger.every_s": 0.0,
            "engine.scheduling": "fixed_k", "engine.decode_steps_per_cycle": tokens,
            "speech.max_wait_s": 1e6, "memory.max_wait_s": 1e6})
    from oxygen_ros.node.parameters import parse_override

    for item in args.param:
        try:
            name, value = parse_override(item)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        params[name] = value
    if condition == "random":
        params["checkpoint"] = ""
        if checkpoint and not params.get("norm_stats_path"):
            from oxygen_ros.training.train import norm_stats_file

            stats = norm_stats_file(checkpoint)
            if stats.is_file():
                params["norm_stats_path"] = str(stats)
    return params


# ---------------------------------------------------------------------------------------------------
# scoring and the report


def _nearest_before(observed: list[dict], t: float) -> dict | None:
    """The ground-truth record at or just before sim/clock time ``t`` (observations are in time order)."""
    times = [o["t"] for o in observed]
    i = int(np.searchsorted(times, t + 1e-6, side="right")) - 1
    return observed[i] if i >= 0 else None


def score_episode(record: dict) -> dict:
    """Outcome, subtask and caption accuracy, latency and rates of one episode record."""
    observed = record["observed"]
    speech_ok = speech_n = caption_ok = caption_n = 0
    for stamp, text in record.get("speech", []):
        truth = _nearest_before(observed, stamp)
        if truth is not None:
            speech_n += 1
            speech_ok += text_matches(text, SUBTASKS[truth["subtask"]])
    for stamp, text in record.get("memory", []):
        truth = _nearest_before(observed, stamp)
        if truth is not None:
            caption_n += 1
            caption_ok += text_matches(text, truth["caption"])
    latencies = record.get("latencies", [])
    inference = record.get("inference_latencies") or []
    # frame to chunk minus the engine's inference latency of the same chunk: the time before the engine took the
    # frame (queueing behind the previous cycle, the node's polling, delivery)
    waiting = [total - engine for total, engine in zip(latencies, inference) if engine is not None] \
        if len(inference) == len(latencies) else []
    measured = [x for x in inference if x is not None]
    frames = record.get("frames") or []
    wall = record.get("wall_s") or 0.0
    distances = record.get("right_distance") or []
    return {"seed": record["seed"], "outcome": outcome(record["flags"]), "first_s": phase_times(record["flags"]),
            "steps": len(record["flags"]),
            "closest_m": float(min(distances)) if distances else None,
            "subtask_correct": speech_ok, "subtask_total": speech_n,
            "caption_correct": caption_ok, "caption_total": caption_n,
            "chunks": record.get("chunks", 0), "mean_latency_s": float(np.mean(latencies)) if latencies else None,
            "mean_inference_latency_s": float(np.mean(measured)) if measured else None,
            "mean_waiting_s": float(np.mean(waiting)) if waiting else None,
            "max_latency_s": float(np.max(latencies)) if latencies else None,
            "resent_frames": sum(1 for _, _, sends in frames if sends > 1),
            "chunks_per_wall_s": record.get("chunks", 0) / wall if wall > 0 else None,
            "wall_s": round(wall, 2), "sim_s": round(record.get("sim_s", 0.0), 3),
            "resets": record.get("resets", 0), "aborted": record.get("aborted"),
            "robot_exit": record.get("robot_exit", 0)}


def summarise(condition: str, episodes: list[dict]) -> dict:
    """Per condition: success per phase with its 95 % Wilson interval, accuracies, means."""
    n = len(episodes)
    success = {}
    for phase in PHASES:
        k = sum(e["outcome"][phase] for e in episodes)
        low, high = wilson_interval(k, n)
        success[phase] = {"successes": k, "episodes": n, "rate": k / n if n else 0.0,
                          "ci95": [round(low, 4), round(high, 4)]}

    def accuracy(key: str) -> dict:
        ok = sum(e[f"{key}_correct"] for e in episodes)
        total = sum(e[f"{key}_total"] for e in episodes)
        return {"correct": ok, "total": total, "accuracy": ok / total if total else None}

    latencies = [e["mean_latency_s"] for e in episodes if e["mean_latency_s"] is not None]

    def mean_of(key: str) -> float | None:
        values = [e[key] for e in episodes if e.get(key) is not None]
        return float(np.mean(values)) if values else None
    chunks = sum(e["chunks"] for e in episodes)
    wall = sum(e["wall_s"] for e in episodes)
    sim = sum(e["sim_s"] for e in episodes)
    closest = [e["closest_m"] for e in episodes if e.get("closest_m") is not None]
    for phase in PHASES:
        times = [e["first_s"][phase] for e in episodes if (e.get("first_s") or {}).get(phase) is not None]
        success[phase]["median_first_s"] = float(np.median(times)) if times else None
    return {"condition": condition, "episodes": n, "success": success, "subtask": accuracy("subtask"),
            "caption": accuracy("caption"),
            "median_closest_m": float(np.median(closest)) if closest else None,
            "mean_latency_s": float(np.mean(latencies)) if latencies else None,
            "mean_inference_latency_s": mean_of("mean_inference_latency_s"),
            "mean_waiting_s": mean_of("mean_waiting_s"),
            "resent_frames": sum(e.get("resent_frames", 0) for e in episodes),
            "chunks_per_wall_s": chunks / wall if wall else None, "chunks_per_sim_s": chunks / sim if sim else None,
            "seconds_per_episode": wall / n if n else None,
            "aborted": sum(1 for e in episodes if e["aborted"]),
            "robot_exit_failures": sum(1 for e in episodes if e.get("robot_exit")), "per_episode": episodes}


def markdown_table(summaries: list[dict]) -> str:
    """The report's table: one row per condition."""
    def pct(s: dict) -> str:
        return f"{s['successes']}/{s['episodes']} ({s['rate']:.0%}, {s['ci95'][0]:.0%}-{s['ci95'][1]:.0%})"

    def acc(a: dict) -> str:
        return "—" if a["accuracy"] is None else f"{a['accuracy']:.0%} ({a['correct']}/{a['total']})"

    def num(x, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    def ms(x) -> str:
        return num(None if x is None else x * 1e3, ".0f")

    lines = ["| condition | reached | grasped | lifted | transferred | grasped at [s] | closest [cm] | subtask acc. | "
             "caption acc. | frame→chunk [ms] | inference [ms] | waiting [ms] | chunks/s (wall) | chunks/s (sim) | "
             "s/episode |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        closest = s.get("median_closest_m")
        lines.append(f"| {s['condition']} | " + " | ".join(pct(s["success"][p]) for p in PHASES)
                     + f" | {num(s['success']['grasped'].get('median_first_s'), '.1f')}"
                     + f" | {num(None if closest is None else closest * 100, '.1f')}"
                     + f" | {acc(s['subtask'])} | {acc(s['caption'])} | "
                     f"{ms(s['mean_latency_s'])} | {ms(s.get('mean_inference_latency_s'))} | "
                     f"{ms(s.get('mean_waiting_s'))} | "
                     f"{num(s['chunks_per_wall_s'], '.2f')} | {num(s['chunks_per_sim_s'], '.2f')} | "
                     f"{num(s['seconds_per_episode'], '.1f')} |")
    return "\n".join(lines)


def contact_sheet(record: dict, condition: str, path: Path) -> Path:
    """A PNG of the top camera over the episode: each frame titled with its time, the ground-truth subtask
    and the phases reached so far; the speech heard nearest before it below (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sheet = record.get("sheet", [])
    cols = max(1, len(sheet))
    fig, axes = plt.subplots(1, cols, figsize=(max(3.2 * cols, 7.0), 3.3), squeeze=False)
    start = record["observed"][0]["t"] if record["observed"] else 0.0
    for ax, (t, image, gt, flags) in zip(axes[0], sheet):
        ax.imshow(image)
        ax.set_axis_off()
        phases = ", ".join(p for p, f in zip(PHASES, flags) if f) or "—"
        heard = [text for stamp, text in record.get("speech", []) if stamp - start <= t + 1e-6]
        ax.set_title(f"t = {t:.1f} s\ntruth: {SUBTASKS[gt]}\nphase: {phases}", fontsize=7)
        if heard:
            ax.text(0.5, -0.06, f"said: {heard[-1].strip()[:40]}", transform=ax.transAxes, ha="center",
                    va="top", fontsize=7)
    result = outcome(record["flags"])
    fig.suptitle(f"{condition}, seed {record['seed']}: " + ", ".join(f"{p} {'yes' if v else 'no'}"
                                                                  for p, v in result.items()), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _episode_line(record: dict) -> str:
    s = score_episode(record)
    reached = ", ".join(f"{p} ({s['first_s'][p]:.1f} s)" for p, v in s["outcome"].items() if v) or "nothing"
    closest = "" if s["closest_m"] is None else f", closest {s['closest_m'] * 100:.1f} cm"
    return (f"{reached}{closest}; subtask {s['subtask_correct']}/{s['subtask_total']}, caption "
            f"{s['caption_correct']}/{s['caption_total']}, {s['chunks']} chunks, {s['wall_s']:.1f} s"
            + ("" if s["mean_latency_s"] is None else f"; frame to chunk {s['mean_latency_s'] * 1e3:.0f} ms")
            + ("" if s["mean_inference_latency_s"] is None else
               f" (inference {s['mean_inference_latency_s'] * 1e3:.0f} ms)")
            + (f"; {s['resent_frames']} frames re-sent" if s["resent_frames"] else "")
            + (f"; ABORTED: {s['aborted']}" if s["aborted"] else ""))


# ---------------------------------------------------------------------------------------------------
# command line


def run_sync_condition(condition: str, params: dict, seeds: list[int], args, out_dir: Path, log) -> list[dict]:
    """Episodes of ``sync``, ``random`` (an :class:`EnginePolicy`) or ``expert``."""
    policy = ExpertPolicy() if condition == "expert" else EnginePolicy(params)
    records = []
    try:
        for seed in seeds:
            record = run_sync_episode(policy, seed, args.execute_steps, args.max_steps,
                                      ensemble_m=0.0 if condition == "expert" else args.ensemble)
            records.append(record)
            log(f"{condition} episode {seed}: {_episode_line(record)}")
    finally:
        policy.close()
    return records


def evaluate(args) -> dict:
    """Run the selected conditions; writes ``eval.json``, ``eval.md`` and the contact sheets under
    ``args.out``; returns the content of ``eval.json``."""
    # Absolute: the robot's child process runs in a directory of its own and writes its record here.
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.start_seed, args.start_seed + args.episodes))
    checkpoint = args.checkpoint or ""
    summaries = []

    def log(message: str) -> None:
        print(message, flush=True)

    for condition in args.conditions:
        params = node_parameters(condition, args, checkpoint)
        (out_dir / f"node_params_{condition}.yaml").write_text(
            yaml.safe_dump({f"/**/{NODE_NAME}": {"ros__parameters": params}}, sort_keys=False))
        wall = time.perf_counter()
        if condition.startswith("node-"):
            records = run_node_condition(condition, params, seeds, args, out_dir, log)
        else:
            records = run_sync_condition(condition, params, seeds, args, out_dir, log)
        episodes = []
        (out_dir / condition).mkdir(parents=True, exist_ok=True)
        for record in records:
            # the whole record (phase flags per step, observations with their ground truth, speech, memory,
            # latencies) next to its contact sheet
            (out_dir / condition / f"episode_{record['seed']}.json").write_text(
                json.dumps({k: v for k, v in record.items() if k != "sheet"}))
            score = score_episode(record)
            score["contact_sheet"] = str(contact_sheet(record, condition,
                                                       out_dir / condition / f"episode_{record['seed']}.png"))
            episodes.append(score)
        summary = summarise(condition, episodes)
        summary["condition_wall_s"] = round(time.perf_counter() - wall, 1)
        summaries.append(summary)
    result = {"checkpoint": checkpoint, "preset": args.preset, "seeds": seeds, "execute_steps": args.execute_steps,
              "ensemble_m": args.ensemble,
              "max_steps": args.max_steps, "instruction": INSTRUCTION, "subtasks": list(SUBTASKS),
              "conditions": summaries, "table": markdown_table(summaries)}
    (out_dir / "eval.json").write_text(json.dumps(result, indent=2))
    (out_dir / "eval.md").write_text(result["table"] + "\n")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.tools.evaluate", description=__doc__.split("\n")[0])
    from oxygen_ros.assets import demo_policy_dir

    parser.add_argument("--checkpoint", default=str(demo_policy_dir()),
                        help="checkpoint directory (default: the shipped demo policy, oxygen_ros/assets/demo_policy; "
                             "runs/train-demo/checkpoint after make train-demo; empty: random weights)")
    parser.add_argument("--preset", default="pi05_demo", help="model preset (default pi05_demo)")
    parser.add_argument("--conditions", default=",".join(CONDITIONS),
                        help=f"comma-separated subset of {','.join(CONDITIONS)} (default all)")
    parser.add_argument("--episodes", type=int, default=20, help="episodes per condition (default 20)")
    parser.add_argument("--start-seed", type=int, default=1000,
                        help="cube seed of the first episode (default 1000; training uses 0..99)")
    parser.add_argument("--max-steps", type=int, default=EPISODE_STEPS,
                        help=f"control steps of 20 ms per episode (default {EPISODE_STEPS}: 10.6 s)")
    parser.add_argument("--execute-steps", type=int, default=10,
                        help="lockstep: actions executed per chunk (execution horizon; default 10 = 0.2 s)")
    parser.add_argument("--ensemble", type=float, default=0.0, metavar="M",
                        help="temporal ensembling of overlapping chunks at execution, ACT's weights exp(-M*i) "
                             "(i: a chunk's age in control steps, 0 the oldest; ACT: 0.01); 0 (default): off, "
                             "the newest chunk wins. Every condition but expert (node-realtime: the robot's "
                             "temporal_ensemble_m)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/eval-<timestamp>)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--language-every", type=int, default=1,
                        help="lockstep: a speech and a memory request every N-th frame (default 1)")
    parser.add_argument("--poll-rate", type=float, default=20.0,
                        help="node-lockstep: the node's control_rate_hz, how often it looks for a new complete "
                             "observation [Hz] (default 20)")
    parser.add_argument("--chunk-timeout", type=float, default=120.0,
                        help="node-lockstep: wall seconds to wait for a chunk before the episode is aborted (default 120)")
    parser.add_argument("--resend", type=float, default=5.0,
                        help="node-lockstep: resend the clock and inputs after this many wall seconds without "
                             "a chunk (default 5)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="wall seconds for the node to become active (default 300)")
    parser.add_argument("--control-rate", type=float, default=3.0, help="node-realtime: chunks per second (default 3; the demo runs 4)")
    parser.add_argument("--camera-rate", type=float, default=None,
                        help="node-realtime: images/s per camera (default: the demo's, 3 / the number of cameras "
                             "the policy sees)")
    parser.add_argument("--staleness", type=float, default=1.5, help="node-realtime: staleness limit [s] (default 1.5, the demo's)")
    parser.add_argument("--speech-every", type=float, default=1.0, help="node-realtime: an utterance every N s (default 1)")
    parser.add_argument("--memory-every", type=float, default=1.0, help="node-realtime: a memory entry every N s (default 1; the demo: 2)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="any oxygen node parameter for every condition (repeatable), e.g. "
                             "--param speech.prompt_template:='...'")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    chosen = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CONDITIONS))
    # Always in CONDITIONS order: node-lockstep after node-realtime in one process got no /clock (every
    # cycle skipped clock_not_started; seen twice, cause not found), node-realtime after node-lockstep works.
    args.conditions = [c for c in CONDITIONS if c in chosen]
    if unknown or not args.conditions:
        parser.error((f"unknown conditions {unknown}" if unknown else "no condition given")
                     + f"; choose from {', '.join(CONDITIONS)}")
    for name in ("episodes", "max_steps", "execute_steps", "language_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    problem = demo_data.seed_range_problem("--start-seed", args.start_seed, args.episodes)
    if problem:
        parser.error(problem)
    if not math.isfinite(args.ensemble):
        parser.error("--ensemble must be finite")
    if args.camera_rate is not None and not args.camera_rate > 0:
        parser.error(f"--camera-rate must be > 0 Hz, got {args.camera_rate}")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        needs = [c for c in args.conditions if c != "expert"]
        if needs:
            parser.error(f"no checkpoint directory {args.checkpoint} (conditions {needs} need one; "
                         "--checkpoint '' runs random weights)")
    if args.out is None:
        args.out = Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation and print the table (or run a robot child process: ``--worker``)."""
    args = parse_args(argv)
    if args.worker:
        mode, spec = args.worker
        return (_lockstep_worker if mode == "lockstep" else _realtime_worker)(json.loads(spec))
    # The run keeps to itself on DDS unless ROS_DOMAIN_ID is set (children inherit it).
    os.environ.setdefault("ROS_DOMAIN_ID", str(150 + os.getpid() % 80))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"evaluate: cannot create the output directory {args.out}: {error.strerror}") from None
    result = evaluate(args)
    print(result["table"])
    print(f"wrote {Path(args.out) / 'eval.json'}, {Path(args.out) / 'eval.md'} and the contact sheets")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
