"""A :class:`~oxygen_ros.engine.fleet.Fleet` served by one thread for callers on many threads.

The fleet node (``oxygen_ros/node/fleet_node.py``) runs one ``oxygen_node`` per robot, each with its own
control-cycle thread at its own rate. Each node gets a :class:`RobotClient` in place of an engine: its
``run_cycle`` hands the observation to the :class:`FleetServer` and waits. The server's thread takes
every observation handed in since its last cycle and serves them in one batched fleet cycle (robots
whose cycles fall in the same stretch of time share one vision call, prefill, denoising loop and decode
steps), earliest deadline first. A robot whose observations stop simply sends none: the others are
served without it, and the text its running requests produce meanwhile waits in its client for its
node's next ``run_cycle`` or ``take_events``. A refused observation or a failing ``on_action`` callback
fails that robot's call only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Hashable

from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.fleet import Fleet
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.outputs import CycleResult, memory_entries
from oxygen_ros.engine.types import ActionChunk, MemoryEntry, Observation, TextEvent


@dataclass
class _Call:
    """One robot's pending cycle."""

    obs: Observation
    deadline: float | None
    on_action: Callable[[ActionChunk], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    result: CycleResult | None = None
    error: BaseException | None = None


class FleetServer:
    """Serves ``fleet`` from its own thread (module docstring).

    Args:
        fleet: the fleet; the server owns it from here on (add and remove robots through the server).
    """

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._cond = threading.Condition()
        self._pending: dict[Hashable, _Call] = {}
        self._clients: dict[Hashable, RobotClient] = {}
        # text events of cycles that did not serve their robot, held for its next call (guarded by _cond)
        self._queued: dict[Hashable, list[TextEvent]] = {}
        self._closed = False
        self.cycles = 0
        self._thread = threading.Thread(target=self._serve, name="oxygen_fleet_server", daemon=True)
        self._thread.start()

    @property
    def robots(self) -> list[Hashable]:
        """The robots served."""
        with self._cond:
            return list(self._clients)

    def add_robot(self, robot_id: Hashable, processor: ModelIO, config: EngineConfig) -> "RobotClient":
        """Add a robot (:meth:`Fleet.add_robot`, same errors); its client stands in for an engine."""
        with self._cond:
            if self._closed:
                raise RuntimeError("fleet server is closed")
            lane = self.fleet.add_robot(robot_id, processor, config)
            client = self._clients[robot_id] = RobotClient(self, robot_id, lane)
            self._queued[robot_id] = []
            return client

    def remove_robot(self, robot_id: Hashable) -> list[TextEvent]:
        """Remove a robot (:meth:`Fleet.remove_robot`): a call of it waiting for a cycle fails with
        RuntimeError; returns its final events and those its client still held. Raises KeyError."""
        with self._cond:
            self._clients.pop(robot_id)
            call = self._pending.pop(robot_id, None)
            queued = self._queued.pop(robot_id, [])
        if call is not None:
            call.error = RuntimeError(f"robot {robot_id!r} was removed from the fleet")
            call.done.set()
        return queued + self.fleet.remove_robot(robot_id)

    def run_robot_cycle(self, robot_id: Hashable, obs: Observation, deadline: float | None = None,
                        on_action: Callable[[ActionChunk], None] | None = None) -> CycleResult:
        """Serve ``robot_id``'s observation in the server's next batched cycle; blocks until then.

        Returns the robot's :class:`CycleResult`, its text events led by those held for it since its last
        call. Raises ValueError (refused observation), RuntimeError (robot not served, removed while
        waiting, a cycle already waiting for it, server closed) or what the model or ``on_action`` raised.
        """
        call = _Call(obs, deadline, on_action)
        with self._cond:
            if self._closed or robot_id not in self._clients:
                raise RuntimeError(f"robot {robot_id!r} is not served (removed, or the server closed)")
            if robot_id in self._pending:
                raise RuntimeError(f"robot {robot_id!r} already has a cycle waiting")
            self._pending[robot_id] = call
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def take_queued(self, robot_id: Hashable) -> list[TextEvent]:
        """The text events held for ``robot_id`` (cycles that did not serve it), oldest first; [] for a
        robot not (or no longer) served."""
        with self._cond:
            if robot_id not in self._queued:
                return []
            events, self._queued[robot_id] = self._queued[robot_id], []
        return events

    def close(self) -> None:
        """Stop serving (calls still waiting fail), remove every robot, close the fleet."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        for robot in self.robots:
            self.remove_robot(robot)
        self.fleet.close()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                calls, self._pending = self._pending, {}
                if self._closed:
                    for call in calls.values():
                        call.error = RuntimeError("fleet server is closed")
                        call.done.set()
                    return
            self._cycle(calls)

    def _cycle(self, calls: dict[Hashable, _Call]) -> None:
        failed: dict[Hashable, BaseException] = {}

        def on_action(robot: Hashable, chunk: ActionChunk) -> None:
            callback = calls[robot].on_action
            if callback is None:
                return
            try:
                callback(chunk)
            except Exception as error:   # the robot's own output failed: its call only
                failed[robot] = error

        try:
            result = self.fleet.run_cycle({r: c.obs for r, c in calls.items()},
                                          {r: c.deadline for r, c in calls.items() if c.deadline is not None},
                                          on_action)
        except BaseException as error:   # the model itself failed: every robot of the cycle
            for call in calls.values():
                call.error = error
                call.done.set()
            return
        self.cycles += 1
        with self._cond:
            for robot, events in result.text_events.items():
                if robot in self._queued:
                    self._queued[robot] += events
        for robot, call in calls.items():
            if robot in result.errors:
                call.error = result.errors[robot]
            elif robot in failed:
                call.error = failed[robot]
            else:
                cycle = result.cycles[robot]
                queued = self.take_queued(robot)
                call.result = CycleResult(cycle.action, queued + cycle.text_events, cycle.record)
            call.done.set()


class RobotShare:
    """One robot's share of a fleet's KV pool, read like a :class:`~oxygen_ros.engine.block_pool.BlockPool`:
    ``num_blocks`` its share's pages, ``num_used`` the distinct pages its language requests hold (its action
    prefix lives only within a cycle), ``bytes_per_block``, ``used_bytes``."""

    def __init__(self, lane: Engine, core):
        self._lane = lane
        self.num_blocks = core.shares.get(lane.robot_id, 0)
        self.bytes_per_block = core.pool.bytes_per_block

    @property
    def num_used(self) -> int:
        pages = set()
        for request in self._lane.active_requests:
            kv = request.kv
            if kv is not None and not kv.freed:
                pages.update(kv.block_table)
        return len(pages)

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_block


class RobotClient:
    """One robot of a :class:`FleetServer`, implementing the engine interface a node uses
    (:class:`~oxygen_ros.engine.engine.RobotEngine`): ``run_cycle`` goes through the server (batched with
    the other robots); submissions, cancellations, metrics and the robot's share of the pool are its
    fleet engine's (:meth:`Fleet.robot`). Events of cycles that did not serve this robot come with its
    next ``run_cycle`` or ``take_events``."""

    def __init__(self, server: FleetServer, robot_id: Hashable, lane: Engine):
        self.robot_id = robot_id
        self.config = lane.config
        self._server = server
        self._lane = lane

    def submit(self, task: str, instruction: str | None = None, prompt_template: str | None = None) -> int:
        """:meth:`Engine.submit` of this robot (any thread)."""
        return self._lane.submit(task, instruction, prompt_template)

    def cancel(self, request_id: int) -> bool:
        """:meth:`Engine.cancel` of this robot (any thread)."""
        return self._lane.cancel(request_id)

    def cancel_task(self, task: str) -> int:
        """:meth:`Engine.cancel_task` of this robot (any thread)."""
        return self._lane.cancel_task(task)

    def observe_delay(self, delay_s: float) -> None:
        """:meth:`Engine.observe_delay` of this robot."""
        self._lane.observe_delay(delay_s)

    @property
    def rtc_counts(self) -> dict[str, int]:
        """:attr:`Engine.rtc_counts` of this robot."""
        return self._lane.rtc_counts

    def metrics(self) -> dict:
        """:meth:`Engine.metrics` of this robot."""
        return self._lane.metrics()

    def reset_metrics(self) -> None:
        """:meth:`Engine.reset_metrics` of this robot."""
        self._lane.reset_metrics()

    @property
    def metrics_records(self):
        """This robot's :class:`~oxygen_ros.engine.metrics.EngineMetrics`."""
        return self._lane.metrics_records

    @property
    def counters(self):
        """The fleet's cumulative model work (shared by its robots)."""
        return self._lane.counters

    @property
    def subtask(self):
        """This robot's latest subtask (:class:`~oxygen_ros.engine.subtask.SubtaskState`)."""
        return self._lane.subtask

    @property
    def active_requests(self) -> list:
        """This robot's waiting and running language requests."""
        return self._lane.active_requests

    @property
    def pool(self) -> "RobotShare":
        """This robot's share of the fleet's pool (what a node reports as its KV pool)."""
        return RobotShare(self._lane, self._server.fleet.core)

    def run_cycle(self, obs: Observation, deadline: float | None = None,
                  on_action: Callable[[ActionChunk], None] | None = None) -> CycleResult:
        """:meth:`Engine.run_cycle`, served in the server's next batched cycle (blocks until then).

        Raises ValueError (refused observation), RuntimeError (robot removed, server closed) or what
        the model or ``on_action`` raised."""
        return self._server.run_robot_cycle(self.robot_id, obs, deadline, on_action)

    def warm_up(self, obs: Observation, on_action: Callable[[ActionChunk], None] | None = None) -> float:
        """The lane's single-robot :meth:`Engine.warm_up` (serialised with the fleet's cycles)."""
        return self._lane.warm_up(obs, on_action)

    def take_events(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """Events of cycles that did not serve this robot, and those produced between cycles."""
        events = self._server.take_queued(self.robot_id) + self._lane.take_events()[0]
        return events, memory_entries(events)

    def flush(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """:meth:`Engine.flush` of this robot's requests (its queued events first)."""
        events = self._server.take_queued(self.robot_id) + self._lane.flush()[0]
        return events, memory_entries(events)

    def close(self) -> list[TextEvent]:
        """Remove the robot from the fleet: its requests end (one final event each), its pages and
        share return to the pool; returns its remaining events. A second close returns []."""
        try:
            return self._server.remove_robot(self.robot_id)
        except KeyError:
            return []
