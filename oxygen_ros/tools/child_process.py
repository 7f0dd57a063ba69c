"""Child processes of the tools (the demo's simulated robot, the evaluation's robot workers): started in a
session of their own, ended with their parent in every case, and stopped as a whole process group.

Linux only: the parent-death signal is ``prctl(PR_SET_PDEATHSIG)`` (man 2 prctl), set in the child
between fork and exec, so a child never outlives a parent killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1      # linux/prctl.h


def package_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the directory this ``oxygen_ros`` package is imported from first on ``PYTHONPATH``, so
    that a child started with ``python -P -m oxygen_ros...`` imports the same package (the source tree or
    the install space the parent runs from)."""
    import oxygen_ros

    env = dict(env)
    root = str(Path(oxygen_ros.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def start_child(command: list[str], log_path: Path, *, append: bool = False,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``command`` as a child process in its own session (process group), ended with this process.

    Args:
        command: the argument vector.
        log_path: stdout and stderr together go to this file; the child runs in its directory (so that
            nothing it writes, e.g. MuJoCo's ``MUJOCO_LOG.TXT``, lands in the user's working directory).
        append: append to ``log_path`` rather than truncate it.
        env: the child's environment (default: this process's).

    Returns:
        the ``subprocess.Popen``; end it with :func:`stop_child`.

    Raises:
        OSError: the command cannot be started or the log cannot be opened.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent() -> None:     # runs in the child between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    with open(log_path, "a" if append else "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=log_path.parent, start_new_session=True, env=env,
                                preexec_fn=die_with_parent)


def stop_child(child: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group; SIGKILL it after ``grace_s`` [s]. Returns at once when the child
    has already exited."""
    if child.poll() is not None:
        return
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
