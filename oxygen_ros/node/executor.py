"""The ``oxygen_node`` executable's executor: single-threaded, except that lifecycle transitions run on a
worker thread of their own.

Why not rclpy's MultiThreadedExecutor: measured side by side on this project's 2-core machine (load average
11-14; two ``oxygen_node`` processes with the tiny config at ``control_rate_hz`` 20, fed the same 30 Hz camera
and joint states, chunks counted over 60 s), the one spun by a 3-thread MultiThreadedExecutor delivered 4.4-4.8
chunks/s against 6.2-7.3 for a single-threaded executor, and 4.4 against 5.5 for this one, which matched the
single-threaded executor (6.35 against 6.45): every message callback hops to a pool thread, and those threads
compete for Python's GIL with the control-cycle thread that runs inference. Why not a single-threaded executor:
configure loads the model inside the ``change_state`` service callback, and nothing else (lifecycle state
queries, parameter services, the ask / command interface) would be answered until it returned.

So every callback runs inline on the spinning thread, as with :class:`rclpy.executors.SingleThreadedExecutor`,
except those the node names as long (``offloaded``: its ``change_state`` service and the autostart timer),
which run on one worker thread. Callback groups keep their meaning: while a transition runs, the other
callbacks of its (mutually exclusive) group wait, and the callbacks of other groups run on the spinning thread.
"""

from __future__ import annotations

from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rclpy.executors import ConditionReachedException, ShutdownException, SingleThreadedExecutor, TimeoutException


class TransitionExecutor(SingleThreadedExecutor):
    """Single-threaded executor that runs the callbacks of the entities ``offloaded`` selects (the lifecycle
    transitions) on one worker thread (see the module docstring).

    Args:
        offloaded: called with a ready entity (service, timer, subscription, ...); True = run its callback on
            the worker thread.
        context: the rclpy context (default the global one).

    An exception raised by an offloaded callback is raised by a later :meth:`spin_once`, as an inline
    callback's is by the one that ran it.
    """

    def __init__(self, offloaded: Callable[[object], bool], *, context=None):
        super().__init__(context=context)
        self._offloaded = offloaded
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oxygen_transition")
        self._pending: list[tuple[ThreadFuture, object]] = []   # (worker future, rclpy task) of offloaded ones

    def _spin_once_impl(self, timeout_sec=None, wait_condition=lambda: False) -> None:
        # rclpy's SingleThreadedExecutor._spin_once_impl, with the offloaded callbacks submitted to the worker
        try:
            handler, entity, _node = self.wait_for_ready_callbacks(timeout_sec, None, wait_condition)
        except (ShutdownException, TimeoutException, ConditionReachedException):
            handler = None
        if handler is not None:
            if self._offloaded(entity):
                self._pending.append((self._worker.submit(handler), handler))
            else:
                handler()
                exception = handler.exception()
                if exception is not None:
                    raise exception
        for future, task in [pending for pending in self._pending if pending[0].done()]:
            self._pending.remove((future, task))
            future.result()
            exception = task.exception()
            if exception is not None:
                raise exception

    def shutdown(self, timeout_sec: float | None = None) -> bool:
        """Stop executing callbacks, then wait for an offloaded callback in progress (a transition) to end."""
        done = super().shutdown(timeout_sec)
        self._worker.shutdown(wait=True)
        return done
