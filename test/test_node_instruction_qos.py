"""How the instruction subscription treats publishers of either durability, over real DDS: a node started
after a transient-local publisher gets its latched instruction, then drops the transient-local
subscription so a volatile publisher (the usual ``create_publisher(String, "instruction", 10)``) never
meets an incompatible subscriber, and its instructions arrive."""
from __future__ import annotations

import pytest

from conftest import spin_until
from node_support import tiny_parameters

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


def test_latched_then_volatile_instruction(ros_context):
    from rclpy.event_handler import PublisherEventCallbacks
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.node import Node
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from oxygen_ros.node.oxygen_node import OxygenNode

    planner = Node("planner", context=ros_context)
    latched = planner.create_publisher(String, "instruction", QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
    latched.publish(String(data="fold the towel"))       # before the node exists
    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(autostart=False))
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(node)
    executor.add_node(planner)
    incompatible = []
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS, node.configure_error
        assert spin_until(executor, lambda: node.instruction == "fold the towel", 30.0), node.instruction
        # Once an instruction has arrived only the volatile subscription is left.
        assert spin_until(executor, lambda: latched.get_subscription_count() == 1, 30.0)

        volatile = planner.create_publisher(String, "instruction", 10, event_callbacks=PublisherEventCallbacks(
            incompatible_qos=incompatible.append))
        assert spin_until(executor, lambda: volatile.get_subscription_count() == 1, 30.0)
        volatile.publish(String(data="put the cube in the bowl"))
        assert spin_until(executor, lambda: node.instruction == "put the cube in the bowl", 30.0)
        spin_until(executor, lambda: False, 1.0)           # give an incompatibility event time to show
        assert incompatible == [] and node.qos_events() == {}
    finally:
        executor.shutdown()
        node.destroy_node()
        planner.destroy_node()
