"""The shipped parameter files under a namespace (what ``ros2 launch ... namespace:=robot1`` does).

Every ``config/*.yaml`` is loaded through rcl's own params-file parser (``--ros-args --params-file``) for the
node ``/robot1/oxygen_node``, and every value in the file must reach the node's parameters; a file keyed
``oxygen_node:`` (root namespace only) must not, which is the failure the ``/**/`` key fixes. Then the
installed executable starts namespaced with the tiny config and becomes active (configure needs
``joint_names`` from the file), answering its lifecycle service under the namespace.
"""
from __future__ import annotations

import os
import time

import pytest
import yaml

from node_support import REPO_ROOT, flat_parameters, node_section, start_executable

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

CONFIGS = sorted((REPO_ROOT / "config").glob("*.yaml"))


def _node_from_file(path, namespace: str):
    """An OxygenNode in ``namespace`` whose context parsed ``path`` as rcl does for ``--params-file``;
    autostart off (only the parameters are read). Returns (context, node)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.node.oxygen_node import OxygenNode

    context = Context()
    rclpy.init(context=context, args=["--ros-args", "--params-file", str(path)])
    node = OxygenNode(context=context, namespace=namespace,
                      parameter_overrides=[Parameter("autostart", value=False)])
    return context, node


def _close(context, node) -> None:
    node.destroy_node()
    context.try_shutdown()
    context.destroy()


def _same(actual, expected) -> bool:
    if isinstance(expected, list):
        return list(actual) == expected
    return actual == expected


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_params_file_applies_to_a_namespaced_node(path):
    values = dict(flat_parameters(node_section(yaml.safe_load(path.read_text()))["ros__parameters"]))
    values.pop("autostart", None)    # overridden to false here
    context, node = _node_from_file(path, "/robot1")
    try:
        assert node.get_fully_qualified_name() == "/robot1/oxygen_node"
        differing = {name: (node.get_parameter(name).value, value) for name, value in values.items()
                     if not _same(node.get_parameter(name).value, value)}
        assert not differing, f"{path.name}: not applied under /robot1: {differing}"
    finally:
        _close(context, node)


def test_a_file_keyed_for_the_root_namespace_does_not_apply_under_a_namespace(tmp_path):
    """The failure the shipped files avoid: keyed ``oxygen_node:``, rcl ignores the section for
    ``/robot1/oxygen_node`` and joint_names stays unset (configure would fail)."""
    data = yaml.safe_load((REPO_ROOT / "config" / "pi05_tiny.yaml").read_text())
    root_keyed = tmp_path / "root_keyed.yaml"
    root_keyed.write_text(yaml.safe_dump({"oxygen_node": node_section(data)}))
    from oxygen_ros.node.parameters import read_settings

    context, node = _node_from_file(root_keyed, "/robot1")
    try:
        with pytest.raises(ValueError, match="joint_names"):
            read_settings(node)
    finally:
        _close(context, node)
    context, node = _node_from_file(REPO_ROOT / "config" / "pi05_tiny.yaml", "/robot1")
    try:
        assert read_settings(node).joint_names
    finally:
        _close(context, node)


def test_executable_starts_namespaced_with_the_tiny_config(tmp_path):
    """``oxygen_node --ros-args -r __ns:=/<ns> --params-file config/pi05_tiny.yaml`` configures and activates
    (joint_names came from the file) and answers ``/<ns>/oxygen_node/get_state``; SIGINT ends it with 0."""
    import signal

    import rclpy
    from lifecycle_msgs.srv import GetState
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node

    namespace = f"/robot_{os.getpid()}"
    process = start_executable(tmp_path, namespace)
    context = Context()
    rclpy.init(context=context)
    client_node = Node("namespace_probe", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(client_node)
    try:
        client = client_node.create_client(GetState, f"{namespace}/oxygen_node/get_state")
        label = ""
        deadline = time.monotonic() + 120.0
        while label != "active" and process.poll() is None and time.monotonic() < deadline:
            if client.wait_for_service(timeout_sec=1.0):
                future = client.call_async(GetState.Request())
                executor.spin_until_future_complete(future, timeout_sec=10.0)
                if future.done():
                    label = future.result().current_state.label
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[0]
        assert label == "active"
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30.0)
        assert process.returncode == 0, output
        assert "joint_names" not in output, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        executor.shutdown()
        client_node.destroy_node()
        context.try_shutdown()
        context.destroy()
