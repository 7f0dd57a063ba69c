"""π0.5's subtask loop through oxygen_node's parameters (tiny preset, CPU, loopback DDS): the loop configured by
``subtask_task`` / ``subtask_prompt_template`` runs, its chunks carry the subtask that conditioned them, and
``speech.publish_on_change`` sends a text on ~/speech_text only when it differs from the last one sent."""
from __future__ import annotations

import pytest

from oxygen_ros.engine.types import RequestStatus, TextEvent
from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

WITH_SUBTASK = "Task: {instruction}, Subtask: {subtask}, State: {state};\nAction: "


@pytest.fixture(scope="module")
def harness():
    h = Harness(tiny_parameters(**{
        "control_rate_hz": 4.0, "subtask_task": "speech", "subtask_prompt_template": WITH_SUBTASK,
        "speech.publish_on_change": True, "speech.trigger.every_s": 0.0, "memory.enabled": False}))
    from std_msgs.msg import String

    h.instruction.publish(String(data="pick up the red cube"))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    assert h.chunks_flow(timeout=20.0)
    yield h
    h.close()


def test_the_loop_configured_by_parameters_conditions_the_chunks(harness):
    action = harness.node._settings.engine.action
    assert (action.subtask_task, action.subtask_prompt_template) == ("speech", WITH_SUBTASK)
    subtask = harness.node._engine.subtask
    assert subtask.enabled and subtask.instruction == "pick up the red cube"
    # Until the speech task completes on its stop token the chunks come from the plain prompt.
    assert all(chunk.subtask == "" for chunk in harness.received["chunk"]) or subtask.updates > 0
    # The tiny random model rarely ends on EOS: give the robot a subtask as a completed request would.
    subtask.text = "grasp the cube"
    assert wait_for(lambda: any(c.subtask == "grasp the cube" for c in harness.received["chunk"]), 20.0)
    assert harness.chunks_flow(timeout=20.0)


def test_speech_text_only_when_it_changes(harness):
    node = harness.node
    # The one utterance the instruction triggers has ended (its text, if speakable, was sent).
    assert wait_for(lambda: any(s.final for s in harness.received["speech"]), 30.0)
    start = harness.count("speech_text")

    def say(*texts):
        for text in texts:
            node._language.publish_speech_text(TextEvent(0, "speech", 0, 0.0, "", text, [], True,
                                                RequestStatus.COMPLETED))

    say("grasp the cube", " grasp the cube \n", "lift the cube", "lift the cube", "grasp the cube")
    want = ["grasp the cube", "lift the cube", "grasp the cube"]
    assert wait_for(lambda: harness.count("speech_text") >= start + len(want), 10.0)
    from rclpy.parameter import Parameter

    assert node.set_parameters([Parameter("speech.publish_on_change", value=False)])[0].successful
    say("grasp the cube", "grasp the cube")
    want += ["grasp the cube", "grasp the cube"]
    assert wait_for(lambda: harness.count("speech_text") >= start + len(want), 10.0)
    assert [m.data for m in harness.received["speech_text"][start:]] == want


def test_speech_text_is_latched_for_late_subscribers(harness):
    """Said once per subtask, the text must still reach a recorder that subscribes afterwards."""
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    assert wait_for(lambda: harness.count("speech_text") > 0, 10.0)
    last = harness.received["speech_text"][-1].data
    late: list[str] = []
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    sub = harness.robot.create_subscription(String, "oxygen_node/speech_text", lambda m: late.append(m.data), qos)
    try:
        # The history replayed on matching ends with the last text sent (a newer one may follow it live).
        assert wait_for(lambda: last in late, 20.0), late
    finally:
        harness.robot.destroy_subscription(sub)
