"""Packaging: `pip install .` gives the ROS-free library (models, engine and benchmarks, without the ROS node);
`colcon build` of the repository as src/oxygen_ros in a workspace installs the package with executables pinned
to the interpreter it was built for, and registers the tests so that `colcon test` runs them."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow     # builds a wheel / a colcon workspace
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
    assert "Requires-Dist: transformers" not in metadata     # tests only: the library never imports it


@pytest.mark.slow     # builds a wheel / a colcon workspace
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
                            f"-DPython3_EXECUTABLE={sys.executable}", "-DBUILD_TESTING=ON",
                            *_compiler_cache(env, tmp_path / "ws")],
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
    _executables_run_with_the_interpreter_they_were_built_for(install, site, tmp_path)
    _colcon_test_runs_the_registered_tests(tmp_path / "ws", source, env)


def _compiler_cache(env: dict, workspace: Path) -> list[str]:
    """CMake arguments (and ``env`` settings) that compile through ccache into the cache `make setup` uses
    (scripts/common.sh: OXYGEN_CCACHE_DIR), with paths below ``workspace`` keyed relative to the build
    directory: the message typesupport compiled by an earlier run or by `make setup` is not compiled again
    (the build still configures, generates, links and installs everything). None without ccache."""
    import shutil

    if shutil.which("ccache") is None or not env.get("OXYGEN_CCACHE_DIR"):
        return []
    env.update(CCACHE_DIR=env["OXYGEN_CCACHE_DIR"], CCACHE_BASEDIR=str(workspace), CCACHE_NOHASHDIR="1",
               CCACHE_MAXSIZE=env.get("CCACHE_MAXSIZE", "1G"))
    return ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]


def _executables_run_with_the_interpreter_they_were_built_for(install, site, tmp_path):
    """The installed scripts start with the build's interpreter and run from a shell whose PATH has no virtual
    environment (as `ros2 run` from a plain terminal): `#!/usr/bin/env python3` would find a python3 without
    rclpy and torch there."""
    import os

    for script in ("oxygen_node", "oxygen_ros"):
        path = install / "lib" / "oxygen_ros" / script
        assert path.read_text().splitlines()[0] == f"#!{sys.executable}", f"{script} is not pinned"
        assert os.access(path, os.X_OK)
    plain = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin",
             "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
             "LD_LIBRARY_PATH": os.pathsep.join([str(install / "lib"), os.environ.get("LD_LIBRARY_PATH", "")]),
             "AMENT_PREFIX_PATH": os.pathsep.join([str(install), os.environ.get("AMENT_PREFIX_PATH", "")]),
             "ROS_DOMAIN_ID": os.environ.get("ROS_DOMAIN_ID", "0"),
             "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    # A missing params file: the node's own one-line refusal and exit code 2 prove that rclpy, torch and the
    # package imported under the pinned interpreter.
    run = subprocess.run([str(install / "lib" / "oxygen_ros" / "oxygen_node"), "--ros-args", "--params-file",
                          str(tmp_path / "missing.yaml")], cwd=tmp_path, env=plain, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith("oxygen_node: "), run.stderr[-2000:]


def _colcon_test_runs_the_registered_tests(workspace, source, env):
    """`colcon test` knows one test per test/test_*.py (listed, not all run: that would be this suite inside
    itself); one of them, test_messages, runs through `colcon test` against the workspace's install and its
    JUnit results reach `colcon test-result`."""
    import re

    listing = subprocess.run(["ctest", "-N"], cwd=workspace / "build" / "oxygen_ros", env=env,
                             capture_output=True, text=True)
    assert listing.returncode == 0, listing.stdout + listing.stderr
    listed = set(re.findall(r"Test\s+#\d+: (\S+)", listing.stdout))
    expected = {path.stem for path in (source / "test").glob("test_*.py")}
    assert listed == expected, (sorted(expected - listed), sorted(listed - expected))
    test = subprocess.run([sys.executable, "-m", "colcon", "test", "--packages-select", "oxygen_ros",
                           "--event-handlers", "console_direct-", "--ctest-args", "-R", "^test_messages$"],
                          cwd=workspace, env=env, capture_output=True, text=True, timeout=900)
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-3000:]
    summary = subprocess.run([sys.executable, "-m", "colcon", "test-result", "--all", "--test-result-base",
                              "build/oxygen_ros"], cwd=workspace, env=env, capture_output=True, text=True)
    assert summary.returncode == 0, summary.stdout + summary.stderr
    match = re.search(r"Summary: (\d+) tests?, (\d+) errors?, (\d+) failures?, (\d+) skipped", summary.stdout)
    assert match, summary.stdout
    tests, errors, failures, _ = map(int, match.groups())
    assert tests >= 5 and errors == 0 and failures == 0, summary.stdout


# Python import name -> rosdep key, for the non-ROS imports that have one
_ROSDEP_KEYS = {"numpy": "python3-numpy", "yaml": "python3-yaml", "cv2": "python3-opencv",
                "matplotlib": "python3-matplotlib", "pytest": "python3-pytest", "PIL": "python3-pil",
                "h5py": "python3-h5py", "tqdm": "python3-tqdm"}
# Python import name -> pip distribution, for the pip-only ones
_PIP_NAMES = {"gym_aloha": "gym-aloha", "mcap_ros2": "mcap", "milvus_lite": "milvus-lite"}


def test_package_xml_declares_every_import():
    """Every module that the package's Python code (oxygen_ros/, launch/) imports is declared in package.xml:
    a ROS package by its name, a Python library by its rosdep key, or named in the comment listing the
    pip-only dependencies. The standard library and oxygen_ros itself are exempt."""
    import ast
    import re
    import xml.etree.ElementTree as ElementTree

    text = (REPO_ROOT / "package.xml").read_text()
    root = ElementTree.fromstring(text)
    declared = {element.text.strip() for tag in ("depend", "exec_depend", "build_depend", "buildtool_depend",
                                                 "test_depend") for element in root.iter(tag)}
    pip_only = " ".join(re.findall(r"pip-only(.*?)-->", text, flags=re.S))
    missing = {}
    for path in sorted(list((REPO_ROOT / "oxygen_ros").rglob("*.py")) + list((REPO_ROOT / "launch").glob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("oxygen_ros", "__future__"):
                    continue
                if top in declared or _ROSDEP_KEYS.get(top) in declared:
                    continue
                if re.search(rf"\b{re.escape(_PIP_NAMES.get(top, top))}\b", pip_only):
                    continue
                missing.setdefault(top, path.relative_to(REPO_ROOT).as_posix())
    assert not missing, f"imports not declared in package.xml (module: first file): {missing}"
