"""Launch the oxygen_ros lifecycle node on a robot.

    ros2 launch oxygen_ros oxygen.launch.py params_file:=/path/to/robot.yaml checkpoint:=/models/pi05_droid
    ros2 launch oxygen_ros oxygen.launch.py namespace:=robot1 log_level:=debug \\
        camera_topics:="[/robot1/cam_high/image_raw, /robot1/cam_wrist/image_raw]"

Arguments:
    params_file   YAML parameter file (default: the package's config/pi05_tiny.yaml, random weights). The
                  shipped files are keyed ``/**/oxygen_node`` and so apply under any namespace.
    namespace     namespace of the node (default: none): ``/<namespace>/oxygen_node``, and the relative input
                  topics (``camera/image_raw``, ``instruction``, ``joint_states``) resolve in it.
    log_level     the node's log level: debug, info, warn, error or fatal (default info); passed as the
                  node's ``--log-level`` ROS argument.
    use_sim_time, checkpoint, device, autostart,
    camera_topics, instruction_topic, joint_states_topic
                  override the params file's value of the parameter of the same name *only when given*;
                  left empty (the default) the params file's value holds (and where the file does not
                  set it, the node's default: use_sim_time false, checkpoint "" = seeded random weights,
                  only allowed for the tiny presets; device cpu; autostart true; camera_topics
                  [camera/image_raw]; instruction_topic instruction; joint_states_topic joint_states).
                  checkpoint: local checkpoint directory; device: cpu, cuda, cuda:0 ...; autostart:
                  configure and activate without a lifecycle manager; camera_topics: a YAML list of topics,
                  parallel to the params file's camera_slots.

Typed arguments are converted by launch_ros itself (``ParameterValue`` with ``value_type``): booleans as launch
parses them, camera_topics as a YAML list of strings; a value of the wrong type fails the launch with
launch_ros's message naming the argument's text.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue

# Launch arguments that override one node parameter when given (non-empty), with the parameter's type
# (None: a string, passed as it is).
OVERRIDES = {"use_sim_time": bool, "checkpoint": None, "device": None, "autostart": bool,
             "camera_topics": "string_array", "instruction_topic": None, "joint_states_topic": None}
LOG_LEVELS = ("debug", "info", "warn", "error", "fatal")


def _value_type(kind):
    """launch_ros's ``value_type`` for ``kind`` (typing's List[str] for a string array)."""
    if kind == "string_array":
        from typing import List
        return List[str]
    return kind


def _oxygen_node(context):
    """The node, with the params file first and a dict of only the arguments the user gave."""
    overrides = {}
    for name, kind in OVERRIDES.items():
        if not LaunchConfiguration(name).perform(context).strip():
            continue    # not given: the params file's value holds
        if kind is None:
            overrides[name] = LaunchConfiguration(name)
        else:
            overrides[name] = ParameterValue(LaunchConfiguration(name), value_type=_value_type(kind))
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
        ros_arguments=["--log-level", LaunchConfiguration("log_level")],
    )]


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("oxygen_ros"), "config", "pi05_tiny.yaml")
    keep = " (empty: the params file's value)"
    arguments = [
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="YAML parameter file for oxygen_node"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("log_level", default_value="info", choices=list(LOG_LEVELS),
                              description="log level of the node"),
        DeclareLaunchArgument("use_sim_time", default_value="", description="use /clock time: true or false" + keep),
        DeclareLaunchArgument("checkpoint", default_value="", description="local checkpoint directory" + keep),
        DeclareLaunchArgument("device", default_value="", description="torch device, e.g. cpu or cuda:0" + keep),
        DeclareLaunchArgument("autostart", default_value="",
                              description="configure and activate without a lifecycle manager: true or false"
                              + keep),
        DeclareLaunchArgument("camera_topics", default_value="",
                              description="camera topics as a YAML list, parallel to camera_slots" + keep),
        DeclareLaunchArgument("instruction_topic", default_value="",
                              description="std_msgs/String instruction topic" + keep),
        DeclareLaunchArgument("joint_states_topic", default_value="",
                              description="sensor_msgs/JointState topic" + keep),
    ]
    return LaunchDescription(arguments + [OpaqueFunction(function=_oxygen_node)])
