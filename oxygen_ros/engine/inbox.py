"""Requests from other threads: on-demand submissions and cancellations, applied by the cycle.

:meth:`Engine.submit`, :meth:`Engine.cancel` and :meth:`Engine.cancel_task` may be called from any
thread while a cycle runs on the engine's own. A submission waits here for the next cycle's
observation; a cancellation is applied at once when no cycle runs, else at the cycle's next decode
step boundary, so pages are never freed under a running forward.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from oxygen_ros.engine.config import TaskConfig
from oxygen_ros.engine.outputs import OutputAssembler
from oxygen_ros.engine.request import Request, new_request_id
from oxygen_ros.engine.scheduler import Scheduler
from oxygen_ros.engine.types import Observation, RequestStatus


@dataclass(frozen=True)
class Submission:
    """A request asked for with :meth:`Engine.submit`, waiting for the next cycle's observation."""

    request_id: int
    task: TaskConfig            # with the submitted prompt template, if one was given
    instruction: str | None     # replaces the observation's instruction in the prompt; None = keep it


class Inbox:
    """Submissions and cancellations from any thread.

    Args:
        scheduler: the active requests (cancellations end them).
        outputs: the final events of submissions that end before they start.
        cycle_lock: the engine's cycle lock (held while a cycle, flush or close runs).
        report: reports the requests that ended (final events), called after cancelling when no
            cycle runs.
    """

    def __init__(self, scheduler: Scheduler, outputs: OutputAssembler, cycle_lock: threading.Lock,
                 report: Callable[[], None]):
        self._scheduler = scheduler
        self._outputs = outputs
        self._cycle_lock = cycle_lock
        self._report = report
        self._lock = threading.Lock()
        self._submissions: list[Submission] = []
        self._starting: dict[int, TaskConfig] = {}     # taken by a cycle, not yet queued: id -> task
        self._pending: list[Callable[[], None]] = []
        self.closed = False

    def submit(self, task: TaskConfig, instruction: str | None) -> int:
        """Queue a request of ``task`` (``instruction``: replaces the observation's, None: keep it)
        for the next cycle; returns its new request id.

        Raises:
            RuntimeError: the engine was closed.
        """
        submission = Submission(new_request_id(), task, instruction)
        with self._lock:
            if self.closed:
                raise RuntimeError("engine is closed")
            self._submissions.append(submission)
        return submission.request_id

    def check_open(self) -> None:
        """Raise RuntimeError (``engine is closed``) once :meth:`close` was called."""
        if self.closed:
            raise RuntimeError("engine is closed")

    def close(self) -> None:
        """Refuse further submissions."""
        with self._lock:
            self.closed = True

    def take(self) -> list[Submission]:
        """The waiting submissions, now being started by a cycle (cancel() finds them by id)."""
        with self._lock:
            taken, self._submissions = self._submissions, []
            self._starting.update((s.request_id, s.task) for s in taken)
        return taken

    def queued(self, request_ids: list[int]) -> None:
        """These submissions are now requests the scheduler holds (cancel() finds them there)."""
        with self._lock:
            for request_id in request_ids:
                self._starting.pop(request_id, None)

    def end_unstarted(self, submission: Submission, status: RequestStatus,
                      obs: Observation | None = None, reason: str = "") -> None:
        """End a submission that never became a request (one final event with the ``reason`` if any,
        no observation when ``obs`` is None)."""
        with self._lock:
            self._starting.pop(submission.request_id, None)
        self._outputs.unstarted(submission.request_id, submission.task.name, submission.task.kind,
                                status, obs, reason)

    def abandon(self, obs: Observation, reason: str = "the cycle that took it failed") -> None:
        """A cycle failed: submissions it took but did not queue end as ``dropped`` with ``reason``."""
        with self._lock:
            abandoned, self._starting = self._starting, {}
        for request_id, task in abandoned.items():
            self._outputs.unstarted(request_id, task.name, task.kind, RequestStatus.DROPPED, obs, reason)

    def withdraw_all(self, status: RequestStatus) -> None:
        """End every submission no cycle has started with ``status``."""
        for submission in self._withdraw(lambda s: True):
            self.end_unstarted(submission, status)

    def cancel_all(self) -> None:
        """End every submission no cycle has started and every active request as ``cancelled``
        (cycle thread)."""
        self.withdraw_all(RequestStatus.CANCELLED)
        self.cancel_requests(self._scheduler.active)

    def cancel(self, request_id: int) -> bool:
        """Cancel one request (see :meth:`Engine.cancel`); True if it was active."""
        withdrawn = self._withdraw(lambda s: s.request_id == request_id)
        if withdrawn:     # submitted, not started: it ends without an observation
            self._defer(lambda: self.end_unstarted(withdrawn[0], RequestStatus.CANCELLED))
            return True
        with self._lock:
            starting = request_id in self._starting
        if starting:      # a cycle is creating it now: cancel it by id once it is queued
            self._defer(lambda: self.cancel_requests(
                [r for r in self._scheduler.active if r.request_id == request_id]))
            return True
        request = self._scheduler.find(request_id)
        if request is None:
            return False
        self._defer(lambda: self.cancel_requests([request]))
        return True

    def cancel_task(self, task: str) -> int:
        """Cancel every active request of ``task`` (see :meth:`Engine.cancel_task`); how many."""
        withdrawn = self._withdraw(lambda s: s.task.name == task)
        with self._lock:
            starting = {rid for rid, config in self._starting.items() if config.name == task}
        requests = [r for r in self._scheduler.active if r.task.name == task]

        def cancel() -> None:
            for submission in withdrawn:
                self.end_unstarted(submission, RequestStatus.CANCELLED)
            self.cancel_requests(requests + [r for r in self._scheduler.active
                                             if r.request_id in starting and r not in requests])

        self._defer(cancel)
        return len(requests) + len(withdrawn) + len(starting - {r.request_id for r in requests})

    def cancel_requests(self, requests: list[Request]) -> None:
        """End the requests of ``requests`` that are still active as ``cancelled`` (cycle thread)."""
        for request in requests:
            if not request.status.terminal:
                self._scheduler.finish(request, RequestStatus.CANCELLED)

    def apply(self) -> None:
        """Apply the cancellations asked for since the last call (cycle thread)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for action in pending:
            action()

    def _defer(self, action: Callable[[], None]) -> None:
        """Apply a cancellation now if no cycle runs, else at the next decode-step boundary."""
        with self._lock:
            self._pending.append(action)
        if self._cycle_lock.acquire(blocking=False):
            try:
                self.apply()
                self._report()
            finally:
                self._cycle_lock.release()

    def _withdraw(self, which: Callable[[Submission], bool]) -> list[Submission]:
        """Remove and return the submissions no cycle has started that ``which`` selects."""
        with self._lock:
            taken = [s for s in self._submissions if which(s)]
            self._submissions = [s for s in self._submissions if not which(s)]
        return taken
