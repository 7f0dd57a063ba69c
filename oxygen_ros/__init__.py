"""oxygen_ros: π0.5 / π0 Vision-Language-Action models in a ROS 2 graph with a unified KV-cache engine.

Layers (dependencies point down only): ``oxygen_ros.node`` (rclpy glue) → ``oxygen_ros.engine``
(scheduler, KV pool, batching; no rclpy) → ``oxygen_ros.models`` (π0.5 / π0 in PyTorch; no rclpy).
After ``colcon build`` the generated messages are importable as ``oxygen_ros.msg``.
"""
