"""The report's command line on bad input, and reading a run whose recorder was killed (no metadata.yaml)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ros


def test_missing_run_directory_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "oxygen_ros.tools.report", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "missing" in proc.stderr


def test_bag_without_metadata_is_read_from_its_mcap(tmp_path):
    from rclpy.serialization import serialize_message

    from oxygen_ros.msg import ActionChunk
    from oxygen_ros.tools.bag_recorder import BagWriter
    from oxygen_ros.tools.report import load_run

    bag = tmp_path / "bag"
    with BagWriter(bag) as writer:
        writer.add_topic("/oxygen_node/action_chunk", "oxygen_ros/msg/ActionChunk")
        for i in range(5):
            msg = ActionChunk(horizon=2, action_dim=3, actions=[float(i)] * 6, observation_seq=i)
            writer.write("/oxygen_node/action_chunk", serialize_message(msg), 10**9 * (i + 1))
    (bag / "metadata.yaml").unlink()                  # as after a SIGKILL
    (mcap,) = bag.glob("*.mcap")
    mcap.write_bytes(mcap.read_bytes()[:-200])        # and no complete summary section
    data = load_run(tmp_path)
    assert [c["seq"] for c in data.chunks] == [0, 1, 2, 3, 4]
    assert data.topics == {"/oxygen_node/action_chunk": 5}
