"""Two "hosts" on one machine for the fleet's cross-machine test: two network namespaces joined by a veth pair.

Not a test module: ``test/test_node_fleet_hosts.py`` runs it as ``unshare -rn python test/two_hosts.py SPEC``,
so this process is root of a new user namespace with a network namespace of its own (host A, the robot) that
has nothing but a loopback interface. It starts the server command in a second network namespace (host B,
``unshare -n``, the same user namespace), joins the two by a veth pair with the addresses of a private /30
(A: ``10.77.0.1``, B: ``10.77.0.2``), runs the robot command on A until it exits, then stops the server
with SIGINT as a user's Ctrl-C does. Nothing reaches the machine's own network: the two namespaces see
only each other.

SPEC is a JSON file: ``{"server": [argv], "robot": [argv], "server_env": {..}, "robot_env": {..},
"timeout_s": float, "out": "dir"}``; each side's environment is this process's with its ``*_env`` applied,
where the value ``"{peer}"`` stands for the other side's address. Results go to ``out``: ``server.log``,
``robot.log`` and ``hosts.json`` (``server_rc``, ``robot_rc``, the veth's byte counters on A,
``rx_bytes`` / ``tx_bytes``, and ``error`` when the set-up failed).

Also run by itself in host B's namespace as ``two_hosts.py --host-b READY ADDRESS -- argv``: wait for
``READY`` (the veth end exists), bring up loopback and the veth end with ``ADDRESS``, then exec ``argv``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

A_ADDRESS, B_ADDRESS, PREFIX = "10.77.0.1", "10.77.0.2", 30
A_LINK, B_LINK = "veth_robot", "veth_server"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def host_b(ready: str, address: str, argv: list[str]) -> None:
    """Host B: wait until A has moved the veth end here, configure it, become the server."""
    _wait(lambda: os.path.exists(ready), 120.0, "the veth pair")
    _ip("link", "set", "lo", "up")
    _ip("addr", "add", f"{address}/{PREFIX}", "dev", B_LINK)
    _ip("link", "set", B_LINK, "up")
    os.execvp(argv[0], argv)


def _environment(changes: dict, peer: str) -> dict:
    env = dict(os.environ)
    env.update({key: value.replace("{peer}", peer) for key, value in changes.items()})
    return env


def _carrier() -> bool:
    link = json.loads(subprocess.run(["ip", "-j", "link", "show", A_LINK], check=True, capture_output=True,
                                     text=True).stdout)[0]
    return "LOWER_UP" in link.get("flags", [])


def _counters() -> dict:
    link = json.loads(subprocess.run(["ip", "-j", "-s", "link", "show", A_LINK], check=True,
                                     capture_output=True, text=True).stdout)[0]
    return {"rx_bytes": link["stats64"]["rx"]["bytes"], "tx_bytes": link["stats64"]["tx"]["bytes"]}


def run(spec: dict) -> dict:
    """Both hosts, the robot to its end, the server stopped by SIGINT; the results (module docstring)."""
    out = Path(spec["out"])
    ready = out / "veth_ready"
    result: dict = {"server_rc": None, "robot_rc": None}
    _ip("link", "set", "lo", "up")
    with open(out / "server.log", "w") as server_log, open(out / "robot.log", "w") as robot_log:
        server = subprocess.Popen(
            ["unshare", "-n", sys.executable, __file__, "--host-b", str(ready), B_ADDRESS, "--", *spec["server"]],
            stdout=server_log, stderr=subprocess.STDOUT, env=_environment(spec.get("server_env", {}), A_ADDRESS))
        try:
            own = os.readlink("/proc/self/ns/net")
            _wait(lambda: os.readlink(f"/proc/{server.pid}/ns/net") != own, 60.0, "host B's namespace")
            _ip("link", "add", A_LINK, "type", "veth", "peer", "name", B_LINK, "netns", str(server.pid))
            _ip("addr", "add", f"{A_ADDRESS}/{PREFIX}", "dev", A_LINK)
            _ip("link", "set", A_LINK, "up")
            ready.touch()
            _wait(_carrier, 120.0, "the veth link to come up")
            try:
                robot = subprocess.run(spec["robot"], stdout=robot_log, stderr=subprocess.STDOUT,
                                       env=_environment(spec.get("robot_env", {}), B_ADDRESS),
                                       timeout=spec["timeout_s"])
                result["robot_rc"] = robot.returncode
            except subprocess.TimeoutExpired:
                result["error"] = f"the robot side ran past {spec['timeout_s']} s"
            result.update(_counters())
        except (OSError, subprocess.CalledProcessError, TimeoutError) as error:
            detail = getattr(error, "stderr", "") or ""
            result["error"] = f"{error} {detail}".strip()
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGINT)
            try:
                result["server_rc"] = server.wait(timeout=120.0)
            except subprocess.TimeoutExpired:
                server.kill()
                result["server_rc"] = server.wait()
                result.setdefault("error", "the server did not end within 120 s of SIGINT")
    return result


def main(argv: list[str]) -> int:
    if argv[:1] == ["--host-b"]:
        split = argv.index("--")
        host_b(argv[1], argv[2], argv[split + 1:])
        return 1    # not reached: host_b execs the server
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    (Path(spec["out"]) / "hosts.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
