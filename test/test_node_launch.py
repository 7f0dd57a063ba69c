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


class _Recorder:
    """Stands in for a launch / launch_ros class: keeps its arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _LaunchConfiguration(_Recorder):
    def perform(self, context):
        return context.launch_configurations[self.args[0]]


def _run_launch_file(given: dict[str, str]) -> tuple[dict, list]:
    """Evaluate launch/oxygen.launch.py with stand-ins for launch / launch_ros (not installable here), as
    ``ros2 launch ... name:=value`` for ``given``: returns the declared defaults and the node's
    ``parameters`` list (substitutions as ``("LaunchConfiguration", name)``)."""
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
        "launch_ros.parameter_descriptions": types.SimpleNamespace(ParameterValue=_Recorder),
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
        if isinstance(value, _Recorder):    # ParameterValue(substitution, value_type=...)
            return plain(value.args[0])
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return defaults, [plain(p) for p in node.kwargs["parameters"]]


def test_launch_arguments_override_the_params_file_only_when_given():
    """The params file's checkpoint / device / autostart / use_sim_time hold unless the argument is given
    (a default after params_file would silently replace the robot's checkpoint with random weights)."""
    defaults, parameters = _run_launch_file({"params_file": "/robot.yaml"})
    assert parameters == [("LaunchConfiguration", "params_file")], parameters
    for name in ("use_sim_time", "checkpoint", "device", "autostart"):
        assert defaults[name] == "", f"launch argument {name} has a default that would override the file"
    _, parameters = _run_launch_file({"params_file": "/robot.yaml", "checkpoint": "/models/pi05_droid",
                                      "device": "cuda:0", "autostart": "false"})
    assert parameters[0] == ("LaunchConfiguration", "params_file")
    assert parameters[1:] == [{"checkpoint": "/models/pi05_droid", "device": "cuda:0", "autostart": False}]
    _, parameters = _run_launch_file({"use_sim_time": "true"})
    assert parameters[1:] == [{"use_sim_time": True}]


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
