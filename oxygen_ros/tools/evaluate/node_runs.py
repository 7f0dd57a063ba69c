"""The node conditions (``node-lockstep``, ``node-realtime``): the oxygen node in this process, over DDS, with
the robot in a child process per episode (:mod:`oxygen_ros.tools.evaluate.workers`)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from oxygen_ros.demo_task import DT, RENDER_RATE_HZ, SETTLE_S
from oxygen_ros.tools.child_process import package_pythonpath, start_child, stop_child
from oxygen_ros.tools.evaluate.conditions import NODE_NAME, topic_camera
from oxygen_ros.tools.evaluate.report import episode_line
from oxygen_ros.tools.evaluate.workers import read_record, worker_command

EPISODE_CLOCK_S = 1000.0             # node-lockstep: episode i's sim clock starts at (i + 1) x this [s]


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


def run_node_condition(condition: str, params: dict, seeds: list[int], args, out_dir: Path, log,
                       runs: list) -> dict[str, list[dict]]:
    """Episodes of ``node-lockstep`` or ``node-realtime`` for the :class:`~oxygen_ros.tools.evaluate.conditions.Run`
    s of the condition (its execution schemes), interleaved: per seed one episode of each run, in turn (the order
    reversed every other seed), so that the runs share the machine's state alike. The oxygen node runs in this
    process (spun by the ``oxygen_node`` executable's executor, as in tools/demo.py) with ``params``; a run whose
    node parameters differ from the ones in force reconfigures it first (deactivate, cleanup, the parameters,
    configure, activate), as a lifecycle manager would. The robot runs in a child process per episode. Returns the records per run name.

    Raises:
        RuntimeError: the node did not become active (at start or after a reconfiguration), or a robot process
            failed before writing its record.
    """
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter
    from rclpy.signals import SignalHandlerOptions

    from oxygen_ros.node.executor import TransitionExecutor
    from oxygen_ros.node.oxygen_node import OxygenNode

    context = Context()
    rclpy.init(args=[], context=context, signal_handler_options=SignalHandlerOptions.NO)
    executor = None
    oxygen = follower = None
    records: dict[str, list[dict]] = {run.name: [] for run in runs}
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: spin_until(executor, stop), daemon=True)   # executor: set below
    try:
        oxygen = OxygenNode(NODE_NAME, context=context,
                            parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        # the oxygen_node executable's executor (oxygen_ros/node/executor.py): a MultiThreadedExecutor here took the
        # control-cycle thread's time (docs/demo.md "Measured")
        executor = TransitionExecutor(oxygen.runs_long, context=context)
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
        # the parameters the runs switch, with the values the node has without them
        switched = sorted({name for run in runs for name in run.params})
        defaults = {name: oxygen.get_parameter(name).value for name in switched}
        in_force = dict(defaults)
        schedule = [(seed, run) for i, seed in enumerate(seeds) for run in (runs if i % 2 == 0 else runs[::-1])]
        for index, (seed, run) in enumerate(schedule):
            wanted = {name: run.params.get(name, defaults[name]) for name in switched}
            if wanted != in_force:
                _reconfigure(oxygen, wanted, args.startup_timeout)
                in_force = wanted
                log(f"{run.name}: node reconfigured with {wanted}")
            out = out_dir / run.name / f"episode_{seed}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            spec = {"seed": seed, "max_steps": args.max_steps, "out": str(out), "cameras": list(cameras),
                    "chunk_topic": f"/{NODE_NAME}/action_chunk", "ensemble_m": run.ensemble_m}
            if condition == "node-lockstep":
                offset = EPISODE_CLOCK_S * (index + 1)
                spec.update(clock_offset_s=offset, execute_steps=run.execute_steps,
                            chunk_timeout_s=args.chunk_timeout, resend_s=args.resend, connect_timeout_s=30.0)
                command = worker_command("lockstep", spec)
            else:
                spec.update(camera_rate_hz=args.camera_rate or RENDER_RATE_HZ / len(cameras))
                command = worker_command("realtime", spec)
            started = time.time()
            child = start_child(command, out_dir / run.name / "robot.log", append=True,
                                env=package_pythonpath(os.environ))
            try:
                limit = args.max_steps * DT * 200 + 120 if condition == "node-lockstep" else args.max_steps * DT * 20 + 60
                child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                log(f"{run.name} episode {seed}: the robot process ran past {limit:.0f} s; stopped")
            finally:
                stop_child(child)
            if not out.is_file():
                raise RuntimeError(f"{condition} episode {seed}: the robot process failed (exit {child.returncode}); "
                                   f"see {out_dir / run.name / 'robot.log'}")
            record = read_record(out)
            # The record is written once the episode has run to its end; a process that fails after it (seen: an
            # abort in the robot's teardown) leaves a whole episode: scored, the failure logged and counted.
            record["robot_exit"] = child.returncode
            if child.returncode != 0:
                log(f"{run.name} episode {seed}: the robot process exited {child.returncode} after writing its "
                    f"record (teardown); episode kept; see {out_dir / run.name / 'robot.log'}")
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
                # The episode's chunks only (observation stamps on the robot's clock, from its settling to its last
                # sample), not those of the robot process's start-up or of the wait for language above; the
                # number of chunks stays the robot's own count over the same span as its wall_s and sim_s.
                observed = record.get("observed") or []
                if observed:
                    first, last = observed[0]["t"] - SETTLE_S, observed[-1]["t"]
                    chunks = [c for c in chunks if first <= c[0] <= last]
                record["inference_latencies"] = [latency for _, _, latency in chunks]
                record["latencies"] = [received - stamp for stamp, received, _ in chunks]
            records[run.name].append(record)
            log(f"{run.name} episode {seed}: {episode_line(record)}")
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join(timeout=5.0)
        if executor is not None:
            executor.shutdown(timeout_sec=5.0)
        if oxygen is not None:
            oxygen.release()
            oxygen.destroy_node()
        if follower is not None:
            follower.node.destroy_node()
        context.try_shutdown()
        context.destroy()
    return records


def _reconfigure(oxygen, parameters: dict, timeout_s: float) -> None:
    """Deactivate and clean up ``oxygen``, set ``parameters``, configure and activate it again.

    Raises:
        RuntimeError: a transition failed, a parameter was refused, or the node was not active within
            ``timeout_s`` [s].
    """
    oxygen.reconfigure(parameters)
    deadline = time.monotonic() + timeout_s
    while oxygen.lifecycle_state != "active":
        if oxygen.configure_error or time.monotonic() > deadline:
            raise RuntimeError(f"the oxygen node did not become active again: {oxygen.configure_error}")
        time.sleep(0.1)


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


def spin_until(executor, stop: threading.Event) -> None:
    """Spin ``executor`` (an in-process node's, on a thread of its own) until ``stop`` is set; an error raised
    after ``stop`` (the context going down at the end) ends it quietly, any other is raised."""
    while not stop.is_set():
        try:
            executor.spin_once(timeout_sec=0.1)
        except Exception:   # the context going down at the end
            if stop.is_set():
                return
            raise
