"""Soak run: the node under the edges of a real deployment for minutes, with every output checked.

    oxygen_ros soak [--bag BAG] [--duration 600] [--delivery-margin 0.1] [--json OUT]

(also ``python -m oxygen_ros.tools.soak``). One process runs the oxygen node (``use_sim_time``) and a
driver node that injects, over real DDS:

* a simulated ``/clock`` at real-time speed that is **reset** half-way (from about 100 s + T/2 back
  to 10 s, as a restarted bag or simulator does);
* camera frames replayed **in a loop** from the image topics of a rosbag2 (``--bag``; synthetic
  frames without one), restamped with the simulated clock, one camera in ``yuv422_yuy2`` (usb_cam's
  YUYV default, converted with OpenCV) and one in ``rgb8``;
* joint states, and a new instruction every ``--instruction-every`` s from a **volatile** publisher
  (``create_publisher(String, "instruction", 10)``, the way most code publishes).

A monitor checks every output on receipt: no action chunk or trajectory with a non-finite value, none
whose last point is already past on the simulated clock (the node runs with ``expired_output_policy:
withhold``, so a late one must be withheld and counted, never sent); speech and memory keep completing
before and after the reset. At the end the node's own counters are compared with what was injected
(one clock jump, the instructions published, no dropped camera frame, no incompatible QoS). Prints a
JSON summary (and writes it to ``--json``); exits 0 when every check holds, 1 otherwise.

The run keeps to itself on DDS: unless ``ROS_DOMAIN_ID`` is set, it picks a domain of its own
(and discovery stays on this host), so a demo or another node on the machine neither disturbs it
nor is disturbed by its ``/clock`` reset. The tiny preset runs with ``action_dt_s`` 0.1 s (a chunk
spans 0.9 s), so on a loaded 2-core machine most chunks still arrive in time; the summary reports
how many were delivered, withheld as expired, or computed.

This is a measurement run, not a test: it takes minutes of wall time by design.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import rclpy
from rclpy.context import Context
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data

CLOCK_START_S = 100.0     # the simulated clock starts here [s]
CLOCK_RESET_TO_S = 10.0   # ... and is reset to this half-way [s]
FRAME_SIZE = (240, 320)   # frames are resized to height x width [px] (even width: YUYV needs it)


def load_frames(bag: Path | None, limit: int = 16) -> list[np.ndarray]:
    """RGB uint8 frames ``[H, W, 3]`` from the ``sensor_msgs/Image`` (rgb8/bgr8) and
    ``CompressedImage`` topics of a rosbag2, resized to :data:`FRAME_SIZE`; synthetic gradients
    when ``bag`` is None.

    Raises:
        ValueError: the bag holds no usable image.
    """
    import cv2

    frames = []
    if bag is None:
        rows, cols = np.mgrid[0:FRAME_SIZE[0], 0:FRAME_SIZE[1]]
        for k in range(4):
            frame = np.stack([(rows + 40 * k) % 256, (cols + 60 * k) % 256, (rows + cols) % 256], -1)
            frames.append(frame.astype(np.uint8))
        return frames
    from rosbags.highlevel import AnyReader

    from oxygen_ros.tools.bag_recorder import project_typestore

    with AnyReader([bag], default_typestore=project_typestore()) as reader:
        connections = [c for c in reader.connections
                       if c.msgtype in ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")]
        for connection, _, raw in reader.messages(connections=connections):
            msg = reader.deserialize(raw, connection.msgtype)
            if connection.msgtype.endswith("CompressedImage"):
                bgr = cv2.imdecode(np.frombuffer(bytes(msg.data), np.uint8), cv2.IMREAD_COLOR)
                rgb = None if bgr is None else cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            elif msg.encoding in ("rgb8", "bgr8") and msg.step == msg.width * 3:
                rgb = np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.width, 3)
                rgb = rgb if msg.encoding == "rgb8" else rgb[..., ::-1]
            else:
                rgb = None
            if rgb is not None:
                frames.append(np.ascontiguousarray(cv2.resize(rgb, FRAME_SIZE[::-1], interpolation=cv2.INTER_AREA)))
            if len(frames) >= limit:
                break
    if not frames:
        raise ValueError(f"{bag}: no rgb8/bgr8 Image or decodable CompressedImage message")
    return frames


class Driver(Node):
    """The robot and world side: ``/clock``, cameras, joint states, instructions; counts what it sent."""

    def __init__(self, frames: list[np.ndarray], joints: list[str], instruction_every_s: float, **kwargs):
        from rosgraph_msgs.msg import Clock
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import String

        super().__init__("soak_driver", **kwargs)
        self._frames, self._joints = frames, joints
        self._clock_pub = self.create_publisher(Clock, "/clock", 10)
        self._cam0 = self.create_publisher(Image, "soak/cam0/image_raw", qos_profile_sensor_data)
        self._cam1 = self.create_publisher(Image, "soak/cam1/image_raw", qos_profile_sensor_data)
        self._joint_pub = self.create_publisher(JointState, "soak/joint_states", qos_profile_sensor_data)
        self.instruction_pub = self.create_publisher(String, "soak/instruction", 10)   # volatile, reliable
        self._lock = threading.Lock()
        self._base, self._since = CLOCK_START_S, time.monotonic()
        self.clock_resets = 0
        self.instructions: list[str] = []
        self.frames_sent = 0
        self._index = 0
        self._instruction_every_s = instruction_every_s
        self._next_instruction = time.monotonic()
        self.create_timer(0.01, self._tick_clock)
        self.create_timer(0.2, self._publish_inputs)

    def now(self) -> float:
        """The simulated clock [s]."""
        with self._lock:
            return self._base + time.monotonic() - self._since

    def reset_clock(self, to_s: float) -> None:
        with self._lock:
            self._base, self._since = to_s, time.monotonic()
            self.clock_resets += 1

    def _stamp(self, seconds: float):
        from builtin_interfaces.msg import Time

        nanoseconds = round(seconds * 1e9)
        return Time(sec=nanoseconds // 10**9, nanosec=nanoseconds % 10**9)

    def _tick_clock(self) -> None:
        from rosgraph_msgs.msg import Clock

        self._clock_pub.publish(Clock(clock=self._stamp(self.now())))

    def _publish_inputs(self) -> None:
        import cv2
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import String

        stamp = self._stamp(self.now())
        rgb = self._frames[self._index % len(self._frames)]
        self._index += 1
        height, width = rgb.shape[:2]
        yuyv = cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_YUY2)
        cam0 = Image(height=height, width=width, encoding="yuv422_yuy2", step=width * 2, data=yuyv.tobytes())
        cam1 = Image(height=height, width=width, encoding="rgb8", step=width * 3, data=rgb.tobytes())
        cam0.header.stamp = cam1.header.stamp = stamp
        self._cam0.publish(cam0)
        self._cam1.publish(cam1)
        self.frames_sent += 1
        phase = 0.5 * math.sin(0.1 * self._index)
        state = JointState(name=self._joints, position=[phase * (0.1 + 0.02 * i) for i in range(len(self._joints))])
        state.header.stamp = stamp
        self._joint_pub.publish(state)
        if time.monotonic() >= self._next_instruction:
            text = f"pick up the cube number {len(self.instructions) + 1}"
            self.instruction_pub.publish(String(data=text))
            self.instructions.append(text)
            self._next_instruction += self._instruction_every_s


class Monitor(Node):
    """Checks every output of the node on receipt against the simulated clock."""

    def __init__(self, driver: Driver, prefix: str, **kwargs):
        from oxygen_ros.msg import ActionChunk, EngineStatus, MemoryEntry, Speech
        from trajectory_msgs.msg import JointTrajectory

        super().__init__("soak_monitor", **kwargs)
        self._driver = driver
        self.phase = "before_reset"
        self.counts: dict[str, dict[str, int]] = {}
        self.non_finite = 0
        self.expired = {"chunk": 0, "trajectory": 0}
        self.worst_lateness_s = {"chunk": -math.inf, "trajectory": -math.inf}
        self.last_status = None
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.create_subscription(ActionChunk, f"{prefix}/action_chunk", self._on_chunk, reliable)
        self.create_subscription(JointTrajectory, f"{prefix}/joint_trajectory", self._on_trajectory, reliable)
        self.create_subscription(Speech, f"{prefix}/speech", self._on_speech, reliable)
        self.create_subscription(MemoryEntry, f"{prefix}/memory", self._on_memory, reliable)
        self.create_subscription(EngineStatus, f"{prefix}/status", self._on_status, reliable)

    def _count(self, name: str) -> None:
        phase = self.counts.setdefault(self.phase, {})
        phase[name] = phase.get(name, 0) + 1

    def _on_chunk(self, msg) -> None:
        self._count("action_chunks")
        if not np.all(np.isfinite(np.asarray(msg.actions, np.float64))):
            self.non_finite += 1
        stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        self._check_end("chunk", stamp + (msg.horizon - 1) * msg.dt)

    def _on_trajectory(self, msg) -> None:
        self._count("trajectories")
        positions = [p for point in msg.points for p in point.positions]
        if not np.all(np.isfinite(np.asarray(positions, np.float64))):
            self.non_finite += 1
        stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        if stamp == 0.0 or not msg.points:
            return    # starts on receipt
        last = msg.points[-1].time_from_start
        self._check_end("trajectory", stamp + last.sec + last.nanosec * 1e-9)

    def _check_end(self, output: str, end_s: float) -> None:
        """Count an output whose last point ``end_s`` is already past on the simulated clock. An
        output computed just before the clock reset ends far in the new clock's future: not expired."""
        lateness = self._driver.now() - end_s
        self.worst_lateness_s[output] = max(self.worst_lateness_s[output], lateness)
        if lateness > 0:
            self.expired[output] += 1

    def _on_speech(self, msg) -> None:
        if msg.final:
            self._count({1: "speech_completed", 2: "speech_cancelled", 3: "speech_dropped"}.get(msg.status,
                                                                                                "speech_other"))

    def _on_memory(self, msg) -> None:
        self._count("memory_entries")

    def _on_status(self, msg) -> None:
        self.last_status = msg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oxygen_ros soak", description=__doc__.split("\n")[0])
    parser.add_argument("--bag", type=Path, default=None,
                        help="rosbag2 whose image topics are replayed in a loop (default: synthetic frames)")
    parser.add_argument("--duration", type=float, default=600.0, help="wall seconds of the run [s] (default 600)")
    parser.add_argument("--control-rate", type=float, default=2.0, help="the node's control rate [Hz]")
    parser.add_argument("--instruction-every", type=float, default=30.0,
                        help="a new instruction every this many s [s] (default 30)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="give up without a chunk by then [s]")
    parser.add_argument("--delivery-margin", type=float, default=0.1,
                        help="the node's expired_output_margin_s: time allowed from publication to receipt [s]")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse_args(argv)
    os.environ.setdefault("ROS_DOMAIN_ID", str(150 + os.getpid() % 80))     # a domain of its own
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    frames = load_frames(args.bag)
    joints = [f"joint_{i}" for i in range(1, 7)] + ["gripper"]
    from oxygen_ros.node.oxygen_node import OxygenNode

    params = {
        "autostart": True, "preset": "pi05_tiny", "use_sim_time": True, "joint_names": joints,
        "joint_states_topic": "soak/joint_states", "instruction_topic": "soak/instruction",
        "camera_topics": ["soak/cam0/image_raw", "soak/cam1/image_raw"],
        "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"], "camera_transports": ["raw", "raw"],
        "camera_reliability": ["best_effort", "best_effort"], "camera_required": [True, False],
        "control_rate_hz": args.control_rate, "staleness_limit_s": 1.0, "action_dt_s": 0.1,
        "speech.trigger.every_s": 3.0, "memory.trigger.every_s": 3.0,
        "publish_trajectory": True, "trajectory_stamp_policy": "observation",
        "trajectory_joint_names": joints[:6], "expired_output_policy": "withhold",
        # delivery to the monitor on this loaded machine: the check happens at publication, the monitor's at receipt
        "expired_output_margin_s": args.delivery_margin,
    }
    context = Context()
    rclpy.init(context=context)
    executor = SingleThreadedExecutor(context=context)
    driver = Driver(frames, joints, args.instruction_every, context=context)
    oxygen = OxygenNode(context=context, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    monitor = Monitor(driver, "/oxygen_node", context=context)
    for node in (driver, oxygen, monitor):
        executor.add_node(node)
    spinner = threading.Thread(target=lambda: _spin(executor), daemon=True)
    spinner.start()
    summary: dict = {}
    try:
        start = time.monotonic()
        while not monitor.counts and time.monotonic() - start < args.startup_timeout:
            time.sleep(0.5)
        if not monitor.counts:
            print(f"no output within {args.startup_timeout:g} s: {oxygen.configure_error}", file=sys.stderr)
            return 1
        start = time.monotonic()
        while time.monotonic() - start < args.duration / 2:
            time.sleep(0.5)
        monitor.phase = "after_reset"
        driver.reset_clock(CLOCK_RESET_TO_S)
        while time.monotonic() - start < args.duration:
            time.sleep(0.5)
        time.sleep(2.0)    # the last status period
        summary = _summary(driver, oxygen, monitor, args)
    finally:
        executor.shutdown(timeout_sec=5.0)
        spinner.join(timeout=5.0)
        oxygen.release()
        for node in (monitor, oxygen, driver):
            node.destroy_node()
        context.try_shutdown()
        context.destroy()
    text = json.dumps(summary, indent=2, sort_keys=True)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if summary.get("passed") else 1


def _spin(executor) -> None:
    try:
        executor.spin()
    except ExternalShutdownException:
        pass


def _engine_figures(engine) -> dict:
    """Mean seconds per cycle phase and frame latency over the engine's metrics window."""
    if engine is None:
        return {}
    metrics = engine.metrics()
    return {"frame_latency_mean_s": metrics["frame_latency_s"]["mean"], "phase_mean_s": metrics["phase_mean_s"],
            "mean_batch_size": metrics["mean_batch_size"], "requests_by_status": metrics["requests_by_status"]}


def _summary(driver: Driver, oxygen, monitor: Monitor, args) -> dict:
    status = monitor.last_status
    node_counters = {} if status is None else {
        name: getattr(status, name) for name in (
            "frames", "clock_jumps", "stamp_jumps", "non_finite_actions", "expired_chunks",
            "expired_trajectories", "incompatible_qos", "dropped_requests", "overloaded_cycles", "deadline_misses")}
    drops = oxygen.input_drops()
    before, after = monitor.counts.get("before_reset", {}), monitor.counts.get("after_reset", {})
    checks = {
        "no non-finite output received": monitor.non_finite == 0,
        "no expired action chunk or trajectory received": not any(monitor.expired.values()),
        "trajectories after the clock reset": after.get("trajectories", 0) > 0,
        "speech completes before and after the clock reset":
            before.get("speech_completed", 0) > 0 and after.get("speech_completed", 0) > 0,
        "memory entries before and after the clock reset":
            before.get("memory_entries", 0) > 0 and after.get("memory_entries", 0) > 0,
        "action chunks delivered before and after the clock reset":
            before.get("action_chunks", 0) > 0 and after.get("action_chunks", 0) > 0,
        "node counted the injected clock resets": node_counters.get("clock_jumps") == driver.clock_resets,
        "node took the last instruction (volatile publisher)": oxygen.instruction == driver.instructions[-1],
        "no camera frame dropped for its encoding": drops.get("unsupported_encoding", 0) == 0,
        "no incompatible QoS": node_counters.get("incompatible_qos") == 0,
    }
    return {
        "passed": all(checks.values()), "checks": checks, "wall_s": args.duration,
        "injected": {"clock_resets": driver.clock_resets, "instructions": len(driver.instructions),
                     "frames_per_camera": driver.frames_sent, "camera_encodings": ["yuv422_yuy2", "rgb8"],
                     "bag": None if args.bag is None else str(args.bag)},
        "delivered_chunk_share": round((before.get("action_chunks", 0) + after.get("action_chunks", 0))
                                       / max(1, node_counters.get("frames", 0)), 3),
        "received": {"before_reset": before, "after_reset": after, "non_finite": monitor.non_finite,
                     "expired": monitor.expired,
                     "latest_end_vs_clock_s": {k: round(v, 3) for k, v in monitor.worst_lateness_s.items()}},
        "node_counters": node_counters, "node_input_drops": drops, "node_skipped_cycles": oxygen.skip_reasons(),
        "engine": _engine_figures(oxygen.engine),
    }


if __name__ == "__main__":
    raise SystemExit(main())
