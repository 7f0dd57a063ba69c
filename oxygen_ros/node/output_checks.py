"""Checks on what leaves the node: finite values, joint position limits, and outputs that expire.

No rclpy here (plain numpy and the standard library), so every rule is unit-testable; the node applies
them to each action chunk before it publishes the ``ActionChunk`` and the ``JointTrajectory``, and to
each memory embedding before it publishes the ``MemoryEntry``.

Rules, in the order the node applies them to an action chunk:
    1. a chunk with any NaN or infinite value is withheld (neither message goes out);
    2. with joint position limits configured, a chunk with any value outside them is clamped into
       them (``clamp``) or withheld (``reject``);
    3. a chunk or trajectory whose last point is already past on the node clock at publication is
       expired: see :func:`expired_by`.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass

import numpy as np

LIMIT_POLICIES = ("clamp", "reject")
EXPIRED_OUTPUT_POLICIES = ("fallback", "withhold")
# URDF joint types whose <limit lower upper> bound a position (continuous and floating joints have none).
_LIMITED_URDF_JOINTS = ("revolute", "prismatic")


def all_finite(values: np.ndarray) -> bool:
    """True when every entry of ``values`` (any shape, float) is finite."""
    return bool(np.all(np.isfinite(values)))


@dataclass(frozen=True)
class JointLimits:
    """Position limits of the D action dimensions.

    Attributes:
        lower, upper: float64 ``[D]``, in the actions' units (rad, m per REP 103); ``-inf`` / ``inf``
            where a dimension has no limit.
        source: where they come from (for logs): ``parameters`` or ``robot_description``.

    Raises:
        ValueError: shapes differ, a bound is NaN, or ``lower > upper`` somewhere.
    """

    lower: np.ndarray
    upper: np.ndarray
    source: str

    def __post_init__(self) -> None:
        if self.lower.shape != self.upper.shape or self.lower.ndim != 1:
            raise ValueError(f"joint limits: lower has shape {self.lower.shape}, upper {self.upper.shape}")
        if np.isnan(self.lower).any() or np.isnan(self.upper).any():
            raise ValueError("joint limits: NaN bound (use -.inf / .inf for an unlimited dimension)")
        bad = np.flatnonzero(self.lower > self.upper)
        if bad.size:
            raise ValueError(f"joint limits: lower > upper at dimensions {bad.tolist()}")

    @property
    def limited(self) -> int:
        """How many dimensions have at least one finite bound."""
        return int(np.sum(np.isfinite(self.lower) | np.isfinite(self.upper)))

    def violations(self, actions: np.ndarray) -> int:
        """Number of entries of ``actions`` (float ``[H, D]``) outside the limits."""
        return int(np.sum((actions < self.lower) | (actions > self.upper)))

    def clamp(self, actions: np.ndarray) -> np.ndarray:
        """``actions`` (float ``[H, D]``) clipped into the limits; a new float32 array.

        A bound that float32 cannot hold exactly is rounded inwards (a clipped value never lies outside
        the float64 limit, e.g. -0.05 becomes -0.049999997 rather than -0.050000001).
        """
        clipped = np.clip(actions, self.lower, self.upper).astype(np.float32)
        below, above = clipped < self.lower, clipped > self.upper
        clipped[below] = np.nextafter(clipped, np.float32(np.inf))[below]
        clipped[above] = np.nextafter(clipped, np.float32(-np.inf))[above]
        return clipped


def limits_from_parameters(lower: list[float], upper: list[float], action_names: tuple[str, ...]
                           ) -> JointLimits | None:
    """The limits given by the ``joint_limits.lower`` / ``joint_limits.upper`` parameters.

    Args:
        lower, upper: one bound per action dimension (parallel to ``action_names``), or both empty
            (no limits).
        action_names: the D action dimension names.

    Returns:
        :class:`JointLimits`, or None when both lists are empty.

    Raises:
        ValueError: lengths differ from D, a NaN bound, or ``lower > upper``; the message names the
            parameters.
    """
    if not lower and not upper:
        return None
    if len(lower) != len(action_names) or len(upper) != len(action_names):
        raise ValueError(f"parameters joint_limits.lower / joint_limits.upper: {len(lower)} and {len(upper)} "
                         f"entries, action_names has {len(action_names)} (one bound per action dimension; "
                         "-.inf / .inf for none)")
    try:
        return JointLimits(np.asarray(lower, np.float64), np.asarray(upper, np.float64), "parameters")
    except ValueError as error:
        raise ValueError(f"parameters joint_limits.lower / joint_limits.upper: {error}") from None


def limits_from_urdf(urdf: str, action_names: tuple[str, ...]) -> tuple[JointLimits, list[str]]:
    """Position limits of the action dimensions named like joints of a URDF (``robot_description``).

    A ``revolute`` or ``prismatic`` joint's ``<limit lower=".." upper=".."/>`` bounds the dimension of the
    same name (the URDF specification's default for a missing attribute is 0); ``continuous`` and other
    joint types, and dimensions not named after a URDF joint, stay unlimited. Only the ``<joint>``
    elements directly under ``<robot>`` are read (``<transmission>`` also has ``<joint>`` children).

    Args:
        urdf: the URDF XML text.
        action_names: the D action dimension names.

    Returns:
        ``(limits, unlimited)``: :class:`JointLimits` with ``source='robot_description'``, and the names
        of the dimensions left unlimited.

    Raises:
        ValueError: not parseable XML, no ``<robot>`` root, a non-numeric bound, or ``lower > upper``.
    """
    try:
        root = ElementTree.fromstring(urdf)
    except ElementTree.ParseError as error:
        raise ValueError(f"robot_description is not valid XML: {error}") from None
    if root.tag != "robot":
        raise ValueError(f"robot_description: root element is <{root.tag}>, expected <robot>")
    bounds: dict[str, tuple[float, float]] = {}
    for joint in root.findall("joint"):
        limit = joint.find("limit")
        if joint.get("type") not in _LIMITED_URDF_JOINTS or limit is None:
            continue
        try:
            bounds[joint.get("name", "")] = (float(limit.get("lower", "0")), float(limit.get("upper", "0")))
        except ValueError:
            raise ValueError(f"robot_description: joint {joint.get('name')!r} has a non-numeric "
                             f"<limit lower={limit.get('lower')!r} upper={limit.get('upper')!r}>") from None
    lower = np.array([bounds.get(name, (-math.inf, math.inf))[0] for name in action_names], np.float64)
    upper = np.array([bounds.get(name, (-math.inf, math.inf))[1] for name in action_names], np.float64)
    try:
        limits = JointLimits(lower, upper, "robot_description")
    except ValueError as error:
        raise ValueError(f"robot_description: {error}") from None
    return limits, [name for name in action_names if name not in bounds]


def expired_by(stamp_s: float, last_point_s: float, now_s: float) -> float | None:
    """How long ago an output's last point was due, or None if it is still ahead.

    Args:
        stamp_s: the output's ``header.stamp`` [s] on the node clock's time base.
        last_point_s: offset of its last point from the stamp [s]: ``(H - 1)·dt`` for an
            ``ActionChunk`` (action i is due at ``stamp + i·dt``), ``H·dt`` for a ``JointTrajectory``
            (point i has ``time_from_start = (i + 1)·dt``).
        now_s: the node clock at publication [s].

    Returns:
        seconds > 0 by which the last point is already past, or None when it is not past.
    """
    late = now_s - (stamp_s + last_point_s)
    return late if late > 0.0 else None
