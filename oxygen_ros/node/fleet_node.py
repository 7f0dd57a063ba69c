"""``oxygen_fleet_node``: one process, one model and one engine serving many robots (docs/fleet.md).

For every robot namespace it serves, the process runs an ordinary ``oxygen_node``
(:class:`~oxygen_ros.node.oxygen_node.OxygenNode`) in that namespace: ``/<robot>/oxygen_node`` with the
robot's own parameters (the process's params file, keyed ``/**/oxygen_node`` or ``/<robot>/oxygen_node``),
inputs resolved in ``/<robot>`` (cameras, joint_states, instruction), outputs under
``/<robot>/oxygen_node/`` (action_chunk, joint_trajectory, speech, speech_text, memory, status), its
lifecycle, services, output checks and diagnostics. What changes is its engine: instead of loading a model
each node gets a client (:class:`~oxygen_ros.engine.fleet_server.RobotClient`) of the one
:class:`~oxygen_ros.engine.fleet.Fleet` this process serves from one thread
(:class:`~oxygen_ros.engine.fleet_server.FleetServer`). Each robot's control-cycle thread hands its
observation to the server, which serves every robot's observation handed in since its last cycle in one
batched cycle. A robot whose inputs stop skips its cycles as a single node does; the others are served
without it.

The model is loaded by the first robot's configure; every later robot must name the same model
(preset, checkpoint, dtype, device, seed and the family's horizon and prompt budget), and may differ in
everything else (conventions family, cameras, joints, tasks, rates, its ``engine.kv_budget_mb``: its share
of the fleet's pool). The fleet's own parameters (this node's, ``oxygen_fleet``): ``robots`` (the
namespaces served from the start), ``kv_budget_mb`` (the shared pool), ``block_size``, ``scheduling``,
``decode_steps_per_cycle`` and ``max_batch_size``; the fleet's ``block_size`` and ``scheduling`` apply to
every robot.

Services: ``~/add_robot`` and ``~/remove_robot`` (``oxygen_ros/srv/FleetRobot``) start and stop serving one
namespace at run time; the other robots keep running. ``~/add_robot`` answers once the robot's autostart
has configured and activated it, or with the reason it failed (nothing of it is kept, so a corrected retry
succeeds). A removed robot's ``~/ask`` goals each get one result (aborted, ``STATUS_CANCELLED``, the reason)
before its node is destroyed; so do every robot's on SIGINT / SIGTERM, before the context shuts down.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import replace
from typing import Callable

import rclpy
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.task import Future

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.fleet import Fleet
from oxygen_ros.engine.fleet_server import FleetServer, RobotClient
from oxygen_ros.node.executor import TransitionExecutor
from oxygen_ros.node.model_loading import load_parts, load_processor, model_key
from oxygen_ros.node.oxygen_node import OxygenNode
from oxygen_ros.node.process import _GOALS_WAIT_S, _RESULTS_SEND_S, error_line as _error_line, run_process
from oxygen_ros.node.parameters import NodeSettings
from oxygen_ros.srv import FleetRobot

_NAMESPACE = re.compile(r"^/?[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)*$")

# The fleet's parameters: name -> (default, description).
FLEET_PARAMETERS = {
    "kv_budget_mb": (256, "MiB of the shared KV pool; each robot's engine.kv_budget_mb is its share of it"),
    "block_size": (16, "tokens per KV page (every robot's)"),
    "scheduling": ("deadline", "deadline or fixed_k, for every robot (the engine's scheduling)"),
    "decode_steps_per_cycle": (5, "k of fixed_k scheduling: decode steps per fleet cycle"),
    "max_batch_size": (64, "most language requests of all robots in one decode step"),
}


class FleetNode(Node):
    """Serves robot namespaces on one model and engine (module docstring).

    Args:
        node_name: this node's name (default ``oxygen_fleet``).
        robot_parameters: parameter overrides of a robot's ``oxygen_node`` by namespace (None: only the
            process's params file and command line, as ``ros2 run`` gives them).
        **kwargs: forwarded to :class:`rclpy.node.Node` (``context``, ``namespace``, ...).

    Call :meth:`attach` with the executor that spins it: robot nodes are added to (and removed from) that
    executor, and the ``robots`` parameter's namespaces are served from then on.
    """

    def __init__(self, node_name: str = "oxygen_fleet",
                 robot_parameters: Callable[[str], list[Parameter]] | None = None, **kwargs):
        super().__init__(node_name, **kwargs)
        # Read-only: at run time robots come and go through ~/add_robot and ~/remove_robot (a parameter
        # update that changed nothing would be silently wrong).
        self.declare_parameter("robots", Parameter.Type.STRING_ARRAY, ParameterDescriptor(
            description="robot namespaces served from the start (at run time: ~/add_robot, ~/remove_robot)",
            read_only=True))
        for name, (default, description) in FLEET_PARAMETERS.items():
            self.declare_parameter(name, default, ParameterDescriptor(description=description, read_only=True))
        self._robot_parameters = robot_parameters
        self._lock = threading.RLock()          # the robot nodes
        self._model_lock = threading.Lock()     # the model and the server (held while the model loads)
        self._nodes: dict[str, OxygenNode] = {}
        # removed robots' nodes, still spun until their ~/ask goals have handed over their results
        # (guarded by _lock): node -> [steady time it was removed, steady time its last goal returned or None]
        self._retiring: dict[OxygenNode, list] = {}
        self._reap_timer = None
        self._server: FleetServer | None = None
        self._model_key: tuple | None = None
        self._executor = None
        # its own group: an add waits (without blocking the executor) for the robot's configure and activate
        self.create_service(FleetRobot, "~/add_robot", self._on_add, callback_group=ReentrantCallbackGroup())
        self.create_service(FleetRobot, "~/remove_robot", self._on_remove)

    # ------------------------------------------------------------------ robots

    @property
    def robots(self) -> list[str]:
        """The namespaces served."""
        with self._lock:
            return list(self._nodes)

    def robot_node(self, robot: str) -> OxygenNode:
        """The ``oxygen_node`` of ``robot`` (KeyError if not served)."""
        with self._lock:
            return self._nodes[_absolute(robot)]

    @property
    def server(self) -> FleetServer | None:
        """The fleet server (None until the first robot configured)."""
        return self._server

    def attach(self, executor) -> None:
        """Spin robot nodes on ``executor`` and serve the ``robots`` parameter's namespaces."""
        self._executor = executor
        try:
            robots = self.get_parameter("robots").value or []
        except Exception:   # noqa: BLE001 - declared without a value: no robot from the start
            robots = []
        for robot in robots:
            ok, message = self.add_robot(robot)
            (self.get_logger().info if ok else self.get_logger().error)(message)

    def runs_long(self, entity) -> bool:
        """Whether ``entity`` is a robot node's lifecycle transition (run on the executor's worker)."""
        with self._lock:
            nodes = list(self._nodes.values())
        return any(node.runs_long(entity) for node in nodes)

    def add_robot(self, robot: str) -> tuple[bool, str]:
        """Start serving ``robot``'s namespace: an ``oxygen_node`` there (autostart configures and activates
        it; its configure adds it to the fleet). Returns ``(success, message)`` of the start; when autostart
        then fails (its configure names another model than the fleet serves, its share does not fit, ...),
        the node is removed again with nothing left of it, the reason logged (:meth:`add_robot_async`
        reports it to the caller)."""
        return self._start_robot(robot)

    def add_robot_async(self, robot: str) -> Future:
        """:meth:`add_robot`, the outcome known once the robot's autostart has ended: a Future (done on this
        node's executor) of ``(success, message)``, where success means the robot's node is active (or, with
        ``autostart`` off, started unconfigured) and a failure's message carries the reason (its configure
        error), the robot not served and nothing of it kept, so a corrected retry succeeds."""
        future = Future(executor=self._executor)
        ok, message = self._start_robot(robot, future)
        if not ok:
            future.set_result((False, message))
        return future

    def _start_robot(self, robot: str, future: Future | None = None) -> tuple[bool, str]:
        """Start ``robot``'s node; once its autostart has ended, :meth:`_settle_autostart` (on the executor,
        the transition's thread only hands it over) removes it if that failed and gives ``future`` the outcome."""
        if not _NAMESPACE.match(robot or ""):
            return False, f"invalid robot namespace {robot!r}"
        robot = _absolute(robot)
        with self._lock:
            if self._executor is None:
                return False, "the fleet node is not spinning yet"
            if robot in self._nodes:
                return False, f"robot {robot} is already served"
            overrides = self._robot_parameters(robot) if self._robot_parameters else []
            try:
                node = OxygenNode(namespace=robot, context=self.context, parameter_overrides=overrides,
                                  engine_builder=lambda settings, robot=robot: self._engine_for(robot, settings))
            except (InvalidParameterTypeException, InvalidParameterValueException) as error:
                return False, f"robot {robot}: invalid parameter: {_error_line(error)}"
            self._nodes[robot] = node
        self._executor.add_node(node)
        added = f"robot {robot} added: {node.get_fully_qualified_name()}"
        node.when_autostarted(lambda: self._executor.create_task(self._settle_autostart, robot, node, added, future))
        return True, added

    def _settle_autostart(self, robot: str, node: OxygenNode, added: str | None = None,
                          future: Future | None = None) -> None:
        """After ``node``'s autostart (on the executor): a robot whose autostart failed is removed with
        everything it holds; ``future`` (an add's) gets the outcome."""
        with self._lock:
            served = self._nodes.get(robot) is node
        failed = node.autostart_failed
        if failed is not None:
            reason = node.configure_error if failed == "configure" and node.configure_error else \
                f"{failed} failed (see its log)"
            message = f"robot {robot} not added: {failed} failed: {reason}"
            if served:
                self.get_logger().error(f"{message}; it can be added again once corrected")
                self._drop(robot, node, f"robot {robot}: {failed} failed")
        elif not served:
            message = f"robot {robot} was removed before its autostart ended"
        else:
            message = added
        if future is not None and not future.done():
            future.set_result((failed is None and served, message))

    def remove_robot(self, robot: str) -> tuple[bool, str]:
        """Stop serving ``robot``: its node stops acting (final Speech of every request, its stop command),
        ends its ``~/ask`` goals (each one result: aborted, ``STATUS_CANCELLED``, "robot ... removed from the
        fleet"), releases its engine client (its pages and share return to the pool) and is destroyed once
        the goals have handed over their results (while the executor spins; :meth:`close` at once); the
        other robots keep running. Refused while the robot's node is configuring. Returns
        ``(success, message)``."""
        robot = _absolute(robot) if _NAMESPACE.match(robot or "") else robot
        with self._lock:
            node = self._nodes.get(robot)
            if node is None:
                return False, f"robot {robot!r} is not served"
            if node.lifecycle_state == "configuring":
                return False, f"robot {robot} is configuring; remove it once configured"
        self._drop(robot, node, f"robot {robot} was removed from the fleet")
        return True, f"robot {robot} removed"

    def _drop(self, robot: str, node: OxygenNode, reason: str) -> None:
        """Stop and release ``node`` (``reason``: its open goals' result message), then retire it."""
        with self._lock:
            if self._nodes.get(robot) is node:
                del self._nodes[robot]
        node.cancel_autostart()
        node.commands.end_goals(reason)     # before the final events: their results carry the reason
        if node.stop_acting():
            node.wait_for_final_messages(0.5)
        node.release()
        with self._lock:
            self._retiring[node] = [time.monotonic(), None]
            if self._reap_timer is None and self._executor is not None:
                # on the steady clock: a paused /clock must not keep removed nodes alive
                self._reap_timer = self.create_timer(0.02, self._reap, clock=Clock(clock_type=ClockType.STEADY_TIME))

    @property
    def retiring(self) -> int:
        """Removed robots' nodes not yet destroyed (their ``~/ask`` goals are handing over results)."""
        with self._lock:
            return len(self._retiring)

    def _reap(self, force: bool = False) -> None:
        """Destroy the retired nodes whose ``~/ask`` goals have all returned their results, after
        :data:`_RESULTS_SEND_S` more of spinning for the action server to send them, or that waited over
        :data:`_GOALS_WAIT_S` for them (logged); ``force``: all now (nothing spins any more)."""
        now = time.monotonic()
        done = []
        with self._lock:
            for node, times in self._retiring.items():
                if node.commands.open_goals and not force:
                    if now - times[0] < _GOALS_WAIT_S:
                        continue
                    self.get_logger().warning(f"{node.get_namespace()}: {node.commands.open_goals} ~/ask goals "
                                              f"without a result after {_GOALS_WAIT_S:g} s; destroying its node")
                elif not force:
                    times[1] = times[1] or now
                    if now - times[1] < _RESULTS_SEND_S:
                        continue
                done.append(node)
            for node in done:
                del self._retiring[node]
            timer = self._reap_timer if not self._retiring else None
            if timer is not None:
                self._reap_timer = None
        for node in done:
            if self._executor is not None:
                self._executor.remove_node(node)
            node.destroy_node()
        if timer is not None:
            self.destroy_timer(timer)

    def stop_robots(self) -> None:
        """End every robot that is not configuring as :meth:`remove_robot` does (a stop signal: their goals'
        result message says so); those configuring are left to :meth:`close`."""
        for robot in self.robots:
            with self._lock:
                node = self._nodes.get(robot)
            if node is not None and node.lifecycle_state != "configuring":
                self._drop(robot, node, "the fleet node is stopping (signal or shutdown)")

    def close(self) -> None:
        """Remove every robot, destroy every removed robot's node now, and stop the fleet server (what the
        process's exit does, after the executor stopped spinning)."""
        for robot in self.robots:
            with self._lock:
                node = self._nodes.get(robot)
            if node is not None:
                node.cancel_autostart()
                self._drop(robot, node, "the fleet node is closing")
        self._reap(force=True)
        with self._model_lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()

    # ------------------------------------------------------------------ engine

    def _fleet_config(self, settings: NodeSettings) -> EngineConfig:
        values = {name: self.get_parameter(name).value for name in FLEET_PARAMETERS}
        return EngineConfig.from_dict({**values, "mode": "unified", "camera_slots": list(settings.engine.camera_slots),
                                       "cuda_graphs": settings.engine.cuda_graphs,
                                       "cpu_compile": settings.engine.cpu_compile,
                                       "intra_op_threads": settings.engine.intra_op_threads})

    def _engine_for(self, robot: str, settings: NodeSettings) -> RobotClient:
        """A robot node's engine (its configure step): a client of the fleet, the model loaded with the first.

        Raises:
            ValueError: the robot names another model than the fleet serves, its share does not fit, or
                its configuration cannot run in the fleet (as :meth:`Fleet.add_robot`); what loading raises.
        """
        with self._model_lock:
            key = model_key(settings)
            if self._server is None:
                parts = load_parts(settings)
                self._server = FleetServer(Fleet(parts.model, self._fleet_config(settings)))
                self._model_key = key
                processor = parts.processor
            elif key != self._model_key:
                raise ValueError(f"robot {robot} names the model {key}, this fleet serves {self._model_key} "
                                 "(one model per fleet node)")
            else:
                processor = load_processor(settings)
            fleet = self._server.fleet.config
            config = replace(settings.engine, scheduling=fleet.scheduling, block_size=fleet.block_size)
            return self._server.add_robot(robot, processor, config)

    async def _on_add(self, request, response):
        response.success, response.message = await self.add_robot_async(request.robot)
        return response

    def _on_remove(self, request, response):
        response.success, response.message = self.remove_robot(request.robot)
        return response


def _absolute(robot: str) -> str:
    return robot if robot.startswith("/") else "/" + robot


def main(args=None) -> int:
    """Run ``oxygen_fleet_node`` until SIGINT / SIGTERM; returns the exit code (0; 2 when the command line or
    a parameter is rejected before the node exists)."""
    return run_process("oxygen_fleet_node", FleetNode, _spin, args)


def _spin(fleet: "FleetNode", received: list[int]) -> int:
    """Spin ``fleet`` until a signal is in ``received``, then stop every robot and tear down (0)."""
    executor = TransitionExecutor(fleet.runs_long, context=fleet.context)
    executor.add_node(fleet)
    fleet.attach(executor)
    logger = fleet.get_logger()
    try:
        while not received and rclpy.ok():
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    start = time.monotonic()
    if received:
        logger.info(f"{signal.Signals(received[0]).name}: stopping")
    try:
        if rclpy.ok(context=fleet.context):
            # Each robot stops while the context is up, and the executor spins until every ~/ask goal has
            # handed its result to its action server and the servers have sent them (bounded: _reap).
            for robot in fleet.robots:
                fleet.robot_node(robot).cancel_autostart()
            fleet.stop_robots()
            while fleet.retiring and rclpy.ok(context=fleet.context):
                executor.spin_once(timeout_sec=0.02)
        executor.shutdown(timeout_sec=5.0)     # a transition in progress ends first
        fleet.close()
        fleet.destroy_node()
        logger.info(f"ended {time.monotonic() - start:.2f} s after the signal")
    finally:
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":    # python -m oxygen_ros.node.fleet_node --ros-args ...
    raise SystemExit(main())
