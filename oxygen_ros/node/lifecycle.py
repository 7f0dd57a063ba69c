"""The lifecycle base of ``oxygen_node``: :class:`ManagedNode` owns the transitions, the parameter lock,
the callback group of the query services and autostart, and calls the hooks of the node built on it.

Transitions and their hooks:
    configure   the parameters are read under the parameter lock in the state ``configuring``
                (:meth:`ManagedNode._read_parameters`), then ``_load(parameters)``: any exception there
                returns FAILURE with the reason logged (:attr:`configure_error`) and must leave nothing
                loaded; then ``_setup(loaded)`` creates what the configuration uses.
    activate    ``_may_activate()`` (False: FAILURE), the lifecycle publishers enabled, ``_start()``.
    deactivate  ``_stop()``, then the lifecycle publishers disabled.
    cleanup     ``_teardown()``.
    shutdown    from any state: ``_stop()`` and ``_teardown()``.
    error       a transition raised: ``_stop()`` (its failure logged) and ``_teardown()``, back to
                unconfigured.
With autostart the node drives configure → activate itself (a zero timer after construction).

Lifecycle state queries and the parameter services (reads and changes) are in a callback group of their
own: with the executable's executor (transitions on a worker thread, oxygen_ros/node/executor.py) or a
multi-threaded one they answer while a transition runs (configure loads the model). Transitions, timers and
subscriptions stay in the default group, one at a time, as with a single-threaded executor. A parameter
change and configure's reading of the parameters exclude each other through the parameter lock
(:meth:`ManagedNode.set_parameters_atomically`), so a change is either read by that configure or judged in
the state ``configuring``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

_QUERY_SERVICES = ("get_state", "get_available_states", "get_available_transitions", "get_transition_graph",
                   "describe_parameters", "get_parameters", "get_parameter_types", "list_parameters",
                   "set_parameters", "set_parameters_atomically")


class ManagedNode(LifecycleNode):
    """A lifecycle node whose transitions call hooks (see the module docstring). A subclass declares its
    parameters and then calls :meth:`_start_up`.

    Args:
        node_name: the node's name.
        **kwargs: forwarded to :class:`rclpy.lifecycle.LifecycleNode` (``context``, ``namespace``,
            ``parameter_overrides``, ...).
    """

    def __init__(self, node_name: str, **kwargs):
        super().__init__(node_name, **kwargs)
        self._query_group = MutuallyExclusiveCallbackGroup()
        for service in self.services:
            if service.srv_name.rsplit("/", 1)[-1] in _QUERY_SERVICES:
                service.callback_group = self._query_group
                self._query_group.add_entity(service)
        self._lifecycle_state = "unconfigured"
        # held while a parameter change is judged and stored, and while configure enters "configuring" and
        # reads the parameters
        self._parameter_lock = threading.RLock()
        self._configure_error: str | None = None
        self._autostart_failed: str | None = None
        self._autostart_cancelled = threading.Event()   # set by a stop signal: no further autostart transition
        self._autostart_ended: list = []   # callbacks of when_autostarted; None once autostart has ended

    def _start_up(self, autostart: bool) -> None:
        """End of the subclass's construction (its parameters declared): parameter changes are judged by
        :meth:`_refuse_change` from now on, and with ``autostart`` configure → activate runs next."""
        self.add_on_set_parameters_callback(self._check_parameter_change)
        if autostart:
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    # ---- hooks ------------------------------------------------------------------------------

    def _read_parameters(self) -> Mapping[str, Any]:
        """The parameter values configure uses (under the parameter lock); default: every parameter."""
        return {name: parameter.value for name, parameter in self._parameters.items()}

    def _load(self, parameters: Mapping[str, Any]) -> Any:
        """Configure's part that may fail: raise to return FAILURE (leave nothing loaded)."""
        return parameters

    def _setup(self, loaded: Any) -> None:
        """Configure's part after a successful :meth:`_load` (entities, state)."""

    def _may_activate(self) -> bool:
        """Whether activate may proceed (False: FAILURE, reason logged by the hook)."""
        return True

    def _start(self) -> None:
        """Activate, once the lifecycle publishers are enabled."""

    def _stop(self) -> None:
        """Deactivate, shutdown, error: stop acting while the lifecycle publishers are still enabled."""

    def _teardown(self) -> None:
        """Cleanup, shutdown, error: free what configure set up. Idempotent."""

    def _refuse_change(self, parameters: list, lifecycle_state: str) -> str | None:
        """Why a parameter change is refused in ``lifecycle_state``, or None to accept it."""
        return None

    # ---- state ------------------------------------------------------------------------------

    @property
    def lifecycle_state(self) -> str:
        """``unconfigured``, ``configuring``, ``inactive``, ``active`` or ``finalized``."""
        return self._lifecycle_state

    @property
    def configure_error(self) -> str | None:
        """Why the last configure failed (as logged), or None after a successful one."""
        return self._configure_error

    @property
    def autostart_failed(self) -> str | None:
        """``configure`` or ``activate`` when autostart's transition failed (the node stays usable, e.g. by
        a lifecycle manager; the ``oxygen_node`` executable exits non-zero), else None."""
        return self._autostart_failed

    # ---- transitions ------------------------------------------------------------------------

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            with self._parameter_lock:    # no parameter change between the state and the values read
                self._lifecycle_state = "configuring"     # configure-time parameters are refused from here on
                parameters = self._read_parameters()
            loaded = self._load(parameters)
        except Exception as error:  # any load failure: report it, keep nothing
            self._configure_error = f"{type(error).__name__}: {error}"
            self.get_logger().error(f"configure failed: {self._configure_error}")
            self._lifecycle_state = "unconfigured"
            return TransitionCallbackReturn.FAILURE
        self._configure_error = None
        self._setup(loaded)
        self._lifecycle_state = "inactive"
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        if not self._may_activate():
            return TransitionCallbackReturn.FAILURE
        result = super().on_activate(state)
        if result != TransitionCallbackReturn.SUCCESS:
            return result
        self._start()
        self._lifecycle_state = "active"
        self.get_logger().info("active")
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop()
        self._lifecycle_state = "inactive"
        self.get_logger().info("inactive")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._teardown()
        self._lifecycle_state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop()
        self._teardown()
        self._lifecycle_state = "finalized"
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error in transition from {state.label}: releasing the engine")
        try:
            self._stop()      # publishers still active: what stopping publishes goes out
        except Exception as error:  # noqa: BLE001 - the teardown below must happen whatever failed here
            self.get_logger().error(f"ending the requests in flight failed: {type(error).__name__}: {error}")
        self._teardown()
        self._lifecycle_state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self) -> None:
        """Destroy the node's entities and then the lifecycle state machine. rclpy's ``LifecycleNode`` has no
        ``destroy_node`` of its own: its state machine keeps the rcl node (and, when it is the context's last
        node, Fast DDS's participant) alive until the garbage collector finalises it at an arbitrary moment,
        where destroying the participant can wait forever on a participant-listener callback in flight.
        Destroying it here finalises the rcl node deterministically, as soon as no executor wait still holds
        one of its entities."""
        super().destroy_node()
        self._state_machine.destroy_when_not_in_use()

    # ---- parameters -------------------------------------------------------------------------

    def set_parameters(self, parameter_list):
        """rclpy's :meth:`rclpy.node.Node.set_parameters`, one parameter at a time under the node's parameter
        lock (see :meth:`set_parameters_atomically`)."""
        return [self.set_parameters_atomically([parameter]) for parameter in parameter_list]

    def set_parameters_atomically(self, parameter_list):
        """rclpy's :meth:`rclpy.node.Node.set_parameters_atomically` (what the ``set_parameters`` and
        ``set_parameters_atomically`` services call) under the node's parameter lock: the change is judged
        against the lifecycle state and stored before configure can read the parameters, or after configure
        entered ``configuring`` (configure-time parameters are then refused with the reason)."""
        with self._parameter_lock:
            return super().set_parameters_atomically(parameter_list)

    def _check_parameter_change(self, parameters) -> SetParametersResult:
        reason = self._refuse_change(parameters, self._lifecycle_state)
        return SetParametersResult(successful=reason is None, reason=reason or "")

    # ---- autostart --------------------------------------------------------------------------

    def runs_long(self, entity) -> bool:
        """Whether ``entity``'s callback may run long: the ``change_state`` service and the autostart timer
        (lifecycle transitions: configure loads the model). The ``oxygen_node`` executable runs these on a
        worker thread (oxygen_ros/node/executor.py)."""
        if entity is getattr(self, "_autostart_timer", None):
            return True
        name = getattr(entity, "srv_name", None)
        return name is not None and name.rsplit("/", 1)[-1] == "change_state" and entity in self.services

    def reconfigure(self, parameters: Mapping[str, Any]) -> None:
        """Deactivate and clean up an active node, set ``parameters`` (name -> value), configure and activate
        it again, on the calling thread (configure loads the model: seconds). Its subscriptions and timers
        need no spinning meanwhile.

        Raises:
            RuntimeError: the node was not active, a parameter was refused, or a transition failed (the
                reason in :attr:`configure_error` or the log); the node is then left in the state reached.
        """
        from rclpy.parameter import Parameter

        if self._lifecycle_state != "active":
            raise RuntimeError(f"reconfigure needs an active node, it is {self._lifecycle_state}")
        for transition, trigger in (("deactivate", self.trigger_deactivate), ("cleanup", self.trigger_cleanup)):
            if trigger() != TransitionCallbackReturn.SUCCESS:
                raise RuntimeError(f"reconfigure: {transition} failed")
        results = self.set_parameters([Parameter(name, value=value) for name, value in parameters.items()])
        refused = [result.reason for result in results if not result.successful]
        if refused:
            raise RuntimeError(f"reconfigure: parameters {dict(parameters)} refused: {refused}")
        for transition, trigger in (("configure", self.trigger_configure), ("activate", self.trigger_activate)):
            if trigger() != TransitionCallbackReturn.SUCCESS:
                raise RuntimeError(f"reconfigure: {transition} failed: {self._configure_error or 'see the log'}")

    def cancel_autostart(self) -> None:
        """Take no further autostart transition (a stop signal arrived): a configure in progress ends, but
        the node is not activated after it, so nothing is published after the signal. Any thread."""
        self._autostart_cancelled.set()

    def when_autostarted(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once autostart's transitions have ended (activated, failed: see
        :attr:`autostart_failed` and :attr:`configure_error`, or stopped by :meth:`cancel_autostart`), on the
        thread that ran them; at once when they have ended already or the node does not autostart."""
        with self._parameter_lock:
            pending = self._autostart_ended is not None and getattr(self, "_autostart_timer", None) is not None
            if pending:
                self._autostart_ended.append(callback)
        if not pending:
            callback()

    def _autostart(self) -> None:
        try:
            self._autostart_transitions()
        finally:
            with self._parameter_lock:
                callbacks, self._autostart_ended = self._autostart_ended, None
            for callback in callbacks:
                callback()

    def _autostart_transitions(self) -> None:
        self.destroy_timer(self._autostart_timer)
        for transition, trigger in (("configure", self.trigger_configure), ("activate", self.trigger_activate)):
            if self._autostart_cancelled.is_set():
                self.get_logger().info(f"autostart: stopping before {transition}; the node stays "
                                       f"{self._lifecycle_state}")
                return
            if trigger() != TransitionCallbackReturn.SUCCESS:
                self._autostart_failed = transition
                self.get_logger().error(f"autostart: {transition} failed (reason above); the node stays "
                                        f"{self._lifecycle_state}")
                return
