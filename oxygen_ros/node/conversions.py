"""Engine outputs (plain Python objects) → ROS messages.

Stamp policy: every output carries the stamp of the observation it was computed from (the newest
camera frame used, or its receipt time when that frame's stamp was zero), never the publish time;
``~/status`` is the exception and carries its publication time.
"""

from __future__ import annotations

from builtin_interfaces.msg import Duration, Time
from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import MemoryEntry as MemoryEntryMsg
from oxygen_ros.msg import Speech
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.engine import ActionChunk, MemoryEntry, RequestStatus, TextEvent

_SPEECH_STATUS = {
    RequestStatus.WAITING: Speech.STATUS_IN_PROGRESS,
    RequestStatus.RUNNING: Speech.STATUS_IN_PROGRESS,
    RequestStatus.COMPLETED: Speech.STATUS_COMPLETED,
    RequestStatus.CANCELLED: Speech.STATUS_CANCELLED,
    RequestStatus.PREEMPTED: Speech.STATUS_CANCELLED,
    RequestStatus.DROPPED: Speech.STATUS_DROPPED,
}


def action_chunk_msg(chunk: ActionChunk, stamp: Time, frame_id: str, action_names: tuple[str, ...], dt: float,
                     model_id: str) -> ActionChunkMsg:
    """An ``oxygen_ros/ActionChunk`` message.

    Args:
        chunk: the engine's chunk, ``actions`` float32 ``[H, D]``.
        stamp: the observation's stamp.
        frame_id: the robot's base frame (may be empty).
        action_names: the D dimension names.
        dt: time between consecutive actions [s] (the control period).
        model_id: weights / preset id.

    Raises:
        ValueError: ``actions`` is not ``[H, len(action_names)]``.
    """
    horizon, dim = chunk.actions.shape
    if dim != len(action_names):
        raise ValueError(f"chunk has {dim} action dimensions, action_names has {len(action_names)}")
    msg = ActionChunkMsg()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.action_names = list(action_names)
    msg.horizon = horizon
    msg.action_dim = dim
    msg.dt = dt
    msg.actions = chunk.actions.astype("float32").ravel().tolist()
    msg.observation_seq = chunk.seq
    msg.inference_latency = chunk.latency_s
    msg.model_id = model_id
    msg.subtask = chunk.subtask or ""
    msg.rtc_delay_steps = int(chunk.rtc_delay_steps)
    msg.rtc_takeover_index = int(chunk.rtc_takeover_index)
    msg.rtc_fallback = chunk.rtc_fallback
    return msg


def _duration(seconds: float) -> Duration:
    nanoseconds = round(seconds * 1e9)
    return Duration(sec=nanoseconds // 1_000_000_000, nanosec=nanoseconds % 1_000_000_000)


def joint_trajectory_msg(chunk: ActionChunk, stamp: Time, frame_id: str, action_names: tuple[str, ...],
                         joint_names: tuple[str, ...], dt: float, first: int = 0) -> JointTrajectory:
    """A ``trajectory_msgs/JointTrajectory`` for ros2_control's joint_trajectory_controller.

    Point j holds the positions of action ``first + j`` for ``joint_names`` (a subset of ``action_names``)
    and ``time_from_start = (j + 1) * dt``.

    Args:
        stamp: ``header.stamp``, per the node's ``trajectory_stamp_policy``: zero (start on receipt), the
            observation's stamp, or (``takeover``) the observation's stamp + ``first * dt``.
        first: the first action sent (``takeover``: the real-time-chunking delay d; the actions before it
            are the ones the robot executes of the previous chunk meanwhile); 0 .. H − 1.

    Raises:
        ValueError: ``first`` outside ``0 .. H − 1``.
    """
    if not 0 <= first < chunk.actions.shape[0]:
        raise ValueError(f"first action {first} outside the chunk's 0..{chunk.actions.shape[0] - 1}")
    columns = [action_names.index(name) for name in joint_names]
    msg = JointTrajectory()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.joint_names = list(joint_names)
    for j, row in enumerate(chunk.actions[first:, columns].astype(float)):
        msg.points.append(JointTrajectoryPoint(positions=row.tolist(), time_from_start=_duration((j + 1) * dt)))
    return msg


def hold_trajectory_msg(joint_names: tuple[str, ...], positions: list[float], frame_id: str,
                        dt: float) -> JointTrajectory:
    """A ``trajectory_msgs/JointTrajectory`` that holds the joints where they are (the node's last command
    on stop, ``on_stop_command: hold``).

    One point: ``positions`` [rad or m] of ``joint_names``, zero velocities, ``time_from_start = dt`` [s];
    ``header.stamp`` zero (the controller starts it on receipt, replacing what it was executing).
    """
    msg = JointTrajectory()
    msg.header.frame_id = frame_id
    msg.joint_names = list(joint_names)
    msg.points.append(JointTrajectoryPoint(positions=[float(p) for p in positions],
                                           velocities=[0.0] * len(joint_names), time_from_start=_duration(dt)))
    return msg


def speech_msg(event: TextEvent, stamp: Time, utterance_id: str, sequence: int, instruction: str) -> Speech:
    """An ``oxygen_ros/Speech`` message: a partial (text so far) or the final (whole text, end status).

    Args:
        event: the engine's text event.
        stamp: the stamp of the observation the request decodes from.
        utterance_id: unique id of the request.
        sequence: 0, 1, 2, ... per message of this utterance.
        instruction: the instruction of that observation.
    """
    msg = Speech()
    msg.header.stamp = stamp
    msg.utterance_id = utterance_id
    msg.text = event.text
    msg.sequence = sequence
    msg.final = event.final
    msg.status = _SPEECH_STATUS[event.status] if event.final else Speech.STATUS_IN_PROGRESS
    msg.task = event.task
    msg.instruction = instruction
    return msg


def memory_entry_msg(entry: MemoryEntry, stamp: Time, entry_id: str, camera_names: tuple[str, ...],
                     instruction: str) -> MemoryEntryMsg:
    """An ``oxygen_ros/MemoryEntry``: caption and pooled prefix embedding (empty when the model has none)."""
    msg = MemoryEntryMsg()
    msg.header.stamp = stamp
    msg.entry_id = entry_id
    msg.text = entry.text
    msg.embedding = [] if entry.embedding is None else entry.embedding.astype("float32").ravel().tolist()
    msg.camera_names = list(camera_names)
    msg.instruction = instruction
    return msg
