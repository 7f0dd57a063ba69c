"""The launch file and parameter files, checked statically (launch_ros is not installable here):
the launch file parses, declares the documented arguments, names an executable and a parameter file
that exist in the install, hands typed arguments to launch_ros's own conversion and the log level to the
node's ROS arguments; every config/*.yaml is keyed for any namespace and sets only parameters the node
declares, with values that pass the node's own validation."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from node_support import INSTALL_PREFIX, REPO_ROOT, flat_parameters, node_section

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

INSTALL_SHARE = INSTALL_PREFIX / "share" / "oxygen_ros"
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
    assert arguments == {"params_file", "namespace", "log_level", "use_sim_time", "checkpoint", "device", "autostart",
                         "camera_topics", "instruction_topic", "joint_states_topic"}
    (node,) = _calls(tree, "LifecycleNode")
    keywords = _keywords(node)
    assert keywords["package"].value == "oxygen_ros"
    executable = keywords["executable"].value
    assert (INSTALL_PREFIX / "lib" / "oxygen_ros" / executable).is_file()
    assert keywords["name"].value == "oxygen_node"
    # the default parameter file: os.path.join(<share>, "config", "<file>")
    joins = [c for c in _calls(tree, "join") if len(c.args) == 3]
    assert joins, "no default params_file path"
    relative = Path(*(arg.value for arg in joins[0].args[1:]))
    assert (INSTALL_SHARE / relative).is_file(), f"{relative} is not installed"
    assert (INSTALL_SHARE / "launch" / "oxygen.launch.py").is_file()


class _Recorder:
    """Stands in for a launch / launch_ros class: keeps its arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _LaunchConfiguration(_Recorder):
    def perform(self, context):
        return context.launch_configurations[self.args[0]]


class _ParameterValue(_Recorder):
    """Stands in for launch_ros's ParameterValue: the substitution and the ``value_type`` it converts to."""


def _run_launch_file(given: dict[str, str]) -> tuple[dict, list, dict]:
    """Evaluate launch/oxygen.launch.py with stand-ins for launch / launch_ros (not installable here), as
    ``ros2 launch ... name:=value`` for ``given``: returns the declared defaults, the node's ``parameters``
    list (substitutions as ``("LaunchConfiguration", name)``, typed ones as ``("ParameterValue", name,
    value_type)``) and the node's other keyword arguments."""
    import importlib.util
    import sys
    import types

    modules = {
        "ament_index_python": types.ModuleType("ament_index_python"),
        "ament_index_python.packages": types.SimpleNamespace(get_package_share_directory=lambda p: f"/share/{p}"),
        "launch": types.SimpleNamespace(LaunchDescription=_Recorder),
        "launch.actions": types.SimpleNamespace(DeclareLaunchArgument=_Recorder, OpaqueFunction=_Recorder),
        "launch.substitutions": types.SimpleNamespace(LaunchConfiguration=_LaunchConfiguration),
        "launch_ros": types.ModuleType("launch_ros"),
        "launch_ros.actions": types.SimpleNamespace(LifecycleNode=_Recorder, Node=_Recorder),
        "launch_ros.parameter_descriptions": types.SimpleNamespace(ParameterValue=_ParameterValue),
    }
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        spec = importlib.util.spec_from_file_location("oxygen_launch", REPO_ROOT / "launch" / "oxygen.launch.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        description = module.generate_launch_description()
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    entities = description.args[0]
    defaults = {e.args[0]: e.kwargs["default_value"] for e in entities if "default_value" in e.kwargs}
    context = types.SimpleNamespace(launch_configurations={**defaults, **given})
    nodes = []
    for entity in entities:
        if "function" in entity.kwargs:
            nodes += entity.kwargs["function"](context)
        elif "package" in entity.kwargs:
            nodes.append(entity)
    (node,) = nodes

    def plain(value):
        if isinstance(value, _LaunchConfiguration):
            return ("LaunchConfiguration", value.args[0])
        if isinstance(value, _ParameterValue):    # ParameterValue(substitution, value_type=...)
            return ("ParameterValue", plain(value.args[0])[1], value.kwargs["value_type"])
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return defaults, [plain(p) for p in node.kwargs["parameters"]], \
        {k: plain(v) for k, v in node.kwargs.items() if k != "parameters"}


def test_launch_arguments_override_the_params_file_only_when_given():
    """The params file's checkpoint / device / autostart / use_sim_time hold unless the argument is given
    (a default after params_file would silently replace the robot's checkpoint with random weights)."""
    from typing import List

    defaults, parameters, _ = _run_launch_file({"params_file": "/robot.yaml"})
    assert parameters == [("LaunchConfiguration", "params_file")], parameters
    for name in ("use_sim_time", "checkpoint", "device", "autostart", "camera_topics", "instruction_topic",
                 "joint_states_topic"):
        assert defaults[name] == "", f"launch argument {name} has a default that would override the file"
    _, parameters, _ = _run_launch_file({"params_file": "/robot.yaml", "checkpoint": "/models/pi05_droid",
                                         "device": "cuda:0", "autostart": "false"})
    assert parameters[0] == ("LaunchConfiguration", "params_file")
    # Typed values are converted by launch_ros (ParameterValue with value_type), not parsed here.
    assert parameters[1:] == [{"checkpoint": ("LaunchConfiguration", "checkpoint"),
                               "device": ("LaunchConfiguration", "device"),
                               "autostart": ("ParameterValue", "autostart", bool)}]
    _, parameters, _ = _run_launch_file({"use_sim_time": "true"})
    assert parameters[1:] == [{"use_sim_time": ("ParameterValue", "use_sim_time", bool)}]
    _, parameters, _ = _run_launch_file({"camera_topics": "[/cam_high/image_raw, /cam_wrist/image_raw]",
                                         "instruction_topic": "/planner/instruction",
                                         "joint_states_topic": "/robot1/joint_states"})
    assert parameters[1:] == [{"camera_topics": ("ParameterValue", "camera_topics", List[str]),
                               "instruction_topic": ("LaunchConfiguration", "instruction_topic"),
                               "joint_states_topic": ("LaunchConfiguration", "joint_states_topic")}]


def test_launch_log_level_and_namespace_reach_the_node():
    defaults, _, node = _run_launch_file({"namespace": "robot1", "log_level": "debug"})
    assert defaults["log_level"] == "info"
    assert node["ros_arguments"] == ["--log-level", ("LaunchConfiguration", "log_level")]
    assert node["namespace"] == ("LaunchConfiguration", "namespace")
    assert node["name"] == "oxygen_node"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_files_set_declared_parameters_with_valid_values(path, ros_context):
    from rclpy.parameter import Parameter

    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.node.parameters import read_settings

    data = yaml.safe_load(path.read_text())
    assert list(data) == ["/**/oxygen_node"], "keyed for any namespace (namespace:=robot1 must still match)"
    values = dict(flat_parameters(node_section(data)["ros__parameters"]))
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
