"""The ``oxygen_node`` process: start one :class:`~oxygen_ros.node.oxygen_node.OxygenNode`, spin it, and
end it cleanly on SIGINT / SIGTERM or a lifecycle shutdown (:func:`main`; its docstring gives the order of the
stop and the exit codes). ``scripts/oxygen_node`` (``ros2 run oxygen_ros oxygen_node``) calls :func:`main`.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time

import rclpy
from rclpy.clock import Clock, ClockType
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.executors import ExternalShutdownException
from rclpy.signals import SignalHandlerOptions

from oxygen_ros.node.executor import TransitionExecutor
from oxygen_ros.node.oxygen_node import OxygenNode


def error_line(error: BaseException) -> str:
    """One line of an rclpy / rcl error: without rcl's ``, at /path/file.c:123`` source locations."""
    text = " ".join(str(error).split())
    return re.sub(r",? at \S+\.c(pp)?:\d+", "", text)


def main(args=None) -> int:
    """Run ``oxygen_node`` until SIGINT / SIGTERM or a lifecycle shutdown; returns the exit code.

    On SIGINT / SIGTERM the node stops acting while the context is still up, on the executor after any
    transition in progress (the control cycle in progress finishes, every language request in flight gets
    its final CANCELLED Speech, the controller its last command, ``on_stop_command``); the executor spins
    until every open ``~/ask`` goal has its result (aborted, STATUS_CANCELLED, the text so far; also after a
    lifecycle shutdown), the node waits up to 0.5 s for reliable subscribers to acknowledge the messages,
    then tears down; the time from the signal to the end of teardown is logged. A second signal
    during the teardown is ignored (``ros2 launch`` escalates SIGINT to SIGTERM).

    Exit codes: 0 after a signal or a lifecycle shutdown; 1 when autostart's configure or activate failed
    (reason logged; without autostart a failed configure leaves the node waiting for a lifecycle manager);
    2 when the command line, the params file or a parameter value is rejected before the node exists (a
    missing or malformed params file, a wrong type, a value out of range): one line on stderr.
    """
    return run_process("oxygen_node", OxygenNode, _spin, args)


def run_process(program: str, make_node, spin, args=None) -> int:
    """The frame every node process of this package shares: ``rclpy.init`` without rclpy's signal handlers,
    SIGINT / SIGTERM recorded in a list, the node built by ``make_node()``, then ``spin(node, received)``
    (which spins until a signal is in ``received`` and ends the node cleanly) returns the exit code.

    Args:
        program: the executable's name, first word of the one-line errors on stderr.
        make_node: builds the node (rclpy's parameter exceptions mean a rejected parameter).
        spin: ``(node, received: list[int]) -> int``.
        args: the command line for ``rclpy.init`` (None: ``sys.argv``).

    Returns:
        ``spin``'s exit code; 2 when the command line, the params file or a parameter value is rejected
        before the node exists (one line on stderr).
    """
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)

    try:
        # rclpy's own handlers would shut the context down inside the signal, before the final messages
        # could be published: the node handles SIGINT / SIGTERM itself.
        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    except Exception as error:  # rcl's argument / params-file parsing
        print(f"{program}: {error_line(error)}", file=sys.stderr)
        return 2
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            node = make_node()
        except (InvalidParameterTypeException, InvalidParameterValueException) as error:
            print(f"{program}: invalid parameter: {error_line(error)}", file=sys.stderr)
            rclpy.try_shutdown()
            return 2
        return spin(node, received)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _spin(node: OxygenNode, received: list[int]) -> int:
    """Spin ``node`` until a signal is in ``received``, a lifecycle shutdown or a failed autostart; then
    end cleanly (see :func:`main`)."""
    # Callbacks inline on this thread, lifecycle transitions on a worker thread (oxygen_ros/node/executor.py:
    # a multi-threaded executor cost inference rate), so that the query services (lifecycle state, parameter
    # reads and changes) and the ask / command interface answer while configure loads the model. Inference runs
    # on the node's own control-cycle thread.
    executor = TransitionExecutor(node.runs_long, context=node.context)
    executor.add_node(node)
    status = 0
    logger = node.get_logger()
    try:
        while not received and rclpy.ok() and node.lifecycle_state != "finalized":
            executor.spin_once(timeout_sec=0.1)
            if node.autostart_failed:
                logger.fatal(f"autostart: {node.autostart_failed} failed; exiting (code 1)")
                status = 1
                break
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    start = time.monotonic()
    node.cancel_autostart()    # a configure in progress is not followed by activate
    if received:
        logger.info(f"{signal.Signals(received[0]).name}: stopping")
    try:
        acted = False
        if rclpy.ok(context=node.context):
            # The node stops acting on the executor, in the default callback group (never concurrently with
            # a transition or the status timer), and the executor keeps spinning until every ~/ask goal has
            # handed its result to the action server, so each open goal gets its result before the exit.
            goals = node.commands.open_goals
            acted = _stop_on_executor(executor, node, logger)
            _drain_goals(executor, node, logger, goals)
        # then the executor's threads: nothing runs on them during the teardown
        executor.shutdown(timeout_sec=5.0)
        if node.stop_acting() or acted:    # a no-op when the executor already stopped it
            node.wait_for_final_messages(0.5)
        stopped = time.monotonic()
        node.release()
        node.destroy_node()
        if received:
            logger.info(f"ended {time.monotonic() - start:.2f} s after the signal (stopping "
                        f"{stopped - start:.2f} s, release {time.monotonic() - stopped:.2f} s)")
    finally:
        rclpy.try_shutdown()
    return status


_STOP_WAIT_S = 10.0      # longest wait for a transition in progress (a model load) before stopping anyway [s]
_GOALS_WAIT_S = 1.0      # longest wait for ~/ask goals to hand over their results [s]
_RESULTS_SEND_S = 0.2    # spinning after the last goal's result, for the action server to send it [s]


def _stop_on_executor(executor, node: OxygenNode, logger) -> bool:
    """Run :meth:`OxygenNode.stop_acting` as a callback of the node's default group (after any transition in
    progress; at most :data:`_STOP_WAIT_S`) and spin ``executor`` until it returned; whether the node was
    active. On the steady clock, so a paused ``/clock`` does not hold it."""
    done = threading.Event()
    acted: list[bool] = []

    def stop() -> None:
        timer.cancel()
        if done.is_set():
            return
        try:
            acted.append(node.stop_acting())
        finally:
            done.set()

    timer = node.create_timer(0.0, stop, clock=Clock(clock_type=ClockType.STEADY_TIME))
    deadline = time.monotonic() + _STOP_WAIT_S
    try:
        while not done.is_set() and time.monotonic() < deadline and rclpy.ok(context=node.context):
            executor.spin_once(timeout_sec=0.05)
    finally:
        timer.cancel()
    if not done.is_set():
        logger.warning(f"stopping: the transition in progress did not end within {_STOP_WAIT_S:g} s")
    return bool(acted and acted[0])


def _drain_goals(executor, node: OxygenNode, logger, goals: int) -> None:
    """End the ``~/ask`` goals still open (their final events, if any, come first) and spin ``executor`` until
    each has handed its result to the action server, then a little longer for the server to send them
    (``goals``: the goals open when the node began to stop; nothing to do when none was and none is)."""
    commands = node.commands
    if not goals and not commands.open_goals:
        return
    commands.end_goals("the node is stopping (signal or shutdown)")
    deadline = time.monotonic() + _GOALS_WAIT_S
    while commands.open_goals and time.monotonic() < deadline and rclpy.ok(context=node.context):
        executor.spin_once(timeout_sec=0.02)
    if commands.open_goals:
        logger.warning(f"stopping: {commands.open_goals} ~/ask goals without a result after {_GOALS_WAIT_S:g} s")
        return
    deadline = time.monotonic() + _RESULTS_SEND_S
    while time.monotonic() < deadline and rclpy.ok(context=node.context):
        executor.spin_once(timeout_sec=0.02)


if __name__ == "__main__":    # python -m oxygen_ros.node.process --ros-args ...
    raise SystemExit(main())
