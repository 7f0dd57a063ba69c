"""`pip install .` gives the ROS-free library: models, engine and benchmarks, without the ROS node."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_the_ros_free_library_and_its_console_scripts(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(REPO_ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("oxygen_ros-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "oxygen_ros/models/kv_cache.py" in names
    assert any(n.startswith("oxygen_ros/engine/") for n in names)
    assert not any(n.startswith("oxygen_ros/node/") for n in names), "the rclpy node must not be in the pip wheel"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "oxygen-bench-model" in text and "oxygen-bench-engine" in text
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: torch==2.13.0" in metadata
    assert "rclpy" not in metadata
