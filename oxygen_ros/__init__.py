"""oxygen_ros: π0.5 / π0 Vision-Language-Action models in a ROS 2 graph with a unified KV-cache engine.

Layers (dependencies point down only): ``oxygen_ros.node`` (rclpy glue) → ``oxygen_ros.engine``
(scheduler, KV pool, batching; no rclpy) → ``oxygen_ros.models`` (π0.5 / π0 in PyTorch; no rclpy).
After ``colcon build`` the generated messages are importable as ``oxygen_ros.msg``.
"""

# Run from a source checkout (the repository root first on sys.path, as with `python -m ...`), this
# package would hide the colcon install space that holds the generated `oxygen_ros.msg`. Extending the
# package path with every other `oxygen_ros` directory on sys.path makes both resolve.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
