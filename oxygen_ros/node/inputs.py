"""The node's input side: the latest frame per camera, the latest joint state, the instruction, and
counted drops of bad inputs.

Subscription callbacks only call the ``store_*`` methods (a lock, a dict assignment); the control-cycle
thread calls :meth:`InputStore.observation` once per cycle. Nothing here blocks on inference.

Times: every age is measured on the node's clock (ROS time, simulated under ``use_sim_time``) from the
moment a message was *received*, never from its header stamp, so a camera whose stamps are zero, from
another machine's clock or from a simulator never makes a frame look fresh or stale by mistake. The
header stamp is only carried through to the outputs; a zero stamp is replaced by the receipt time.
A frame or joint state received "in the future" (after the node clock's current reading: the clock
jumped back since) is stale, like one older than the limit.
"""

from __future__ import annotations

import unicodedata

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from builtin_interfaces.msg import Time

from oxygen_ros.engine import Observation
from oxygen_ros.node.parameters import CameraSettings


class InputError(ValueError):
    """An input message that cannot be used.

    Attributes:
        reason: short key of the drop counter (``joint_state_missing_joint``, ``joint_state_nan``,
            ``joint_state_bad_length``).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def is_blank(instruction: str) -> bool:
    """True for an instruction that gives no task: empty, or only whitespace and invisible format characters
    (Unicode category Cf: zero-width space, byte-order mark, ...). The node acts on none (no action chunk from an
    empty prompt: openpi refuses to run without one) and refuses one where it is given."""
    return not "".join(c for c in instruction if unicodedata.category(c) != "Cf").strip()


def stamp_seconds(stamp: Time) -> float:
    """``builtin_interfaces/Time`` → seconds (float)."""
    return stamp.sec + stamp.nanosec * 1e-9


def time_msg(seconds: float) -> Time:
    """Seconds (float, >= 0) → ``builtin_interfaces/Time`` (nanoseconds rounded, at most 999 999 999)."""
    sec = math.floor(seconds)
    return Time(sec=int(sec), nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))


def is_zero(stamp: Time) -> bool:
    """True for the unset stamp (0 s, 0 ns)."""
    return stamp.sec == 0 and stamp.nanosec == 0


class DropCounter:
    """Counts dropped inputs by reason and logs one throttled warning per reason.

    Args:
        warn: logging function (e.g. ``node.get_logger().warning``).
        throttle_s: at most one warning per reason per this many wall-clock seconds.
        what: what is counted, as the warnings name it (default ``dropped input``).

    Thread-safe.
    """

    def __init__(self, warn: Callable[[str], object], throttle_s: float = 5.0, what: str = "dropped input"):
        self._warn = warn
        self._throttle_s = throttle_s
        self._what = what
        self._counts: dict[str, int] = {}
        self._since_warning: dict[str, int] = {}
        self._last_warning: dict[str, float] = {}
        self._logged_once: set[str] = set()
        self._lock = threading.Lock()

    def drop(self, reason: str, detail: str, log: Callable[[str], object] | None = None, once: bool = False) -> None:
        """Count one dropped input with ``reason`` (a short key) and ``detail`` (for the log); ``log``, when
        given, logs this one instead of ``warn`` (e.g. at INFO for an expected wait), under the same throttle.
        ``once``: log only the first drop of ``reason`` since the last :meth:`reset` (a state that may last
        long, such as waiting for an instruction); every one is still counted."""
        now = time.monotonic()
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            self._since_warning[reason] = self._since_warning.get(reason, 0) + 1
            if now - self._last_warning.get(reason, -math.inf) < self._throttle_s or \
                    (once and reason in self._logged_once):
                return
            self._logged_once.add(reason)
            count, self._since_warning[reason] = self._since_warning[reason], 0
            self._last_warning[reason] = now
        message = f"{self._what} ({reason}, {count} since last logged): {detail}"
        # Separate call sites: rclpy's logger refuses one call site logging at two severities.
        if log is None:
            self._warn(message)
        else:
            log(message)

    def counts(self) -> dict[str, int]:
        """Drops per reason since the last :meth:`reset`."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """All drops since the last :meth:`reset`."""
        with self._lock:
            return sum(self._counts.values())

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._since_warning.clear()
            self._logged_once.clear()


@dataclass(frozen=True)
class Frame:
    """One converted camera frame.

    Attributes:
        image: uint8 ``[H, W, 3]`` RGB.
        stamp: the header stamp, or the receipt time when the header stamp was zero.
        received_s: receipt time on the node clock [s].
    """

    image: np.ndarray
    stamp: Time
    received_s: float


@dataclass(frozen=True)
class ObservationInputs:
    """What one control cycle uses, besides the :class:`Observation` itself.

    Attributes:
        observation: the engine input.
        stamp: the observation's stamp (the newest camera frame used), copied to every output.
        camera_slots: slots whose images are in the observation (masked ones excluded).
    """

    observation: Observation
    stamp: Time
    camera_slots: tuple[str, ...]


class InputStore:
    """Latest inputs of the node; thread-safe.

    Args:
        cameras: the camera inputs (slot, required flag).
        joint_names: joint order of the state vector.
        instruction: the instruction until one is stored.
    """

    def __init__(self, cameras: tuple[CameraSettings, ...], joint_names: tuple[str, ...], instruction: str):
        self._cameras = cameras
        self._joint_names = joint_names
        self._frames: dict[str, Frame] = {}
        self._state: np.ndarray | None = None
        self._state_received_s = -math.inf
        self._instruction = instruction
        self._receipts = 0
        self._lock = threading.Lock()

    @property
    def instruction(self) -> str:
        with self._lock:
            return self._instruction

    @property
    def receipts(self) -> int:
        """Frames and joint states stored so far (changes whenever a new one arrives)."""
        with self._lock:
            return self._receipts

    def store_frame(self, slot: str, frame: Frame) -> None:
        """Keep ``frame`` as the latest of camera ``slot`` (the older one is dropped)."""
        with self._lock:
            self._frames[slot] = frame
            self._receipts += 1

    def store_instruction(self, text: str) -> bool:
        """Set the instruction; returns True when it differs from the previous one."""
        with self._lock:
            changed = text != self._instruction
            self._instruction = text
            return changed

    def map_joint_state(self, names, positions) -> np.ndarray:
        """JointState ``name[]`` / ``position[]`` → float64 ``[len(joint_names)]`` in ``joint_names`` order
        (the message's own precision: the π0.5 state bins are computed from it).

        Extra joints in the message are ignored.

        Raises:
            InputError: lengths differ, a configured joint is missing, or a used position is NaN/inf.
        """
        if len(names) != len(positions):
            raise InputError("joint_state_bad_length", f"{len(names)} names but {len(positions)} positions")
        index = {name: i for i, name in enumerate(names)}
        missing = [name for name in self._joint_names if name not in index]
        if missing:
            raise InputError("joint_state_missing_joint", f"joints {missing} missing (message has {list(names)})")
        state = np.array([positions[index[name]] for name in self._joint_names], dtype=np.float64)
        if not np.all(np.isfinite(state)):
            bad = [name for name, value in zip(self._joint_names, state) if not math.isfinite(value)]
            raise InputError("joint_state_nan", f"non-finite positions of joints {bad}")
        return state

    def store_joint_state(self, state: np.ndarray, received_s: float) -> None:
        """Keep ``state`` (from :meth:`map_joint_state`) as the latest, received at ``received_s``."""
        with self._lock:
            self._state = state
            self._state_received_s = received_s
            self._receipts += 1

    def clear(self) -> None:
        """Forget frames and state (on deactivate: nothing stale survives a restart)."""
        with self._lock:
            self._frames.clear()
            self._state = None
            self._state_received_s = -math.inf

    def frame_ages(self, now_s: float) -> dict[str, float | None]:
        """Age [s] of each camera's latest frame on the node clock; None when none was received."""
        with self._lock:
            return {c.slot: (now_s - self._frames[c.slot].received_s) if c.slot in self._frames else None
                    for c in self._cameras}

    def observation(self, now: Callable[[], float], staleness_limit_s: float, seq: int) -> ObservationInputs | str:
        """The observation of one control cycle, or why there is none.

        A camera whose latest frame is older than ``staleness_limit_s``, received in the future (after
        ``now``: the clock jumped back since), or absent is masked when optional; when required, there is
        no observation. Nor is there one when no camera is usable or the joint state is not.

        Args:
            now: reads the node clock [s]; called once, after the inputs are taken (so every input was
                received before that reading unless the clock jumped back).
            staleness_limit_s: the largest usable age [s].
            seq: the observation's sequence number.

        Returns:
            :class:`ObservationInputs`, or a short reason string (``stale required camera base_0_rgb
            (1.20 s)``).
        """
        with self._lock:
            frames = {camera.slot: self._frames.get(camera.slot) for camera in self._cameras}
            state, state_received_s, instruction = self._state, self._state_received_s, self._instruction
        now_s = now()

        def unusable(received_s: float) -> str | None:
            age = now_s - received_s
            if age < 0.0:
                return f"received {-age:.2f} s in the future of the node clock"
            return f"{age:.2f} s" if age > staleness_limit_s else None

        images: dict[str, np.ndarray | None] = {}
        used: list[Frame] = []
        for camera in self._cameras:
            frame = frames[camera.slot]
            why = "no frame" if frame is None else unusable(frame.received_s)
            if why is not None:
                if camera.required:
                    return f"no frame from required camera {camera.slot}" if frame is None else \
                        f"stale required camera {camera.slot} ({why})"
                images[camera.slot] = None
                continue
            images[camera.slot] = frame.image
            used.append(frame)
        if not used:
            return "no fresh camera frame"
        if state is None:
            return "no joint state"
        why = unusable(state_received_s)
        if why is not None:
            return f"stale joint state ({why})"
        newest = max(used, key=lambda f: (f.stamp.sec, f.stamp.nanosec))
        observation = Observation(images=images, instruction=instruction, state=state,
                                  stamp=stamp_seconds(newest.stamp), seq=seq)
        return ObservationInputs(observation, newest.stamp,
                                 tuple(slot for slot, image in images.items() if image is not None))
