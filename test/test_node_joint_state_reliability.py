"""``joint_states_reliability``: the node's joint-state subscription is best effort (sensor data) by default and
reliable on request, over real DDS.

Why it exists: the evaluation's lockstep robot (oxygen_ros/tools/evaluate/, ``node-lockstep``) publishes each
frame's joint state once, together with ~690 kB of camera images. On a loaded machine the best-effort joint state
was lost in transport while the reliable images were repaired, so the node never had the frame's joint state
(``stale joint state (0.20 s)``, the episode aborted). A reliable subscription is repaired like the images.
"""
from __future__ import annotations

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


def _joint_state_reliability(harness) -> list:
    """The reliability of the oxygen node's joint-state subscription, as the ROS graph reports it."""
    return [info.qos_profile.reliability for info in
            harness.robot.get_subscriptions_info_by_topic(harness.topic("joint_states"))
            if info.node_name == "oxygen_node"]


def test_default_joint_state_subscription_is_best_effort():
    from rclpy.qos import ReliabilityPolicy

    h = Harness(tiny_parameters())
    try:
        assert wait_for(lambda: h.node.lifecycle_state == "active", 120.0), "autostart did not reach active"
        assert wait_for(lambda: _joint_state_reliability(h) != [], 20.0)
        assert _joint_state_reliability(h) == [ReliabilityPolicy.BEST_EFFORT]
        assert h.chunks_flow(timeout=30.0)       # the harness's best-effort joint states are taken
    finally:
        h.close()


def test_reliable_joint_state_subscription_takes_only_reliable_publishers():
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import JointState

    h = Harness(tiny_parameters(joint_states_reliability="reliable"))
    try:
        assert wait_for(lambda: h.node.lifecycle_state == "active", 120.0), "autostart did not reach active"
        assert wait_for(lambda: _joint_state_reliability(h) != [], 20.0)
        assert _joint_state_reliability(h) == [ReliabilityPolicy.RELIABLE]
        # The harness's best-effort joint-state publisher cannot reach a reliable subscription: DDS reports the
        # incompatibility, the node counts it, and with no joint state it publishes no action chunk.
        endpoint = f"subscription {h.topic('joint_states')}"
        assert wait_for(lambda: h.node.qos_events().get(endpoint, 0) > 0, 30.0), h.node.qos_events()
        assert wait_for(lambda: h.node.skip_reasons().get("no_observation", 0) > 0, 30.0)
        assert h.count("chunk") == 0
        # A reliable publisher (the lockstep robot's) is taken: chunks flow.
        h.joints = h.robot.create_publisher(JointState, "joint_states",
                                            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        assert h.chunks_flow(timeout=60.0)
    finally:
        h.close()
