"""The language outputs of ``oxygen_node``: the engine's text events on ``~/speech`` (partials and finals),
the completed utterances a TTS can say on ``~/speech_text``, and memory entries on ``~/memory`` (one with
a non-finite embedding is withheld and counted; each carries the robot's pose at its observation when
known and goes to the memory store when one is set: oxygen_ros/node/memory_service.py). The ``~/ask`` goals
get their feedback and results from the same events (oxygen_ros/node/commands.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from std_msgs.msg import String

from oxygen_ros.engine import RequestStatus
from oxygen_ros.engine.detokenizer import is_speakable
from oxygen_ros.node import conversions
from oxygen_ros.node.commands import Commands
from oxygen_ros.node.diagnostics import StatusTracker
from oxygen_ros.node.inputs import DropCounter
from oxygen_ros.node.output_checks import all_finite


class LanguageOutput:
    """Publishes the language events of the engine (see the module docstring).

    Args:
        node: the node whose parameters (``<task>.publish_on_change``) and logger are used.
        publishers: the configured topics (:class:`~oxygen_ros.node.topics.TopicBridge`: ``speech``,
            ``speech_text``, ``memory``, ``memory_service``).
        commands: the ``~/ask`` goals (their instructions, feedback and results).
        tag: an output's observation tag (its ``stamp``, ``instruction`` and ``camera_slots``).
        utterance_id: the id the Speech messages (or MemoryEntry) of an engine request carry.
        status, withheld: ~/status events and the error-level counter of withheld outputs.
    """

    def __init__(self, node, publishers, commands: Commands, tag: Callable[[object], object],
                 utterance_id: Callable[[int], str], status: StatusTracker, withheld: DropCounter):
        self._node = node
        self._publishers = publishers
        self._commands = commands
        self._tag = tag
        self._utterance_id = utterance_id
        self._status = status
        self._withheld = withheld
        self.speech_text_withheld = 0      # completed utterances without speakable text, since activation
        self._speech_text_last: dict[str, str] = {}   # per task: the text last published on ~/speech_text

    def reset(self) -> None:
        """A new activation: counts and the texts last sent start again."""
        self.speech_text_withheld = 0
        self._speech_text_last.clear()

    def publish(self, events) -> None:
        """Speech events on ``~/speech`` (and ``~/speech_text``); a memory request's entry, carried by its final
        event, on ``~/memory`` (its text events are not speech)."""
        for event in events:
            if event.kind == "memory":
                if event.memory is not None:
                    self._publish_memory(event.memory)
                continue
            info = self._tag(event)
            self._publishers.speech.publish(conversions.speech_msg(
                event, info.stamp, self._utterance_id(event.request_id), event.index,
                self._commands.instruction_for(event.request_id, info.instruction)))
            if event.final and event.status == RequestStatus.COMPLETED:
                self.publish_speech_text(event)
        self._commands.on_language(events)    # ~/ask goals: feedback and results

    def _publish_memory(self, entry) -> None:
        """A memory entry on ``~/memory``, unless its embedding is not finite (withheld, counted)."""
        if entry.embedding is not None and not all_finite(entry.embedding):
            bad = int(np.sum(~np.isfinite(entry.embedding)))
            self._status.record_event("non_finite_embeddings", f"memory request {entry.request_id}")
            self._withheld.drop("non_finite_embeddings", f"memory entry of observation {entry.seq} withheld: "
                                f"{bad} of {entry.embedding.size} embedding values are NaN or infinite")
            return
        info = self._tag(entry)
        msg = conversions.memory_entry_msg(entry, info.stamp, self._utterance_id(entry.request_id), info.camera_slots,
                                           self._commands.instruction_for(entry.request_id, info.instruction))
        memory = self._publishers.memory_service
        memory.complete(msg)        # robot and pose
        self._publishers.memory.publish(msg)
        memory.record(msg)          # queued for the store's writer thread (never waits)

    def publish_speech_text(self, event) -> None:
        """``~/speech_text`` gets a completed utterance's text only when a TTS can say it; with
        ``<task>.publish_on_change``, only when it differs from the task's text last published there.
        The text goes out without leading and trailing whitespace (a TTS reads it as is)."""
        node = self._node
        if is_speakable(event.text):
            text = event.text.strip()
            name = f"{event.task}.publish_on_change"
            on_change = node.has_parameter(name) and node.get_parameter(name).value
            if on_change and self._speech_text_last.get(event.task) == text:
                return
            self._speech_text_last[event.task] = text
            self._publishers.speech_text.publish(String(data=text))
            return
        self.speech_text_withheld += 1
        node.get_logger().warning(
            f"speech_text withheld: utterance {self._utterance_id(event.request_id)} has nothing to say "
            f"({event.text[:40]!r}); {self.speech_text_withheld} withheld since activation",
            throttle_duration_sec=5.0)

