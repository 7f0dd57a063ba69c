"""The node's sense of time: backwards jumps of the node clock and of camera header stamps, the offset
between camera stamps and the node clock, and a clock that has not started. No rclpy here.

Definitions (all times in seconds):
    * node clock: ROS time of the node (``/clock`` under ``use_sim_time``, else the system clock).
      Under ``use_sim_time`` it reads exactly 0 until the first ``/clock`` message: the clock has
      not started (:func:`clock_started`).
    * clock jump: the node clock reads less than it read before (a simulator or a bag player
      restarting ``/clock``, a system clock stepped back). Detected on every read through
      :class:`ClockWatch`, whichever thread reads.
    * stamp jump: one camera's non-zero header stamp is less than that camera's previous one (a bag
      replayed in a loop without restamping, a driver restarted with another time base).
    * camera clock offset: node clock at receipt minus header stamp, per camera (transport latency
      plus the difference between the camera's clock and the node clock).
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def clock_started(now_s: float) -> bool:
    """False when the node clock reads exactly 0 (``use_sim_time`` before the first ``/clock``)."""
    return now_s != 0.0


class ClockWatch(Generic[T]):
    """Reads the node clock and detects backwards jumps; thread-safe.

    Args:
        read: returns ``(now, seconds)`` of the node clock (``now`` is passed through, e.g. a
            ``builtin_interfaces/Time``).
        on_jump: called with ``(from_s, to_s)`` after a read that went backwards, outside the watch's
            lock, in the thread that read; it must not read the clock through this watch again.

    Reading and comparing happen under one lock, so two threads reading in turn never look like a jump.
    """

    def __init__(self, read: Callable[[], tuple[T, float]], on_jump: Callable[[float, float], None]):
        self._read = read
        self._on_jump = on_jump
        self._last_s = -math.inf
        self._lock = threading.Lock()

    def now(self) -> tuple[T, float]:
        """The node clock now: ``(now, seconds)``; reports a backwards jump through ``on_jump``."""
        with self._lock:
            now, seconds = self._read()
            previous, self._last_s = self._last_s, seconds
        if seconds < previous:
            self._on_jump(previous, seconds)
        return now, seconds


class StampWatch:
    """Per camera: the last header stamp (to detect stamp jumps) and the last clock offset; thread-safe."""

    def __init__(self):
        self._last_stamp: dict[str, float] = {}
        self._offset: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, camera: str, stamp_s: float, received_s: float) -> float | None:
        """Record one frame of ``camera`` with a non-zero header stamp ``stamp_s`` received at
        ``received_s`` on the node clock.

        Returns:
            the previous stamp when ``stamp_s`` is less than it (a stamp jump), else None.
        """
        with self._lock:
            previous = self._last_stamp.get(camera)
            self._last_stamp[camera] = stamp_s
            self._offset[camera] = received_s - stamp_s
        return previous if previous is not None and stamp_s < previous else None

    def offsets(self) -> dict[str, float]:
        """The latest ``received - stamp`` [s] per camera that has sent a non-zero stamp."""
        with self._lock:
            return dict(self._offset)

    def largest_offset(self) -> float | None:
        """The offset largest in magnitude over the cameras (signed) [s], or None when none is known."""
        offsets = self.offsets()
        return max(offsets.values(), key=abs) if offsets else None

    def clear(self) -> None:
        """Forget stamps and offsets (after a node clock jump: both belong to the old time base)."""
        with self._lock:
            self._last_stamp.clear()
            self._offset.clear()
