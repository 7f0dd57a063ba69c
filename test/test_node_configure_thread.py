"""The ``oxygen_node`` executable answers lifecycle state queries, parameter reads and parameter changes while
configure loads the model: the normalisation statistics file is a named pipe, so configure blocks in reading it
(a file read that releases Python's GIL, as a checkpoint load does) until the test opens the pipe's other end,
which it does only after those services answered with the node in the ``configuring`` state. While configuring,
a configure-time parameter is refused with the reason (the load in progress uses the values read when configure
began) and a dynamic one is accepted."""
from __future__ import annotations

import contextlib
import errno
import os
import time

import pytest

from node_support import start_executable

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes


def _call(executor, client, request, timeout: float = 20.0):
    future = client.call_async(request)
    executor.spin_until_future_complete(future, timeout_sec=timeout)
    assert future.done(), f"no answer from {client.srv_name}"
    return future.result()


def _release(pipe, process, timeout: float = 120.0) -> None:
    """Open and close the write end of ``pipe`` once configure has opened its read end (until then opening
    it without blocking fails with ENXIO): the reader then sees end of file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as error:
            if error.errno != errno.ENXIO or process.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextlib.contextmanager
def _configuring_node(tmp_path, name: str):
    """Start the ``oxygen_node`` executable (tiny config, autostart) whose ``norm_stats_path`` is a named pipe, and
    wait until it is ``configuring`` (blocked in reading the pipe). Yields ``(process, pipe, namespace, probe,
    executor)``: the process (stdout and stderr together), the pipe, the node's namespace and a probe node with
    its executor for service calls; kills the process if it is still running at the end."""
    import rclpy
    from lifecycle_msgs.srv import GetState
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.node import Node

    pipe = tmp_path / "norm_stats.json"
    os.mkfifo(pipe)
    namespace = f"/{name}_{os.getpid()}"
    process = start_executable(tmp_path, namespace, overrides=[f"norm_stats_path:={pipe}"])
    context = Context()
    rclpy.init(context=context)
    probe = Node(f"{name}_probe", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(probe)
    try:
        get_state = probe.create_client(GetState, f"{namespace}/oxygen_node/get_state")
        assert get_state.wait_for_service(timeout_sec=60.0), "no get_state service"
        label = ""
        deadline = time.monotonic() + 120.0
        while label != "configuring" and process.poll() is None and time.monotonic() < deadline:
            label = _call(executor, get_state, GetState.Request()).current_state.label
            time.sleep(0.1)
        assert label == "configuring", f"state {label!r}"
        yield process, pipe, namespace, probe, executor
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        executor.shutdown()
        probe.destroy_node()
        context.try_shutdown()
        context.destroy()


def test_services_answer_while_configure_loads_the_model(tmp_path):
    from lifecycle_msgs.srv import GetState
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import GetParameters, ListParameters, SetParameters

    with _configuring_node(tmp_path, "configuring") as (process, pipe, namespace, probe, executor):
        get_state = probe.create_client(GetState, f"{namespace}/oxygen_node/get_state")
        get_parameters = probe.create_client(GetParameters, f"{namespace}/oxygen_node/get_parameters")
        assert get_parameters.wait_for_service(timeout_sec=20.0)
        values = _call(executor, get_parameters, GetParameters.Request(names=["preset", "norm_stats_path"])).values
        assert [v.string_value for v in values] == ["pi05_tiny", str(pipe)]
        names = _call(executor, probe.create_client(ListParameters, f"{namespace}/oxygen_node/list_parameters"),
                      ListParameters.Request()).result.names
        assert "preset" in names and "staleness_limit_s" in names
        set_parameters = probe.create_client(SetParameters, f"{namespace}/oxygen_node/set_parameters")
        assert set_parameters.wait_for_service(timeout_sec=20.0)
        device = Parameter(name="device", value=ParameterValue(type=ParameterType.PARAMETER_STRING,
                                                               string_value="cpu"))
        staleness = Parameter(name="staleness_limit_s", value=ParameterValue(type=ParameterType.PARAMETER_DOUBLE,
                                                                             double_value=0.75))
        refused, accepted = _call(executor, set_parameters, SetParameters.Request(parameters=[device, staleness])).results
        assert not refused.successful and "configuring" in refused.reason and "device" in refused.reason, refused
        assert accepted.successful, accepted.reason
        values = _call(executor, get_parameters, GetParameters.Request(names=["staleness_limit_s"])).values
        assert values[0].double_value == 0.75
        # Still configuring: configure waits on the pipe.
        assert _call(executor, get_state, GetState.Request()).current_state.label == "configuring"
        _release(pipe, process)      # end of file: not JSON, configure fails
        output, _ = process.communicate(timeout=120.0)
        assert process.returncode == 1, output                # autostart's configure failed
        assert "configure failed" in output, output


def test_a_signal_during_configure_stops_autostart_before_activate(tmp_path):
    """SIGINT while autostart's configure loads the model: configure ends, but the node is never activated
    (nothing could be published after the signal), and the process exits 0."""
    import re
    import signal

    import numpy as np

    from oxygen_ros.models.config import NormStats, save_norm_stats

    joints = 7    # config/pi05_tiny.yaml's joint_names
    stats = NormStats(mean=np.zeros(joints), std=np.ones(joints), q01=-np.ones(joints), q99=np.ones(joints))
    valid = tmp_path / "valid.json"
    save_norm_stats({"state": stats, "actions": stats}, valid)
    with _configuring_node(tmp_path, "stopping") as (process, pipe, _namespace, _probe, _executor):
        process.send_signal(signal.SIGINT)
        with open(pipe, "w") as writer:        # configure has the read end open: it now reads valid statistics
            writer.write(valid.read_text())
        output, _ = process.communicate(timeout=120.0)
        assert process.returncode == 0, output
        assert "autostart: stopping before activate" in output, output
        assert re.search(r"\]: configured ", output), output      # configure itself completed
        assert not re.search(r"\]: active$", output, flags=re.M), output
