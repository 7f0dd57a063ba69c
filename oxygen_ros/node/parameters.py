"""ROS parameters of ``oxygen_node``: one declaration per parameter, from which come its descriptor,
its check when set, its value's way into :class:`NodeSettings` and its row in ``docs/parameters.md``.

Two sources, one pattern (a :class:`~oxygen_ros.engine.config.Knob` per setting: description, unit, range
or choices, when a change applies):

* the engine's own configuration: the fields of :class:`~oxygen_ros.engine.config.EngineConfig` are the
  parameters ``engine.<field>`` (``cuda_graphs`` and ``cpu_compile`` sit with the model's parameters), the
  action task's fields are top-level (``control_rate_hz``, ``num_denoise_steps``, ``noise_seed``), and the fields of
  :class:`~oxygen_ros.engine.config.TaskConfig` are ``speech.<field>`` and ``memory.<field>`` (nested
  configurations as ``speech.trigger.every_s``) with ``speech.enabled`` / ``memory.enabled`` (and the node-only
  ``speech.publish_on_change``). The same
  names and units as the engine YAML and the benchmark flags; :func:`settings_from_values` builds the
  :class:`EngineConfig` from these subtrees once, and the engine validates it once.
* the node-only settings (model files, robot, cameras, topics, outputs, time checks): :data:`NODE_PARAMETERS`.

Arrays are typed ROS arrays (``string[]``, ``bool[]``), never comma-separated strings. Per-camera arrays
(``camera_slots``, ``camera_transports``, ``camera_reliability``, ``camera_required``, and
``camera_accept_mono16``, which may also be empty) are parallel to ``camera_topics``.

When a change applies (``additional_constraints`` of each descriptor; docs/parameters.md): *next use*
parameters are accepted in every lifecycle state and read at their next use (the next control cycle,
instruction, output or status period); *next configure* (runtime knobs) and *structural* ones (model,
robot, cameras, topics) are read in ``configure``: ``ros2 param set`` accepts them while the node is
unconfigured (after ``cleanup``, or before the first ``configure``) and refuses them with the reason while
it is configured (inactive or active), since the running engine would not see them. ``autostart`` only
acts at start-up and is read-only.

Settings come from a plain mapping of parameter values (:func:`settings_from_values`): the node passes
its own (:func:`parameter_values`, what :func:`read_settings` does), and a tool passes a dict of the names it
sets, the others taking their declared defaults, without a node.

``python -m oxygen_ros.node.parameters --markdown > docs/parameters.md`` writes the parameter page.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import ParameterUninitializedException
from rclpy.node import Node
from rclpy.parameter import Parameter

from oxygen_ros.engine.config import (NEXT_CONFIGURE, NEXT_USE, START_UP, STRUCTURAL, EngineConfig, Knob,
                                      TaskConfig, leaves)
from oxygen_ros.engine.rate import automatic_floor_hz
from oxygen_ros.memory.store import DEFAULT_COLLECTION
from oxygen_ros.models.config import PRESETS, get_preset
from oxygen_ros.models.conventions import MODEL_CAMERA_SLOTS, NORM_MODES, Conventions, apply_settings, \
    resolve_conventions
from oxygen_ros.node.command_conflicts import CONFLICT_POLICIES
from oxygen_ros.node.output_checks import (EXPIRED_OUTPUT_POLICIES, LIMIT_POLICIES, JointLimits,
                                           limits_from_parameters)

TRANSPORTS = ("raw", "compressed")
RELIABILITIES = ("best_effort", "reliable")
TRAJECTORY_STAMP_POLICIES = ("now", "observation", "takeover")
STOP_COMMANDS = ("hold", "none")
DTYPES = ("float32", "bfloat16")
# Full-size presets: random weights are meaningless there (and a robot must never run them unnoticed).
FULL_PRESETS = ("pi05", "pi0")


@dataclass(frozen=True)
class Declaration:
    """One ROS parameter of ``oxygen_node``.

    Attributes:
        name: the parameter name (dotted for a subtree).
        default: its default value, or a ``Parameter.Type`` for an array that may stay empty.
        knob: description, unit, range or choices, when a change applies.
        section: the heading it is listed under in docs/parameters.md.
        engine_path: where its value goes in the :class:`EngineConfig` mapping (``("kv_budget_mb",)``,
            ``("action", "num_denoise_steps")``, ``("speech", "trigger", "every_s")`` for a language
            task); None for a node-only parameter.
    """

    name: str
    default: Any
    knob: Knob
    section: str
    engine_path: tuple[str, ...] | None = None


def _node(name: str, default: Any, doc: str, section: str, **meta: Any) -> Declaration:
    return Declaration(name, default, Knob(doc, **meta), section)


_MODEL, _ROBOT, _INPUTS, _ACTION, _OUTPUTS = "Model", "Robot", "Inputs", "Action task and node rates", "Outputs"
_MEMORY = "Memory: place and store"
# The node-only parameters (the engine's come from its configuration dataclasses: _engine_declarations).
NODE_PARAMETERS: tuple[Declaration, ...] = (
    _node("autostart", True, "configure and activate on start-up, without a lifecycle manager", _MODEL,
          when=START_UP),
    _node("preset", "pi05_tiny", "model preset", _MODEL, choices=tuple(sorted(PRESETS)), when=STRUCTURAL),
    _node("checkpoint", "", "local checkpoint directory; empty = seeded random weights (tiny presets; a full "
          "preset needs allow_random_weights)", _MODEL, when=STRUCTURAL),
    _node("allow_random_weights", False, "let a full-size preset (pi05, pi0) run with seeded random weights when "
          "checkpoint is empty (meaningless actions: for tests only)", _MODEL, when=STRUCTURAL),
    _node("tokenizer_path", "", "local PaliGemma SentencePiece model (full presets); empty for tiny presets",
          _MODEL, when=STRUCTURAL),
    _node("conventions", "", "checkpoint family whose conventions the checkpoint was trained with (prompt "
          "layout, normalisation, horizon, delta actions, robot adaptation, cameras): openpi/pi05_aloha, "
          "openpi/pi05_droid, openpi/pi05_libero, openpi/pi0_aloha, openpi/pi0_droid, openpi/pi0_libero, "
          "openpi/pi05, openpi/pi0, lerobot/pi05, lerobot/pi0; empty = what the checkpoint carries (a LeRobot "
          "config.json), else the preset's defaults (docs/conventions.md)", _MODEL, when=STRUCTURAL),
    _node("norm_stats_path", "", "openpi norm_stats.json of the robot; empty = the statistics the checkpoint "
          "carries (LeRobot processor files, openpi assets/<asset>/norm_stats.json); none without a checkpoint "
          "= data already normalised", _MODEL, when=STRUCTURAL),
    _node("norm_mode", "", "state/action normalisation: quantile, mean_std or identity; empty = the "
          "conventions' (pi0.5: quantile, pi0: mean_std); must agree with a checkpoint's or family's", _MODEL,
          choices=("",) + NORM_MODES, when=STRUCTURAL),
    _node("action_horizon", 0, "H: actions per chunk; 0 = the conventions' (e.g. openpi/pi05_droid 15); must "
          "agree with a checkpoint's or family's", _MODEL, low=0, high=1000, when=STRUCTURAL),
    _node("device", "cpu", "torch device, e.g. cpu, cuda, cuda:0", _MODEL, when=STRUCTURAL),
    _node("dtype", "float32", "weight dtype", _MODEL, choices=DTYPES, when=STRUCTURAL),
    _node("seed", 0, "seed of the random weights when no checkpoint is given", _MODEL, low=0, high=2**31 - 1,
          when=STRUCTURAL),
    # ---- robot
    _node("joint_names", Parameter.Type.STRING_ARRAY, "joints of the robot state vector, in order, each once, "
          "matched by name in sensor_msgs/JointState (required: pi0 and pi0.5 read the state)", _ROBOT, when=STRUCTURAL),
    _node("action_dim", 0, "D: action dimensions kept from the model's padded 32; 0 = the conventions' robot "
          "action dimension, else the number of joint_names", _ROBOT, low=0, high=32, when=STRUCTURAL),
    _node("action_dt_s", 0.0, "time between consecutive actions of a chunk (the policy's action period); 0 = "
          "the conventions' (e.g. 1/15 s for DROID), else 0.05 s", _ROBOT, unit="s", low=0.0, high=10.0,
          when=STRUCTURAL),
    _node("action_names", Parameter.Type.STRING_ARRAY, "name of each of the D action dimensions, each once; "
          "empty = joint_names when it has D entries, else action_0 ... action_{D-1}", _ROBOT, when=STRUCTURAL),
    # ---- inputs
    _node("camera_topics", ["camera/image_raw"], "camera topics (relative names resolve in the node's "
          "namespace)", _INPUTS, when=STRUCTURAL),
    _node("camera_slots", ["base_0_rgb"], "model camera slot of each camera topic (openpi image keys); the "
          "model sees them in its order", _INPUTS, choices=MODEL_CAMERA_SLOTS, when=STRUCTURAL),
    _node("camera_transports", ["raw"], "per camera: raw (sensor_msgs/Image) or compressed "
          "(sensor_msgs/CompressedImage, JPEG or PNG)", _INPUTS, choices=TRANSPORTS, when=STRUCTURAL),
    _node("camera_reliability", ["best_effort"], "per camera subscription reliability: best_effort "
          "(sensor-data QoS) or reliable", _INPUTS, choices=RELIABILITIES, when=STRUCTURAL),
    _node("camera_required", [True], "per camera: true = a stale or missing frame skips the cycle (no new "
          "action chunk); false = the slot is masked", _INPUTS, when=STRUCTURAL),
    _node("camera_accept_mono16", Parameter.Type.BOOL_ARRAY, "per camera: true = a 16-bit grayscale camera, "
          "accept mono16 / 16UC1 (scaled to 8 bits); empty = false for every camera (a depth image is "
          "dropped as unsupported_encoding)", _INPUTS, when=STRUCTURAL),
    _node("staleness_limit_s", 0.5, "frames and joint states received longer ago than this (node clock) are "
          "not used", _INPUTS, unit="s", low=0.001, high=3600.0, when=NEXT_USE),
    _node("instruction_topic", "instruction", "std_msgs/String instruction topic (reliable, volatile, depth "
          "10; plus a transient-local subscription for a latched instruction until the first one arrives)",
          _INPUTS, when=STRUCTURAL),
    _node("default_instruction", "", "instruction used until one arrives on the instruction topic; "
          "empty = none: no action output (nor language) until one arrives", _INPUTS),
    _node("max_instruction_chars", 1000, "longer instructions are dropped (counted, with a warning)", _INPUTS,
          low=1, high=1_000_000, when=NEXT_USE),
    _node("max_pending_goals", 64, "most ~/ask goals accepted and without a result yet; a goal beyond is "
          "rejected with the reason (every goal request is answered, up to 1000 queued at once)", _INPUTS,
          low=1, high=1000, when=NEXT_USE),
    _node("joint_states_topic", "joint_states", "sensor_msgs/JointState topic", _INPUTS, when=STRUCTURAL),
    _node("joint_states_reliability", "best_effort", "joint-state subscription reliability: best_effort "
          "(sensor-data QoS, for a driver that streams its state) or reliable (for a source that publishes "
          "each state once, e.g. a simulator stepping in lockstep: a lost best-effort sample is never "
          "replaced)", _INPUTS, choices=RELIABILITIES, when=STRUCTURAL),
    _node("camera_clock_offset_warn_s", 1.0, "/diagnostics warns when a camera's header stamps differ from "
          "the node clock at receipt by more than this", _INPUTS, unit="s", low=0.0, high=1e9, when=NEXT_USE),
    # ---- rates
    _node("status_rate_hz", 1.0, "~/status and /diagnostics publications per second", _ACTION, unit="Hz",
          low=0.01, high=100.0),
    # ---- outputs
    _node("frame_id", "", "header.frame_id of ActionChunk and JointTrajectory (the robot's base frame)",
          _OUTPUTS),
    _node("publish_trajectory", False, "also publish trajectory_msgs/JointTrajectory on ~/joint_trajectory",
          _OUTPUTS),
    _node("trajectory_joint_names", Parameter.Type.STRING_ARRAY, "action dimensions (by name, each once) sent in "
          "the JointTrajectory; empty = all", _OUTPUTS),
    _node("trajectory_stamp_policy", "now", "JointTrajectory header.stamp: now (stamp 0: the controller starts "
          "on receipt), observation (the observation's stamp: point i is due at observation + (i+1)*dt, so "
          "the inference latency is accounted for) or takeover (as observation, but a chunk guided by real-time "
          "chunking starts at its take-over action d, stamped observation + d*dt: the controller keeps the "
          "previous trajectory until then)", _OUTPUTS, choices=TRAJECTORY_STAMP_POLICIES),
    _node("joint_limits.lower", Parameter.Type.DOUBLE_ARRAY, "lower position limit of each action dimension "
          "(parallel to action_names; -.inf = none); empty = no limits from parameters", _OUTPUTS,
          unit="rad or m"),
    _node("joint_limits.upper", Parameter.Type.DOUBLE_ARRAY, "upper position limit of each action dimension "
          "(parallel to action_names; .inf = none)", _OUTPUTS, unit="rad or m"),
    _node("joint_limits.from_robot_description", False, "read the position limits of the action dimensions "
          "named like URDF joints from std_msgs/String robot_description (transient local); no chunk is "
          "published until it arrives", _OUTPUTS),
    _node("joint_limits.policy", "clamp", "an action chunk with a value outside the joint limits: clamp (clip "
          "into them) or reject (withhold the chunk); counted either way", _OUTPUTS, choices=LIMIT_POLICIES,
          when=NEXT_USE),
    _node("expired_output_policy", "fallback", "an output whose last point is already past at publication: "
          "fallback (JointTrajectory sent with stamp 0, ActionChunk sent as it is) or withhold (not sent); "
          "counted and warned either way", _OUTPUTS, choices=EXPIRED_OUTPUT_POLICIES, when=NEXT_USE),
    _node("expired_output_margin_s", 0.0, "an output counts as expired (expired_output_policy) when less than "
          "this much of it is left at publication: the time it takes to reach and start on the controller",
          _OUTPUTS, unit="s", low=0.0, high=1e9, when=NEXT_USE),
    _node("command_conflict_policy", "refuse", "another publisher of ~/action_chunk or ~/joint_trajectory on the "
          "graph (a second oxygen_node with the same name and namespace, checked at activate and every 1 s): "
          "refuse (activation fails; while active no action output while it is there) or warn (publish anyway, "
          "logged and on /diagnostics)", _OUTPUTS, choices=CONFLICT_POLICIES, when=NEXT_USE),
    _node("on_stop_command", "hold", "the controller's last command when the node stops acting (deactivate, "
          "shutdown, SIGINT / SIGTERM, a failed transition while active): hold (one JointTrajectory on "
          "~/joint_trajectory holding the latest JointState positions of trajectory_joint_names; needs "
          "publish_trajectory) or none (nothing)", _OUTPUTS, choices=STOP_COMMANDS, when=NEXT_USE),
    # ---- memory: where each entry was taken, and the store (docs/memory.md)
    _node("memory.robot", "", "the robot named in every MemoryEntry (robot) and stored entry; empty = the node's "
          "namespace without its leading slash (empty in the root namespace)", _MEMORY),
    _node("memory.pose.topic", "", "geometry_msgs/PoseStamped topic with the robot frame's pose in a fixed frame "
          "(e.g. a localisation's base_link in map); each MemoryEntry carries the sample nearest its observation's "
          "stamp; empty = entries carry no pose (has_pose false)", _MEMORY, when=STRUCTURAL),
    _node("memory.pose.max_age_s", 0.5, "a pose sample whose stamp is further than this from the observation's stamp "
          "is not used: the entry is then marked without pose (has_pose false), never given a guessed one", _MEMORY,
          unit="s", low=0.0, high=3600.0),
    _node("memory.pose.fixed_frame", "", "the frame the poses must be in: a sample with another header.frame_id is "
          "dropped (counted, warned); empty = any, the entry carries the sample's frame", _MEMORY),
    _node("memory.store.path", "", "the store every published MemoryEntry is also written to (created when "
          "missing, reopened with its entries), and ~/query_memory answers from: a SQLite file (PATH or sqlite:PATH), "
          "milvus:PATH.db (milvus-lite, embedded) or http(s)://HOST:PORT (a Milvus server; token from the "
          "environment variable OXYGEN_MILVUS_TOKEN); empty = no store, no service", _MEMORY, when=STRUCTURAL),
    _node("memory.store.collection", DEFAULT_COLLECTION, "the collection of a Milvus store (letters, digits, _); "
          "robots sharing a server and a collection share their memory; not used by a SQLite store", _MEMORY,
          when=STRUCTURAL),
    _node("memory.store.queue_size", 256, "memory entries waiting for the store's writer thread; one beyond is "
          "dropped (counted, warned)", _MEMORY, low=1, high=1_000_000),
    _node("memory.store.synchronous", "full", "full: an entry is on disk when its write returns (survives a power "
          "loss); normal: fewer fsyncs, survives a process crash; a Milvus store takes normal only", _MEMORY,
          choices=("full", "normal")),
    _node("memory.store.max_age_s", 0.0, "retention: entries whose observation is older than this are removed "
          "(node clock); 0 = kept", _MEMORY, unit="s", low=0.0, high=1e12),
    _node("memory.store.max_count", 0, "retention: beyond this many entries the oldest are removed; 0 = no limit",
          _MEMORY, low=0, high=2**31 - 1),
    _node("memory.store.duplicate_radius_m", 0.0, "retention: of two entries of one robot within this distance "
          "with alike captions (memory.store.duplicate_text_similarity) the older is removed; entries without a "
          "pose are kept; 0 = off", _MEMORY, unit="m", low=0.0, high=1e6),
    _node("memory.store.duplicate_text_similarity", 1.0, "word-set Jaccard similarity at which two captions are "
          "alike (1 = the same words)", _MEMORY, low=0.01, high=1.0),
    _node("memory.store.prune_every_s", 60.0, "how often the writer thread applies the retention rules (and once "
          "at configure)", _MEMORY, unit="s", low=1.0, high=1e9),
)

# The node's language tasks: the engine's TaskConfig fields as ``<task>.<field>`` parameters, with these
# defaults where the node's differ from the engine's (the task's name and kind are fixed).
LANGUAGE_TASKS: dict[str, dict[str, Any]] = {
    "speech": {"kind": "speech", "outputs": "~/speech, ~/speech_text", "max_new_tokens": 16, "priority": 1,
               "cancel_on_new_instruction": True, "trigger": {"on_new_instruction": True}},
    "memory": {"kind": "memory", "outputs": "~/memory", "max_new_tokens": 8, "trigger": {"every_s": 2.0}},
}
# Engine fields placed elsewhere than ``engine.<field>``: the action task's at the top level (the node's
# control rate), cuda_graphs and cpu_compile with the model's settings.
_PLACED = {("cuda_graphs",): "cuda_graphs", ("cpu_compile",): "cpu_compile"}


# The time between a chunk's actions when neither the parameter action_dt_s nor the family gives one [s].
DEFAULT_ACTION_DT_S = 0.05


def _engine_declarations() -> Iterator[Declaration]:
    """The parameters that are fields of the engine's configuration (see the module docstring)."""
    for leaf in leaves(EngineConfig):
        if leaf.path[0] == "action":
            yield Declaration(leaf.path[-1], leaf.default, leaf.knob, _ACTION, leaf.path)
        elif leaf.path[0] == "rtc":
            yield Declaration("rtc." + ".".join(leaf.path[1:]), leaf.default, leaf.knob, "Real-time chunking",
                              leaf.path)
        elif leaf.path in _PLACED:
            yield Declaration(_PLACED[leaf.path], leaf.default, leaf.knob, _MODEL, leaf.path)
        else:
            yield Declaration("engine." + ".".join(leaf.path), leaf.default, leaf.knob, "Engine", leaf.path)
    for task, defaults in LANGUAGE_TASKS.items():
        section = f"Language task {task}"
        yield Declaration(f"{task}.enabled", True, Knob(f"run the {task} task ({defaults['outputs']})"), section)
        if defaults["kind"] == "speech":
            yield Declaration(f"{task}.publish_on_change", False, Knob(
                "publish a completed utterance on ~/speech_text only when its text differs from the previous "
                "one published there since activation (a subtask said once, when it changes: pi0.5's subtask "
                "loop); ~/speech keeps every partial and final", when=NEXT_USE), section)
        for leaf in leaves(TaskConfig):
            default: Any = defaults
            for key in leaf.path:
                default = default.get(key) if isinstance(default, dict) else None
            if default is None:
                default = leaf.default
            if default is None:     # no engine default: the ROS value meaning "off" / "the model's prompt"
                default = leaf.knob.off if leaf.knob.off is not None else ""
            yield Declaration(f"{task}." + ".".join(leaf.path), default, leaf.knob, section, (task,) + leaf.path)


# Every parameter of oxygen_node, by name.
DECLARATIONS: dict[str, Declaration] = {d.name: d for d in (*NODE_PARAMETERS, *_engine_declarations())}
# Read-only: only acts at start-up.
START_ONLY = frozenset(name for name, d in DECLARATIONS.items() if d.knob.when == START_UP)
# Read at configure: settable while unconfigured, refused while configured.
CONFIGURE_TIME = frozenset(name for name, d in DECLARATIONS.items() if d.knob.when in (NEXT_CONFIGURE, STRUCTURAL))
# Read at their next use: settable in every state.
DYNAMIC = frozenset(name for name, d in DECLARATIONS.items() if d.knob.when == NEXT_USE)
_WHEN_TEXT = {START_UP: "read-only: acts at start-up",
              NEXT_CONFIGURE: "applied at the next configure; settable only while unconfigured",
              STRUCTURAL: "structural: applied at the next configure; settable only while unconfigured",
              NEXT_USE: "dynamic: takes effect at its next use"}


def _ros_range(declaration: Declaration) -> dict[str, list]:
    """The descriptor's range of a numeric parameter with both bounds (its ``off`` value included)."""
    knob, default = declaration.knob, declaration.default
    if knob.low is None or knob.high is None or isinstance(default, bool) or \
            not isinstance(default, (int, float)):
        return {}
    low = knob.low if knob.off is None else min(knob.low, knob.off)
    if isinstance(default, int):
        start = int(low) + 1 if knob.low_open and knob.off is None else int(low)
        return {"integer_range": [IntegerRange(from_value=start, to_value=int(knob.high), step=1)]}
    return {"floating_point_range": [FloatingPointRange(from_value=float(low), to_value=float(knob.high),
                                                        step=0.0)]}


def descriptor(declaration: Declaration) -> ParameterDescriptor:
    """The ROS descriptor of ``declaration``: description (with its unit), range, read-only, and in
    ``additional_constraints`` when a change applies and the allowed values."""
    knob = declaration.knob
    constraints = _WHEN_TEXT[knob.when]
    if knob.choices:
        constraints += "; one of " + ", ".join(choice or '""' for choice in knob.choices)
    description = knob.doc + (f" [{knob.unit}]" if knob.unit else "")
    return ParameterDescriptor(description=description, read_only=knob.when == START_UP,
                               additional_constraints=constraints, **_ros_range(declaration))


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
class MemorySettings:
    """The memory entries' place and store (parameters ``memory.robot``, ``memory.pose.*``, ``memory.store.*``;
    docs/memory.md). ``store_path`` empty = no store; ``pose_topic`` empty = no pose."""

    robot: str = ""
    pose_topic: str = ""
    pose_max_age_s: float = 0.5
    fixed_frame: str = ""
    store_path: str = ""
    collection: str = DEFAULT_COLLECTION
    queue_size: int = 256
    synchronous: str = "full"
    max_age_s: float = 0.0
    max_count: int = 0
    duplicate_radius_m: float = 0.0
    duplicate_text_similarity: float = 1.0
    prune_every_s: float = 60.0


@dataclass(frozen=True)
class NodeSettings:
    """Validated values of the configure-time parameters (:data:`CONFIGURE_TIME`), read once per
    ``configure``: the node-only settings and the engine's own configuration (``engine``).

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
    seed: int
    joint_names: tuple[str, ...]
    action_dim: int
    action_dt_s: float
    action_names: tuple[str, ...]
    cameras: tuple[CameraSettings, ...]
    instruction_topic: str
    default_instruction: str
    joint_states_topic: str
    joint_states_reliability: str
    status_rate_hz: float
    frame_id: str
    publish_trajectory: bool
    trajectory_joint_names: tuple[str, ...]
    trajectory_stamp_policy: str
    joint_limits: JointLimits | None
    joint_limits_from_robot_description: bool
    engine: EngineConfig
    memory: MemorySettings = MemorySettings()

    @property
    def model_camera_slots(self) -> tuple[str, ...]:
        """The configured slots in the model's order (:data:`MODEL_CAMERA_SLOTS`), whatever the order of
        ``camera_topics``: images reach the model by slot name."""
        return tuple(sorted((c.slot for c in self.cameras), key=MODEL_CAMERA_SLOTS.index))

    @property
    def control_rate_hz(self) -> float:
        """Control cycles per second [Hz] (the action task's ``control_rate_hz``)."""
        return self.engine.action.control_rate_hz

    @property
    def control_period_s(self) -> float:
        """Control period [s]."""
        return self.engine.action.control_period_s

    @property
    def model_id(self) -> str:
        """Identifies the weights: ``preset`` or ``preset@checkpoint``, plus device and dtype."""
        weights = f"{self.preset}@{self.checkpoint}" if self.checkpoint else f"{self.preset}(seed {self.seed})"
        return f"{weights} {self.dtype} {self.device}"


def declare_parameters(node: Node) -> None:
    """Declare every parameter of ``oxygen_node`` on ``node`` with its :func:`descriptor`; a parameter
    given (params file, ``-p``) that is not one of them is logged as a warning (a misspelt or renamed
    name would otherwise be ignored without a word)."""
    for declaration in DECLARATIONS.values():
        node.declare_parameter(declaration.name, declaration.default, descriptor(declaration))
    given = getattr(node, "_parameter_overrides", {})     # rclpy keeps the overrides there
    unknown = sorted(name for name in given if not node.has_parameter(name))
    if unknown:
        node.get_logger().warning(f"ignored parameters that oxygen_node does not have: {unknown} "
                                  "(docs/parameters.md lists its parameters)")


def _value(node: Node, name: str):
    try:
        return node.get_parameter(name).value
    except ParameterUninitializedException:   # an array declared by type only, and not set: empty
        return []


def parameter_values(node: Node) -> dict[str, Any]:
    """The values of ``node``'s ``oxygen_node`` parameters (declared by :func:`declare_parameters`) by name;
    an array declared by type only and not set is empty."""
    return {name: _value(node, name) for name in DECLARATIONS}


def default_value(name: str) -> Any:
    """The declared default of parameter ``name`` (an empty list for an array declared by type only).
    Raises KeyError for a name that is not a parameter of ``oxygen_node``."""
    default = DECLARATIONS[name].default
    return [] if isinstance(default, Parameter.Type) else default


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"parameter {name}: {value!r} is not one of {list(allowed)}")
    return value


def _check_unique(name: str, names: tuple[str, ...]) -> None:
    """Raises ValueError naming parameter ``name`` and its repeated entries when ``names`` has one twice (a
    joint named twice in a state vector or a trajectory is ambiguous: a controller rejects or misapplies it)."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"parameter {name}: names must be unique, {repeated} appear more than once in "
                         f"{list(names)}")


def engine_mapping(values: dict[str, Any], conventions: Conventions, camera_slots: tuple[str, ...]) -> dict:
    """The :meth:`EngineConfig.from_dict` mapping of the parameter ``values`` (by name): every
    declaration with an ``engine_path`` at its path, the enabled language tasks with their fixed name
    and kind, the cameras' slots, and the family's prompts (the action prompt, and the language prompt
    for a task whose ``prompt_template`` is empty)."""
    data: dict[str, Any] = {"camera_slots": list(camera_slots),
                            "action": {"prompt_template": conventions.action_prompt.template},
                            "rtc": {"action_dt_s": conventions.action_dt_s or DEFAULT_ACTION_DT_S}}
    tasks: dict[str, dict] = {task: {"name": task, "kind": LANGUAGE_TASKS[task]["kind"]}
                              for task in LANGUAGE_TASKS if values[f"{task}.enabled"]}
    for declaration in DECLARATIONS.values():
        path = declaration.engine_path
        if path is None:
            continue
        if path[0] in LANGUAGE_TASKS:
            if path[0] not in tasks:
                continue
            node, path = tasks[path[0]], path[1:]
        else:
            node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = values[declaration.name]
    for task in tasks.values():
        task["prompt_template"] = task["prompt_template"] or conventions.language_prompt.template
    data["language_tasks"] = list(tasks.values())
    data["rtc"].update(checkpoint_rtc_defaults(values, conventions))
    return data


def rtc_parameters(horizon: int, steps_between_chunks: int, delay_steps: int | None) -> dict:
    """The node parameters of real-time chunking for chunks of ``horizon`` actions, one every
    ``steps_between_chunks`` control steps: guidance toward the whole overlap with the chunk in flight
    (``rtc.execution_horizon`` = H − steps between chunks, where the paper's prefix weights reach 0), the
    delay fixed at ``delay_steps`` (an injected delay) or measured (None: ``auto``). Tools (the demo, the
    evaluation) set RTC with these."""
    params = {"rtc.enabled": True, "rtc.execution_horizon": max(0, horizon - steps_between_chunks)}
    if delay_steps is None:
        params["rtc.delay_mode"] = "auto"
    else:
        params.update({"rtc.delay_mode": "fixed", "rtc.fixed_delay_steps": delay_steps})
    return params


def checkpoint_rtc_defaults(values: Mapping[str, Any], conventions: Conventions) -> dict[str, Any]:
    """The real-time chunking settings the checkpoint gives for the ``rtc.*`` parameters left at their declared
    defaults (engine keys → values): its ``rtc_config``'s execution horizon, schedule and β
    (:class:`~oxygen_ros.models.conventions.CheckpointRTC`); without one, an ``n_action_steps`` below the horizon H
    gives the execution horizon H − n_action_steps (the overlap of consecutive chunks when each runs
    n_action_steps actions). ``rtc.enabled`` is never taken from a checkpoint: guidance needs the robot's delay and
    controller set up for it (``trajectory_stamp_policy: takeover``), the integrator's decision."""
    given: dict[str, Any] = {}
    if conventions.rtc is not None:
        given = {"execution_horizon": conventions.rtc.execution_horizon, "schedule": conventions.rtc.schedule,
                 "max_guidance_weight": conventions.rtc.max_guidance_weight}
    elif conventions.action_steps is not None and conventions.action_steps < conventions.action_horizon:
        given = {"execution_horizon": conventions.action_horizon - conventions.action_steps}
    return {key: value for key, value in given.items() if values[f"rtc.{key}"] == default_value(f"rtc.{key}")}


def read_settings(node: Node) -> NodeSettings:
    """Read and validate the parameters of ``node`` (declared by :func:`declare_parameters`):
    :func:`settings_from_values` of :func:`parameter_values`, logging the conventions on the node's logger.

    Raises:
        ValueError: an invalid or inconsistent value; the message names the parameter.
    """
    return settings_from_values(parameter_values(node), node.get_logger().info)


def settings_from_values(values: Mapping[str, Any], log: Callable[[str], None] | None = None) -> NodeSettings:
    """Validate parameter ``values`` (a plain mapping: parameter name → value, as ``ros2 param`` or a params
    file gives them) into :class:`NodeSettings`; a parameter not in ``values`` takes its declared default
    (:func:`default_value`). ``log`` (if given) gets one line naming the conventions in use.

    Raises:
        ValueError: a name that is not a parameter of ``oxygen_node`` (``use_sim_time``, every ROS node's own,
            is allowed and ignored), or an invalid or inconsistent value; the message names the parameter.
    """
    unknown = sorted(set(values) - set(DECLARATIONS) - {"use_sim_time"})
    if unknown:
        raise ValueError(f"unknown node parameters {unknown} (docs/parameters.md lists them)")
    v = {name: values[name] if name in values else default_value(name) for name in DECLARATIONS}
    # Choices first (start-up overrides bypass the set-time check): an unknown preset is named as such, not
    # hidden behind the first missing value a check below would report.
    for name, declaration in DECLARATIONS.items():
        if declaration.engine_path is None and declaration.knob.choices and isinstance(v[name], str):
            declaration.knob.check(f"parameter {name}", v[name], "str")
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
    _check_unique("joint_names", joint_names)
    conventions = _conventions(v, joint_names, cameras)
    if log is not None:
        log(f"conventions {conventions.describe()}")
    action_dim = conventions.action_dim or len(joint_names)
    action_names = tuple(v["action_names"])
    if not action_names:
        action_names = joint_names if len(joint_names) == action_dim else \
            tuple(f"action_{i}" for i in range(action_dim))
    if len(action_names) != action_dim:
        raise ValueError(f"parameter action_names: {len(action_names)} names for action_dim {action_dim}")
    _check_unique("action_names", action_names)
    trajectory_names = tuple(v["trajectory_joint_names"]) or action_names
    _check_unique("trajectory_joint_names", trajectory_names)
    unknown = set(trajectory_names) - set(action_names)
    if unknown:
        raise ValueError(f"parameter trajectory_joint_names: {sorted(unknown)} are not in action_names")
    joint_limits = limits_from_parameters(list(v["joint_limits.lower"]), list(v["joint_limits.upper"]),
                                          action_names)
    if joint_limits is not None and v["joint_limits.from_robot_description"]:
        raise ValueError("parameters joint_limits.lower / joint_limits.upper and "
                         "joint_limits.from_robot_description: set one source of joint limits, not both")
    for name, declaration in DECLARATIONS.items():
        if declaration.knob.choices and isinstance(v[name], str):
            _choice(name, v[name], declaration.knob.choices)
    model_slots = tuple(sorted((c.slot for c in cameras), key=MODEL_CAMERA_SLOTS.index))
    try:
        engine = EngineConfig.from_dict(engine_mapping(v, conventions, model_slots))
    except ValueError as err:
        raise ValueError(node_parameter_names(str(err))) from None
    action_dt_s = conventions.action_dt_s or DEFAULT_ACTION_DT_S
    engine = _resolve_rate_floor(engine, conventions.action_horizon * action_dt_s, conventions.action_horizon,
                                 action_dt_s)
    return NodeSettings(
        preset=v["preset"], checkpoint=v["checkpoint"], allow_random_weights=bool(v["allow_random_weights"]),
        tokenizer_path=v["tokenizer_path"], norm_stats_path=v["norm_stats_path"], conventions=conventions,
        device=v["device"], dtype=v["dtype"], seed=int(v["seed"]),
        joint_names=joint_names, action_dim=action_dim,
        action_dt_s=action_dt_s, action_names=action_names, cameras=cameras,
        instruction_topic=v["instruction_topic"],
        default_instruction=v["default_instruction"] or conventions.default_prompt or "",
        joint_states_topic=v["joint_states_topic"], joint_states_reliability=v["joint_states_reliability"],
        status_rate_hz=float(v["status_rate_hz"]),
        frame_id=v["frame_id"], publish_trajectory=bool(v["publish_trajectory"]),
        trajectory_joint_names=trajectory_names, trajectory_stamp_policy=v["trajectory_stamp_policy"],
        joint_limits=joint_limits,
        joint_limits_from_robot_description=bool(v["joint_limits.from_robot_description"]),
        engine=engine, memory=MemorySettings(
            robot=v["memory.robot"], pose_topic=v["memory.pose.topic"],
            pose_max_age_s=float(v["memory.pose.max_age_s"]),
            fixed_frame=v["memory.pose.fixed_frame"], store_path=v["memory.store.path"],
            collection=v["memory.store.collection"],
            queue_size=int(v["memory.store.queue_size"]), synchronous=v["memory.store.synchronous"],
            max_age_s=float(v["memory.store.max_age_s"]), max_count=int(v["memory.store.max_count"]),
            duplicate_radius_m=float(v["memory.store.duplicate_radius_m"]),
            duplicate_text_similarity=float(v["memory.store.duplicate_text_similarity"]),
            prune_every_s=float(v["memory.store.prune_every_s"])))


def node_parameter_names(message: str) -> str:
    """``message`` (an :class:`EngineConfig` error) with the engine's names of the action task's fields
    (``action.control_rate_hz``) replaced by the node's parameter names (``control_rate_hz``): the node
    declares those fields at top level; the engine's other names (``engine.*``, ``rtc.*``, ``speech.*``)
    already are the parameters'."""
    renames = {".".join(d.engine_path): name for name, d in DECLARATIONS.items()
               if d.engine_path and ".".join(d.engine_path) != name and d.engine_path[0] == "action"}
    if not renames:
        return message
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(renames, key=len, reverse=True)))
                         + r")(?!\w)")
    return pattern.sub(lambda match: renames[match.group(1)], message)


def _resolve_rate_floor(engine: EngineConfig, span_s: float, horizon: int, action_dt_s: float) -> EngineConfig:
    """In adaptive ``control_rate_mode``: ``control_rate_min_hz`` 0 replaced by its automatic value
    (:func:`oxygen_ros.engine.rate.automatic_floor_hz`), a given floor checked against a chunk's span ``span_s``.

    Raises:
        ValueError: a given floor whose period is not shorter than the span, naming the ways out.
    """
    action = engine.action
    if action.control_rate_mode != "adaptive":
        return engine
    if action.control_rate_min_hz == 0:
        floor = automatic_floor_hz(action.control_rate_hz, action.control_rate_step_hz, span_s)
        return replace(engine, action=replace(action, control_rate_min_hz=floor))
    if 1.0 / action.control_rate_min_hz >= span_s:
        raise ValueError(f"parameter control_rate_min_hz: {action.control_rate_min_hz:g} Hz (a "
                         f"{1.0 / action.control_rate_min_hz:g} s period) would let the robot run out of actions: a "
                         f"chunk spans {span_s:g} s (H {horizon} x action_dt_s {action_dt_s:g} s); the slowest "
                         f"adaptive rate must be above {1.0 / span_s:g} Hz (0 chooses it; or control_rate_mode fixed)")
    return engine


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


def overrides(items: list[str]) -> dict[str, Any]:
    """The parameters of a tool's ``--param name:=value`` options (:func:`parse_override` each), later ones
    winning; raises SystemExit with the first bad item's message (a usage error, not a traceback)."""
    out = {}
    for item in items:
        try:
            name, value = parse_override(item)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        out[name] = value
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``name:=value`` (a tool's ``--param``, YAML as in ``ros2 run ... -p``) → ``(name, value)`` checked against
    the parameter's declaration, so that a mistake is one line before any node starts rather than a traceback from
    a node's constructor: an integer for a float parameter (or float array) becomes a float.

    Raises:
        ValueError: not of the form ``name:=value``, no such parameter, malformed YAML, a value of another type,
            or outside the declared range (the descriptor's, which rclpy would enforce).
    """
    import yaml

    name, sep, text = item.partition(":=")
    if not sep:
        raise ValueError(f"--param {item!r} is not of the form name:=value")
    declaration = DECLARATIONS.get(name)
    if declaration is None:
        raise ValueError(f"--param {name}: the oxygen node has no such parameter (docs/parameters.md lists them)")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"--param {name}:={text!r}: not a YAML value ({getattr(err, 'problem', err)})") from None
    default = declaration.default

    def fits(v, d) -> bool:
        if isinstance(d, bool) or isinstance(v, bool):
            return isinstance(v, bool) and isinstance(d, bool)
        if isinstance(d, float):
            return isinstance(v, (int, float))
        return isinstance(v, type(d))

    if isinstance(default, Parameter.Type):        # an array parameter whose default is empty
        ok = isinstance(value, list)
        if ok and default == Parameter.Type.DOUBLE_ARRAY:
            ok = all(fits(v, 0.0) for v in value)
            value = [float(v) for v in value] if ok else value
    elif isinstance(default, list):
        ok = isinstance(value, list) and all(fits(v, default[0]) for v in value) if default else isinstance(value, list)
        if ok and default and isinstance(default[0], float):
            value = [float(v) for v in value]
    else:
        ok = not isinstance(default, (bool, int, float, str)) or fits(value, default)
        if ok and isinstance(default, float):
            value = float(value)
    if not ok:
        raise ValueError(f"--param {name}:={text}: expects a value like {default!r}, got {value!r}")
    ranges = descriptor(declaration)
    for bound in (*ranges.floating_point_range, *ranges.integer_range):
        if not bound.from_value <= value <= bound.to_value:
            raise ValueError(f"--param {name}:={text}: outside its range {bound.from_value:g} .. {bound.to_value:g}")
    if type(default) in (int, float):        # a number (not a bool, nor a Parameter.Type, an IntEnum)
        # The knob's own check (Knob.check, as at configure): also an open lower bound such as a rate > 0,
        # which the ROS range above cannot express.
        try:
            declaration.knob.check(name, value, type(default).__name__)
        except ValueError as err:
            raise ValueError(f"--param {name}:={text}: {err}") from None
    return name, value


def check_dynamic_change(parameters: list[Parameter], lifecycle_state: str = "unconfigured") -> str | None:
    """Why a change of ``parameters`` is refused in ``lifecycle_state``, or None when it is accepted (for an
    ``add_on_set_parameters_callback``): a :data:`CONFIGURE_TIME` parameter while the node is configured
    (inactive or active), or a string outside its declaration's choices."""
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
        declaration = DECLARATIONS.get(parameter.name)
        allowed = declaration.knob.choices if declaration is not None else ()
        if allowed and isinstance(parameter.value, str) and parameter.value not in allowed:
            return f"parameter {parameter.name}: {parameter.value!r} is not one of {list(allowed)}"
    return None


def _cell(value: Any) -> str:
    if isinstance(value, Parameter.Type):
        return "`[]`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in value) + "]`"
    return f"`{value!r}`"


def _number(value: float) -> str:
    """A bound as written: whole numbers without a fraction, 2147483647 not 2.1e9."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def _type_name(value: Any) -> str:
    if isinstance(value, Parameter.Type):
        return {Parameter.Type.STRING_ARRAY: "string[]", Parameter.Type.BOOL_ARRAY: "bool[]",
                Parameter.Type.DOUBLE_ARRAY: "double[]", Parameter.Type.INTEGER_ARRAY: "integer[]"}[value]
    if isinstance(value, list):
        return {bool: "bool[]", str: "string[]", float: "double[]", int: "integer[]"}[type(value[0])] + ""
    return {bool: "bool", str: "string", float: "double", int: "integer"}[type(value)]


def _range_text(knob: Knob) -> str:
    if knob.choices:
        return ", ".join(f"`{c}`" if c else '`""`' for c in knob.choices)
    if knob.low is None and knob.high is None:
        return ""
    low = "" if knob.low is None else f"{'(' if knob.low_open else '['}{_number(knob.low)}"
    high = "" if knob.high is None else f"{_number(knob.high)}]"
    text = f"{low}, {high}"
    if knob.off is not None:
        text += f" or {_number(knob.off)} (off)"
    return text


def markdown() -> str:
    """The parameter page (docs/parameters.md), generated from :data:`DECLARATIONS`."""
    lines = [
        "# oxygen_node parameters",
        "",
        "<!-- Generated by `python -m oxygen_ros.node.parameters --markdown > docs/parameters.md` from the",
        "     declarations in oxygen_ros/node/parameters.py and oxygen_ros/engine/config.py; do not edit. -->",
        "",
        "One name per setting: the engine's configuration fields (`oxygen_ros/engine/config.py`) are the",
        "parameters `engine.<field>`; the action task's fields are top-level (`control_rate_hz`,",
        "`num_denoise_steps`, `noise_seed`) and `cuda_graphs` and `cpu_compile` sit with the model; a language",
        "task's fields are `speech.<field>` / `memory.<field>` (a nested field as `speech.trigger.every_s`). The engine YAML",
        "(`EngineConfig.from_yaml`) and the benchmark flags (`--kv-budget-mb`, `--action-horizon`, ...) use",
        "the same names and units.",
        "",
        "**Applies** says when a change takes effect:",
        "",
        "- *next use*: accepted in every lifecycle state, read at its next use (the next control cycle,",
        "  instruction, output or status period);",
        "- *next configure*: a runtime knob, accepted while the node is unconfigured (before the first",
        "  `configure`, or after `cleanup`) and applied by the next `configure`; refused with the reason",
        "  while the node is inactive or active;",
        "- *structural*: model, robot, cameras and topics; accepted and refused like *next configure*;",
        "- *start-up*: read-only, acts only when the node starts.",
        "",
        "Ranges are inclusive (`(` excludes the bound: the engine checks it at configure); the descriptor",
        "(`ros2 param describe /oxygen_node <name>`) carries the same description, range and rule.",
    ]
    sections: dict[str, list[Declaration]] = {}
    for declaration in DECLARATIONS.values():
        sections.setdefault(declaration.section, []).append(declaration)
    for section, declarations in sections.items():
        lines += ["", f"## {section}", "", "| name | type | default | range | unit | applies | description |",
                  "|---|---|---|---|---|---|---|"]
        for d in declarations:
            doc = d.knob.doc.replace("|", "\\|").replace("<", "\\<")
            lines.append(f"| `{d.name}` | {_type_name(d.default)} | {_cell(d.default)} | {_range_text(d.knob)} | "
                         f"{d.knob.unit} | {d.knob.when} | {doc} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.node.parameters",
                                     description="oxygen_node's parameters")
    parser.add_argument("--markdown", action="store_true", help="print docs/parameters.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        for name, declaration in DECLARATIONS.items():
            print(f"{name} = {declaration.default!r}  ({declaration.knob.when})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
