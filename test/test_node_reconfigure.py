"""Writable parameters over real DDS (``ros2 param set``'s SetParameters service): configure-time parameters
are accepted while unconfigured and applied at the next configure, refused with the reason while the node
is configured; dynamic ones are accepted in every state; ``autostart`` is read-only."""
from __future__ import annotations

import pytest

from node_support import JOINTS, Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


def _set(h: Harness, name: str, value):
    """Set one parameter through the node's ``set_parameters`` service (as ``ros2 param set`` does)."""
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    client = h.robot.create_client(SetParameters, "oxygen_node/set_parameters")
    try:
        assert client.wait_for_service(timeout_sec=10.0)
        future = client.call_async(SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()]))
        assert wait_for(future.done, 30.0), f"no answer to setting {name}"
        return future.result().results[0]
    finally:
        h.robot.destroy_client(client)


def test_configure_time_parameters_apply_at_configure_and_are_refused_while_configured():
    h = Harness(tiny_parameters(autostart=False, control_rate_hz=4.0))
    try:
        # unconfigured: a structural and a configure-time knob are accepted ...
        assert _set(h, "trajectory_joint_names", JOINTS[:3]).successful
        assert _set(h, "speech.max_new_tokens", 8).successful
        assert h.change_state("configure") and h.change_state("activate")
        # ... and applied by configure
        assert wait_for(lambda: h.count("trajectory") >= 1, 30.0)
        assert list(h.received["trajectory"][-1].joint_names) == JOINTS[:3]
        # configured: refused with the reason, the value unchanged
        for state in ("active", "inactive"):
            refused = _set(h, "control_rate_hz", 8.0)
            assert not refused.successful
            assert "read at configure" in refused.reason and state in refused.reason, refused.reason
            assert h.node.get_parameter("control_rate_hz").value == 4.0
            refused = _set(h, "preset", "pi0_tiny")
            assert not refused.successful and "cleanup" in refused.reason
            if state == "active":
                # a dynamic knob is accepted while active and used from the next cycle
                assert _set(h, "staleness_limit_s", 0.8).successful
                assert h.node.get_parameter("staleness_limit_s").value == 0.8
                assert _set(h, "on_stop_command", "none").successful
                assert not _set(h, "on_stop_command", "brake").successful
                assert h.change_state("deactivate")
        assert not _set(h, "autostart", True).successful     # read-only: only acts at start-up
        assert h.change_state("cleanup")
        # after cleanup: accepted again and applied by the next configure
        assert _set(h, "trajectory_joint_names", JOINTS[:6]).successful
        assert _set(h, "on_stop_command", "hold").successful
        assert _set(h, "control_rate_hz", 5.0).successful          # a new control rate ...
        assert _set(h, "speech.trigger.every_s", 7.0).successful   # ... and a new trigger
        assert h.change_state("configure") and h.change_state("activate")
        config = h.node.engine.config
        assert config.action.control_period_s == pytest.approx(1.0 / 5.0)
        assert config.task("speech").trigger.every_s == 7.0
        count = h.count("trajectory")
        assert wait_for(lambda: h.count("trajectory") > count, 30.0)
        assert list(h.received["trajectory"][-1].joint_names) == JOINTS[:6]
        # ManagedNode.reconfigure (the closed-loop evaluation's node runs): the same transitions on the calling thread
        h.node.reconfigure({"control_rate_hz": 3.0})
        assert h.node.lifecycle_state == "active"
        assert h.node.engine.config.action.control_period_s == pytest.approx(1.0 / 3.0)
        count = h.count("trajectory")
        assert wait_for(lambda: h.count("trajectory") > count, 30.0)
        with pytest.raises(RuntimeError, match="refused"):
            h.node.reconfigure({"on_stop_command": "brake"})      # not one of its choices
        assert h.node.lifecycle_state == "unconfigured"
        with pytest.raises(RuntimeError, match="needs an active node"):
            h.node.reconfigure({"control_rate_hz": 2.0})
    finally:
        h.close()
