"""Launch the oxygen_ros lifecycle node on a robot.

    ros2 launch oxygen_ros oxygen.launch.py params_file:=/path/to/robot.yaml checkpoint:=/models/pi05_droid

Arguments: params_file (default: the package's config/pi05_tiny.yaml), namespace, use_sim_time,
checkpoint (empty: the preset's own weights), device (cpu, cuda, cuda:0 ...), autostart (configure and
activate without a lifecycle manager).
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("oxygen_ros"), "config", "pi05_tiny.yaml")
    arguments = [
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="YAML parameter file for oxygen_node"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("use_sim_time", default_value="false", description="use /clock time"),
        DeclareLaunchArgument("checkpoint", default_value="",
                              description="local checkpoint directory (empty: the preset's weights)"),
        DeclareLaunchArgument("device", default_value="cpu", description="torch device, e.g. cpu or cuda:0"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure and activate without a lifecycle manager"),
    ]
    node = LifecycleNode(
        package="oxygen_ros",
        executable="oxygen_node",
        name="oxygen_node",
        namespace=LaunchConfiguration("namespace"),
        output="screen",
        emulate_tty=True,
        parameters=[
            LaunchConfiguration("params_file"),
            {
                "use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool),
                "checkpoint": ParameterValue(LaunchConfiguration("checkpoint"), value_type=str),
                "device": ParameterValue(LaunchConfiguration("device"), value_type=str),
                "autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool),
            },
        ],
    )
    return LaunchDescription(arguments + [node])
