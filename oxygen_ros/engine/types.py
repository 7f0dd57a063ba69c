"""Plain Python objects exchanged between the engine and its callers (the ROS node, benchmarks).

No ROS types appear here: the node converts messages to :class:`Observation` and publishes
:class:`ActionChunk`, :class:`TextEvent` and :class:`MemoryEntry` objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np


@dataclass
class Observation:
    """One robot observation: what every task of one control cycle reads.

    Attributes:
        images: camera slot name -> uint8 ``[H, W, 3]`` RGB image, or None when the camera is missing
            or masked (its tokens are excluded from the prefix, never replaced by a black image).
        instruction: the natural-language task instruction.
        state: float64 ``[D]`` robot state in the robot's own units (rad, m), un-normalised; None if
            the robot publishes none.
        stamp: acquisition time in seconds (ROS time or ``time.monotonic()``); used by time triggers.
        seq: monotonically increasing sequence number of the observation; also seeds the
            flow-matching noise of its action chunk.
        tag: any object of the caller's (e.g. the node's header stamp, instruction and camera
            slots); the engine never reads it and hands it back unchanged on every output produced
            from this observation (:class:`ActionChunk`, :class:`TextEvent`, :class:`MemoryEntry`).

    Raises:
        ValueError: an image is not uint8 ``[H, W, 3]``, the state is not 1-D, or seq is negative.
    """

    images: Mapping[str, np.ndarray | None]
    instruction: str
    state: np.ndarray | None = None
    stamp: float = 0.0
    seq: int = 0
    tag: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for slot, image in self.images.items():
            if image is None:
                continue
            if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                    or image.shape[2] != 3:
                shape = getattr(image, "shape", None)
                dtype = getattr(image, "dtype", type(image).__name__)
                raise ValueError(f"camera {slot!r}: expected uint8 [H, W, 3], got {dtype} {shape}")
        if self.state is not None:
            # float64: the π0.5 state bins are computed from the state as received (JointState is float64)
            self.state = np.asarray(self.state, dtype=np.float64)
            if self.state.ndim != 1:
                raise ValueError(f"state must be a 1-D vector, got shape {self.state.shape}")
        if self.seq < 0:
            raise ValueError(f"seq must be >= 0, got {self.seq}")


@dataclass
class ActionChunk:
    """The action task's output for one observation.

    Attributes:
        actions: float32 ``[H, action_dim]`` actions (unnormalised robot units when the engine has a
            processor with norm stats, else the model's raw padded output).
        seq, stamp: the observation they were computed from.
        latency_s: seconds from the start of the control cycle to the chunk being ready.
        tag: that observation's :attr:`Observation.tag`.
        subtask: the subtask that conditioned it (the ``{subtask}`` of ``action.subtask_prompt_template``,
            π0.5's subtask loop: ``oxygen_ros/engine/subtask.py``), or None for the plain action prompt.
        prompt_ids: the token ids of the action prompt it was computed from.
        rtc_delay_steps: real-time chunking (``engine/realtime.py``): the inference delay d (control steps)
            it was guided with; -1 when denoised plainly.
        rtc_takeover_index: the action of the previous chunk that this one takes over from (its own action
            ``rtc_delay_steps`` replaces it); -1 when denoised plainly.
        rtc_fallback: why it was denoised plainly with RTC on (``no_chunk``, ``delay_unknown``, ``expired``,
            ``stale_stamp``), else "".
    """

    actions: np.ndarray
    seq: int
    stamp: float
    latency_s: float
    tag: Any = field(default=None, repr=False)
    subtask: str | None = None
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)
    rtc_delay_steps: int = -1
    rtc_takeover_index: int = -1
    rtc_fallback: str = ""


class RequestStatus(str, enum.Enum):
    """Lifecycle of one language request; every request ends in exactly one terminal status."""

    WAITING = "waiting"        # triggered, not yet admitted (pool or slack could not hold it)
    RUNNING = "running"        # admitted: owns pages, advances one token per decode step
    COMPLETED = "completed"    # stop token or max new tokens reached
    CANCELLED = "cancelled"    # cancel() or a new instruction interrupted it
    DROPPED = "dropped"        # never admitted: pool too small (drop policy) or waited too long
    PREEMPTED = "preempted"    # evicted from the pool for a higher-priority request

    @property
    def terminal(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class TextEvent:
    """Streaming text of one language request.

    Partial events (``final=False``) carry the newly decoded text ``delta``; exactly one final event
    ends every request and carries the whole ``text`` and the terminal ``status``. A completed
    memory request's final event also carries its :class:`MemoryEntry` (``memory``): the engine
    emits each request once, as this one stream of events.

    Attributes:
        request_id: engine-wide unique request id.
        task: the language task's name (``speech``, ``memory``, ...).
        seq, stamp: the observation the request was triggered by.
        delta: text added since the previous event of this request.
        text: all text decoded so far.
        token_ids: all tokens decoded so far.
        final: True for the last event of the request.
        status: request status at the time of the event.
        index: the event's position among its request's events (0, 1, ...; the final event's index
            is the number of partial events before it).
        kind: the task's kind, ``speech`` or ``memory``.
        tag: the triggering observation's :attr:`Observation.tag`; None for a request submitted and
            ended before any observation started it.
        memory: the :class:`MemoryEntry` of a completed memory request (final event only), else None.
        reason: why a request ended without running (final event only; e.g. a submission whose
            prompt could not be built), else "".
    """

    request_id: int
    task: str
    seq: int
    stamp: float
    delta: str
    text: str
    token_ids: list[int]
    final: bool
    status: RequestStatus
    index: int = 0
    kind: str = "speech"
    tag: Any = field(default=None, repr=False)
    memory: MemoryEntry | None = field(default=None, repr=False)
    reason: str = ""


# A final text output is the final event of a request.
TextOutput = TextEvent


@dataclass
class MemoryEntry:
    """A completed memory-task caption, with the pooled prefix hidden state as its embedding.

    Attributes:
        request_id, task, seq, stamp: as in :class:`TextEvent`.
        text: the caption.
        embedding: float32 ``[W]`` pooled hidden state of the request's prefix, or None when the model
            does not return one.
        tag: the triggering observation's :attr:`Observation.tag`.
    """

    request_id: int
    task: str
    seq: int
    stamp: float
    text: str
    embedding: np.ndarray | None = field(default=None, repr=False)
    tag: Any = field(default=None, repr=False)
