"""``make demo``: the whole system end to end on a CPU, for a bounded time, then a summary and plots.

What runs:
    * a simulated ALOHA robot (:mod:`oxygen_ros.tools.sim_robot`) in a child process of its own (so its
      MuJoCo rendering never competes with inference for Python's GIL): the cameras the policy sees
      (its ``demo_policy.json``'s ``cameras``; top, left_wrist and right_wrist without one) rendered round
      robin at ``--camera-rate`` each (default 3 images/s in all), 14 joint states at 50 Hz; it executes
      the action chunks;
    * the oxygen node (``OxygenNode``) with the shipped demo policy (``pi05_demo`` trained in this
      simulator, :func:`oxygen_ros.assets.demo_policy_dir`; docs/demo-policy.md) on the CPU: the action
      task, a speech task that says the current subtask (an utterance every ``--speech-every`` s, published
      on ``~/speech_text`` when it changes) and conditions the action prompt (π0.5's subtask loop), and a
      memory task that captions the scene (an entry every ``--memory-every`` s), reusing the newest camera
      frames within ``--staleness`` s. ``--random-weights`` runs the former configuration instead
      (``pi05_tiny`` with random weights, language decoded from the action prompt's prefix);
    * a recorder (:mod:`oxygen_ros.tools.bag_recorder`) that writes every topic to
      ``runs/<timestamp>/bag`` (rosbag2, MCAP);
    * this process publishes the instruction (latched) and follows the outputs.
The node, the recorder and the follower share one executor in this process, the one the ``oxygen_node``
executable spins (:class:`oxygen_ros.node.executor.TransitionExecutor`: callbacks on the spinning thread,
lifecycle transitions on a worker; a MultiThreadedExecutor here took the control-cycle thread's time, docs/demo.md
"Measured"); the robot
process is ended with this one in every case (SIGINT, SIGTERM, errors, and the kernel's parent-death
signal if this process is killed). On a robot the same nodes come up with ``ros2 launch``.

The robot publishes the task's outcome (reached, grasped, lifted, transferred) on ``/task_outcome``.
Afterwards :mod:`oxygen_ros.tools.report` reads the bag back and prints the summary and writes
``timeline.png`` and ``contact_sheet.png`` next to it. Exit status 0 when action chunks flowed.

Command line: ``python -m oxygen_ros.tools.demo [--duration 60] [--checkpoint DIR] ...`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__":
    # Ctrl-C while the heavy modules below are still importing (seconds on a loaded machine): end quietly with
    # the shell's status for SIGINT; main() installs the run's own handler.
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import rclpy  # noqa: E402
import yaml  # noqa: E402
from rclpy.context import Context  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from rclpy.signals import SignalHandlerOptions  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros import demo_task  # noqa: E402
from oxygen_ros.assets import demo_policy_dir, policy_cameras, read_policy_file  # noqa: E402
from oxygen_ros.models.processing import ACTION_PROMPT  # noqa: E402
from oxygen_ros.msg import ActionChunk, MemoryEntry, Speech  # noqa: E402
from oxygen_ros.models import get_preset  # noqa: E402
from oxygen_ros.node.executor import TransitionExecutor  # noqa: E402
from oxygen_ros.node.parameters import overrides, rtc_parameters  # noqa: E402
from oxygen_ros.tools import demo_data, demo_rate, sim_robot  # noqa: E402
from oxygen_ros.tools.bag_recorder import BagRecorder, default_run_dir  # noqa: E402
from oxygen_ros.tools.child_process import start_child, stop_child  # noqa: E402

NODE_NAME = "oxygen_node"
ACTION_DT_S = 0.02            # ALOHA's 50 Hz control: the time between a chunk's actions [s]
SETTLE_CYCLES = 8             # cycles before the recording: first prefills, the adaptive rate's first adjustments
DEFAULT_SEED = 1000           # the cube's start pose: the first evaluation seed (the training data used 0..99)
# pi05_tiny's chunk spans 0.2 s (H = 10): no adaptive floor can stay under it, so its rate is fixed.
RANDOM_WEIGHTS = {"preset": "pi05_tiny", "checkpoint": "", "instruction": "pick up the red cube",
                  "language_prompt": "shared", "control_rate": 3.0, "speech_every": 3.0, "rate": "fixed"}


def demo_rtc_parameters(args: argparse.Namespace, control_rate_hz: float) -> dict:
    """The node's real-time chunking parameters at ``control_rate_hz``: the delay measured, guidance toward the
    whole overlap with the chunk in flight (H − the 20 ms control steps between chunks)."""
    return rtc_parameters(get_preset(args.preset).action_horizon,
                          max(1, round(1.0 / (control_rate_hz * ACTION_DT_S))), None)


def label_tokens(preset: str) -> int:
    """Decode budget for the demo policy's language: tokens of the longest subtask label or caption in
    the preset's tokenizer, plus EOS (the evaluation's: :func:`oxygen_ros.tools.evaluate.label_tokens`)."""
    from oxygen_ros.tools.evaluate import label_tokens as tokens

    return tokens(preset)


def node_parameters(args: argparse.Namespace) -> dict:
    """The oxygen node's parameters for the simulated ALOHA robot (then ``--param`` overrides).

    With a checkpoint that has a ``demo_policy.json`` (the shipped one; ``--language-prompt policy``):
    ``conventions`` empty (the π0.5 defaults the policy was trained with), the speech and memory prompts it
    was trained on, its instruction as ``default_instruction``, decode budgets of its longest label, and —
    when it was trained with the subtask in the action prompt — π0.5's subtask loop: ``subtask_task``
    speech, ``subtask_prompt_template`` its ``action_subtask_prompt``, ``speech.publish_on_change``.
    """
    policy = read_policy_file(args.checkpoint)
    cameras = args.cameras
    params = {
        "preset": args.preset, "checkpoint": args.checkpoint, "device": args.device,
        "dtype": args.dtype,
        "joint_names": list(sim_robot.JOINTS), "action_dim": len(sim_robot.JOINTS),
        "action_names": list(sim_robot.JOINTS),
        "action_dt_s": ACTION_DT_S,
        "camera_topics": [f"/cameras/{camera}/image_raw" for camera in cameras],
        "camera_slots": list(cameras.values()),
        "camera_transports": ["raw"] * len(cameras),
        "camera_reliability": ["best_effort"] * len(cameras),
        # The first camera (top) is required; a late wrist frame only masks its slot for that cycle.
        "camera_required": [True] + [False] * (len(cameras) - 1),
        "staleness_limit_s": args.staleness,
        # Beside the simulator's renders one intra-op thread and the compiled denoising steps (RTC's guided ones
        # included) ran the cycle fastest: denoising 52-55 ms against 77-129 ms with the automatic thread count
        # and eager steps (docs/demo.md, "Measured"). Compiled at configure: 7-11 s with inductor's cache warm.
        "engine.intra_op_threads": 1,
        "cpu_compile": True,
        "instruction_topic": "/instruction", "joint_states_topic": "/joint_states",
        "control_rate_hz": args.control_rate,
        "control_rate_mode": args.rate,
        "control_rate_min_hz": args.min_control_rate,       # 0: the node's automatic floor
        "speech.trigger.every_s": args.speech_every,
        "memory.trigger.every_s": args.memory_every,
    }
    if args.language_prompt == "policy":
        if "speech_prompt" not in policy:
            raise SystemExit(f"--language-prompt policy: no demo_policy.json with prompts in {args.checkpoint!r}")
        tokens = label_tokens(args.preset)
        params.update({
            "conventions": "", "default_instruction": policy["instruction"],
            "speech.prompt_template": policy["speech_prompt"], "memory.prompt_template": policy["memory_prompt"],
            "speech.max_new_tokens": tokens, "memory.max_new_tokens": tokens})
        if policy.get("action_subtask_prompt") and policy.get("subtask_in_action_prompt", 0) > 0:
            params.update({"subtask_task": "speech", "subtask_prompt_template": policy["action_subtask_prompt"],
                           "speech.publish_on_change": True})
    elif args.language_prompt == "shared":
        # Speech and memory read the action task's prefix KV: one prefill per frame serves all three tasks
        # (the unified cache's sharing at its best; what makes the CPU demo meet its rates).
        params["speech.prompt_template"] = params["memory.prompt_template"] = ACTION_PROMPT
    if args.rtc == "on":
        # Real-time chunking with the delay the node measures, guided toward the whole overlap with the chunk in
        # flight (docs/demo-policy.md, "Real-time chunking": on the shipped policy it transfers at least as often
        # as the newest chunk and halves the seams).
        params.update(demo_rtc_parameters(args, args.control_rate))
    params.update(overrides(args.param))
    return params


class DemoFollower(Node):
    """Publishes the instruction (reliable, transient local) and counts the oxygen node's outputs.

    Also copies the engine's per-cycle records (encode / prefill / denoise / decode times) from the
    in-process node every second, before the node's own windowing can reset them.
    """

    def __init__(self, instruction: str, oxygen_node, **kwargs):
        super().__init__("demo_follower", **kwargs)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.create_publisher(String, "/instruction", latched).publish(String(data=instruction))
        prefix = f"/{NODE_NAME}"
        self.chunks = self.final_utterances = self.completed_utterances = self.memory_entries = 0
        self.first_chunk_time: float | None = None
        self.create_subscription(ActionChunk, f"{prefix}/action_chunk", self._on_chunk, 10)
        self.create_subscription(Speech, f"{prefix}/speech", self._on_speech, 100)
        self.create_subscription(MemoryEntry, f"{prefix}/memory", self._on_memory, 10)
        self._oxygen_node = oxygen_node
        self.cycles: dict[int, dict] = {}
        self._ignored: set[int] = set()
        self.create_timer(1.0, self.collect_cycles)

    def restart(self, ignore_seqs: set[int] = frozenset()) -> None:
        """Count from zero again (the run starts after the settling cycles); the engine records of
        ``ignore_seqs`` (the settling cycles) are not collected."""
        self.chunks = self.final_utterances = self.completed_utterances = self.memory_entries = 0
        self.first_chunk_time = None
        self.cycles = {}
        self._ignored = set(ignore_seqs)

    def _on_chunk(self, msg: ActionChunk) -> None:
        self.chunks += 1
        if self.first_chunk_time is None:
            self.first_chunk_time = time.monotonic()

    def _on_speech(self, msg: Speech) -> None:
        if msg.final:
            self.final_utterances += 1
            self.completed_utterances += msg.status == Speech.STATUS_COMPLETED
            from oxygen_ros.tools.report import SPEECH_STATUS_NAMES   # imported by main() already

            status = SPEECH_STATUS_NAMES.get(msg.status, f"status {msg.status}")
            self.get_logger().info(f"speech ({status}) {msg.text!r}")

    def _on_memory(self, msg: MemoryEntry) -> None:
        self.memory_entries += 1
        self.get_logger().info(f"memory {msg.entry_id}: {msg.text!r} (embedding {len(msg.embedding)})")

    def collect_cycles(self) -> None:
        """Copy the engine's new per-cycle records (keyed by observation seq)."""
        engine = self._oxygen_node.engine
        if engine is not None:
            for record in list(engine.metrics_records.cycles):
                if record.seq not in self._ignored:
                    self.cycles.setdefault(record.seq, asdict(record))


def _start_robot(args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    """The simulated robot as a child process in its own session, ended with this process
    (:func:`oxygen_ros.tools.child_process.start_child`)."""
    command = [sys.executable, "-P", "-m", "oxygen_ros.tools.sim_robot", "--ros-args",
               "-p", f"camera_rate_hz:={args.camera_rate}", "-p", f"cameras:={json.dumps(list(args.cameras))}",
               "-p", f"action_chunk_topic:=/{NODE_NAME}/action_chunk", "-p", f"seed:={args.seed}"]
    return start_child(command, log_path)


class StartupClock:
    """The demo's start-up limits: ``configure_timeout`` s from the demo's start for the node to configure and
    activate (model load, and on a machine that never ran it the compilation of the denoising steps), then
    ``startup_timeout`` s from its activation to the first action chunk. While the node configures,
    :meth:`expired` logs every ``note_every`` s how long it has taken so far. A configure step in progress
    (a compile) cannot be interrupted: after a limit or a signal the demo ends when that step returns.

    Args:
        node: anything with ``receiving() -> bool`` (True once active; the oxygen node).
        configure_timeout, startup_timeout, note_every: seconds.
        log: a logger with ``info`` (None: quiet); clock: monotonic seconds.
    """

    def __init__(self, node, configure_timeout: float, startup_timeout: float, log=None,
                 clock=time.monotonic, note_every: float = 30.0):
        self._node, self._log, self._clock = node, log, clock
        self.configure_timeout, self.startup_timeout, self._note_every = configure_timeout, startup_timeout, note_every
        self._start = clock()
        self._next_note = self._start + note_every
        self.active_after: float | None = None     # seconds from the start to the node's activation

    def expired(self) -> str | None:
        """None while within the limits, else why the start-up failed (one line)."""
        now = self._clock()
        if self.active_after is None:
            if self._node.receiving():
                self.active_after = now - self._start
            elif now - self._start > self.configure_timeout:
                return f"the node did not configure and activate within {self.configure_timeout:g} s"
            else:
                if now >= self._next_note and self._log is not None:
                    self._log.info(f"the node is still configuring ({now - self._start:.0f} s: loading the model; "
                                   "a first run on this machine also compiles the denoising steps)")
                    self._next_note = now + self._note_every
                return None
        if now - self._start - self.active_after > self.startup_timeout:
            return f"no action chunk within {self.startup_timeout:g} s of the node's activation"
        return None


def _end_tqdm_monitor() -> None:
    """End tqdm's monitor thread (started by a progress bar while the model's files load), so the check for
    threads left at exit reports only ours."""
    tqdm = sys.modules.get("tqdm")
    monitor = getattr(getattr(tqdm, "tqdm", None), "monitor", None)
    if monitor is not None:
        monitor.exit()


def settle(args: argparse.Namespace, executor, oxygen, robot: subprocess.Popen, stop: threading.Event,
           startup: StartupClock, log) -> set[int]:
    """Spin until the node has run ``--settle-cycles`` control cycles (one-time costs, and with the adaptive rate
    its first adjustments to this machine's load, land there, not in the recording); returns their seqs.

    Returns early (with the cycles so far) when a stop signal, the robot's exit, a failed autostart or
    the ``startup`` limits come first: the caller's loop reports those.
    """
    seqs: set[int] = set()
    if args.settle_cycles == 0:
        return seqs
    log.info(f"settling: {args.settle_cycles} control cycles before the recording starts")
    while not stop.is_set() and robot.poll() is None and oxygen.autostart_failed is None \
            and startup.expired() is None:
        executor.spin_once(timeout_sec=0.1)
        engine = oxygen.engine
        if engine is not None:
            seqs = {record.seq for record in list(engine.metrics_records.cycles)}
            if len(seqs) >= args.settle_cycles:
                break
    rate = oxygen.control_rate
    if rate is not None:
        done = (f"settled after {len(seqs)}" if len(seqs) >= args.settle_cycles
                else f"settling ended after {len(seqs)} of {args.settle_cycles}")
        log.info(f"{done} cycles at {rate.hz:g} Hz")
    return seqs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.tools.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds to run once the first action chunk arrived [s] (default 60)")
    parser.add_argument("--configure-timeout", type=float, default=900.0,
                        help="give up when the node has not configured and activated within this time [s] "
                             "(default 900: a machine that never ran the demo compiles its denoising steps, "
                             "minutes on 2 cores)")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="give up when no action chunk arrived within this time of the node's "
                             "activation [s] (default 120)")
    parser.add_argument("--min-outputs", type=int, default=0, metavar="N",
                        help="after --duration, keep running until at least N action chunks, N "
                             "completed utterances and N memory entries arrived (default 0: stop at "
                             "--duration); bounded by --max-duration")
    parser.add_argument("--max-duration", type=float, default=600.0,
                        help="with --min-outputs: stop this many s after the first action chunk "
                             "whatever arrived [s] (default 600)")
    parser.add_argument("--output", type=Path, default=None, help="run directory (default runs/<timestamp>)")
    parser.add_argument("--random-weights", action="store_true",
                        help="the untrained configuration: pi05_tiny with random weights, language from the "
                             "action prompt's prefix, instruction 'pick up the red cube', 3 chunks/s")
    parser.add_argument("--preset", default=None, help="model preset (default pi05_demo, the shipped policy's)")
    parser.add_argument("--checkpoint", default=None,
                        help="local checkpoint directory (default: the shipped demo policy, "
                             "oxygen_ros/assets/demo_policy; '' = random weights)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights' dtype (float32: the tiny preset's cycle is faster in float32 on CPUs)")
    parser.add_argument("--language-prompt", choices=("policy", "shared", "model"), default=None,
                        help="policy (default with a checkpoint that has demo_policy.json): its trained speech "
                             "and memory prompts and the subtask loop; shared (default otherwise): speech and "
                             "memory decode from the action prompt's prefix (one prefill per frame); model: "
                             "the model's own language prompt (a prefill per request; use with a real "
                             "checkpoint, whose language head was trained on it)")
    parser.add_argument("--instruction", default=None,
                        help="the instruction published to the node (default: the policy's, "
                             "'transfer the cube to the left arm'; with --random-weights 'pick up the red cube')")
    parser.add_argument("--control-rate", type=float, default=None,
                        help="action chunks per second [Hz] (default 4; 3 with --random-weights)")
    parser.add_argument("--rtc", choices=("on", "off"), default="on",
                        help="real-time chunking: each chunk continues the one the robot executes (default on)")
    parser.add_argument("--rate", choices=("adaptive", "fixed"), default=None,
                        help="adaptive (default; fixed with --random-weights): the node's control rate follows the "
                             "measured cycle cost between --min-control-rate and --control-rate (control_rate_mode "
                             "adaptive, oxygen_ros/engine/rate.py); fixed: always --control-rate")
    parser.add_argument("--min-control-rate", type=float, default=0.0,
                        help="adaptive: the slowest control rate [Hz], above 1 / a chunk's span of H x 20 ms "
                             "(default 0: the node's automatic floor, 1.5 Hz for the shipped policy's 1 s chunks)")
    parser.add_argument("--settle-cycles", type=int, default=SETTLE_CYCLES, metavar="N",
                        help="control cycles run before the recording (and the summary) starts (default "
                             "%(default)s)")
    parser.add_argument("--camera-rate", type=float, default=None,
                        help="images per second per camera [Hz] (default: 3 / the number of cameras the policy "
                             "sees: 1 for three cameras)")
    parser.add_argument("--staleness", type=float, default=1.5,
                        help="the node reuses camera frames up to this age [s]")
    parser.add_argument("--speech-every", type=float, default=None,
                        help="an utterance every this many s (default 1; 3 with --random-weights)")
    parser.add_argument("--memory-every", type=float, default=2.0, help="a memory entry every this many s")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"seed of the cube's start pose (gym-aloha's sample_box_pose; default {DEFAULT_SEED}, "
                             "so runs are comparable; e.g. --seed $RANDOM for a fresh pose)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="any oxygen node parameter (repeatable), e.g. --param dtype:=bfloat16")
    args = parser.parse_args(argv)
    for name in ("duration", "configure_timeout", "startup_timeout", "max_duration"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 s, got {getattr(args, name)}")
    if args.settle_cycles < 0:
        parser.error(f"--settle-cycles must be >= 0, got {args.settle_cycles}")
    if not args.min_control_rate >= 0:
        parser.error(f"--min-control-rate must be >= 0 Hz, got {args.min_control_rate}")
    if args.control_rate is not None and not args.control_rate > 0:
        parser.error(f"--control-rate must be > 0 Hz, got {args.control_rate}")
    problem = demo_data.seed_range_problem("--seed", args.seed, 1)    # checked here, not in the robot's process
    if problem:
        parser.error(problem)
    defaults = dict(RANDOM_WEIGHTS) if args.random_weights else {
        "preset": "pi05_demo", "checkpoint": str(demo_policy_dir()), "instruction": None,
        "language_prompt": None, "control_rate": 4.0, "speech_every": 1.0, "rate": "adaptive"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rate == "adaptive" and args.min_control_rate > args.control_rate:
        parser.error(f"--min-control-rate {args.min_control_rate:g} Hz is above --control-rate {args.control_rate:g} Hz")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")
    policy = read_policy_file(args.checkpoint)
    try:
        args.cameras = policy_cameras(policy)      # robot camera -> model slot, for the node and the robot
    except ValueError as err:
        parser.error(f"--checkpoint {args.checkpoint}: {err}")
    if args.camera_rate is None:
        args.camera_rate = demo_task.RENDER_RATE_HZ / len(args.cameras)
    elif not args.camera_rate > 0:
        parser.error(f"--camera-rate must be > 0 Hz, got {args.camera_rate}")
    if args.language_prompt is None:
        args.language_prompt = "policy" if "speech_prompt" in policy else "shared"
    if args.instruction is None:
        args.instruction = policy.get("instruction", RANDOM_WEIGHTS["instruction"])
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the demo (see the module docstring); returns the process exit status."""
    args = parse_args(argv)
    from oxygen_ros.tools import report
    from oxygen_ros.node.oxygen_node import OxygenNode

    wall_start = time.monotonic()
    run_dir = args.output or default_run_dir()
    if (run_dir / "bag").exists():
        raise SystemExit(f"{run_dir} already holds a recording ({run_dir / 'bag'}); choose another --output")
    params = node_parameters(args)
    run_dir.mkdir(parents=True, exist_ok=True)

    (run_dir / "oxygen_node_params.yaml").write_text(
        yaml.safe_dump({f"/**/{NODE_NAME}": {"ros__parameters": params}}, sort_keys=False))   # any namespace
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    context = Context()
    rclpy.init(args=[], context=context, signal_handler_options=SignalHandlerOptions.NO)
    robot = _start_robot(args, run_dir / "sim_robot.log")
    executor = None
    nodes: list[Node] = []
    recorder = follower = oxygen = None
    status = 1
    try:
        oxygen = OxygenNode(NODE_NAME, context=context,
                            parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        nodes.append(oxygen)
        # the oxygen_node executable's executor (oxygen_ros/node/executor.py; docs/demo.md "Measured")
        executor = TransitionExecutor(oxygen.runs_long, context=context)
        follower = DemoFollower(args.instruction, oxygen, context=context)
        nodes.append(follower)
        for node in nodes:
            executor.add_node(node)
        log = follower.get_logger()
        log.info(f"run directory {run_dir}; robot log {run_dir / 'sim_robot.log'}")
        startup = StartupClock(oxygen, args.configure_timeout, args.startup_timeout, log)
        follower.restart(settle(args, executor, oxygen, robot, stop, startup, log))
        # The recording (and the summary read from it) starts after the settling cycles.
        recorder = BagRecorder(run_dir / "bag", context=context)
        nodes.insert(0, recorder)     # destroyed last
        executor.add_node(recorder)
        next_progress = time.monotonic() + 10.0
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.1)
            now = time.monotonic()
            if robot.poll() is not None:
                log.error(f"the simulated robot exited ({robot.returncode}); see {run_dir / 'sim_robot.log'}")
                break
            if follower.first_chunk_time is None:
                if oxygen.autostart_failed is not None:
                    log.error(f"the oxygen node's {oxygen.autostart_failed} failed (reason above); no action "
                              "chunk will come")
                    break
                problem = startup.expired()
                if problem:
                    log.error(problem)
                    break
                continue
            if now >= next_progress:
                log.info(f"{max(0.0, now - follower.first_chunk_time):.0f} s: {follower.chunks} action chunks, "
                         f"{follower.final_utterances} utterances, {follower.memory_entries} memory entries")
                next_progress += 10.0
            elapsed = now - follower.first_chunk_time
            enough = min(follower.chunks, follower.completed_utterances,
                         follower.memory_entries) >= args.min_outputs
            if elapsed >= args.duration and (enough or elapsed >= args.max_duration):
                status = 0
                break
        if stop.is_set() and follower.first_chunk_time is None:
            log.error("stopped by a signal before the first action chunk")
        if not oxygen.receiving() and not oxygen.autostart_failed:
            log.info("waiting for the node's configure step to return (it cannot be interrupted mid-compile)")
        follower.collect_cycles()
    finally:
        stop_child(robot)
        rate = oxygen.control_rate if oxygen is not None else None
        if rate is not None:      # the rates run (the summary joins them with the recorded cycles)
            (run_dir / "control_rate.json").write_text(json.dumps(demo_rate.rate_log(rate), indent=2))
        # Order matters: no thread may still be inside native code (torch, rclpy) when the interpreter
        # tears down, or the process aborts with "terminate called without an active exception". The
        # control-cycle thread (a daemon) was found still inside a torch op at teardown in the aborted
        # runs, so it must be joined: the executor's worker threads first (no callback in flight), then
        # the cycle thread (release), the nodes, the context (shut down and destroyed).
        if executor is not None:
            executor.shutdown(timeout_sec=5.0)
        if oxygen is not None:
            oxygen.release()
        for node in reversed(nodes):
            node.destroy_node()
        context.try_shutdown()
        context.destroy()    # the DDS participant and its threads go now, not in static destructors

    if follower is not None:
        (run_dir / "engine_cycles.json").write_text(
            json.dumps([follower.cycles[seq] for seq in sorted(follower.cycles)]))
    if follower is None or follower.first_chunk_time is None:
        print(f"no action chunk arrived: no report (the reason is logged above; robot log {run_dir / 'sim_robot.log'})")
    elif recorder is not None and (run_dir / "bag" / "metadata.yaml").is_file():
        result = report.write_report(run_dir)
        print(report.format_summary(result))
    print(f"robot process {robot.pid} ended (exit status {robot.returncode})")
    print(f"demo wall time {time.monotonic() - wall_start:.1f} s; run directory {run_dir}")
    _end_tqdm_monitor()
    leftover = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if leftover:    # would run on into interpreter teardown (and may abort the process there)
        print(f"warning: threads still running at exit: {leftover}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
