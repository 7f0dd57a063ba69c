"""The launch file and parameter files, checked statically (launch_ros is not installable here):
the launch file parses, declares the documented arguments, names an executable and a parameter file
that exist in the install; every config/*.yaml sets only parameters the node declares, with values
that pass the node's own validation."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from test_node_support import REPO_ROOT

pytestmark = pytest.mark.ros

INSTALL_SHARE = REPO_ROOT / "install" / "oxygen_ros" / "share" / "oxygen_ros"
CONFIGS = sorted((REPO_ROOT / "config").glob("*.yaml"))


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


def _keywords(call: ast.Call) -> dict[str, ast.AST]:
    return {k.arg: k.value for k in call.keywords}


def test_launch_file_declares_the_arguments_and_names_installed_files():
    source = (REPO_ROOT / "launch" / "oxygen.launch.py").read_text()
    tree = ast.parse(source)
    assert any(isinstance(n, ast.FunctionDef) and n.name == "generate_launch_description" for n in tree.body)
    arguments = {call.args[0].value for call in _calls(tree, "DeclareLaunchArgument")}
    assert arguments == {"params_file", "namespace", "use_sim_time", "checkpoint", "device", "autostart"}
    (node,) = _calls(tree, "LifecycleNode")
    keywords = _keywords(node)
    assert keywords["package"].value == "oxygen_ros"
    executable = keywords["executable"].value
    assert (REPO_ROOT / "install" / "oxygen_ros" / "lib" / "oxygen_ros" / executable).is_file()
    assert keywords["name"].value == "oxygen_node"
    # the default parameter file: os.path.join(<share>, "config", "<file>")
    joins = [c for c in _calls(tree, "join") if len(c.args) == 3]
    assert joins, "no default params_file path"
    relative = Path(*(arg.value for arg in joins[0].args[1:]))
    assert (INSTALL_SHARE / relative).is_file(), f"{relative} is not installed"
    assert (INSTALL_SHARE / "launch" / "oxygen.launch.py").is_file()


def _flat(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_files_set_declared_parameters_with_valid_values(path, ros_context):
    from rclpy.parameter import Parameter

    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.node.parameters import read_settings

    data = yaml.safe_load(path.read_text())
    assert list(data) == ["oxygen_node"]
    values = dict(_flat(data["oxygen_node"]["ros__parameters"]))
    node = OxygenNode(context=ros_context, parameter_overrides=[Parameter("autostart", value=False)])
    try:
        undeclared = sorted(name for name in values if not node.has_parameter(name))
        assert not undeclared, f"undeclared parameters: {undeclared}"
    finally:
        node.destroy_node()
    node = OxygenNode(context=ros_context, parameter_overrides=[
        Parameter(name, value=value) for name, value in values.items() if name != "autostart"] +
        [Parameter("autostart", value=False)])
    try:
        settings = read_settings(node)
        assert settings.cameras and settings.joint_names
    finally:
        node.destroy_node()
