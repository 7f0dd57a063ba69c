"""Per-robot checkpoint-family conventions on one oxygen_fleet_node, over real DDS (loopback).

Two robots share one model and one engine but not their conventions: ``plain`` is a 7-joint arm with the
π0.5 preset's defaults (openpi's base conventions: no robot adaptation, no delta joints), ``aloha`` a
14-joint ALOHA with ``conventions: openpi/pi05_aloha`` (joint flips, the gripper conversions, the 12 arm
joints predicted relative to the state, the adapted state in the prompt). Each robot's published chunk
must equal what a single-robot engine with that robot's own settings computes for the same frame: the
robot side sends the same pixels, joint positions and instruction in every frame, so a frame is known
from its chunk's observation_seq (which also seeds the noise). A third engine, the ALOHA robot without its
family, shows that the family changes the ALOHA robot's actions: conventions shared across the fleet
would fail the test. Random weights (pi05_tiny, seed 0); no wall-clock assertion.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from node_support import JOINTS, RobotSide, assert_own_chunks, spinning_fleet, tiny_parameters

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

ALOHA_JOINTS = ["left_waist", "left_shoulder", "left_elbow", "left_forearm_roll", "left_wrist_angle",
                "left_wrist_rotate", "left_gripper", "right_waist", "right_shoulder", "right_elbow",
                "right_forearm_roll", "right_wrist_angle", "right_wrist_rotate", "right_gripper"]
HORIZON = 50          # openpi/pi05_aloha's; the plain robot sets it too, so both name one model
CHUNKS = 3            # chunks compared per robot
_IDS = itertools.count(1)
LONG = 600.0          # bounds a hang only: model load and cycles on a loaded 2-core machine


def robot_parameters(robot: str, instruction: str, family: bool = True) -> list:
    """The ``oxygen_node`` parameters of robot ``plain`` or ``aloha`` (``family``: with its conventions).
    Both cameras are required (every chunk is computed from both), the default instruction is the one the
    robot side publishes (so a chunk computed before it arrived is computed from the same prompt), and the
    language tasks are off (the actions are what is compared)."""
    common = {"engine.kv_budget_mb": 16, "action_horizon": HORIZON, "camera_required": [True, True],
              "default_instruction": instruction, "speech.enabled": False, "memory.enabled": False}
    if robot == "plain":
        return tiny_parameters(**common)
    aloha = {"joint_names": ALOHA_JOINTS, "action_dim": 0, "action_dt_s": 0.0,
             "trajectory_joint_names": [j for j in ALOHA_JOINTS if not j.endswith("gripper")]}
    if family:
        aloha["conventions"] = "openpi/pi05_aloha"
    return tiny_parameters(**common, **aloha)


@pytest.fixture
def fleet():
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.node.fleet_node import FleetNode

    base = f"/fleet_conv_{os.getpid()}"
    context = Context()
    rclpy.init(context=context)
    sides = {"plain": RobotSide(context, f"{base}/plain", 1000),
             "aloha": RobotSide(context, f"{base}/aloha", 2000, joint_names=ALOHA_JOINTS)}
    by_namespace = {f"{base}/{name}": name for name in sides}
    node = FleetNode(context=context, namespace=base,
                     parameter_overrides=[Parameter("robots", value=list(by_namespace)),
                                          Parameter("kv_budget_mb", value=48)],
                     robot_parameters=lambda ns: robot_parameters(by_namespace[ns],
                                                                  sides[by_namespace[ns]].instruction_text))
    with spinning_fleet(node, sides, context):
        yield node, sides, context


def _settings(context, parameters):
    from rclpy.parameter import Parameter

    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.node.parameters import read_settings

    overrides = [p for p in parameters if p.name != "autostart"] + [Parameter("autostart", value=False)]
    node = OxygenNode(context=context, parameter_overrides=overrides, namespace=f"/settings_{next(_IDS)}")
    try:
        return read_settings(node)
    finally:
        node.destroy_node()


def _frame(side: RobotSide, n_joints: int, msg):
    """The observation the robot's node built for the chunk ``msg``: the robot side's pixels through the
    node's own image conversions, its joint positions as the node's float32 state, its instruction."""
    from node_support import jpeg_image, raw_image
    from oxygen_ros.engine import Observation
    from oxygen_ros.node.image_conversion import compressed_to_rgb, image_to_rgb

    images = {"base_0_rgb": image_to_rgb(raw_image()), "left_wrist_0_rgb": compressed_to_rgb(jpeg_image())}
    return Observation(images, side.instruction_text, np.full(n_joints, 0.1, np.float32),
                       stamp=msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, seq=msg.observation_seq)


def test_robots_of_one_fleet_keep_their_own_conventions(fleet):
    from oxygen_ros.engine import Engine
    from oxygen_ros.node.model_loading import load_parts, load_processor

    node, sides, context = fleet
    for side in sides.values():
        assert side.chunks_after(0, CHUNKS, LONG), f"robots served: {node.robots}"
    assert len(node.server.robots) == 2          # one engine serves both
    for name, side in sides.items():
        others = [s.sent for n, s in sides.items() if n != name]
        assert_own_chunks(side.records(0, CHUNKS), side.sent, others)
    # the single-robot engines: each robot's own settings, one model of the same preset and seed
    settings = {name: _settings(context, robot_parameters(name, side.instruction_text))
                for name, side in sides.items()}
    settings["aloha without family"] = _settings(
        context, robot_parameters("aloha", sides["aloha"].instruction_text, family=False))
    assert settings["aloha"].conventions.name == "openpi/pi05_aloha"
    assert settings["aloha"].conventions.adaptation is not None
    assert settings["plain"].conventions.adaptation is None
    assert settings["aloha without family"].conventions.adaptation is None
    model = load_parts(settings["plain"]).model
    engines = {name: Engine(model, load_processor(s), s.engine) for name, s in settings.items()}
    joints = {"plain": JOINTS, "aloha": ALOHA_JOINTS}
    try:
        for name, side in sides.items():
            for msg in side.chunks[:CHUNKS]:
                assert (msg.horizon, msg.action_dim, list(msg.action_names)) == \
                    (HORIZON, len(joints[name]), joints[name])
                published = np.asarray(msg.actions, np.float64).reshape(HORIZON, len(joints[name]))
                obs = _frame(side, len(joints[name]), msg)
                expected = engines[name].run_cycle(obs).action.actions
                np.testing.assert_allclose(published, expected, rtol=1e-5, atol=1e-4,
                                           err_msg=f"{name} observation {msg.observation_seq}")
                if name == "aloha":
                    # the family is what makes the difference: without it, other actions
                    other = engines["aloha without family"].run_cycle(obs).action.actions
                    assert np.abs(other - published).max() > 0.05
    finally:
        for engine in engines.values():
            engine.close()
