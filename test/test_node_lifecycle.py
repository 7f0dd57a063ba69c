"""OxygenNode's lifecycle driven through its change_state service, as a lifecycle manager drives it.

Covers every transition of the managed-node state machine (configure, activate, deactivate, cleanup,
shutdown from unconfigured / inactive / active), transitions the state machine refuses, a failing
configure, deactivation in the middle of decoding (no KV page held, final Speech CANCELLED), and
SIGINT / SIGTERM ending the ``oxygen_node`` executable.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from test_node_support import EXECUTABLE, REPO_ROOT, Harness, tiny_parameters, wait_for

pytestmark = pytest.mark.ros

# Long utterances decoded a few tokens per cycle, so that a deactivation lands mid-decoding.
DECODING = {"autostart": False, "control_rate_hz": 4.0, "engine.scheduling": "fixed_k",
            "engine.decode_steps_per_cycle": 2, "speech.trigger_every_n_frames": 1,
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

    executable = EXECUTABLE
    params = REPO_ROOT / "config" / "pi05_tiny.yaml"
    process = subprocess.Popen([sys.executable, str(executable), "--ros-args", "--params-file", str(params)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ))
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
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
