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
    assert "oxygen_ros/models/csrc/decode_attention.cpp" in names   # built on first use (native.py)
    assert any(n.startswith("oxygen_ros/engine/") for n in names)
    assert not any(n.startswith("oxygen_ros/node/") for n in names), "the rclpy node must not be in the pip wheel"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "oxygen-bench-model" in text and "oxygen-bench-engine" in text
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: torch==2.13.0" in metadata
    assert "rclpy" not in metadata


def test_colcon_builds_the_repository_as_src_oxygen_ros_in_a_workspace(tmp_path):
    """The robot workflow: the repository cloned into <ws>/src/oxygen_ros, `colcon build` in <ws>."""
    import os
    import shutil

    import pytest

    if not os.environ.get("AMENT_PREFIX_PATH") or shutil.which("cmake") is None:
        pytest.skip("needs the ROS build environment of `make test` (scripts/env.sh)")
    source = tmp_path / "ws" / "src" / "oxygen_ros"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLCON")}
    build = subprocess.run([sys.executable, "-m", "colcon", "build", "--packages-select", "oxygen_ros",
                            "--event-handlers", "console_direct-", "--cmake-args",
                            f"-DPython3_EXECUTABLE={sys.executable}", "-DBUILD_TESTING=OFF"],
                           cwd=tmp_path / "ws", env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    install = tmp_path / "ws" / "install" / "oxygen_ros"
    site = install / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    probe = ("from oxygen_ros.msg import ActionChunk; import oxygen_ros.models.kv_cache as k; "
             "print(k.__file__)")
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["LD_LIBRARY_PATH"] = f"{install / 'lib'}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(install) in out.stdout
    assert (install / "lib" / "oxygen_ros" / "oxygen_node").exists()
    assert (install / "share" / "oxygen_ros" / "launch" / "oxygen.launch.py").exists()
