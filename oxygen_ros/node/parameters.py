"""ROS parameters of ``oxygen_node``: declarations with descriptors, and their validated values.

Every parameter is declared with a :class:`ParameterDescriptor` (description, range, and when a change
takes effect). Arrays are typed ROS arrays
(``string[]``, ``bool[]``), never comma-separated strings. Per-camera arrays (``camera_slots``,
``camera_transports``, ``camera_reliability``, ``camera_required``, and ``camera_accept_mono16``, which may
also be empty) are parallel to ``camera_topics``.

Two kinds (:data:`CONFIGURE_TIME`, :data:`DYNAMIC`): the configure-time parameters (model, device,
cameras, topics, rates, triggers, prompt templates, engine, trajectory options, ...) are read once, in
``configure``: ``ros2 param set`` accepts them while the node is unconfigured (after ``cleanup``, or before
the first ``configure``) and refuses them with the reason while it is configured (inactive or active),
since the running engine would not see them. The dynamic ones (``staleness_limit_s``,
``max_instruction_chars``, ``joint_limits.policy``, ``expired_output_policy``,
``expired_output_margin_s``, ``on_stop_command``,
``camera_clock_offset_warn_s``) are accepted in every state and read at their next use (the next control
cycle, instruction, output or status period). ``autostart`` only acts at start-up and is read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import ParameterUninitializedException
from rclpy.node import Node
from rclpy.parameter import Parameter

from oxygen_ros.models.config import get_preset
from oxygen_ros.models.conventions import MODEL_CAMERA_SLOTS, NORM_MODES, Conventions, apply_settings, \
    resolve_conventions
from oxygen_ros.node.output_checks import (EXPIRED_OUTPUT_POLICIES, LIMIT_POLICIES, JointLimits,
                                           limits_from_parameters)

TRANSPORTS = ("raw", "compressed")
RELIABILITIES = ("best_effort", "reliable")
TRAJECTORY_STAMP_POLICIES = ("now", "observation")
# Full-size presets: random weights are meaningless there (and a robot must never run them unnoticed).
FULL_PRESETS = ("pi05", "pi0")


def _float_range(low: float, high: float) -> list[FloatingPointRange]:
    return [FloatingPointRange(from_value=low, to_value=high, step=0.0)]


def _int_range(low: int, high: int) -> list[IntegerRange]:
    return [IntegerRange(from_value=low, to_value=high, step=1)]


# name -> (default or Parameter.Type for an array that may be empty, description, range kwargs, at_configure:
# True = read at configure (settable while unconfigured), False = dynamic (read at its next use))
_DECLARATIONS: dict[str, tuple] = {
    # ---- lifecycle
    "autostart": (True, "configure and activate on start-up, without a lifecycle manager", {}, True),
    # ---- model
    "preset": ("pi05_tiny", "model preset: pi05, pi0, pi05_tiny or pi0_tiny", {}, True),
    "checkpoint": ("", "local checkpoint directory; empty = seeded random weights (tiny presets; a full "
                   "preset needs allow_random_weights)", {}, True),
    "allow_random_weights": (False, "let a full-size preset (pi05, pi0) run with seeded random weights when "
                             "checkpoint is empty (meaningless actions: for tests only)", {}, True),
    "tokenizer_path": ("", "local PaliGemma SentencePiece model (full presets); empty for tiny presets", {},
                       True),
    "conventions": ("", "checkpoint family whose conventions the checkpoint was trained with (prompt layout, "
                    "normalisation, horizon, delta actions, robot adaptation, cameras): openpi/pi05_aloha, "
                    "openpi/pi05_droid, openpi/pi05_libero, openpi/pi0_aloha, openpi/pi0_droid, openpi/pi0_libero, "
                    "openpi/pi05, openpi/pi0, lerobot/pi05, lerobot/pi0; empty = what the checkpoint carries "
                    "(a LeRobot config.json), else the preset's defaults (docs/conventions.md)", {}, True),
    "norm_stats_path": ("", "openpi norm_stats.json of the robot; empty = the statistics the checkpoint carries "
                        "(LeRobot processor files, openpi assets/<asset>/norm_stats.json); none without a "
                        "checkpoint = data already normalised", {}, True),
    "norm_mode": ("", "state/action normalisation: quantile, mean_std or identity; empty = the conventions' "
                  "(pi0.5: quantile, pi0: mean_std); must agree with a checkpoint's or family's", {}, True),
    "action_horizon": (0, "H: actions per chunk; 0 = the conventions' (e.g. openpi/pi05_droid 15); must agree "
                       "with a checkpoint's or family's", {"integer_range": _int_range(0, 1000)}, True),
    "device": ("cpu", "torch device, e.g. cpu, cuda, cuda:0", {}, True),
    "dtype": ("float32", "weight dtype: float32 or bfloat16", {}, True),
    "cuda_graphs": (True, "on a CUDA device, replay the vision tower and the denoising loop from CUDA graphs "
                    "(captured on first use; false = eager PyTorch)", {}, True),
    "seed": (0, "seed of the random weights when no checkpoint is given", {"integer_range": _int_range(0, 2**31 - 1)},
             True),
    # ---- robot
    "joint_names": (Parameter.Type.STRING_ARRAY,
                    "joints of the robot state vector, in order, matched by name in "
                    "sensor_msgs/JointState (required: pi0 and pi0.5 read the state)", {}, True),
    "action_dim": (0, "D: action dimensions kept from the model's padded 32; 0 = the conventions' robot "
                   "action dimension, else the number of joint_names", {"integer_range": _int_range(0, 32)}, True),
    "action_dt_s": (0.0, "time between consecutive actions of a chunk (the policy's action period) [s]; 0 = the "
                    "conventions' (e.g. 1/15 s for DROID), else 0.05 s",
                    {"floating_point_range": _float_range(0.0, 10.0)}, True),
    "action_names": (Parameter.Type.STRING_ARRAY,
                     "name of each of the D action dimensions; empty = joint_names when it has D entries, "
                     "else action_0 ... action_{D-1}", {}, True),
    # ---- inputs
    "camera_topics": (["camera/image_raw"], "camera topics (relative names resolve in the node's namespace)",
                      {}, True),
    "camera_slots": (["base_0_rgb"], "model camera slot of each camera topic: base_0_rgb, left_wrist_0_rgb or "
                     "right_wrist_0_rgb (openpi image keys); the model sees them in that order", {}, True),
    "camera_transports": (["raw"], "per camera: raw (sensor_msgs/Image) or compressed "
                          "(sensor_msgs/CompressedImage, JPEG or PNG)", {}, True),
    "camera_reliability": (["best_effort"], "per camera subscription reliability: best_effort (sensor-data "
                           "QoS) or reliable", {}, True),
    "camera_required": ([True], "per camera: true = a stale or missing frame skips the cycle (no new action "
                        "chunk); false = the slot is masked", {}, True),
    "camera_accept_mono16": (Parameter.Type.BOOL_ARRAY, "per camera: true = a 16-bit grayscale camera, accept "
                             "mono16 / 16UC1 (scaled to 8 bits); empty = false for every camera (a depth "
                             "image is dropped as unsupported_encoding)", {}, True),
    "staleness_limit_s": (0.5, "frames and joint states received longer ago than this (node clock) are not "
                          "used [s]", {"floating_point_range": _float_range(0.001, 3600.0)}, False),
    "instruction_topic": ("instruction", "std_msgs/String instruction topic (reliable, volatile, depth 10; "
                          "plus a transient-local subscription for a latched instruction until the first "
                          "one arrives)", {}, True),
    "default_instruction": ("", "instruction used until one arrives on the instruction topic", {}, True),
    "max_instruction_chars": (1000, "longer instructions are dropped (counted, with a warning)",
                              {"integer_range": _int_range(1, 1_000_000)}, False),
    "joint_states_topic": ("joint_states", "sensor_msgs/JointState topic", {}, True),
    # ---- rates and engine
    "control_rate_hz": (2.0, "control cycles (action chunks) per second [Hz]",
                        {"floating_point_range": _float_range(0.01, 1000.0)}, True),
    "num_denoise_steps": (10, "flow-matching Euler steps per action chunk",
                          {"integer_range": _int_range(1, 100)}, True),
    "status_rate_hz": (1.0, "~/status and /diagnostics publications per second [Hz]",
                       {"floating_point_range": _float_range(0.01, 100.0)}, True),
    "engine.mode": ("unified", "isolated, shared_prefix or unified", {}, True),
    "engine.scheduling": ("deadline", "deadline (decode in the slack) or fixed_k", {}, True),
    "engine.decode_steps_per_cycle": (5, "k of fixed_k scheduling", {"integer_range": _int_range(1, 1000)}, True),
    "engine.kv_budget_mb": (64, "KV pool budget [MiB]", {"integer_range": _int_range(1, 1_000_000)}, True),
    "engine.block_size": (16, "tokens per KV page", {"integer_range": _int_range(1, 1024)}, True),
    "engine.max_batch_size": (64, "most language requests per batched decode step",
                              {"integer_range": _int_range(1, 4096)}, True),
    # ---- language tasks
    "speech.enabled": (True, "run the speech task (~/speech, ~/speech_text)", {}, True),
    "speech.trigger_every_n_frames": (0, "start an utterance every n control cycles; 0 = off",
                                      {"integer_range": _int_range(0, 1_000_000)}, True),
    "speech.trigger_every_s": (0.0, "start an utterance every this many seconds of observation stamps; 0 = off",
                               {"floating_point_range": _float_range(0.0, 86400.0)}, True),
    "speech.trigger_on_new_instruction": (True, "start an utterance when the instruction changes", {}, True),
    "speech.cancel_on_new_instruction": (True, "a new instruction cancels the utterance in flight", {}, True),
    "speech.max_new_tokens": (16, "most tokens per utterance", {"integer_range": _int_range(1, 4096)}, True),
    "speech.prompt_template": ("", "prompt with {instruction} (and optionally {state}); empty = the "
                               "model's language prompt", {}, True),
    "memory.enabled": (True, "run the memory task (~/memory)", {}, True),
    "memory.trigger_every_s": (2.0, "a memory entry every this many seconds of observation stamps [s]",
                               {"floating_point_range": _float_range(0.01, 86400.0)}, True),
    "memory.max_new_tokens": (8, "most caption tokens per memory entry", {"integer_range": _int_range(1, 4096)},
                              True),
    "memory.prompt_template": ("", "caption prompt with {instruction}; empty = the model's language prompt",
                               {}, True),
    # ---- outputs
    "frame_id": ("", "header.frame_id of ActionChunk and JointTrajectory (the robot's base frame)", {}, True),
    "publish_trajectory": (False, "also publish trajectory_msgs/JointTrajectory on ~/joint_trajectory", {},
                           True),
    "trajectory_joint_names": (Parameter.Type.STRING_ARRAY,
                               "action dimensions (by name) sent in the JointTrajectory; empty = all", {}, True),
    "trajectory_stamp_policy": ("now", "JointTrajectory header.stamp: now (stamp 0: the controller starts "
                                "on receipt) or observation (the observation's stamp: point i is due at "
                                "observation + (i+1)*dt, so the inference latency is accounted for)", {}, True),
    # ---- output checks (what leaves the node) and time
    "joint_limits.lower": (Parameter.Type.DOUBLE_ARRAY,
                           "lower position limit of each action dimension (parallel to action_names; -.inf = "
                           "none) [rad or m]; empty = no limits from parameters", {}, True),
    "joint_limits.upper": (Parameter.Type.DOUBLE_ARRAY,
                           "upper position limit of each action dimension (parallel to action_names; .inf = "
                           "none) [rad or m]", {}, True),
    "joint_limits.from_robot_description": (False, "read the position limits of the action dimensions named "
                                            "like URDF joints from std_msgs/String robot_description "
                                            "(transient local); no chunk is published until it arrives",
                                            {}, True),
    "joint_limits.policy": ("clamp", "an action chunk with a value outside the joint limits: clamp (clip "
                            "into them) or reject (withhold the chunk); counted either way", {}, False),
    "expired_output_policy": ("fallback", "an output whose last point is already past at publication: "
                              "fallback (JointTrajectory sent with stamp 0, ActionChunk sent as it is) or "
                              "withhold (not sent); counted and warned either way", {}, False),
    "expired_output_margin_s": (0.0, "an output counts as expired (expired_output_policy) when less than this "
                                "much of it is left at publication [s]: the time it takes to reach and start "
                                "on the controller", {"floating_point_range": _float_range(0.0, 1e9)}, False),
    "on_stop_command": ("hold", "the controller's last command when the node stops acting (deactivate, "
                        "shutdown, SIGINT / SIGTERM, a failed transition while active): hold (one "
                        "JointTrajectory on ~/joint_trajectory holding the latest JointState positions of "
                        "trajectory_joint_names; needs publish_trajectory) or none (nothing)", {}, False),
    "camera_clock_offset_warn_s": (1.0, "/diagnostics warns when a camera's header stamps differ from the node "
                                   "clock at receipt by more than this [s]",
                                   {"floating_point_range": _float_range(0.0, 1e9)}, False),
}

# Parameters that may change at run time and take a value from a fixed set: checked when set.
STOP_COMMANDS = ("hold", "none")
DYNAMIC_CHOICES = {"joint_limits.policy": LIMIT_POLICIES, "expired_output_policy": EXPIRED_OUTPUT_POLICIES,
                   "on_stop_command": STOP_COMMANDS}


@dataclass(frozen=True)
class CameraSettings:
    """One camera input: topic, model slot, message type, QoS reliability, whether it is required, whether
    it accepts 16-bit single-channel images (a 16-bit grayscale camera)."""

    topic: str
    slot: str
    transport: str
    reliability: str
    required: bool
    accept_mono16: bool = False


@dataclass(frozen=True)
class NodeSettings:
    """Validated values of the configure-time parameters (:data:`CONFIGURE_TIME`), read once per
    ``configure``.

    ``conventions`` is the checkpoint family's, resolved and checked against the explicit settings;
    ``action_dim`` and ``action_dt_s`` are the resolved values.

    Raises (from :func:`read_settings`):
        ValueError: inconsistent values (lengths of the per-camera arrays, unknown enum values, settings
            that contradict the checkpoint's conventions, ...), with the parameter named in the message.
    """

    preset: str
    checkpoint: str
    allow_random_weights: bool
    tokenizer_path: str
    norm_stats_path: str
    conventions: Conventions
    device: str
    dtype: str
    cuda_graphs: bool
    seed: int
    joint_names: tuple[str, ...]
    action_dim: int
    action_dt_s: float
    action_names: tuple[str, ...]
    cameras: tuple[CameraSettings, ...]
    instruction_topic: str
    default_instruction: str
    joint_states_topic: str
    control_rate_hz: float
    num_denoise_steps: int
    status_rate_hz: float
    engine_mode: str
    engine_scheduling: str
    decode_steps_per_cycle: int
    kv_budget_bytes: int
    block_size: int
    max_batch_size: int
    speech_enabled: bool
    speech_every_n_frames: int
    speech_every_s: float
    speech_on_new_instruction: bool
    speech_cancel_on_new_instruction: bool
    speech_max_new_tokens: int
    speech_prompt_template: str
    memory_enabled: bool
    memory_every_s: float
    memory_max_new_tokens: int
    memory_prompt_template: str
    frame_id: str
    publish_trajectory: bool
    trajectory_joint_names: tuple[str, ...]
    trajectory_stamp_policy: str
    joint_limits: JointLimits | None
    joint_limits_from_robot_description: bool

    @property
    def model_camera_slots(self) -> tuple[str, ...]:
        """The configured slots in the model's order (:data:`MODEL_CAMERA_SLOTS`), whatever the order of
        ``camera_topics``: images reach the model by slot name."""
        return tuple(sorted((c.slot for c in self.cameras), key=MODEL_CAMERA_SLOTS.index))

    @property
    def control_period_s(self) -> float:
        """Control period [s]."""
        return 1.0 / self.control_rate_hz

    @property
    def model_id(self) -> str:
        """Identifies the weights: ``preset`` or ``preset@checkpoint``, plus device and dtype."""
        weights = f"{self.preset}@{self.checkpoint}" if self.checkpoint else f"{self.preset}(seed {self.seed})"
        return f"{weights} {self.dtype} {self.device}"


# Read-only: only acts at start-up.
START_ONLY = frozenset({"autostart"})
# Read at configure: settable while unconfigured, refused while configured.
CONFIGURE_TIME = frozenset(name for name, declaration in _DECLARATIONS.items() if declaration[3]) - START_ONLY
# Read at their next use: settable in every state.
DYNAMIC = frozenset(name for name, declaration in _DECLARATIONS.items() if not declaration[3])


def declare_parameters(node: Node) -> None:
    """Declare every parameter of ``oxygen_node`` on ``node`` with its descriptor (its
    ``additional_constraints`` say when a change takes effect)."""
    for name, (default, description, ranges, at_configure) in _DECLARATIONS.items():
        when = "read-only: acts at start-up" if name in START_ONLY else \
            "applied at the next configure; settable only while unconfigured" if at_configure else \
            "dynamic: takes effect at its next use"
        descriptor = ParameterDescriptor(description=description, read_only=name in START_ONLY,
                                         additional_constraints=when, **ranges)
        node.declare_parameter(name, default, descriptor)


def _value(node: Node, name: str):
    try:
        return node.get_parameter(name).value
    except ParameterUninitializedException:   # an array declared by type only, and not set: empty
        return []


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"parameter {name}: {value!r} is not one of {list(allowed)}")
    return value


def read_settings(node: Node) -> NodeSettings:
    """Read and validate the parameters of ``node`` (declared by :func:`declare_parameters`).

    Raises:
        ValueError: an invalid or inconsistent value; the message names the parameter.
    """
    v = {name: _value(node, name) for name in _DECLARATIONS}
    topics = list(v["camera_topics"])
    if not topics:
        raise ValueError("parameter camera_topics: at least one camera is needed")
    for name in ("camera_slots", "camera_transports", "camera_reliability", "camera_required"):
        if len(v[name]) != len(topics):
            raise ValueError(f"parameter {name}: {len(v[name])} entries, camera_topics has {len(topics)}")
    if len(set(v["camera_slots"])) != len(topics):
        raise ValueError(f"parameter camera_slots: slots must be unique, got {list(v['camera_slots'])}")
    unknown_slots = [slot for slot in v["camera_slots"] if slot not in MODEL_CAMERA_SLOTS]
    if unknown_slots:
        raise ValueError(f"parameter camera_slots: {unknown_slots} are not camera slots of the model; "
                         f"valid slots: {list(MODEL_CAMERA_SLOTS)}")
    if v["preset"] in FULL_PRESETS and not v["checkpoint"] and not v["allow_random_weights"]:
        raise ValueError(f"parameter checkpoint: preset {v['preset']} is a full-size model and no checkpoint is "
                         "given; set checkpoint to a local checkpoint directory (random weights are only for "
                         "the tiny presets; allow_random_weights: true forces them, with meaningless actions)")
    mono16 = list(v["camera_accept_mono16"]) or [False] * len(topics)
    if len(mono16) != len(topics):
        raise ValueError(f"parameter camera_accept_mono16: {len(mono16)} entries, camera_topics has {len(topics)} "
                         "(or leave it empty)")
    cameras = tuple(CameraSettings(topic, slot, _choice("camera_transports", transport, TRANSPORTS),
                                   _choice("camera_reliability", reliability, RELIABILITIES), bool(required),
                                   bool(accept_mono16))
                    for topic, slot, transport, reliability, required, accept_mono16 in
                    zip(topics, v["camera_slots"], v["camera_transports"], v["camera_reliability"],
                        v["camera_required"], mono16))
    joint_names = tuple(v["joint_names"])
    if not joint_names:
        raise ValueError("parameter joint_names: list the joints of the robot state (pi0/pi0.5 read the state)")
    if len(set(joint_names)) != len(joint_names):
        raise ValueError(f"parameter joint_names: names must be unique, got {list(joint_names)}")
    conventions = _conventions(v, joint_names, cameras)
    node.get_logger().info(f"conventions {conventions.describe()}")
    action_dim = conventions.action_dim or len(joint_names)
    action_names = tuple(v["action_names"])
    if not action_names:
        action_names = joint_names if len(joint_names) == action_dim else \
            tuple(f"action_{i}" for i in range(action_dim))
    if len(action_names) != action_dim:
        raise ValueError(f"parameter action_names: {len(action_names)} names for action_dim {action_dim}")
    trajectory_names = tuple(v["trajectory_joint_names"]) or action_names
    unknown = set(trajectory_names) - set(action_names)
    if unknown:
        raise ValueError(f"parameter trajectory_joint_names: {sorted(unknown)} are not in action_names")
    joint_limits = limits_from_parameters(list(v["joint_limits.lower"]), list(v["joint_limits.upper"]),
                                          action_names)
    if joint_limits is not None and v["joint_limits.from_robot_description"]:
        raise ValueError("parameters joint_limits.lower / joint_limits.upper and "
                         "joint_limits.from_robot_description: set one source of joint limits, not both")
    for name, allowed in DYNAMIC_CHOICES.items():
        _choice(name, v[name], allowed)
    if v["speech.enabled"] and not (v["speech.trigger_every_n_frames"] or v["speech.trigger_every_s"]
                                    or v["speech.trigger_on_new_instruction"]):
        raise ValueError("speech is enabled but has no trigger: set speech.trigger_every_n_frames, "
                         "speech.trigger_every_s or speech.trigger_on_new_instruction")
    return NodeSettings(
        preset=v["preset"], checkpoint=v["checkpoint"], allow_random_weights=bool(v["allow_random_weights"]),
        tokenizer_path=v["tokenizer_path"],
        norm_stats_path=v["norm_stats_path"], conventions=conventions,
        device=v["device"], dtype=_choice("dtype", v["dtype"], ("float32", "bfloat16")),
        cuda_graphs=bool(v["cuda_graphs"]), seed=int(v["seed"]),
        joint_names=joint_names, action_dim=action_dim,
        action_dt_s=conventions.action_dt_s or 0.05, action_names=action_names, cameras=cameras,
        instruction_topic=v["instruction_topic"], default_instruction=v["default_instruction"],
        joint_states_topic=v["joint_states_topic"], control_rate_hz=float(v["control_rate_hz"]),
        num_denoise_steps=int(v["num_denoise_steps"]), status_rate_hz=float(v["status_rate_hz"]),
        engine_mode=v["engine.mode"], engine_scheduling=v["engine.scheduling"],
        decode_steps_per_cycle=int(v["engine.decode_steps_per_cycle"]),
        kv_budget_bytes=int(v["engine.kv_budget_mb"]) * 2**20, block_size=int(v["engine.block_size"]),
        max_batch_size=int(v["engine.max_batch_size"]),
        speech_enabled=bool(v["speech.enabled"]), speech_every_n_frames=int(v["speech.trigger_every_n_frames"]),
        speech_every_s=float(v["speech.trigger_every_s"]),
        speech_on_new_instruction=bool(v["speech.trigger_on_new_instruction"]),
        speech_cancel_on_new_instruction=bool(v["speech.cancel_on_new_instruction"]),
        speech_max_new_tokens=int(v["speech.max_new_tokens"]), speech_prompt_template=v["speech.prompt_template"],
        memory_enabled=bool(v["memory.enabled"]), memory_every_s=float(v["memory.trigger_every_s"]),
        memory_max_new_tokens=int(v["memory.max_new_tokens"]), memory_prompt_template=v["memory.prompt_template"],
        frame_id=v["frame_id"], publish_trajectory=bool(v["publish_trajectory"]),
        trajectory_joint_names=trajectory_names,
        trajectory_stamp_policy=_choice("trajectory_stamp_policy", v["trajectory_stamp_policy"],
                                        TRAJECTORY_STAMP_POLICIES),
        joint_limits=joint_limits,
        joint_limits_from_robot_description=bool(v["joint_limits.from_robot_description"]))


def _conventions(v: dict, joint_names: tuple[str, ...], cameras: tuple[CameraSettings, ...]) -> Conventions:
    """The checkpoint family's conventions (checkpoint files, ``conventions``, or the preset's defaults),
    with the explicit settings applied; a setting or a camera that contradicts binding conventions raises
    a one-line ValueError naming both values."""
    preset = get_preset(v["preset"])
    if v["norm_mode"]:
        _choice("norm_mode", v["norm_mode"], NORM_MODES)
    conventions = resolve_conventions(preset.variant, preset.action_horizon, preset.max_token_len,
                                      v["checkpoint"] or None, v["conventions"] or None)
    conventions = apply_settings(
        conventions, labels={"state_dim": "parameter joint_names (number of joints)"},
        norm_mode=v["norm_mode"] or None, action_horizon=int(v["action_horizon"]) or None,
        state_dim=len(joint_names), action_dim=int(v["action_dim"]) or None,
        action_dt_s=float(v["action_dt_s"]) or None)
    if conventions.binding:
        for camera in cameras:
            spec = conventions.camera(camera.slot)
            if spec is None:
                raise ValueError(f"parameter camera_slots: {camera.slot} is not used by {conventions.source} "
                                 f"(its cameras: {[f'{c.slot} ({c.key})' for c in conventions.cameras]})")
            if spec.required and not camera.required:
                raise ValueError(f"parameter camera_required is false for {camera.slot} but {conventions.source} "
                                 f"says true ({spec.key} is required)")
        configured = {camera.slot for camera in cameras}
        for spec in conventions.cameras:
            if spec.required and spec.slot not in configured:
                raise ValueError(f"parameter camera_slots lacks {spec.slot} but {conventions.source} requires it "
                                 f"({spec.key})")
    return conventions


def check_dynamic_change(parameters: list[Parameter], lifecycle_state: str = "unconfigured") -> str | None:
    """Why a change of ``parameters`` is refused in ``lifecycle_state``, or None when it is accepted (for an
    ``add_on_set_parameters_callback``): a :data:`CONFIGURE_TIME` parameter while the node is configured
    (inactive or active), or a :data:`DYNAMIC_CHOICES` value outside its set."""
    for parameter in parameters:
        if parameter.name in CONFIGURE_TIME and lifecycle_state == "configuring":
            return (f"parameter {parameter.name} is read at configure and the node is configuring (the model is "
                    "loading with the values read when configure began): once configure has ended, cleanup, set "
                    "it, then configure again")
        if parameter.name in CONFIGURE_TIME and lifecycle_state not in ("unconfigured", "finalized"):
            return (f"parameter {parameter.name} is read at configure and the node is {lifecycle_state}: "
                    "deactivate and cleanup, set it, then configure again (the running engine keeps the value "
                    "it was configured with)")
    for parameter in parameters:
        allowed = DYNAMIC_CHOICES.get(parameter.name)
        if allowed is not None and parameter.value not in allowed:
            return f"parameter {parameter.name}: {parameter.value!r} is not one of {list(allowed)}"
    return None
