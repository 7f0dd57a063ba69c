"""OxygenNode's lifecycle driven through its change_state service, as a lifecycle manager drives it.

Covers every transition of the managed-node state machine (configure, activate, deactivate, cleanup,
shutdown from unconfigured / inactive / active), transitions the state machine refuses, a failing
configure, deactivation in the middle of decoding (no KV page held, final Speech CANCELLED), and
SIGINT / SIGTERM ending the ``oxygen_node`` executable.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from node_support import JOINTS, Harness, start_executable, stop_process, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

# Long utterances decoded a few tokens per cycle, so that a deactivation lands mid-decoding.
DECODING = {"autostart": False, "control_rate_hz": 4.0, "engine.scheduling": "fixed_k",
            "engine.decode_steps_per_cycle": 2, "speech.trigger.every_n_frames": 1,
            "speech.max_new_tokens": 60, "memory.enabled": False}


@pytest.fixture(scope="module")
def harness():
    from std_msgs.msg import String

    h = Harness(tiny_parameters(**DECODING))
    h.instruction.publish(String(data="stack the blocks"))
    yield h
    h.close()


def _speech_in_flight(h: Harness) -> bool:
    engine = h.node.engine
    return engine is not None and any(r.task.name == "speech" for r in engine.active_requests)


def test_manager_sequence_configure_activate_deactivate_cleanup_and_again(harness):
    assert harness.node.lifecycle_state == "unconfigured" and harness.node.engine is None
    for _ in range(2):
        assert harness.change_state("configure")
        assert harness.node.lifecycle_state == "inactive" and harness.node.engine is not None
        assert harness.change_state("activate")
        assert harness.chunks_flow(timeout=20.0)
        assert harness.change_state("deactivate")
        count = harness.count("chunk")
        time.sleep(0.6)
        assert harness.count("chunk") <= count + 1     # publishers are off (one may have been in flight)
        assert harness.change_state("activate")         # re-activation without reconfiguring
        assert harness.chunks_flow(timeout=20.0)
        assert harness.change_state("deactivate")
        assert harness.change_state("cleanup")
        assert harness.node.lifecycle_state == "unconfigured" and harness.node.engine is None


def test_refused_transitions_leave_the_state_unchanged(harness):
    assert harness.node.lifecycle_state == "unconfigured"
    assert not harness.change_state("activate")
    assert not harness.change_state("deactivate")
    assert not harness.change_state("cleanup")
    assert harness.node.lifecycle_state == "unconfigured"
    assert harness.change_state("configure")
    assert not harness.change_state("configure")
    assert not harness.change_state("deactivate")
    assert harness.node.lifecycle_state == "inactive"
    assert harness.change_state("cleanup")


def test_deactivate_mid_decoding_cancels_speech_and_frees_every_kv_page(harness):
    assert harness.change_state("configure") and harness.change_state("activate")
    assert wait_for(lambda: _speech_in_flight(harness) and any(not s.final for s in harness.received["speech"]),
                    20.0), "no utterance in flight"
    in_flight = {r.request_id for r in harness.node.engine.active_requests}
    assert harness.change_state("deactivate")
    assert harness.node.engine.pool.num_used == 0
    assert not harness.node.engine.active_requests

    def cancelled(request_id: int) -> bool:
        return any(s.final and s.status == s.STATUS_CANCELLED and s.utterance_id.endswith(f"-{request_id}")
                   for s in harness.received["speech"])

    assert wait_for(lambda: all(cancelled(rid) for rid in in_flight)), "no final CANCELLED Speech"
    assert harness.change_state("cleanup")


@pytest.mark.parametrize("from_state", ["unconfigured", "inactive", "active"])
def test_shutdown_from_every_state(from_state):
    harness = Harness(tiny_parameters(autostart=False))
    try:
        if from_state != "unconfigured":
            assert harness.change_state("configure")
        if from_state == "active":
            assert harness.change_state("activate")
            assert harness.chunks_flow(timeout=20.0, n=1)
        assert harness.change_state("shutdown")
        assert harness.node.lifecycle_state == "finalized" and harness.node.engine is None
    finally:
        harness.close()


def test_harnesses_do_not_answer_each_others_lifecycle_services():
    """Two harnesses at once (as with a module-scoped fixture alive): each change_state reaches its own
    node only, and a closed harness leaves nothing behind that a later one could reach."""
    first = Harness(tiny_parameters(autostart=False))
    second = Harness(tiny_parameters(autostart=False))
    try:
        assert first.namespace != second.namespace
        assert first.change_state("shutdown")
        assert first.node.lifecycle_state == "finalized"
        assert second.node.lifecycle_state == "unconfigured"
        assert second.change_state("configure")     # not "no transition ... for current state finalized"
        assert second.node.lifecycle_state == "inactive"
        first.close()
        third = Harness(tiny_parameters(autostart=False))
        try:
            assert third.change_state("configure") and third.node.lifecycle_state == "inactive"
            assert second.node.lifecycle_state == "inactive"
            assert third.change_state("cleanup")
        finally:
            third.close()
        assert second.change_state("cleanup")
    finally:
        first.close()
        second.close()


def test_destroy_node_takes_the_node_off_the_graph_at_once(ros_context):
    """``OxygenNode.destroy_node`` finalises the rcl node itself, lifecycle state machine included (rclpy's
    LifecycleNode leaves that to the garbage collector, and a DDS participant destroyed from there can hang):
    another context sees the node leave the graph while the Python object is still referenced and the
    collector is off. Waits are bounded only to fail instead of hanging."""
    import gc

    import rclpy
    from rclpy.context import Context

    from oxygen_ros.node.oxygen_node import OxygenNode

    namespace = f"/destroy_{os.getpid()}"
    watcher_context = Context()
    rclpy.init(context=watcher_context)
    watcher = rclpy.create_node("graph_watcher", context=watcher_context, namespace=namespace)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        node = OxygenNode(context=ros_context, namespace=namespace, parameter_overrides=tiny_parameters(
            autostart=False))
        on_graph = lambda: ("oxygen_node", namespace) in watcher.get_node_names_and_namespaces()  # noqa: E731
        try:
            assert wait_for(on_graph, 30.0), "the watcher never saw the node"
        finally:
            node.destroy_node()
        assert wait_for(lambda: not on_graph(), 30.0), "the node is still on the graph after destroy_node"
        node.destroy_node()     # idempotent
    finally:
        if was_enabled:
            gc.enable()
        watcher.destroy_node()
        watcher_context.try_shutdown()
        watcher_context.destroy()


def test_configure_failure_is_reported_and_nothing_is_loaded():
    harness = Harness(tiny_parameters(autostart=False, preset="no_such_preset"))
    try:
        assert not harness.change_state("configure")
        assert harness.node.lifecycle_state == "unconfigured" and harness.node.engine is None
        assert not harness.change_state("activate")
    finally:
        harness.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_executable_ends_cleanly_on_signal(signum, tmp_path):
    """``oxygen_node`` with the tiny config becomes active, then exits with code 0 on the signal (the time
    it takes is logged, not asserted: a busy CI machine must not make this flaky)."""
    from oxygen_ros.msg import ActionChunk  # noqa: F401  (the environment has the built package)

    process = start_executable(tmp_path)
    try:
        output = []
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            output.append(line)
            if "active" in line and "inactive" not in line or process.poll() is not None:
                break
        assert process.poll() is None, "".join(output)
        time.sleep(1.0)                          # a few control cycles (no camera: they are skipped)
        start = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=10.0)
        elapsed = time.monotonic() - start
        print(f"{signal.Signals(signum).name}: exited in {elapsed:.2f} s with code {process.returncode}")
        assert process.returncode == 0
        # Before its first observation the node waits for inputs: logged at INFO, never as a warning.
        log = "".join(output) + process.stdout.read()
        assert "[INFO]" in log and "waiting for the first observation: no frame from required camera" in log, log
        assert not [line for line in log.splitlines() if "[WARN]" in line and "skipped cycle" in line], log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class _RobotSide:
    """A robot side for the ``oxygen_node`` executable under namespace ``namespace``: publishes camera frames,
    joint states and a latched instruction, records Speech and JointTrajectory (own context)."""

    def __init__(self, namespace: str):
        import threading

        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import String
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.msg import Speech
        from node_support import JOINTS, raw_image

        self.context = Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node("robot_side", context=self.context, namespace=namespace)
        self.positions = [0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.02]
        camera = self.node.create_publisher(Image, "camera/image_raw", qos_profile_sensor_data)
        joints = self.node.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        instruction = self.node.create_publisher(String, "instruction", QoSProfile(
            depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        instruction.publish(String(data="stack the blocks"))
        self.speech: list = []
        self.trajectories: list = []
        self.node.create_subscription(Speech, "oxygen_node/speech", self.speech.append, QoSProfile(
            depth=100, reliability=ReliabilityPolicy.RELIABLE))
        self.node.create_subscription(JointTrajectory, "oxygen_node/joint_trajectory", self.trajectories.append,
                                      QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))

        def publish():
            camera.publish(raw_image())
            joints.publish(JointState(name=JOINTS, position=self.positions))

        self.node.create_timer(0.1, publish)
        from oxygen_ros.action import Ask
        from rclpy.action import ActionClient

        self.Ask = Ask
        self.asker = ActionClient(self.node, Ask, "oxygen_node/ask")
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException

        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def ask_until_feedback(self, timeout: float = 120.0):
        """Send a ``~/ask`` speech goal, request its result at once and wait for its first feedback; returns
        (result future, feedback list)."""
        assert self.asker.wait_for_server(timeout_sec=30.0), "no ~/ask server"
        feedback: list = []
        sent = self.asker.send_goal_async(self.Ask.Goal(task="speech", instruction="what do you see?"),
                                          feedback_callback=lambda msg: feedback.append(msg.feedback))
        assert wait_for(sent.done, 30.0) and sent.result().accepted, "goal not accepted"
        result = sent.result().get_result_async()
        assert wait_for(lambda: feedback or result.done(), timeout), "no feedback"
        assert not result.done(), f"the goal ended before the stop: {result.result()}"
        return result, feedback

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5.0)
        self.thread.join(timeout=5.0)
        self.asker.destroy()    # a waitable: destroy_node leaves it, and it would keep the node alive
        self.node.destroy_node()
        self.context.try_shutdown()
        self.context.destroy()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_utterance_ends_it_and_holds_the_arm(signum, tmp_path):
    """A signal while an utterance and an ``~/ask`` goal are being decoded: before the process exits (code 0),
    every utterance that had a partial Speech gets exactly one final Speech (CANCELLED), the goal its one
    result (aborted, STATUS_CANCELLED, the text decoded so far), and the controller the on_stop_command hold
    trajectory (one point: the latest JointState positions of the trajectory joints). The time from the
    signal to the exit is printed, not asserted."""
    from action_msgs.msg import GoalStatus

    namespace = f"/sigtest_{os.getpid()}_{signum}"
    overrides = ["control_rate_hz:=4.0", "engine.scheduling:=fixed_k", "engine.decode_steps_per_cycle:=2",
                 "speech.trigger.every_n_frames:=1", "speech.max_new_tokens:=60", "memory.enabled:=false"]
    robot = _RobotSide(namespace)
    process = start_executable(tmp_path, namespace, overrides=overrides)
    try:
        assert wait_for(lambda: any(not s.final for s in list(robot.speech)) or process.poll() is not None,
                        120.0), "no partial Speech"
        assert process.poll() is None, process.stdout.read()
        result, feedback = robot.ask_until_feedback()
        start = time.monotonic()
        process.send_signal(signum)
        output, _ = process.communicate(timeout=30.0)
        elapsed = time.monotonic() - start
        print(f"{signal.Signals(signum).name} mid-utterance: exited in {elapsed:.2f} s with code {process.returncode}")
        assert process.returncode == 0, output
        assert "Traceback" not in output, output
        assert wait_for(result.done, 10.0), f"no ~/ask result before the exit\n{output}"
        response = result.result()
        assert response.status == GoalStatus.STATUS_ABORTED, output
        assert response.result.status == response.result.STATUS_CANCELLED, response.result
        assert response.result.text.startswith(feedback[-1].text), (response.result.text, feedback[-1].text)
        assert response.result.utterance_id == feedback[-1].utterance_id
        time.sleep(0.5)     # anything still in transit on loopback
        speech = list(robot.speech)
        started = {s.utterance_id for s in speech if not s.final}
        finals = [s for s in speech if s.final]
        for utterance in started:
            ends = [s for s in finals if s.utterance_id == utterance]
            assert len(ends) == 1, f"utterance {utterance}: {len(ends)} final Speech messages\n{output}"
        in_flight_at_signal = [s for s in finals if s.utterance_id in started and s.status == s.STATUS_CANCELLED]
        assert in_flight_at_signal, f"no utterance ended CANCELLED by the signal\n{output}"
        hold = robot.trajectories[-1]
        assert len(hold.points) == 1, output
        assert list(hold.joint_names) == ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6"]
        assert list(hold.points[0].positions) == pytest.approx(robot.positions[:6])
        assert list(hold.points[0].velocities) == [0.0] * 6
        assert hold.header.stamp.sec == 0 and hold.header.stamp.nanosec == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        robot.close()


@pytest.mark.parametrize("stop_command", ["hold", "none"])
def test_deactivate_sends_the_configured_last_command(stop_command):
    """on_stop_command hold: deactivate ends with one JointTrajectory holding the latest JointState positions
    of the trajectory joints; none: no trajectory after the deactivation."""
    harness = Harness(tiny_parameters(autostart=False, on_stop_command=stop_command))
    try:
        assert harness.change_state("configure") and harness.change_state("activate")
        assert wait_for(lambda: harness.count("trajectory") >= 1, 30.0), "no trajectory while active"
        assert harness.change_state("deactivate")
        before = harness.count("trajectory")
        if stop_command == "hold":
            assert wait_for(lambda: any(len(t.points) == 1 for t in harness.received["trajectory"]))
            hold = harness.received["trajectory"][-1]
            assert len(hold.points) == 1
            assert list(hold.joint_names) == JOINTS[:6]
            assert list(hold.points[0].positions) == pytest.approx(harness.joint_positions[:6])
            assert list(hold.points[0].velocities) == [0.0] * 6
        time.sleep(0.5)
        assert harness.count("trajectory") == before
        assert all(len(t.points) > 1 for t in harness.received["trajectory"][:before - (stop_command == "hold")])
        assert harness.change_state("cleanup")
    finally:
        harness.close()


@pytest.mark.parametrize("transition", ["shutdown", "deactivate"])
def test_an_open_ask_goal_gets_its_result_on_shutdown_and_deactivate(transition, tmp_path):
    """``oxygen_node`` (the executable, its own executor) with an ``~/ask`` goal being decoded: a lifecycle
    shutdown or deactivate ends the goal with exactly one result (aborted, STATUS_CANCELLED, the text so
    far) and one final Speech for its utterance; after shutdown the process exits with code 0."""
    from action_msgs.msg import GoalStatus
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    namespace = f"/asktest_{os.getpid()}_{transition}"
    overrides = ["control_rate_hz:=4.0", "engine.scheduling:=fixed_k", "engine.decode_steps_per_cycle:=1",
                 "speech.trigger.every_s:=0.0", "speech.max_new_tokens:=60", "memory.enabled:=false"]
    robot = _RobotSide(namespace)
    process = start_executable(tmp_path, namespace, overrides=overrides)
    try:
        # active: the latched instruction's utterance is being decoded
        assert wait_for(lambda: any(not s.final for s in list(robot.speech)) or process.poll() is not None,
                        120.0), "no partial Speech"
        assert process.poll() is None, process.stdout.read()
        result, feedback = robot.ask_until_feedback()
        change_state = robot.node.create_client(ChangeState, "oxygen_node/change_state")
        assert change_state.wait_for_service(timeout_sec=20.0)
        answer = change_state.call_async(ChangeState.Request(transition=Transition(label=transition)))
        assert wait_for(answer.done, 60.0) and answer.result().success, f"{transition} failed"
        assert wait_for(result.done, 30.0), "no ~/ask result"
        response = result.result()
        assert response.status == GoalStatus.STATUS_ABORTED
        assert response.result.status == response.result.STATUS_CANCELLED, response.result
        assert response.result.text.startswith(feedback[-1].text)
        utterance = response.result.utterance_id
        assert wait_for(lambda: any(s.final and s.utterance_id == utterance for s in list(robot.speech)), 10.0)
        time.sleep(0.5)     # anything still in transit on loopback
        finals = [s for s in list(robot.speech) if s.final and s.utterance_id == utterance]
        assert len(finals) == 1 and finals[0].status == finals[0].STATUS_CANCELLED
        assert finals[0].text == response.result.text
        if transition == "shutdown":
            output, _ = process.communicate(timeout=30.0)
            assert process.returncode == 0, output
            assert "Traceback" not in output, output
    finally:
        stop_process(process, 30.0)
        robot.close()
