"""Output assembly: streaming detokenisation, text events, memory entries and request records.

Every output carries its provenance: the observation's ``seq``, ``stamp`` and opaque ``tag``, and a
text event its ``index`` within its request. Every request ends with exactly one final
:class:`TextEvent`; a completed memory request's final event also carries its :class:`MemoryEntry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from oxygen_ros.engine.detokenizer import IncrementalDetokenizer
from oxygen_ros.engine.metrics import CycleRecord, EngineMetrics, RequestRecord
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.request import Request
from oxygen_ros.engine.types import ActionChunk, MemoryEntry, Observation, RequestStatus, TextEvent


@dataclass
class CycleResult:
    """What one control cycle produced: the ``action`` chunk of its observation, the partial and
    final ``text_events`` of every language request (in order) and the cycle's ``record``."""

    action: ActionChunk
    text_events: list[TextEvent]
    record: CycleRecord

    @property
    def memory_entries(self) -> list[MemoryEntry]:
        """The memory entries of the memory requests completed during the cycle (carried by their
        final events)."""
        return memory_entries(self.text_events)


class OutputAssembler:
    """Turns sampled tokens and ended requests into the events the engine hands out.

    Args:
        io: the model's pre/post-processing (its ``detokenize``).
        eos_token_id: the model's end-of-sequence token (the stop token of tasks that name none).
        metrics: where ended requests are recorded.
    """

    def __init__(self, io: ModelIO, eos_token_id: int, metrics: EngineMetrics):
        self._io = io
        self._eos = eos_token_id
        self._metrics = metrics
        self._events: list[TextEvent] = []

    def add_token(self, request: Request, token: int) -> bool:
        """Record a sampled token and stream its text; True when the token ends the request.

        The text goes through the request's :class:`IncrementalDetokenizer` (a trailing stop token
        is not text): a partial event carries the text that became stable, none is sent while the
        text is held back, and ``request.text`` is always the concatenation of the deltas sent.
        """
        request.output_ids.append(token)
        if request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(self._io.detokenize)
        done = request.is_done(self._eos)
        if not (done and token in request.stop_tokens(self._eos)):
            request.detokenizer.add(token)
        if done:
            return True     # the final event (ended()) carries the last delta and the whole text
        text = request.detokenizer.text
        if len(text) > len(request.text):
            delta, request.text = text[len(request.text):], text
            self._emit(request, delta, final=False)
        return False

    def ended(self, requests: list[Request]) -> None:
        """Final events, memory entries and records of ``requests``, which reached a terminal
        status."""
        for request in requests:
            # The held-back text ends the stream: the final delta makes the deltas add up to the text.
            if request.detokenizer is not None:
                request.detokenizer.finish()
                full = request.detokenizer.text
            else:
                full = ""
            delta, request.text = full[len(request.text):], full
            memory = None
            if request.task.kind == "memory" and request.status == RequestStatus.COMPLETED:
                embedding = None if request.pooled is None else request.pooled.float().cpu().numpy()
                memory = MemoryEntry(request.request_id, request.task.name, request.obs_seq,
                                     request.stamp, request.text, embedding, request.tag)
            self._emit(request, delta, final=True, memory=memory)
            self._metrics.add_request(RequestRecord(
                request.request_id, request.task.name, request.status.value,
                len(request.output_ids),
                None if request.t_first_token is None else request.t_first_token - request.t_arrival,
                request.t_finish - request.t_arrival))
            request.pooled = None
            request.next_logits = None

    def unstarted(self, request_id: int, task: str, kind: str, status: RequestStatus,
                  obs: Observation | None, reason: str = "") -> None:
        """The final event (and record) of a submitted request that never started, with the
        ``reason`` when there is one; without an observation it carries ``seq`` -1, ``stamp`` 0.0 and
        no tag."""
        seq, stamp, tag = (-1, 0.0, None) if obs is None else (obs.seq, obs.stamp, obs.tag)
        self._events.append(TextEvent(request_id, task, seq, stamp, "", "", [], True, status,
                                      kind=kind, tag=tag, reason=reason))
        self._metrics.add_request(RequestRecord(request_id, task, status.value, 0, None, 0.0))

    def take(self) -> list[TextEvent]:
        """The events assembled since the last call, in order."""
        events, self._events = self._events, []
        return events

    def take_with_memory(self) -> tuple[list[TextEvent], list[MemoryEntry]]:
        """:meth:`take`, with the memory entries those events carry."""
        events = self.take()
        return events, memory_entries(events)

    def _emit(self, request: Request, delta: str, final: bool, memory: MemoryEntry | None = None) -> None:
        self._events.append(TextEvent(
            request.request_id, request.task.name, request.obs_seq, request.stamp, delta,
            request.text, list(request.output_ids), final, request.status,
            index=request.events_sent, kind=request.task.kind, tag=request.tag, memory=memory))
        request.events_sent += 1


def memory_entries(events: list[TextEvent]) -> list[MemoryEntry]:
    """The memory entries carried by ``events`` (completed memory requests), in order."""
    return [event.memory for event in events if event.memory is not None]
