"""The evaluation's conditions and the oxygen node's parameters for each (what the node runs with, and what the
synchronous conditions build the engine from)."""

from __future__ import annotations

import dataclasses

from oxygen_ros.demo_task import DT, INSTRUCTION, JOINTS, SUBTASKS
from oxygen_ros.node.parameters import rtc_parameters

CONDITIONS = ("node-lockstep", "node-realtime", "sync", "random", "expert")
CHUNKING = ("newest", "ensemble", "rtc")
IN_PROCESS = ("sync", "random", "expert")   # the conditions that take an injected delay (--delays)
NODE_NAME = "oxygen_node"
ACT_ENSEMBLE_M = 0.01                       # ACT's temporal-ensembling coefficient (chunk_execution.py)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the evaluation: a condition with one execution scheme and one injected delay.

    Attributes:
        name: the run's name in the report and its output folder: the condition alone when the evaluation
            has one scheme and no delay, else ``condition/scheme/d<d>``.
        chunking: ``newest``, ``ensemble`` or ``rtc`` (:data:`CHUNKING`).
        delay_steps: the injected inference delay d [control steps] (in-process conditions; 0 for the node's).
        execute_steps: actions executed per chunk in lockstep, ``max(--execute-steps, d)``.
        ensemble_m: the robot's temporal-ensembling coefficient (0: off).
        params: node parameters of the scheme, over the condition's (:func:`node_parameters`).
    """

    name: str
    condition: str
    chunking: str
    delay_steps: int
    execute_steps: int
    ensemble_m: float
    params: dict


def plan_runs(args) -> list[Run]:
    """The runs of ``args.conditions`` × ``args.chunking`` × ``args.delays`` (delays: in-process conditions
    only; the expert has no chunking of its own: newest only), in that order."""
    from oxygen_ros.models import get_preset

    horizon = get_preset(args.preset).action_horizon
    plain = len(args.chunking) == 1 and args.delays == [0]
    runs = []
    for condition in args.conditions:
        for chunking in (["newest"] if condition == "expert" else args.chunking):
            for delay in (args.delays if condition in IN_PROCESS else [0]):
                steps = max(args.execute_steps, delay)
                ensemble = (args.ensemble or ACT_ENSEMBLE_M) if chunking == "ensemble" else 0.0
                params = {}
                if chunking == "rtc":
                    if condition in IN_PROCESS:
                        params = rtc_parameters(horizon, steps, delay)
                    else:
                        between = steps if condition == "node-lockstep" else round(1.0 / (args.control_rate * DT))
                        params = rtc_parameters(horizon, between, None)
                name = condition if plain else f"{condition}/{chunking}/d{delay}"
                runs.append(Run(name, condition, chunking, delay, steps, ensemble, params))
    return runs


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
            "speech.max_wait_s": 1e6, "memory.max_wait_s": 1e6,
            # A fixed thread count: the automatic one follows the machine's load, and a float32 sum over another
            # number of threads differs in its last bits, so two lockstep runs of a seed would not be identical.
            "engine.intra_op_threads": 2})
    from oxygen_ros.node.parameters import overrides

    params.update(overrides(args.param))
    if condition == "random":
        params["checkpoint"] = ""
        if checkpoint and not params.get("norm_stats_path"):
            from oxygen_ros.assets import norm_stats_file

            stats = norm_stats_file(checkpoint)
            if stats.is_file():
                params["norm_stats_path"] = str(stats)
    return params
