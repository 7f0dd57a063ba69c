"""Asking and commanding the node over real DDS: the ``~/ask`` action (feedback, result, cancel while
decoding and before the request started, rejected goals), ``~/pause_actions`` / ``~/resume_actions`` (no
action chunk while paused, language still answered, chunks again after) and ``~/set_instruction``.
No wall-clock assertions: waits are bounded only to fail instead of hanging."""
from __future__ import annotations

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

# One decode step per cycle and long utterances: a cancel lands while the request decodes.
SETTINGS = {"control_rate_hz": 4.0, "engine.scheduling": "fixed_k", "engine.decode_steps_per_cycle": 1,
            "speech.max_new_tokens": 40, "speech.trigger.every_s": 0.0, "memory.trigger.every_s": 3600.0,
            "memory.max_new_tokens": 4}


class _Asker:
    """An ``oxygen_ros/action/Ask`` client on the harness's robot node, recording feedback."""

    def __init__(self, harness: Harness):
        from oxygen_ros.action import Ask
        from rclpy.action import ActionClient

        self.Ask = Ask
        self.harness = harness
        self.client = ActionClient(harness.robot, Ask, harness.topic("oxygen_node/ask"))
        if not self.client.wait_for_server(timeout_sec=20.0):
            self.close()
            raise AssertionError("no ~/ask server")

    def close(self) -> None:
        """Destroy the action client (``destroy_node`` leaves a node's waitables, which would keep the robot
        node alive until garbage collection)."""
        self.client.destroy()

    def send(self, **goal):
        """Send a goal; returns (goal_handle or None when rejected, feedback list)."""
        feedback = []
        future = self.client.send_goal_async(self.Ask.Goal(**goal),
                                             feedback_callback=lambda msg: feedback.append(msg.feedback))
        assert wait_for(future.done, 30.0), "no answer to the goal"
        handle = future.result()
        return (handle if handle.accepted else None), feedback

    def result(self, handle, timeout: float = 90.0):
        future = handle.get_result_async()
        assert wait_for(future.done, timeout), "no result"
        return future.result()


def _call(harness: Harness, srv_type, name: str, request):
    client = harness.robot.create_client(srv_type, harness.topic(f"oxygen_node/{name}"))
    try:
        assert client.wait_for_service(timeout_sec=20.0)
        future = client.call_async(request)
        assert wait_for(future.done, 30.0), f"no answer from {name}"
        return future.result()
    finally:
        harness.robot.destroy_client(client)


@pytest.fixture(scope="module")
def harness():
    from std_msgs.msg import String

    h = Harness(tiny_parameters(**SETTINGS))
    h.instruction.publish(String(data="stack the blocks"))
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    assert h.chunks_flow(timeout=30.0)
    yield h
    h.close()


@pytest.fixture(scope="module")
def asker(harness):
    asker = _Asker(harness)
    yield asker
    asker.close()


def _speech(harness, utterance_id):
    return [s for s in harness.received["speech"] if s.utterance_id == utterance_id]


def test_ask_streams_feedback_and_returns_the_final_text(harness, asker):
    from action_msgs.msg import GoalStatus

    handle, feedback = asker.send(task="speech", instruction="what is on the table?")
    assert handle is not None
    response = asker.result(handle)
    result = response.result
    assert response.status == GoalStatus.STATUS_SUCCEEDED
    assert result.status == result.STATUS_COMPLETED and result.message == "completed"
    assert feedback, "no feedback"
    assert [f.sequence for f in feedback] == list(range(len(feedback)))
    assert all(f.utterance_id == result.utterance_id for f in feedback)
    assert "".join(f.delta for f in feedback) == feedback[-1].text
    assert result.text.startswith(feedback[-1].text)
    assert (result.header.stamp.sec, result.header.stamp.nanosec) in harness.sent_stamps
    # The same utterance on ~/speech: same id, text, stamp, and the goal's instruction.
    assert wait_for(lambda: any(s.final for s in _speech(harness, result.utterance_id)))
    final = [s for s in _speech(harness, result.utterance_id) if s.final][0]
    assert final.text == result.text and final.status == final.STATUS_COMPLETED
    assert final.instruction == "what is on the table?"
    assert (final.header.stamp.sec, final.header.stamp.nanosec) == \
        (result.header.stamp.sec, result.header.stamp.nanosec)


def test_ask_the_memory_task(harness, asker):
    handle, _ = asker.send(task="memory")
    assert handle is not None
    result = asker.result(handle).result
    assert result.status == result.STATUS_COMPLETED
    assert wait_for(lambda: any(m.entry_id == result.utterance_id for m in harness.received["memory"]))
    entry = [m for m in harness.received["memory"] if m.entry_id == result.utterance_id][0]
    assert entry.text == result.text and len(entry.embedding) > 0


def test_cancel_while_decoding_ends_only_that_request(harness, asker):
    from action_msgs.msg import GoalStatus

    handle, feedback = asker.send(task="speech", instruction="describe the scene")
    assert handle is not None
    assert wait_for(lambda: len(feedback) >= 1, 60.0), "no feedback before cancelling"
    cancel = handle.cancel_goal_async()
    assert wait_for(cancel.done, 30.0) and len(cancel.result().goals_canceling) == 1
    response = asker.result(handle)
    result = response.result
    assert response.status == GoalStatus.STATUS_CANCELED
    assert result.status == result.STATUS_CANCELLED
    assert result.text.startswith(feedback[0].text)
    assert wait_for(lambda: any(s.final for s in _speech(harness, result.utterance_id)))
    final = [s for s in _speech(harness, result.utterance_id) if s.final]
    assert len(final) == 1 and final[0].status == final[0].STATUS_CANCELLED
    request_id = int(result.utterance_id.rsplit("-", 1)[1])
    assert all(r.request_id != request_id for r in harness.node.engine.active_requests)
    assert harness.chunks_flow(timeout=30.0)      # the action task never stopped


def test_cancel_before_any_observation_ends_the_goal(harness, asker):
    """Cameras off: cycles are skipped, so the goal's request cannot start; cancelling it still ends it
    (one final Speech, a result with a zero stamp)."""
    from action_msgs.msg import GoalStatus

    harness.publish_cam0 = False
    try:
        skipped = harness.node.skipped_cycles()
        assert wait_for(lambda: harness.node.skipped_cycles() >= skipped + 2, 30.0), "cycles not skipped"
        handle, feedback = asker.send(task="speech")
        assert handle is not None
        cancel = handle.cancel_goal_async()
        assert wait_for(cancel.done, 30.0)
        response = asker.result(handle)
        result = response.result
        assert response.status == GoalStatus.STATUS_CANCELED and result.status == result.STATUS_CANCELLED
        assert not feedback and result.text == ""
        assert (result.header.stamp.sec, result.header.stamp.nanosec) == (0, 0)
        assert len([s for s in _speech(harness, result.utterance_id) if s.final]) <= 1
    finally:
        harness.publish_cam0 = True
    assert harness.chunks_flow(timeout=30.0)


def test_goals_the_node_cannot_serve_are_rejected(harness, asker):
    assert asker.send(task="poem")[0] is None
    assert asker.send(task="speech", prompt_template="no placeholder")[0] is None
    limit = harness.node.get_parameter("max_instruction_chars").value
    assert asker.send(task="speech", instruction="x" * (limit + 1))[0] is None


def test_goals_with_a_malformed_template_are_rejected_and_never_cost_a_cycle(harness, asker):
    """A template the prompt builder would fail on (an unknown field, a positional field, an unbalanced
    brace) is rejected at the goal; a valid goal sent between them completes and the chunks keep coming:
    the engine's unit of failure is the request, never the control cycle."""
    from action_msgs.msg import GoalStatus

    start, failed = harness.count("chunk"), harness.node.failed_cycles()
    for template in ("Describe {instruction} in {language}", "{instruction} {}", "{instruction} {"):
        assert asker.send(task="speech", prompt_template=template)[0] is None
    handle, _ = asker.send(task="speech", instruction="what do you see?", prompt_template="Q: {instruction}\nA:")
    assert handle is not None
    assert asker.result(handle).status == GoalStatus.STATUS_SUCCEEDED
    assert asker.send(task="speech", prompt_template="Describe {instruction} in {language}")[0] is None
    # {memory} is a field of ~/ask templates, but only with a memory store (this node has none)
    assert asker.send(task="speech", prompt_template="{memory} {instruction}")[0] is None
    assert harness.chunks_flow(timeout=30.0) and harness.count("chunk") > start
    assert harness.node.failed_cycles() == failed


def test_a_burst_of_goals_gets_one_answer_each_and_every_accepted_goal_one_result(harness):
    """100 goals sent at once (no wait between them): each is answered, accepted up to max_pending_goals, the
    rest rejected (the cameras are off, so no accepted goal can end before all are answered); every accepted
    goal gets one result once the cameras are back. rclpy's default service queues (depth 10) left most of
    such a burst without any answer."""
    from action_msgs.msg import GoalStatus
    from oxygen_ros.action import Ask
    from rclpy.action import ActionClient
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    goals, limit = 100, 30
    # The client's own queues deep too: this tests the server's answers, not the client's default depth.
    deep = QoSProfile(depth=goals * 2, reliability=ReliabilityPolicy.RELIABLE)
    client = ActionClient(harness.robot, Ask, harness.topic("oxygen_node/ask"), goal_service_qos_profile=deep,
                          result_service_qos_profile=deep, cancel_service_qos_profile=deep)
    assert harness.node.set_parameters([Parameter("max_pending_goals", value=limit)])[0].successful
    harness.publish_cam0 = False
    try:
        assert client.wait_for_server(timeout_sec=20.0)
        skipped = harness.node.skipped_cycles()
        assert wait_for(lambda: harness.node.skipped_cycles() >= skipped + 2, 30.0), "cycles not skipped"
        answers = [client.send_goal_async(Ask.Goal(task="memory")) for _ in range(goals)]
        assert wait_for(lambda: all(a.done() for a in answers), 120.0), \
            f"{sum(not a.done() for a in answers)} of {goals} goals never answered"
        accepted = [a.result() for a in answers if a.result().accepted]
        assert len(accepted) == limit, (len(accepted), goals)
        harness.publish_cam0 = True
        results = [handle.get_result_async() for handle in accepted]
        assert wait_for(lambda: all(r.done() for r in results), 600.0), \
            f"{sum(not r.done() for r in results)} of {limit} accepted goals without a result"
        assert all(r.result().status in (GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_ABORTED) for r in results)
        assert harness.node.commands.open_goals == 0
    finally:
        harness.publish_cam0 = True
        harness.node.set_parameters([Parameter("max_pending_goals", value=64)])
        client.destroy()
    assert harness.chunks_flow(timeout=30.0)


def test_pause_withholds_action_chunks_while_language_runs_and_resume_restores_them(harness, asker):
    from oxygen_ros.srv import SwitchActions

    response = _call(harness, SwitchActions, "pause_actions", SwitchActions.Request())
    assert response.success and response.paused
    assert harness.node.commands.actions_paused
    # A language request asked after the pause completes: at least one whole cycle ran since.
    handle, _ = asker.send(task="memory")
    assert asker.result(handle).result.status == 1
    chunks, withheld = harness.count("chunk"), harness.node.commands.withheld_chunks
    handle, _ = asker.send(task="memory")
    assert asker.result(handle).result.status == 1
    assert harness.node.commands.withheld_chunks > withheld, "no cycle computed a chunk while paused"
    assert harness.count("chunk") == chunks, "an action chunk left the node while paused"
    again = _call(harness, SwitchActions, "pause_actions", SwitchActions.Request())
    assert again.success and again.paused and "already" in again.message
    response = _call(harness, SwitchActions, "resume_actions", SwitchActions.Request())
    assert response.success and not response.paused
    assert harness.chunks_flow(timeout=30.0)


def test_set_instruction_answers_whether_it_was_taken(harness, asker):
    from oxygen_ros.srv import SetInstruction

    response = _call(harness, SetInstruction, "set_instruction", SetInstruction.Request(instruction="fold the towel"))
    assert response.accepted, response.message
    handle, _ = asker.send(task="memory")
    result = asker.result(handle).result
    assert wait_for(lambda: any(m.entry_id == result.utterance_id for m in harness.received["memory"]))
    entry = [m for m in harness.received["memory"] if m.entry_id == result.utterance_id][0]
    assert entry.instruction == "fold the towel"
    unchanged = _call(harness, SetInstruction, "set_instruction",
                      SetInstruction.Request(instruction="fold the towel"))
    assert unchanged.accepted and "unchanged" in unchanged.message
    empty = _call(harness, SetInstruction, "set_instruction", SetInstruction.Request(instruction="  "))
    assert not empty.accepted and "empty" in empty.message
    limit = harness.node.get_parameter("max_instruction_chars").value
    long = _call(harness, SetInstruction, "set_instruction", SetInstruction.Request(instruction="y" * (limit + 1)))
    assert not long.accepted and "max_instruction_chars" in long.message
    assert harness.drops("instruction_empty") >= 1 and harness.drops("instruction_too_long") >= 1


def test_an_unconfigured_node_refuses_goals_and_instructions_but_can_be_paused():
    from oxygen_ros.srv import SetInstruction, SwitchActions

    h = Harness(tiny_parameters(autostart=False))
    try:
        asker = _Asker(h)
        try:
            assert asker.send(task="speech")[0] is None
        finally:
            asker.close()
        response = _call(h, SetInstruction, "set_instruction", SetInstruction.Request(instruction="wave"))
        assert not response.accepted and "unconfigured" in response.message
        paused = _call(h, SwitchActions, "pause_actions", SwitchActions.Request())
        assert paused.success and paused.paused
    finally:
        h.close()
