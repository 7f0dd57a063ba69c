"""The node's outputs recorded to a rosbag2 MCAP (the project's BagRecorder: rosbags with the message
definitions of msg/) and read back field for field against what a live subscriber received."""
from __future__ import annotations

import math

import numpy as np
import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

# relative to the harness's namespace
OUTPUTS = {"oxygen_node/action_chunk": ("chunk", lambda m: m.observation_seq),
           "oxygen_node/joint_trajectory": ("trajectory", lambda m: tuple(p.positions[0] for p in m.points[:2])),
           "oxygen_node/speech": ("speech", lambda m: (m.utterance_id, m.sequence)),
           "oxygen_node/memory": ("memory", lambda m: m.entry_id),
           "oxygen_node/status": ("status", lambda m: (m.header.stamp.sec, m.header.stamp.nanosec))}


def _assert_same(live, recorded, path: str) -> None:
    """``live`` (rclpy message) equals ``recorded`` (rosbags message) in every field, recursively."""
    if hasattr(live, "get_fields_and_field_types"):
        for field in live.get_fields_and_field_types():
            _assert_same(getattr(live, field), getattr(recorded, field), f"{path}.{field}")
    elif isinstance(live, (list, tuple)) or hasattr(live, "typecode") or isinstance(live, np.ndarray):
        assert len(live) == len(recorded), path
        for i, (a, b) in enumerate(zip(live, recorded)):
            _assert_same(a, b, f"{path}[{i}]")
    elif isinstance(live, float):
        assert live == recorded or (math.isnan(live) and math.isnan(recorded)), f"{path}: {live} != {recorded}"
    else:
        assert live == recorded, f"{path}: {live!r} != {recorded!r}"


def test_outputs_recorded_to_mcap_read_back_field_for_field(tmp_path):
    from rosbags.highlevel import AnyReader
    from std_msgs.msg import String

    from oxygen_ros.tools.bag_recorder import BagRecorder, project_typestore

    harness = Harness(tiny_parameters(**{"control_rate_hz": 4.0, "memory.trigger.every_s": 1.0}))
    TOPICS = {harness.topic(relative): value for relative, value in OUTPUTS.items()}
    bag = tmp_path / "bag"
    recorder = BagRecorder(bag, topics=list(TOPICS), context=harness.context, discovery_period_s=0.2)
    try:
        harness.executor.add_node(recorder)
        harness.instruction.publish(String(data="put the cube in the bowl"))
        assert wait_for(lambda: set(recorder.recorded_topics) == set(TOPICS), 60.0), recorder.recorded_topics
        assert wait_for(lambda: all(recorder.message_counts.get(t, 0) >= 2 for t in TOPICS), 30.0), \
            recorder.message_counts
        harness.executor.remove_node(recorder)
    finally:
        recorder.destroy_node()
        harness.close()
    print(f"recorded {recorder.message_counts}")

    matched = {topic: 0 for topic in TOPICS}
    with AnyReader([bag], default_typestore=project_typestore()) as reader:
        assert reader.connections and {c.topic for c in reader.connections} == set(TOPICS)
        for connection, _, raw in reader.messages():
            name, key = TOPICS[connection.topic]
            message = reader.deserialize(raw, connection.msgtype)
            live = [m for m in harness.received[name] if key(m) == key(message)]
            if live:
                _assert_same(live[0], message, connection.topic)
                matched[connection.topic] += 1
    assert all(count >= 1 for count in matched.values()), matched
