"""The test suite's own guards (test/conftest.py): a node left alive fails its test, and a hang becomes a failure
with every thread's stack, also where pytest's own watchdog does not reach (after a test failed, after the
last test)."""
from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import conftest

HANG_BOUND_S = 300.0    # bounds a broken watchdog only (the subprocess is killed then): never reached when it works


# ---- the node leak guard -----------------------------------------------------------------------------------

@pytest.mark.ros
@pytest.mark.parametrize("holder", ["no destroy_node", "unreferenced", "action client", "lifecycle state machine"])
def test_a_node_left_alive_fails_the_check_and_is_destroyed(ros_context, holder):
    """Each way a node outlives its test is reported, naming the node and its holder, and the node is destroyed
    then (not by the garbage collector); a node destroyed properly passes the same check."""
    from rclpy.action import ActionClient
    from rclpy.lifecycle import LifecycleNode
    from rclpy.node import Node

    from oxygen_ros.action import Ask

    since = conftest._last_serial
    clean = Node("guard_clean", context=ros_context)
    clean.create_timer(10.0, lambda: None)
    clean.destroy_node()
    conftest._check_nodes(since, "the self-test")    # nothing left: no failure

    since = conftest._last_serial
    client = None
    if holder == "lifecycle state machine":
        node = LifecycleNode("guard_leaky", context=ros_context)
    else:
        node = Node("guard_leaky", context=ros_context)
    node.create_timer(10.0, lambda: node)     # a reference cycle, as most nodes have: only the collector frees it
    handle = node.handle
    if holder == "action client":
        client = ActionClient(node, Ask, "guard_ask")
    if holder in ("action client", "lifecycle state machine"):
        node.destroy_node()
    expected = {"no destroy_node": "destroy_node\\(\\) was not called",
                "unreferenced": "destroy_node\\(\\) was not called",
                "action client": "ActionClient \\(a waitable",
                "lifecycle state machine": "lifecycle state machine"}[holder]
    if holder == "unreferenced":
        del node
        gc.collect()     # what the collector may do at any moment: the guard still holds the node
    with pytest.raises(pytest.fail.Exception, match=f"(?s)the self-test left 1 rclpy node.*/guard_leaky .*{expected}"):
        conftest._check_nodes(since, "the self-test")
    assert conftest._destroy_requested(handle)
    if client is not None:
        assert conftest._destroy_requested(client._client_handle)
    assert not [serial for serial in conftest._NODES if serial > since]    # checked once, then let go


@pytest.mark.ros
def test_a_constructor_that_raises_leaves_no_node(ros_context, tmp_path):
    """A node whose constructor raises is never seen by its caller, so nobody but the node itself can destroy
    it: the replay's BagPlayer (a missing bag, a bad rate) and OxygenNode (a parameter of the wrong type, as
    ``~/add_robot`` of the fleet may be given) leave no rcl node for the garbage collector."""
    from rclpy.exceptions import InvalidParameterTypeException
    from rclpy.parameter import Parameter

    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.tools.replay import BagPlayer

    since = conftest._last_serial
    with pytest.raises(FileNotFoundError):
        BagPlayer(tmp_path / "missing", context=ros_context)
    with pytest.raises(ValueError, match="rate"):
        BagPlayer(tmp_path, rate=0.0, context=ros_context)
    with pytest.raises(InvalidParameterTypeException):
        OxygenNode(context=ros_context, parameter_overrides=[Parameter("control_rate_hz", value="fast")])
    left = {name: conftest._holders(node) for serial, (node, name, _) in conftest._NODES.items() if serial > since}
    assert not any(left.values()), left


@pytest.mark.ros
@pytest.mark.dds
def test_make_test_fast_fails_a_test_that_starts_a_node_unmarked(tmp_path):
    """``make test-fast`` (OXYGEN_TEST_FAST=1) leaves out the tests marked ``dds``; one that starts an rclpy node
    without the marker fails there, saying so, and passes with it."""
    shutil.copy(Path(conftest.__file__), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\nmarkers =\n    ros: x\n    dds: x\n")
    (tmp_path / "test_node.py").write_text(textwrap.dedent("""\
        import pytest

        def _start_a_node():
            import rclpy
            from rclpy.context import Context
            from rclpy.node import Node

            context = Context()
            rclpy.init(context=context)
            Node("unmarked", context=context).destroy_node()
            context.try_shutdown()
            context.destroy()

        def test_unmarked():
            _start_a_node()

        @pytest.mark.dds
        def test_marked():
            _start_a_node()
        """))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"OXYGEN_TEST_FAST": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rE", str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=HANG_BOUND_S)
    output = result.stdout + result.stderr
    assert "test_unmarked started 1 rclpy node(s) but is not marked `dds`" in output, output
    assert re.search(r"\b2 passed, (\d+ warnings?, )?1 error\b", output), output     # the unmarked one errs at teardown


# ---- the watchdog ------------------------------------------------------------------------------------------

def _run_hanging_suite(tmp_path: Path, test_source: str, timeout_s: int) -> subprocess.CompletedProcess:
    """pytest on ``test_source`` with this suite's conftest and a ``timeout_s`` watchdog, in a process of its own.
    ``timeout_s`` leaves room for a loaded machine's slow imports, so that the watchdog cannot fire before the
    hang (the stack asserted would not be there)."""
    shutil.copy(Path(conftest.__file__), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        addopts = -p no:cacheprovider
        faulthandler_timeout = {timeout_s}
        faulthandler_exit_on_timeout = true
        """).format(timeout_s=timeout_s))
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(test_source))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_BOUND_S)


def test_a_hang_in_the_teardown_of_a_failed_test_is_dumped_and_ends_the_run(tmp_path):
    """pytest cancels its watchdog when a test fails; a teardown that then spins holding the GIL (a regular
    expression's backtracking, like a finaliser inside C++ code) still gets every thread's stack and exit 1."""
    result = _run_hanging_suite(tmp_path, """\
        import re
        import pytest

        @pytest.fixture
        def spins_in_teardown():
            yield
            re.match(r"(a+)+$", "a" * 64 + "b")    # never returns in practice; the GIL stays held

        def test_fails(spins_in_teardown):
            assert False
        """, timeout_s=5)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    # "Timeout (0:00:04.9...)!": the failed test's remaining budget
    assert "Timeout (0:00:0" in output and "spins_in_teardown" in output, output


def test_a_hang_at_the_interpreter_exit_is_dumped_and_ends_the_run(tmp_path):
    """After the last test (the report, atexit, the interpreter's last garbage collections) the watchdog still
    runs: a hang there is dumped and the process exits with status 1 instead of 0 or a CI timeout."""
    result = _run_hanging_suite(tmp_path, """\
        import atexit
        import time

        def hangs_at_exit():
            while True:
                time.sleep(0.1)

        def test_passes():
            atexit.register(hangs_at_exit)
        """, timeout_s=20)
    output = result.stdout + result.stderr
    assert "1 passed" in output, output
    assert result.returncode == 1, output
    assert "Timeout (0:00:20)!" in output and "hangs_at_exit" in output, output
