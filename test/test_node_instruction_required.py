"""Nothing moves without a task, over real DDS: with ``default_instruction: ""`` (the shipped tiny config) and no
instruction published, the node publishes no ActionChunk or JointTrajectory while its inputs flow; the skipped
cycles are counted (``no_instruction``) and ``/diagnostics`` says why. Blank instructions (topic,
``~/set_instruction``) and ``~/ask`` goals with a blank instruction or while there is none are refused with the
reason. The first instruction starts the action outputs. No wall-clock assertions: counts of cycles only."""
from __future__ import annotations

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

SETTINGS = {"default_instruction": "", "control_rate_hz": 4.0, "speech.max_new_tokens": 4,
            "memory.max_new_tokens": 4}


@pytest.fixture(scope="module")
def harness():
    h = Harness(tiny_parameters(**SETTINGS))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    yield h
    h.close()


@pytest.fixture(scope="module")
def asker(harness):
    from oxygen_ros.action import Ask
    from rclpy.action import ActionClient

    client = ActionClient(harness.robot, Ask, harness.topic("oxygen_node/ask"))
    assert client.wait_for_server(timeout_sec=20.0)

    def send(**goal):
        """The goal's handle when accepted, else None."""
        future = client.send_goal_async(Ask.Goal(**goal))
        assert wait_for(future.done, 30.0), "no answer to the goal"
        return future.result() if future.result().accepted else None

    yield send
    client.destroy()


def _no_instruction_skips(harness) -> int:
    return harness.node.skip_reasons().get("no_instruction", 0)


def _engine_status(harness):
    name = f"{harness.namespace}/oxygen_node: engine"
    statuses = [s for array in list(harness.received["diagnostics"]) for s in array.status if s.name == name]
    return statuses[-1] if statuses else None


def test_without_an_instruction_no_action_output_and_the_status_says_why(harness):
    assert wait_for(lambda: _no_instruction_skips(harness) >= 6, 60.0), harness.node.skip_reasons()
    assert harness.count("chunk") == 0 and harness.count("trajectory") == 0
    assert harness.count("speech") == 0 and harness.count("memory") == 0
    assert wait_for(lambda: _engine_status(harness) is not None
                    and "waiting for an instruction" in _engine_status(harness).message, 30.0), \
        _engine_status(harness)


def test_blank_instructions_are_refused_with_the_reason(harness, asker):
    from oxygen_ros.srv import SetInstruction
    from std_msgs.msg import String

    drops = harness.drops("instruction_empty")
    harness.instruction.publish(String(data=" \t\n "))
    assert wait_for(lambda: harness.drops("instruction_empty") > drops, 30.0)
    client = harness.robot.create_client(SetInstruction, harness.topic("oxygen_node/set_instruction"))
    try:
        assert client.wait_for_service(timeout_sec=20.0)
        future = client.call_async(SetInstruction.Request(instruction="   "))
        assert wait_for(future.done, 30.0)
        assert not future.result().accepted and "blank" in future.result().message
    finally:
        harness.robot.destroy_client(client)
    # ~/ask: no goal while the node has no instruction, with or without one of its own; blank ones never
    assert asker(task="speech") is None
    assert asker(task="speech", instruction="what do you see?") is None
    assert asker(task="speech", instruction="   ") is None
    skips = _no_instruction_skips(harness)
    assert wait_for(lambda: _no_instruction_skips(harness) >= skips + 2, 60.0)
    assert harness.count("chunk") == 0 and harness.count("trajectory") == 0


def test_the_first_instruction_starts_the_action_outputs(harness, asker):
    from std_msgs.msg import String

    harness.instruction.publish(String(data="stack the blocks"))
    assert harness.chunks_flow(timeout=60.0)
    assert wait_for(lambda: harness.count("trajectory") > 0, 30.0)
    assert asker(task="speech", instruction="   ") is None
    handle = asker(task="memory")
    assert handle is not None
    future = handle.get_result_async()
    assert wait_for(future.done, 120.0), "no result"


def test_invisible_only_instructions_are_blank():
    """Whitespace and invisible format characters (zero-width space, byte-order mark, word joiner) give no task;
    any visible character does."""
    from oxygen_ros.node.inputs import is_blank

    for blank in ("", "   ", "\t\n", "\u200b", "\ufeff \u2060", "\u00a0\u3000"):
        assert is_blank(blank), repr(blank)
    for task in ("pick", " x\u200b", "拾う"):
        assert not is_blank(task), repr(task)
