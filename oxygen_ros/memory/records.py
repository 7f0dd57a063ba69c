"""What the memory store keeps and how it is asked (no rclpy: the node converts its messages to these).

* :class:`Pose` — where the robot was: a position [m] and orientation (unit quaternion) in a fixed frame.
* :class:`MemoryRecord` — one stored entry: caption, observation stamp, robot, instruction, cameras, pose,
  embedding.
* :class:`MemoryQuery` — the filters and the ranking of a retrieval.
* :class:`Hit` — one retrieved record with its score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Pose:
    """The pose of the robot frame in a fixed frame at one instant.

    Attributes:
        frame_id: the fixed frame the pose is expressed in (e.g. ``map``, ``odom``).
        position: ``(x, y, z)`` [m].
        orientation: ``(x, y, z, w)``, a unit quaternion.
        stamp_s: the stamp of the pose sample [s] (the clock of the observation stamps).
    """

    frame_id: str
    position: tuple[float, float, float]
    orientation: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0)
    stamp_s: float = 0.0

    def distance_to(self, point: tuple[float, float, float]) -> float:
        """Euclidean distance from this pose's position to ``point`` [m]."""
        return math.dist(self.position, point)


@dataclass(frozen=True)
class MemoryRecord:
    """One memory entry as the store keeps it.

    Attributes:
        entry_id: unique id (the MemoryEntry's ``entry_id``); storing an id again replaces the record.
        stamp_s: the observation's stamp [s] (node clock: wall time, or simulated time with use_sim_time).
        text: the caption.
        robot: the robot it is about ("" when unnamed).
        instruction: the instruction active at the observation.
        camera_names: the camera slots whose images were in the prefix.
        pose: where the robot was at ``stamp_s``, or None when unknown (never a guessed pose).
        embedding: the pooled prefix hidden state, float32, shape ``(width,)``, or None.
    """

    entry_id: str
    stamp_s: float
    text: str
    robot: str = ""
    instruction: str = ""
    camera_names: tuple[str, ...] = ()
    pose: Pose | None = None
    embedding: np.ndarray | None = field(default=None, compare=False)

    def to_json(self, embeddings: bool = True) -> dict:
        """A JSON-ready dict (the export's line): every field, the embedding as a list of floats (or
        left out when ``embeddings`` is false), the pose as ``{frame_id, position, orientation, stamp_s}``
        or null."""
        out = {"entry_id": self.entry_id, "stamp_s": self.stamp_s, "text": self.text, "robot": self.robot,
               "instruction": self.instruction, "camera_names": list(self.camera_names),
               "pose": None if self.pose is None else {
                   "frame_id": self.pose.frame_id, "position": list(self.pose.position),
                   "orientation": list(self.pose.orientation), "stamp_s": self.pose.stamp_s}}
        if embeddings:
            out["embedding"] = None if self.embedding is None else [float(v) for v in self.embedding]
        return out

    @staticmethod
    def from_json(data: dict) -> MemoryRecord:
        """The record of a :meth:`to_json` dict (an export's line). Raises KeyError / TypeError / ValueError
        for a malformed one."""
        pose = data.get("pose")
        embedding = data.get("embedding")
        return MemoryRecord(
            entry_id=str(data["entry_id"]), stamp_s=float(data["stamp_s"]), text=str(data["text"]),
            robot=str(data.get("robot", "")), instruction=str(data.get("instruction", "")),
            camera_names=tuple(data.get("camera_names", ())),
            pose=None if pose is None else Pose(str(pose["frame_id"]), tuple(float(v) for v in pose["position"]),
                                                tuple(float(v) for v in pose["orientation"]),
                                                float(pose.get("stamp_s", 0.0))),
            embedding=None if embedding is None else np.asarray(embedding, dtype=np.float32))


@dataclass(frozen=True)
class MemoryQuery:
    """A retrieval: filters (each off at its default) and a ranking.

    Ranking: by the caption's full-text match to ``text`` (BM25, larger score = better; an entry matches when
    its caption has one of the words, words in half or more of the entries aside: they carry no BM25 weight)
    when ``text`` is given; else by cosine similarity to ``embedding`` when given (score in [-1, 1]); else by
    closeness of the stamp to ``near_time_s`` when given (nearest first; ties: the earlier, then the smaller entry
    id; score 0); else newest first (score 0). ``oldest_first`` puts time before the score: the entries that
    ``text`` matches (every entry without ``text``) oldest first, ties the smaller entry id (score 0), for a
    question about the first time something was seen. ``text`` and ``embedding`` are not combined: a text query's words
    and an observation's pooled prefix state are not in one space (docs/memory.md).

    Attributes:
        text: words to find in the captions; "" = no text ranking.
        since_s, until_s: keep entries with ``since_s <= stamp_s <= until_s`` [s]; None = unbounded.
        near: ``(x, y, z)`` [m] in the store's fixed frame; with ``radius_m``, keep entries with a pose within
            ``radius_m`` of it (entries without a pose never match a place).
        radius_m: the place filter's radius [m]; must be > 0 when ``near`` is given.
        robot: keep this robot's entries only; None = every robot.
        embedding: float32 ``(width,)`` to rank by cosine similarity; None = not used.
        k: most hits returned, >= 1.
        near_time_s: a time [s] to rank by closeness to (not with ``text`` or ``embedding``); None = not used.
        oldest_first: rank the matches by stamp, oldest first, instead of by score or newest first (not with
            ``embedding`` or ``near_time_s``).

    Raises:
        ValueError: ``k`` < 1, ``near`` without a positive ``radius_m``, a NaN time bound, ``since_s`` after
            ``until_s``, or both
            ``text`` and ``embedding``, a ``near_time_s`` that is not finite or comes with either, ``oldest_first``
            with ``embedding`` or ``near_time_s``.
    """

    text: str = ""
    since_s: float | None = None
    until_s: float | None = None
    near: tuple[float, float, float] | None = None
    radius_m: float = 0.0
    robot: str | None = None
    embedding: np.ndarray | None = field(default=None, compare=False)
    k: int = 10
    near_time_s: float | None = None
    oldest_first: bool = False

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.near is not None and not (self.radius_m > 0 and math.isfinite(self.radius_m)):
            raise ValueError(f"a place query needs a finite radius_m > 0, got {self.radius_m}")
        if self.near is not None and (len(self.near) != 3 or not all(math.isfinite(v) for v in self.near)):
            raise ValueError(f"near must be three finite coordinates [m], got {self.near}")
        if any(bound is not None and math.isnan(bound) for bound in (self.since_s, self.until_s)):
            raise ValueError(f"a time bound must not be NaN, got since_s {self.since_s}, until_s {self.until_s}")
        if self.since_s is not None and self.until_s is not None and self.since_s > self.until_s:
            raise ValueError(f"since_s {self.since_s} is after until_s {self.until_s}")
        if self.text.strip() and self.embedding is not None:
            raise ValueError("give text or embedding, not both: they are not in one space (docs/memory.md)")
        if self.near_time_s is not None:
            if not math.isfinite(self.near_time_s):
                raise ValueError(f"near_time_s must be finite, got {self.near_time_s}")
            if self.text.strip() or self.embedding is not None:
                raise ValueError("rank by text, embedding or near_time_s, one of them")
        if self.oldest_first and (self.embedding is not None or self.near_time_s is not None):
            raise ValueError("oldest_first orders the text matches (or every entry) by time: not with embedding or "
                             "near_time_s")


@dataclass(frozen=True)
class Hit:
    """One retrieved record and its score (BM25 for a text query, cosine for an embedding query, else 0)."""

    record: MemoryRecord
    score: float
