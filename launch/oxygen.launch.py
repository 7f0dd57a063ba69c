"""Launch the oxygen_ros lifecycle node on a robot.

    ros2 launch oxygen_ros oxygen.launch.py params_file:=/path/to/robot.yaml checkpoint:=/models/pi05_droid

Arguments:
    params_file   YAML parameter file (default: the package's config/pi05_tiny.yaml, random weights).
    namespace     namespace of the node (default: none).
    use_sim_time, checkpoint, device, autostart
                  override the params file's value of the parameter of the same name *only when given*;
                  left empty (the default) the params file's value holds (and where the file does not
                  set it, the node's default: use_sim_time false, checkpoint "" = seeded random weights,
                  only allowed for the tiny presets; device cpu; autostart true).
                  checkpoint: local checkpoint directory; device: cpu, cuda, cuda:0 ...; autostart:
                  configure and activate without a lifecycle manager.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

# Launch arguments that override one node parameter when given (non-empty), with the parameter's type.
OVERRIDES = {"use_sim_time": bool, "checkpoint": str, "device": str, "autostart": bool}


def _typed(name, text, kind):
    if kind is str:
        return text
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"launch argument {name}:={text!r} is not a boolean (true or false)")


def _oxygen_node(context):
    """The node, with the params file first and a dict of only the arguments the user gave."""
    overrides = {}
    for name, kind in OVERRIDES.items():
        text = LaunchConfiguration(name).perform(context).strip()
        if text:
            overrides[name] = _typed(name, text, kind)
    parameters = [LaunchConfiguration("params_file")]
    if overrides:
        parameters.append(overrides)   # later entries win: only what was given on the command line
    return [LifecycleNode(
        package="oxygen_ros",
        executable="oxygen_node",
        name="oxygen_node",
        namespace=LaunchConfiguration("namespace"),
        output="screen",
        emulate_tty=True,
        parameters=parameters,
    )]


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("oxygen_ros"), "config", "pi05_tiny.yaml")
    keep = " (empty: the params file's value)"
    arguments = [
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="YAML parameter file for oxygen_node"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("use_sim_time", default_value="", description="use /clock time: true or false" + keep),
        DeclareLaunchArgument("checkpoint", default_value="", description="local checkpoint directory" + keep),
        DeclareLaunchArgument("device", default_value="", description="torch device, e.g. cpu or cuda:0" + keep),
        DeclareLaunchArgument("autostart", default_value="",
                              description="configure and activate without a lifecycle manager: true or false"
                              + keep),
    ]
    return LaunchDescription(arguments + [OpaqueFunction(function=_oxygen_node)])
