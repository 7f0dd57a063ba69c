"""The robot child processes of the node conditions (``python -m oxygen_ros.tools.evaluate --worker MODE SPEC``):
``lockstep`` (the simulated robot on simulated time) and ``realtime`` (the demo's :class:`SimRobot`); each
writes its episode record (JSON, and the contact sheet's frames as npz) for the parent to read."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from oxygen_ros.demo_task import DT, JOINTS, SETTLE_S, SceneGeoms, phase_flags, scene_caption, scene_state
from oxygen_ros.demo_task import state_subtask as ground_truth_subtask
from oxygen_ros.tools.chunk_execution import ChunkExecutor
from oxygen_ros.tools.evaluate.episode import ENSEMBLE_MAX_CHUNKS, EpisodeSim, sheet_times


def lockstep_worker(spec: dict) -> int:
    """Child process of ``node-lockstep``: the simulated robot on simulated time (the package docstring,
    ``node-lockstep``).

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
        write_record(record, sim.sheet, Path(spec["out"]))
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


def realtime_worker(spec: dict) -> int:
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
    geoms = SceneGeoms(scene.model)
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
                  "wall_s": time.perf_counter() - wall, "sim_s": scene.sim_time - SETTLE_S, "aborted": None,
                  "seams": list(robot.seams)}
        write_record(record, sheet, Path(spec["out"]))
    finally:
        _end_worker(executor, spinner, robot)
    return 0


def write_record(record: dict, sheet: list, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out.with_suffix(".npz"), *[frame for _, frame, _, _ in sheet])
    record["sheet_meta"] = [(t, gt, flags) for t, _, gt, flags in sheet]
    out.write_text(json.dumps(record))


def read_record(out: Path) -> dict:
    record = json.loads(out.read_text())
    with np.load(out.with_suffix(".npz")) as frames:
        images = [frames[f"arr_{i}"] for i in range(len(frames.files))]
    record["sheet"] = [(t, image, gt, flags) for (t, gt, flags), image in zip(record.pop("sheet_meta"), images)]
    return record


def worker_command(mode: str, spec: dict) -> list[str]:
    return [sys.executable, "-P", "-m", "oxygen_ros.tools.evaluate", "--worker", mode, json.dumps(spec)]
