"""Ask and command ``oxygen_node``: the ``~/ask`` action, ``~/pause_actions`` / ``~/resume_actions`` and
``~/set_instruction`` (after the request/response interfaces of llama_ros and rosetta).

    ~/ask               oxygen_ros/action/Ask: one language output on request. The goal names a language
                        task (``speech`` or ``memory``) and optionally an instruction and a prompt template;
                        it is submitted to the engine (``Engine.submit``) and starts from the next control
                        cycle's observation. Feedback streams the decoded text, the result carries the whole
                        text and how it ended; cancelling the goal cancels that request only. A template
                        with ``{memory}`` gets the captions of ``memory_k`` stored memory entries for the
                        goal's instruction (docs/memory.md), their ids in the result.
    ~/pause_actions     oxygen_ros/srv/SwitchActions: stop publishing action chunks and trajectories while
    ~/resume_actions    staying active (language keeps running); the pause holds until resumed.
    ~/set_instruction   oxygen_ros/srv/SetInstruction: set the instruction, with an answer saying whether it
                        was taken.

Threads: the services and the action server's callbacks run on the executor and do no inference. A goal's
execute callback is a coroutine that waits on an rclpy ``Future`` which the control-cycle thread completes
when the engine produced text for that goal's request (:meth:`Commands.on_language`), so an executor — single-
or multi-threaded — is never blocked by a goal. The services live in their own callback group, so with the
``oxygen_node`` executable's executor (transitions on a worker thread, oxygen_ros/node/executor.py) or a
multi-threaded one they answer while a lifecycle transition (e.g. configure's model load) runs.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from oxygen_ros.action import Ask
from oxygen_ros.srv import SetInstruction, SwitchActions
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.task import Future

from oxygen_ros.engine import RequestStatus, TextEvent
from oxygen_ros.engine.config import check_template
from oxygen_ros.memory.prompt import DEFAULT_K, MEMORY_FIELD, fill_memory, has_memory_field
from oxygen_ros.node.inputs import is_blank, time_msg
from oxygen_ros.node.memory_service import MAX_QUERY_K as MAX_MEMORY_K

if TYPE_CHECKING:
    from oxygen_ros.node.oxygen_node import OxygenNode

# The ~/ask server's goal, result and cancel services. rclpy's default (depth 10) loses requests beyond the 10th
# of a burst before the executor takes them: the goal is never answered. Deeper than any burst admission
# should answer: beyond max_pending_goals goals are rejected, not dropped.
ASK_QUEUE_DEPTH = 1000
_ASK_SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=ASK_QUEUE_DEPTH,
                              reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)

_RESULT_STATUS = {
    RequestStatus.COMPLETED: Ask.Result.STATUS_COMPLETED,
    RequestStatus.CANCELLED: Ask.Result.STATUS_CANCELLED,
    RequestStatus.PREEMPTED: Ask.Result.STATUS_CANCELLED,
    RequestStatus.DROPPED: Ask.Result.STATUS_DROPPED,
}
_ENDINGS = {
    RequestStatus.COMPLETED: "completed",
    RequestStatus.CANCELLED: "cancelled",
    RequestStatus.PREEMPTED: "cancelled: preempted by a higher-priority request",
    RequestStatus.DROPPED: "dropped: not admitted (KV pool full, waited too long) or the prompt exceeds the "
                           "model's prompt budget",
}


class _Goal:
    """One ``~/ask`` goal's mailbox between the control-cycle thread and the goal's coroutine."""

    def __init__(self, instruction: str | None):
        self.instruction = instruction
        self.lock = threading.Lock()
        self.events: list[TextEvent] = []
        self.wake: Future | None = None
        self.ended: str | None = None     # set when the node ends the goal without a final event

    def put(self, event: TextEvent | None = None, ended: str | None = None) -> None:
        with self.lock:
            if event is not None:
                self.events.append(event)
            if ended is not None and self.ended is None:    # the first reason given is the goal's
                self.ended = ended
            wake, self.wake = self.wake, None
        if wake is not None and not wake.done():
            wake.set_result(True)


class Commands:
    """The ask / command interface of one :class:`OxygenNode` (see the module docstring).

    Args:
        node: the node; its engine, instruction input, observation stamps and session id are read through
            the node's own methods at call time (they change with configure / cleanup).
    """

    def __init__(self, node: "OxygenNode"):
        self._node = node
        self.callback_group = MutuallyExclusiveCallbackGroup()
        self._paused = False
        self._gate = threading.Lock()
        self._withheld = 0
        self._goals: dict[int, _Goal] = {}
        self._goal_ids: dict[bytes, int] = {}
        self._goals_lock = threading.Lock()
        self._executing = 0     # goals whose execute callback has not returned its result yet
        self._pending = 0       # goals accepted whose execute callback has not returned (max_pending_goals)
        self._memory = None     # the memory service filling {memory} (attach_memory), while a store is open
        group = self.callback_group
        node.create_service(SwitchActions, "~/pause_actions",
                            lambda request, response: self._switch(True, response), callback_group=group)
        node.create_service(SwitchActions, "~/resume_actions",
                            lambda request, response: self._switch(False, response), callback_group=group)
        node.create_service(SetInstruction, "~/set_instruction", self._set_instruction, callback_group=group)
        self._ask = ActionServer(node, Ask, "~/ask", execute_callback=self._execute,
                                 goal_callback=self._on_goal, cancel_callback=self._on_cancel,
                                 callback_group=group, goal_service_qos_profile=_ASK_SERVICE_QOS,
                                 result_service_qos_profile=_ASK_SERVICE_QOS,
                                 cancel_service_qos_profile=_ASK_SERVICE_QOS)

    # ---- pause / resume -----------------------------------------------------------------------

    @property
    def actions_paused(self) -> bool:
        """Whether action outputs are paused (``~/pause_actions``)."""
        return self._paused

    @property
    def withheld_chunks(self) -> int:
        """Action chunks computed but not published because actions were paused."""
        return self._withheld

    def gate_action(self, publish: Callable[[], None]) -> None:
        """Run ``publish`` (the action chunk's publication) unless actions are paused. Holds the pause lock
        while publishing, so once ``~/pause_actions`` has answered no chunk leaves the node."""
        with self._gate:
            if self._paused:
                self._withheld += 1
                return
            publish()

    def _switch(self, pause: bool, response: SwitchActions.Response) -> SwitchActions.Response:
        with self._gate:
            changed = self._paused != pause
            self._paused = pause
        word = "paused" if pause else "resumed"
        response.success, response.paused = True, pause
        response.message = f"action outputs {word}" if changed else f"action outputs already {word}"
        if changed:
            self._node.get_logger().info(response.message + ("; language keeps running" if pause else ""))
        return response

    # ---- set instruction ------------------------------------------------------------------------

    def _set_instruction(self, request: SetInstruction.Request,
                         response: SetInstruction.Response) -> SetInstruction.Response:
        response.accepted, response.message = self._node.take_instruction(request.instruction)
        return response

    # ---- the ask action -------------------------------------------------------------------------

    def _refusal(self, goal: Ask.Goal) -> str | None:
        node = self._node
        engine = node.engine
        if engine is None or node.lifecycle_state != "active":
            return f"the node is {node.lifecycle_state}, not active"
        task = goal.task or "speech"
        names = [t.name for t in engine.config.language_tasks]
        if task not in names:
            return f"the node runs no language task {task!r} (it runs {names}; set {task}.enabled: true)"
        limit = node.get_parameter("max_instruction_chars").value
        if len(goal.instruction) > limit:
            return f"instruction of {len(goal.instruction)} characters exceeds max_instruction_chars {limit}"
        if goal.instruction and is_blank(goal.instruction):
            return "the goal's instruction is blank (whitespace only): give one, or leave it empty for the node's"
        if is_blank(node.instruction or ""):
            return ("the node has no instruction yet, so no control cycle runs (publish one on the instruction "
                    "topic, call ~/set_instruction or set default_instruction)")
        if goal.prompt_template:
            try:
                check_template(goal.prompt_template, "prompt_template", extra_fields=(MEMORY_FIELD,))
            except ValueError as error:
                return str(error)
            if has_memory_field(goal.prompt_template):
                if self._memory is None:
                    return "prompt_template has {memory} but the node has no memory store (set memory.store.path)"
                if goal.memory_k > MAX_MEMORY_K:
                    return f"memory_k {goal.memory_k} is over {MAX_MEMORY_K} (the most ~/query_memory returns too)"
        return None

    def attach_memory(self, memory) -> None:
        """The memory service whose store fills ``{memory}`` (oxygen_ros/node/memory_service.py), or None."""
        self._memory = memory

    def _on_goal(self, goal: Ask.Goal) -> GoalResponse:
        """Admission: every goal request gets an answer; beyond ``max_pending_goals`` accepted goals without a
        result it is no (rejected, logged throttled), never a request left unanswered."""
        reason = self._refusal(goal)
        if reason is None:
            limit = self._node.get_parameter("max_pending_goals").value
            with self._goals_lock:
                if self._pending >= limit:
                    reason = f"{self._pending} goals pending, at most max_pending_goals {limit}: ask again later"
                else:
                    self._pending += 1
        if reason is not None:
            self._node.get_logger().warning(f"~/ask goal rejected: {reason}", throttle_duration_sec=1.0)
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _on_cancel(self, goal_handle) -> CancelResponse:
        with self._goals_lock:
            request_id = self._goal_ids.get(bytes(goal_handle.goal_id.uuid))
        engine = self._node.engine
        if request_id is None:      # not submitted yet: execute sees the cancel request first
            return CancelResponse.ACCEPT
        if engine is None or not engine.cancel(request_id):
            return CancelResponse.REJECT     # already ended: its result is on its way
        return CancelResponse.ACCEPT

    @property
    def open_goals(self) -> int:
        """``~/ask`` goals whose execute callback has not yet returned its result to the action server (the
        ``oxygen_node`` executable spins until none is left before it exits)."""
        with self._goals_lock:
            return self._executing

    async def _execute(self, goal_handle) -> Ask.Result:
        with self._goals_lock:
            self._executing += 1
        try:
            return await self._serve(goal_handle)
        finally:
            with self._goals_lock:
                self._executing -= 1
                self._pending -= 1

    async def _serve(self, goal_handle) -> Ask.Result:
        goal = goal_handle.request
        engine = self._node.engine
        if goal_handle.is_cancel_requested:
            goal_handle.canceled()
            return Ask.Result(status=Ask.Result.STATUS_CANCELLED, message="cancelled before it was submitted")
        if engine is None or not self._node.lifecycle_state == "active":
            goal_handle.abort()
            return Ask.Result(status=Ask.Result.STATUS_CANCELLED, message="the node left the active state")
        mailbox = _Goal(goal.instruction or None)
        key = bytes(goal_handle.goal_id.uuid)
        template, memory_ids, asked_s = goal.prompt_template or None, [], None
        memory = self._memory
        if template is not None and has_memory_field(template):
            try:     # a store query on the executor (milliseconds; docs/memory.md, "Cost"), no inference
                text, memory_ids, asked_s = memory.recall(goal.instruction or self._node.instruction or "",
                                                          goal.memory_k or DEFAULT_K)
            except Exception as error:     # no store any more (cleanup), or the store failed
                goal_handle.abort()
                return Ask.Result(status=Ask.Result.STATUS_DROPPED, message=f"memory not read: {error}")
            template = fill_memory(template, text)
        try:
            with self._goals_lock:    # registered before on_language can see the request's events
                request_id = engine.submit(goal.task or "speech", goal.instruction or None, template)
                self._goals[request_id] = mailbox
                self._goal_ids[key] = request_id
        except (KeyError, ValueError, RuntimeError) as error:
            goal_handle.abort()
            return Ask.Result(status=Ask.Result.STATUS_DROPPED, message=f"not submitted: {error}")
        utterance_id = self._node.utterance_id(request_id)
        try:
            result = await self._follow(goal_handle, mailbox, utterance_id)
            result.memory_entry_ids = memory_ids
            if asked_s is not None:
                result.memory_stamp = time_msg(asked_s)
            return result
        finally:
            with self._goals_lock:
                self._goals.pop(request_id, None)
                self._goal_ids.pop(key, None)

    async def _follow(self, goal_handle, mailbox: _Goal, utterance_id: str) -> Ask.Result:
        """Feedback for each partial event of the goal's request; the result from its final event."""
        sequence = 0
        while True:
            with mailbox.lock:
                events, mailbox.events = mailbox.events, []
                ended = mailbox.ended
                wake = None
                if not events and ended is None:
                    wake = Future(executor=self._node.executor)
                    # A done callback makes set_result (from the cycle thread) wake the executor.
                    wake.add_done_callback(lambda future: None)
                    mailbox.wake = wake
            if wake is not None:
                await wake
                continue
            for event in events:
                if not event.final:
                    goal_handle.publish_feedback(Ask.Feedback(utterance_id=utterance_id, delta=event.delta,
                                                              text=event.text, sequence=sequence))
                    sequence += 1
                    continue
                message = _ENDINGS[event.status] + (f": {event.reason}" if event.reason else "")
                if ended is not None and event.status != RequestStatus.COMPLETED:
                    message = f"{message}: {ended}"     # why the node ended it (end_goals before the flush)
                result = Ask.Result(utterance_id=utterance_id, status=_RESULT_STATUS[event.status],
                                    text=event.text, message=message)
                result.header.stamp = self._node.output_stamp(event)
                if event.status == RequestStatus.COMPLETED:
                    goal_handle.succeed()
                elif goal_handle.is_cancel_requested:
                    goal_handle.canceled()
                else:
                    goal_handle.abort()
                return result
            if ended is not None:
                goal_handle.abort()
                return Ask.Result(utterance_id=utterance_id, status=Ask.Result.STATUS_CANCELLED, message=ended)

    # ---- hooks called by the node ---------------------------------------------------------------

    def on_language(self, events: list[TextEvent]) -> None:
        """Route the engine's text events to the goals whose requests they belong to (any thread)."""
        if not self._goals:
            return
        for event in events:
            with self._goals_lock:
                mailbox = self._goals.get(event.request_id)
            if mailbox is not None:
                mailbox.put(event)

    def instruction_for(self, request_id: int, default: str) -> str:
        """The instruction a request answers: its goal's instruction when one was given, else ``default``
        (the observation's)."""
        with self._goals_lock:
            mailbox = self._goals.get(request_id)
        return mailbox.instruction if mailbox is not None and mailbox.instruction else default

    def end_goals(self, reason: str) -> None:
        """End every goal still waiting (the node releases its engine); each gets a result with ``reason``
        (after a final event of its request that is already in its mailbox or comes before the goal's
        coroutine next runs: then that event's result, its message followed by ``reason``)."""
        with self._goals_lock:
            mailboxes = list(self._goals.values())
        for mailbox in mailboxes:
            mailbox.put(ended=reason)

    def destroy(self) -> None:
        """Destroy the action server (the services go with the node). Idempotent."""
        if self._ask is not None:
            self._ask.destroy()
            self._ask = None
