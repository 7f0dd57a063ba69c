"""The action output of ``oxygen_node``: one decision per action chunk — publish it as computed, clamp it,
or withhold it — with the reason, then the ``~/action_chunk`` and ``~/joint_trajectory`` messages that the
decision allows; and the controller's last command when the node stops acting (``on_stop_command``).

The gates and checks, in order (the first that withholds ends the decision):
    paused          ``~/pause_actions`` is in force (counted by :class:`~oxygen_ros.node.commands.Commands`)
    command_conflict  another publisher of the command topics under ``command_conflict_policy: refuse``
                    (counted by :class:`~oxygen_ros.node.command_conflicts.CommandConflicts`)
    non_finite_actions  a NaN or infinite value: neither ActionChunk nor JointTrajectory goes out
    limited_actions values outside the joint limits: clamped into them, or the chunk withheld
                    (``joint_limits.policy``)
    expired_chunks, expired_trajectories  the output's last point is already past at publication
                    (``expired_output_policy``: ``fallback`` publishes the ActionChunk as it is and the
                    JointTrajectory with stamp 0, ``withhold`` withholds it)
The checks themselves are oxygen_ros/node/output_checks.py; each event is counted in ~/status and logged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from builtin_interfaces.msg import Time

from oxygen_ros.engine import ActionChunk
from oxygen_ros.node import conversions
from oxygen_ros.node.command_conflicts import CommandConflicts
from oxygen_ros.node.commands import Commands
from oxygen_ros.node.diagnostics import StatusTracker
from oxygen_ros.node.inputs import DropCounter, stamp_seconds
from oxygen_ros.node.output_checks import all_finite, expired_by
from oxygen_ros.node.parameters import NodeSettings
from oxygen_ros.node.time_checks import StampWatch


@dataclass(frozen=True)
class ActionDecision:
    """What leaves the node for one action chunk.

    Attributes:
        chunk: the chunk as it goes out (its actions clamped when the joint limits clamp them); None when
            withheld.
        publish_chunk: whether the ActionChunk is published.
        trajectory_stamp: the JointTrajectory's header stamp (zero: executed on receipt); None when no
            JointTrajectory goes out (withheld, or ``publish_trajectory`` is off).
        trajectory_first: the chunk's first action in the JointTrajectory (``takeover``: the real-time-chunking
            delay d of a guided chunk, else 0).
        reasons: why the output differs from the chunk as computed (``paused``, ``command_conflict``,
            ``non_finite_actions``, ``limited_actions``, ``expired_chunks``, ``expired_trajectories``);
            empty when it goes out unchanged.
    """

    chunk: ActionChunk | None
    publish_chunk: bool
    trajectory_stamp: Time | None
    reasons: tuple[str, ...] = ()
    trajectory_first: int = 0


def _withheld(reason: str) -> ActionDecision:
    return ActionDecision(None, False, None, (reason,))


class ActionOutput:
    """Decides and publishes the action outputs of each chunk (see the module docstring).

    Args:
        node: the node whose parameters (``command_conflict_policy``, ``joint_limits.policy``,
            ``expired_output_policy``, ``expired_output_margin_s``) and logger are used.
        settings: the configure step's settings (frame, names, action_dt_s, trajectory stamp policy).
        publishers: the configured topics (:class:`~oxygen_ros.node.topics.TopicBridge`): ``action_chunk``,
            ``trajectory`` (None without ``publish_trajectory``) and the ``joint_positions`` to hold.
        commands: the pause gate; conflicts: the command-conflict gate.
        joint_limits: returns the joint limits in force (or None).
        now: the node clock (``Time``, seconds).
        status, withheld, changed, stamps: where events are recorded: ~/status, the error-level counter of
            withheld outputs, the warning-level counter of changed ones, and the camera clock offsets named
            by the expiry warning.
    """

    def __init__(self, node, settings: NodeSettings, publishers, commands: Commands, conflicts: CommandConflicts,
                 joint_limits: Callable[[], object], now: Callable[[], tuple[Time, float]], status: StatusTracker,
                 withheld: DropCounter, changed: DropCounter, stamps: StampWatch):
        self._node = node
        self._settings = settings
        self._publishers = publishers
        self._commands = commands
        self._conflicts = conflicts
        self._joint_limits = joint_limits
        self._now = now
        self._status = status
        self._withheld = withheld
        self._changed = changed
        self._stamps = stamps
        self._expiry_warned = False

    def reset(self) -> None:
        """A new activation: the expiry warning may be given again."""
        self._expiry_warned = False

    def publish(self, chunk: ActionChunk, stamp: Time) -> ActionDecision:
        """Decide on ``chunk`` (its observation stamped ``stamp``) and publish what the decision allows; once
        per chunk, from the control-cycle thread. Under the pause gate's lock: once ``~/pause_actions`` has
        answered, no chunk leaves the node."""
        decision = _withheld("paused")

        def send() -> None:
            nonlocal decision
            decision = self.decide(chunk, stamp)
            self._send(decision, stamp)

        self._commands.gate_action(send)
        return decision

    def decide(self, chunk: ActionChunk, stamp: Time) -> ActionDecision:
        """The command-conflict gate, the output checks and expiry for ``chunk`` (not the pause gate), with
        their events counted and logged."""
        parameter = self._node.get_parameter
        if self._conflicts.withholds(parameter("command_conflict_policy").value):
            return _withheld("command_conflict")    # logged when the conflict appeared; on /diagnostics
        actions = chunk.actions
        if not all_finite(actions):
            bad = int(np.sum(~np.isfinite(actions)))
            self._status.record_event("non_finite_actions", f"observation {chunk.seq}: {bad} of {actions.size} values")
            self._withheld.drop("non_finite_actions", f"action chunk of observation {chunk.seq} withheld (neither "
                                f"ActionChunk nor JointTrajectory sent): {bad} of {actions.size} values are NaN or "
                                "infinite")
            return _withheld("non_finite_actions")
        reasons: list[str] = []
        limits = self._joint_limits()
        if limits is not None and limits.violations(actions):
            outside = limits.violations(actions)
            policy = parameter("joint_limits.policy").value
            self._status.record_event("limited_actions", f"observation {chunk.seq}: {outside} values {policy}ed")
            (self._withheld if policy == "reject" else self._changed).drop(
                "limited_actions", f"action chunk of observation {chunk.seq}: {outside} of {actions.size} values "
                f"outside the joint limits ({limits.source}): "
                + ("chunk withheld" if policy == "reject" else "clamped into them"))
            if policy == "reject":
                return _withheld("limited_actions")
            chunk = replace(chunk, actions=limits.clamp(actions))
            reasons.append("limited_actions")
        settings = self._settings
        expiry = parameter("expired_output_policy").value
        margin = parameter("expired_output_margin_s").value   # delivery time to the controller
        _, now_s = self._now()
        stamp_s = stamp_seconds(stamp)
        horizon, dt = chunk.actions.shape[0], settings.action_dt_s
        late = expired_by(stamp_s, (horizon - 1) * dt - margin, now_s)
        if late is not None:
            self._status.record_event("expired_chunks", f"observation {chunk.seq}: {late:.3f} s past")
            self._warn_expired("ActionChunk", late, now_s - stamp_s, expiry)
            reasons.append("expired_chunks")
        publish_chunk = late is None or expiry == "fallback"
        if not settings.publish_trajectory:
            return ActionDecision(chunk, publish_chunk, None, tuple(reasons))
        trajectory_stamp: Time | None = Time()
        first = 0
        if settings.trajectory_stamp_policy in ("observation", "takeover"):
            late = expired_by(stamp_s, horizon * dt - margin, now_s)
            if late is None:
                trajectory_stamp = stamp
                if settings.trajectory_stamp_policy == "takeover" and 0 < chunk.rtc_delay_steps < horizon:
                    # from the action that takes over from the chunk in flight, at its time: the controller keeps
                    # the previous trajectory's (frozen) actions until then
                    first = chunk.rtc_delay_steps
                    nanoseconds = stamp.sec * 1_000_000_000 + stamp.nanosec + round(first * dt * 1e9)
                    trajectory_stamp = Time(sec=nanoseconds // 1_000_000_000, nanosec=nanoseconds % 1_000_000_000)
            else:
                self._status.record_event("expired_trajectories", f"observation {chunk.seq}: {late:.3f} s past")
                self._warn_expired("JointTrajectory", late, now_s - stamp_s, expiry)
                reasons.append("expired_trajectories")
                if expiry == "withhold":
                    trajectory_stamp = None
        return ActionDecision(chunk, publish_chunk, trajectory_stamp, tuple(reasons), first)

    def _send(self, decision: ActionDecision, stamp: Time) -> None:
        settings, chunk = self._settings, decision.chunk
        if decision.publish_chunk:
            self._publishers.action_chunk.publish(conversions.action_chunk_msg(
                chunk, stamp, settings.frame_id, settings.action_names, settings.action_dt_s, settings.model_id))
        trajectory = self._publishers.trajectory
        if decision.trajectory_stamp is not None and trajectory is not None:
            trajectory.publish(conversions.joint_trajectory_msg(
                chunk, decision.trajectory_stamp, settings.frame_id, settings.action_names,
                settings.trajectory_joint_names, settings.action_dt_s, decision.trajectory_first))

    def send_hold(self) -> None:
        """``on_stop_command: hold``: one JointTrajectory holding the latest JointState positions of the
        trajectory joints (stamp 0: executed on receipt). Logged and not sent when there is nothing to
        hold from (no JointState, or one without a trajectory joint), or without ``publish_trajectory``."""
        trajectory, positions = self._publishers.trajectory, self._publishers.joint_positions
        if trajectory is None:
            return
        settings, logger = self._settings, self._node.get_logger()
        names = settings.trajectory_joint_names
        missing = list(names) if positions is None else [name for name in names if name not in positions]
        if missing:
            logger.warning(f"on_stop_command hold: no hold trajectory sent, no JointState position of "
                           f"{missing} received while active")
            return
        trajectory.publish(conversions.hold_trajectory_msg(
            names, [positions[name] for name in names], settings.frame_id, settings.action_dt_s))
        logger.info(f"on_stop_command hold: sent a JointTrajectory holding {list(names)}")

    def _warn_expired(self, output: str, late_s: float, behind_s: float, policy: str) -> None:
        """One warning per activation for the first expired output, naming the clock offset."""
        if self._expiry_warned:
            return
        self._expiry_warned = True
        offset = self._stamps.largest_offset()
        action = {"fallback": "JointTrajectories go out with stamp 0 (start on receipt), ActionChunks as they are",
                  "withhold": "such outputs are withheld"}[policy]
        self._node.get_logger().warning(
            f"{output} already {late_s:.3f} s past its last point at publication: the observation stamp is "
            f"{behind_s:.3f} s behind the node clock"
            + ("" if offset is None else f" (camera header stamps vs node clock at receipt: {offset:+.3f} s)")
            + f". expired_output_policy {policy}: {action}; counted in ~/status (expired_chunks, "
            "expired_trajectories). If the camera offset is small the delay is inference time: the chunk spans "
            "less time (action_horizon x action_dt_s) than a cycle takes on this machine; otherwise synchronise "
            "the camera and node clocks, or use trajectory_stamp_policy: now. "
            "This warning is given once per activation.")
