"""Nothing non-finite or out of bounds leaves the node, over real DDS, with outputs made non-finite by real
means: a tiny π0 checkpoint whose weights overflow for some inputs (not for the warm-up's), and one whose
warm-up output is already NaN.

Checkpoint ``overflowing``: ``state_proj`` maps joint_1 with a weight of 3e38 (fp32 max 3.4e38), so a joint
state of 0 or 0.1 rad gives finite actions and one of 10 rad an infinite state token, hence NaN actions;
and the embedding row of one token that only the memory prompt uses is NaN, so every memory embedding
(the pooled prefix) is NaN while the action prefix stays finite.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

MEMORY_WORD = "zq"     # the memory prompt's marker: none of its tokens is in the action prompt
INSTRUCTION = "pick up the red cube"
JOINT_1_LIMITS = (-0.05, 0.05)


def _pi0_tiny_checkpoint(directory, edit) -> str:
    import torch

    from oxygen_ros.models import load_model
    from oxygen_ros.models.checkpoint import save_checkpoint

    model = load_model("pi0_tiny", seed=0)
    with torch.no_grad():
        edit(model)
    save_checkpoint(model, directory)
    return str(directory)


def _memory_only_token(model_config) -> int:
    from oxygen_ros.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_config, None)
    action = set(tokenizer.encode(f"{INSTRUCTION}\n")) | set(tokenizer.encode(""))
    memory_only = [t for t in tokenizer.encode(f"{INSTRUCTION} {MEMORY_WORD}") if t not in action]
    assert memory_only, "the marker shares every token with the action prompt"
    return memory_only[-1]


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    def edit(model):
        model.state_proj.weight[:, 0] = 3e38
        model.token_embedding.weight[_memory_only_token(model.config)] = math.nan

    return _pi0_tiny_checkpoint(tmp_path_factory.mktemp("overflowing"), edit)


@pytest.fixture(scope="module")
def guarded(overflowing):
    from std_msgs.msg import String

    lower = [JOINT_1_LIMITS[0]] + [-math.inf] * 6
    upper = [JOINT_1_LIMITS[1]] + [math.inf] * 6
    h = Harness(tiny_parameters(**{
        # the checkpoint carries no statistics: identity normalisation (a family that normalises
        # refuses a checkpoint without them)
        "preset": "pi0_tiny", "checkpoint": overflowing, "norm_mode": "identity", "speech.enabled": False,
        "memory.trigger.every_s": 1.0, "memory.prompt_template": "{instruction} " + MEMORY_WORD,
        # k decode steps every cycle, slack or not: memory requests complete however loaded the machine is
        "engine.scheduling": "fixed_k", "engine.decode_steps_per_cycle": 8,
        "joint_limits.lower": lower, "joint_limits.upper": upper}))
    h.instruction.publish(String(data=INSTRUCTION))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 90.0), h.node.configure_error
    assert h.chunks_flow(timeout=60.0)
    yield h
    h.close()


def _actions(chunk) -> np.ndarray:
    return np.asarray(chunk.actions, np.float64).reshape(chunk.horizon, chunk.action_dim)


def test_a_non_finite_chunk_is_withheld_counted_and_an_error(guarded):
    h = guarded
    events = h.node.output_events
    before = events()["non_finite_actions"]
    h.joint_positions = [10.0] + h.joint_positions[1:]      # finite input, NaN output
    try:
        assert wait_for(lambda: events()["non_finite_actions"] >= before + 1, 60.0)
        chunks, trajectories = h.count("chunk"), h.count("trajectory")
        assert wait_for(lambda: events()["non_finite_actions"] >= before + 5, 60.0)
        assert h.count("chunk") <= chunks + 1 and h.count("trajectory") <= trajectories + 1
        assert wait_for(lambda: any(d.status[0].level == d.status[0].ERROR and "non-finite" in d.status[0].message
                                    for d in list(h.received["diagnostics"])), 30.0)
        assert wait_for(lambda: h.received["status"][-1].non_finite_actions >= before + 1, 30.0)
    finally:
        h.joint_positions = [0.1] + h.joint_positions[1:]
    assert h.chunks_flow(timeout=60.0)
    for chunk in h.received["chunk"]:
        assert np.all(np.isfinite(chunk.actions))
    for trajectory in h.received["trajectory"]:
        assert all(np.all(np.isfinite(point.positions)) for point in trajectory.points)


def test_a_non_finite_memory_embedding_is_withheld_and_counted(guarded):
    h = guarded
    assert wait_for(lambda: h.node.output_events()["non_finite_embeddings"] >= 2, 120.0)
    assert all(np.all(np.isfinite(entry.embedding)) for entry in h.received["memory"])
    assert h.count("memory") == 0      # every memory prefix holds the NaN token
    assert h.chunks_flow()


def test_joint_limits_clamp_or_reject(guarded):
    from rclpy.parameter import Parameter

    h = guarded
    events = h.node.output_events
    low, high = JOINT_1_LIMITS
    start = h.count("chunk")
    assert wait_for(lambda: h.count("chunk") >= start + 3, 60.0)
    clamped = [_actions(c)[:, 0] for c in h.received["chunk"][start:]]
    assert all(np.all((column >= low) & (column <= high)) for column in clamped)
    # The model exceeds them: clamped values sit at a bound (rounded inwards to float32).
    assert any(np.any(np.isclose(column, low, rtol=0, atol=1e-7) | np.isclose(column, high, rtol=0, atol=1e-7))
               for column in clamped)
    for trajectory in h.received["trajectory"][-3:]:
        assert all(low <= point.positions[0] <= high for point in trajectory.points)
    assert events()["limited_actions"] >= 3

    assert h.node.set_parameters([Parameter("joint_limits.policy", value="reject")])[0].successful
    try:
        time.sleep(0.5)
        chunks, limited = h.count("chunk"), events()["limited_actions"]
        assert wait_for(lambda: events()["limited_actions"] >= limited + 4, 60.0)
        assert h.count("chunk") <= chunks + 1
    finally:
        h.node.set_parameters([Parameter("joint_limits.policy", value="clamp")])
    assert h.chunks_flow(timeout=60.0)


def test_a_non_finite_warm_up_fails_configure(ros_context, tmp_path):
    from rclpy.lifecycle import TransitionCallbackReturn

    from oxygen_ros.node.oxygen_node import OxygenNode

    def edit(model):
        model.action_out_proj.bias[3] = math.nan

    checkpoint = _pi0_tiny_checkpoint(tmp_path / "nan_head", edit)
    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(
        autostart=False, preset="pi0_tiny", checkpoint=checkpoint, norm_mode="identity"))
    try:
        assert node.trigger_configure() != TransitionCallbackReturn.SUCCESS
        assert node.engine is None and node.lifecycle_state == "unconfigured"
        assert "warm-up" in node.configure_error and "non-finite" in node.configure_error
    finally:
        node.destroy_node()


URDF = """<robot name="arm">
  <joint name="joint_1" type="revolute"><limit lower="-0.5" upper="0.5" effort="1" velocity="1"/></joint>
  <joint name="joint_2" type="continuous"/>
  <joint name="joint_3" type="prismatic"><limit lower="0.0" upper="0.2" effort="1" velocity="1"/></joint>
</robot>"""


def test_joint_limits_come_from_the_latched_robot_description(ros_context):
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.node import Node
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from conftest import spin_until
    from oxygen_ros.node.oxygen_node import OxygenNode

    both = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(
        autostart=False, **{"joint_limits.from_robot_description": True,
                            "joint_limits.lower": [0.0] * 7, "joint_limits.upper": [1.0] * 7}))
    try:   # one source of limits, not two
        assert both.trigger_configure() != TransitionCallbackReturn.SUCCESS
        assert "joint_limits.from_robot_description" in both.configure_error
    finally:
        both.destroy_node()

    # robot_state_publisher's convention: the URDF latched on robot_description before the node starts.
    publisher_node = Node("robot_state_publisher", context=ros_context)
    publisher = publisher_node.create_publisher(String, "robot_description", QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
    publisher.publish(String(data=URDF))
    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(
        autostart=False, **{"joint_limits.from_robot_description": True}))
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(node)
    executor.add_node(publisher_node)
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS, node.configure_error
        assert spin_until(executor, lambda: node.joint_limits is not None, 30.0)
        limits = node.joint_limits
        assert limits.source == "robot_description"
        np.testing.assert_array_equal(limits.lower, [-0.5, -math.inf, 0.0] + [-math.inf] * 4)
        np.testing.assert_array_equal(limits.upper, [0.5, math.inf, 0.2] + [math.inf] * 4)
    finally:
        executor.shutdown()
        node.destroy_node()
        publisher_node.destroy_node()
