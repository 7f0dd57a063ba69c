"""The robot side of a fleet as a process of its own (not a test module): the robots' computers in the
fleet's process tests (``test/test_node_fleet_process.py``), talking to an ``oxygen_fleet_node`` in another
process, or on another "host" (``test/two_hosts.py``), over DDS only.

``python test/fleet_robot.py OUT NAMESPACE... [--chunks N] [--timeout S]``: one
:class:`node_support.RobotSide` per namespace (robot i's frame stamps start at ``1000 * (i + 1)`` s) until
every robot has received N action chunks or S seconds pass; then writes OUT, JSON
``{namespace: {"sent": [[sec, nanosec], ...], "chunks": [[sec, nanosec, observation_seq], ...]}}``. Exit
code 0 when every robot got its N chunks, else 1 (OUT is written either way).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_support import RobotSide  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("namespaces", nargs="+")
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    import rclpy
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor

    context = Context()
    rclpy.init(context=context)
    sides = {ns: RobotSide(context, ns, 1000 * (i + 1)) for i, ns in enumerate(args.namespaces)}
    executor = SingleThreadedExecutor(context=context)
    for side in sides.values():
        executor.add_node(side.node)
    deadline = time.monotonic() + args.timeout
    done = False
    while not done and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
        done = all(len(side.chunks) >= args.chunks for side in sides.values())
    Path(args.out).write_text(json.dumps(
        {ns: {"sent": sorted(side.sent), "chunks": side.records()} for ns, side in sides.items()}))
    print({ns: len(side.chunks) for ns, side in sides.items()}, "chunks received", flush=True)
    executor.shutdown(timeout_sec=5.0)
    for side in sides.values():
        side.node.destroy_node()
    context.try_shutdown()
    return 0 if done else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
