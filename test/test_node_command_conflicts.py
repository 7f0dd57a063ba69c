"""A duplicate node goes noticed, over real DDS: another publisher of the node's command topics (a second
``oxygen_node`` with the same name and namespace, or any publisher there) is found on the graph. Under
``command_conflict_policy: refuse`` (the default) the running node withholds its action outputs while it is
there and resumes once it has gone, and a node that finds one at activate fails to activate; under ``warn``
it activates and publishes. No wall-clock assertions: waits are bounded only to fail instead of hanging."""
from __future__ import annotations

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


@pytest.fixture(scope="module")
def harness():
    h = Harness(tiny_parameters(control_rate_hz=4.0))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    assert h.chunks_flow(timeout=60.0)
    yield h
    h.close()


def test_another_trajectory_publisher_stops_the_action_outputs_until_it_goes(harness):
    from trajectory_msgs.msg import JointTrajectory

    node = harness.node
    other = harness.robot.create_publisher(JointTrajectory, harness.topic("oxygen_node/joint_trajectory"), 1)
    try:
        assert wait_for(lambda: node.command_conflicts.withheld >= 1, 60.0), node.command_conflicts.conflict
        assert "joint_trajectory" in node.command_conflicts.conflict
        chunks, trajectories = harness.count("chunk"), harness.count("trajectory")
        withheld = node.command_conflicts.withheld
        assert wait_for(lambda: node.command_conflicts.withheld >= withheld + 3, 60.0)
        assert (harness.count("chunk"), harness.count("trajectory")) == (chunks, trajectories)
        name = f"{harness.namespace}/oxygen_node: engine"
        assert wait_for(lambda: any(s.name == name and s.level == s.ERROR and "other publisher" in s.message
                                    for array in list(harness.received["diagnostics"]) for s in array.status), 30.0)
    finally:
        harness.robot.destroy_publisher(other)
    assert wait_for(lambda: node.command_conflicts.conflict is None, 60.0)
    assert harness.chunks_flow(timeout=60.0)


def test_a_duplicate_node_fails_to_activate_unless_the_policy_is_warn(harness):
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.parameter import Parameter

    from oxygen_ros.node.oxygen_node import OxygenNode

    duplicate = OxygenNode(context=harness.context, namespace=harness.namespace,
                           parameter_overrides=tiny_parameters(autostart=False, control_rate_hz=4.0))
    try:
        assert duplicate.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert duplicate.trigger_activate() == TransitionCallbackReturn.FAILURE
        assert duplicate.lifecycle_state == "inactive" and "action_chunk" in duplicate.command_conflicts.conflict
        # the running node sees the duplicate's publishers (configured: they exist while inactive) and stops too
        assert wait_for(lambda: harness.node.command_conflicts.conflict is not None, 60.0)
        assert duplicate.set_parameters([Parameter("command_conflict_policy", value="warn")])[0].successful
        assert duplicate.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert duplicate.lifecycle_state == "active"
    finally:
        duplicate.release()
        duplicate.destroy_node()
    assert wait_for(lambda: harness.node.command_conflicts.conflict is None, 60.0), \
        [(i.node_namespace, i.node_name, i.endpoint_gid) for i in harness.node.get_publishers_info_by_topic(
            harness.topic("oxygen_node/action_chunk"))]
    assert harness.chunks_flow(timeout=60.0)
