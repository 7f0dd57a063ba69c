"""``oxygen_fleet_node`` as a user runs it: the installed executable in a process of its own, serving robots
whose side runs in another process (``test/fleet_robot.py``), over DDS only.

* On this host (loopback): two robots are served, each receives action chunks computed from its own frames
  (stamps, observation sequence numbers), and SIGINT ends the server with exit code 0 and no traceback.
* On two "hosts" (docs/fleet.md, "Across machines"): the robot side and the server in two network
  namespaces of one machine joined by a veth pair (``test/two_hosts.py``), Fast DDS over UDP only (no shared
  memory between them), discovery by multicast (the LAN default) and by ``ROS_STATIC_PEERS`` (unicast to the
  named host). The frames and chunks cross the veth: its byte counters carry at least the frames the chunks
  came from. Skipped only where unprivileged user namespaces or ``ip`` are unavailable.

Timeouts bound hangs only (model load and cycles on a loaded machine); nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from node_support import FLEET_EXECUTABLE, TEST_INSTRUCTION, assert_own_chunks, executable_command, stop_process

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

HERE = Path(__file__).resolve().parent
LONG = 900.0    # bounds a hang only: two processes import torch and rclpy, one loads the model, on a loaded machine
CHUNKS = 3                   # per robot
RAW_FRAME_BYTES = 24 * 32 * 3   # node_support.raw_image's rgb8 frame: a lower bound of one frame on the wire


def _robot_command(out: Path, namespaces: list[str]) -> list[str]:
    return [sys.executable, str(HERE / "fleet_robot.py"), str(out), *namespaces, "--chunks", str(CHUNKS),
            "--timeout", str(LONG)]


def _server_command(tmp_path: Path, namespaces: list[str]) -> list[str]:
    """``oxygen_fleet_node`` as docs/fleet.md runs it: the robots' params file and the fleet's own."""
    fleet = tmp_path / "fleet.yaml"
    # two robots' shares (config/pi05_tiny.yaml: engine.kv_budget_mb 16) in the fleet's pool; the robots get a
    # default instruction (nothing moves, and no ~/ask goal is taken, without a task)
    fleet.write_text(yaml.safe_dump({"oxygen_fleet": {"ros__parameters": {"robots": namespaces,
                                                                          "kv_budget_mb": 48}},
                                     "/**/oxygen_node": {"ros__parameters": {"default_instruction": TEST_INSTRUCTION}}}))
    return executable_command(executable=FLEET_EXECUTABLE) + ["--params-file", str(fleet)]


def _assert_served(results: dict, namespaces: list[str]) -> int:
    """Each robot got its chunks from its own frames; returns the number of distinct frames they came from."""
    frames = 0
    for ns in namespaces:
        sent = {tuple(s) for s in results[ns]["sent"]}
        others = [{tuple(s) for s in results[other]["sent"]} for other in namespaces if other != ns]
        records = [tuple(r) for r in results[ns]["chunks"]]
        assert len(records) >= CHUNKS, (ns, records)
        assert_own_chunks(records, sent, others)
        frames += len({(sec, nanosec) for sec, nanosec, _ in records})
    return frames


def _assert_clean_exit(code: int, log: str) -> None:
    assert code == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert "SIGINT: stopping" in log, log[-4000:]
    assert "ignored parameters" not in log, log[-4000:]     # the fleet's section reached the fleet node only


def test_executable_serves_robots_and_ends_on_sigint(tmp_path):
    namespaces = [f"/fleet_process_{os.getpid()}/r1", f"/fleet_process_{os.getpid()}/r2"]
    out = tmp_path / "robots.json"
    # the server's log goes to a file: a pipe nobody reads until the end could fill and block it
    with open(tmp_path / "server.log", "w") as server_log:
        server = subprocess.Popen(_server_command(tmp_path, namespaces), cwd=tmp_path, stdout=server_log,
                                  stderr=subprocess.STDOUT)
        try:
            robot = subprocess.run(_robot_command(out, namespaces), cwd=tmp_path, capture_output=True, text=True,
                                   timeout=LONG + 120)
        finally:
            stop_process(server, 120.0)
    log = (tmp_path / "server.log").read_text()
    assert robot.returncode == 0, robot.stdout + robot.stderr + log[-4000:]
    _assert_served(json.loads(out.read_text()), namespaces)
    _assert_clean_exit(server.returncode, log)


def test_sigint_answers_every_waiting_ask_goal(tmp_path):
    """SIGINT while an ``~/ask`` goal waits on a robot of the fleet process (no frame: its request never
    starts): the goal gets its one result before the process exits (aborted, STATUS_CANCELLED, the reason),
    the process exits 0 with no traceback and no "Failed to send result response" (issue 38, item 3)."""
    import threading
    import time

    import rclpy
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor

    from node_support import wait_for
    from oxygen_ros.action import Ask

    namespace = f"/fleet_sigint_{os.getpid()}/r1"
    context = Context()
    rclpy.init(context=context)
    asker_node = rclpy.create_node("asker", context=context)
    asker = ActionClient(asker_node, Ask, f"{namespace}/oxygen_node/ask")
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(asker_node)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()
    with open(tmp_path / "server.log", "w") as server_log:
        server = subprocess.Popen(_server_command(tmp_path, [namespace]), cwd=tmp_path, stdout=server_log,
                                  stderr=subprocess.STDOUT)
        try:
            assert asker.wait_for_server(timeout_sec=LONG), "no ~/ask server"
            accepted = None
            deadline = time.monotonic() + LONG      # goals are refused until the robot's node is active
            while accepted is None and time.monotonic() < deadline and server.poll() is None:
                sent = asker.send_goal_async(Ask.Goal(task="speech", instruction="what do you see?"))
                assert wait_for(sent.done, 60.0)
                if sent.result().accepted:
                    accepted = sent.result()
                else:
                    time.sleep(0.5)
            assert accepted is not None, (tmp_path / "server.log").read_text()[-4000:]
            result = accepted.get_result_async()
            assert not result.done()
        finally:
            stop_process(server, 120.0)
        try:
            assert wait_for(result.done, 30.0), "no ~/ask result before the exit\n" + \
                (tmp_path / "server.log").read_text()[-4000:]
            response = result.result()
        finally:
            executor.shutdown(timeout_sec=5.0)
            thread.join(timeout=5.0)
            asker.destroy()
            asker_node.destroy_node()
            context.try_shutdown()
    log = (tmp_path / "server.log").read_text()
    assert response.status == GoalStatus.STATUS_ABORTED, (response, log[-4000:])
    assert response.result.status == Ask.Result.STATUS_CANCELLED, response.result
    assert "stopping" in response.result.message, response.result.message
    assert "Failed to send result response" not in log, log[-4000:]
    _assert_clean_exit(server.returncode, log)


def _namespaces_unavailable() -> str | None:
    """Why two network namespaces cannot be built here (None: they can)."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "show", "lo"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        return f"unprivileged user and network namespaces are unavailable: unshare -rn: {probe.stderr.strip()}"
    return None


# How the two hosts find each other (docs/fleet.md): the LAN default, multicast discovery on the subnet;
# where multicast does not pass, discovery on this host only plus the other host named as a static peer.
DISCOVERY = {
    "multicast": {"ROS_AUTOMATIC_DISCOVERY_RANGE": "SUBNET"},
    "static_peers": {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "ROS_STATIC_PEERS": "{peer}"},
}


@pytest.mark.parametrize("discovery", sorted(DISCOVERY))
def test_robot_and_server_on_two_hosts(tmp_path, discovery):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    namespaces = ["/r1", "/r2"]
    env = {"RMW_IMPLEMENTATION": "rmw_fastrtps_cpp",
           # UDP only: the two namespaces share /dev/shm, and Fast DDS's shared-memory transport would carry
           # the data past the veth; two real hosts have no shared memory either.
           "FASTDDS_BUILTIN_TRANSPORTS": "UDPv4", **DISCOVERY[discovery]}
    spec = {"server": _server_command(tmp_path, namespaces),
            "robot": _robot_command(tmp_path / "robots.json", namespaces),
            "server_env": env, "robot_env": env, "timeout_s": LONG + 120, "out": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    environment = {k: v for k, v in os.environ.items() if k != "ROS_STATIC_PEERS"}
    subprocess.run(["unshare", "-rn", sys.executable, str(HERE / "two_hosts.py"), str(tmp_path / "spec.json")],
                   cwd=tmp_path, check=True, timeout=LONG + 400, env=environment)
    hosts = json.loads((tmp_path / "hosts.json").read_text())
    server_log = (tmp_path / "server.log").read_text()
    robot_log = (tmp_path / "robot.log").read_text()
    assert "error" not in hosts, (hosts, robot_log, server_log[-4000:])
    assert hosts["robot_rc"] == 0, (robot_log, server_log[-4000:])
    frames = _assert_served(json.loads((tmp_path / "robots.json").read_text()), namespaces)
    # every chunk's frame crossed the veth from the robot (A) to the server (B), at least its raw image
    assert hosts["tx_bytes"] >= frames * RAW_FRAME_BYTES, hosts
    _assert_clean_exit(hosts["server_rc"], server_log)
