"""The memory store's interface and its retention policy (no rclpy).

:class:`MemoryStore` is what the node, the CLI and a user's code talk to; :class:`~oxygen_ros.memory.sqlite_store.
SqliteMemoryStore` is the embedded implementation (docs/memory.md says why SQLite), :class:`~oxygen_ros.memory.
milvus_store.MilvusMemoryStore` the one in Milvus (milvus-lite or a server). :class:`RetentionPolicy`
says what :meth:`MemoryStore.prune` removes; :func:`near_duplicates` is its place-and-text rule, shared by every
implementation.
"""

from __future__ import annotations

import abc
import json
import math
import re
from dataclasses import dataclass
from typing import IO, Iterable, Iterator

from oxygen_ros.memory.records import Hit, MemoryQuery, MemoryRecord

_WORD = re.compile(r"\w+", re.UNICODE)
# the Milvus collection a store location names unless told otherwise (node parameter memory.store.collection)
DEFAULT_COLLECTION = "oxygen_memory"


def words(text: str) -> frozenset[str]:
    """The case-folded words of ``text`` (``\\w+`` runs), as a set."""
    return frozenset(w.casefold() for w in _WORD.findall(text))


def text_similarity(a: str, b: str) -> float:
    """Jaccard similarity of the word sets of ``a`` and ``b`` in [0, 1] (1 for two texts without words)."""
    wa, wb = words(a), words(b)
    if not wa and not wb:
        return 1.0
    return len(wa & wb) / len(wa | wb)


@dataclass(frozen=True)
class RetentionPolicy:
    """What :meth:`MemoryStore.prune` removes; each rule is off at 0.

    Attributes:
        max_age_s: entries older than ``now - max_age_s`` [s].
        max_count: beyond this many entries, the oldest.
        duplicate_radius_m: near-duplicates: of two entries of one robot with poses in the same fixed frame
            within this distance [m] and captions at least ``duplicate_text_similarity`` alike, the older
            goes (the place still has its newest description). Entries without a pose are never removed as
            duplicates (their place is unknown).
        duplicate_text_similarity: word-set Jaccard similarity in (0, 1] at which two captions count as alike
            (1 = the same words).

    Raises:
        ValueError: a negative or non-finite value, or a similarity outside (0, 1].
    """

    max_age_s: float = 0.0
    max_count: int = 0
    duplicate_radius_m: float = 0.0
    duplicate_text_similarity: float = 1.0

    def __post_init__(self):
        for name in ("max_age_s", "max_count", "duplicate_radius_m"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"retention {name} must be finite and >= 0 (0 = off), got {value}")
        if not 0 < self.duplicate_text_similarity <= 1:
            raise ValueError(f"retention duplicate_text_similarity must be in (0, 1], got "
                             f"{self.duplicate_text_similarity}")

    @property
    def active(self) -> bool:
        """Whether any rule is on."""
        return bool(self.max_age_s or self.max_count or self.duplicate_radius_m)


def near_duplicates(rows: Iterable[tuple[str, float, str, str, str, float, float, float]], radius_m: float,
                    similarity: float) -> list[str]:
    """The ids of the entries :class:`RetentionPolicy`'s near-duplicate rule removes.

    Args:
        rows: ``(entry_id, stamp_s, robot, text, frame_id, x, y, z)`` of the entries with a pose.
        radius_m: places within this distance [m] are the same place (> 0).
        similarity: captions with a word-set Jaccard similarity at least this are alike.

    Returns:
        Every entry for which a newer entry of the same robot and frame lies within ``radius_m`` with an
        alike caption (compared with the newer entries kept, newest first; a grid of ``radius_m`` cells
        limits the comparisons to neighbouring cells).
    """
    ordered = sorted(rows, key=lambda r: (-r[1], r[0]))
    kept: dict[tuple, list[tuple[tuple[float, float, float], frozenset[str]]]] = {}
    removed = []
    for entry_id, _, robot, text, frame_id, x, y, z in ordered:
        cell = (math.floor(x / radius_m), math.floor(y / radius_m), math.floor(z / radius_m))
        mine = words(text)
        duplicate = False
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                for dz in (-1, 0, 1):
                    for place, other in kept.get((robot, frame_id, cell[0] + dx, cell[1] + dy, cell[2] + dz), ()):
                        if math.dist(place, (x, y, z)) <= radius_m and _alike(mine, other, similarity):
                            duplicate = True
                            break
                    if duplicate:
                        break
                if duplicate:
                    break
        if duplicate:
            removed.append(entry_id)
        else:
            kept.setdefault((robot, frame_id) + cell, []).append(((x, y, z), mine))
    return removed


def _alike(a: frozenset[str], b: frozenset[str], similarity: float) -> bool:
    if not a and not b:
        return True
    return len(a & b) / len(a | b) >= similarity


class MemoryStore(abc.ABC):
    """A persistent store of memory entries (see the module docstring). Implementations are safe to use from
    several threads (one writer and readers at once)."""

    @abc.abstractmethod
    def insert(self, records: Iterable[MemoryRecord]) -> int:
        """Store ``records`` (SQLite: in one transaction, all or none; Milvus: one write per collection, the
        entries last, see :class:`~oxygen_ros.memory.milvus_store.MilvusMemoryStore`); a record whose ``entry_id``
        is already stored replaces it. Returns how many were stored. Raises ValueError for a record the backend
        cannot hold (before anything is written), and the backend's error when it cannot write (disk full,
        read-only file, an unreachable server)."""

    @abc.abstractmethod
    def query(self, query: MemoryQuery) -> list[Hit]:
        """The at most ``query.k`` best records that pass every filter of ``query``, best first
        (:class:`MemoryQuery` gives the ranking)."""

    @abc.abstractmethod
    def get(self, entry_ids: Iterable[str]) -> list[MemoryRecord]:
        """The stored records of ``entry_ids`` (unknown ids left out), in the order asked."""

    @abc.abstractmethod
    def records(self, embeddings: bool = True) -> Iterator[MemoryRecord]:
        """Every stored record, oldest first (``embedding`` None when ``embeddings`` is false)."""

    @abc.abstractmethod
    def prune(self, policy: RetentionPolicy, now_s: float | None = None) -> dict[str, int]:
        """Remove what ``policy`` says, ``now_s`` [s] being the present for ``max_age_s`` (None = the newest
        stored stamp); SQLite in one transaction, Milvus batch by batch. Returns the number removed per rule
        (``age``, ``count``, ``duplicate``)."""

    @abc.abstractmethod
    def count(self) -> int:
        """Number of stored records."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Figures for a person: ``entries``, ``with_pose``, ``robots``, ``oldest_s``, ``newest_s``,
        ``bytes`` (on disk) and backend-specific ones."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the store; idempotent."""

    def export_jsonl(self, stream: IO[str], embeddings: bool = True) -> int:
        """Write every record, oldest first, one JSON object per line (:meth:`MemoryRecord.to_json`) to
        ``stream``. Returns the number written."""
        n = 0
        for record in self.records(embeddings=embeddings):
            stream.write(json.dumps(record.to_json(embeddings=embeddings), ensure_ascii=False) + "\n")
            n += 1
        return n

    def import_jsonl(self, stream: IO[str], batch: int = 1000) -> int:
        """Insert the records of an export (:meth:`export_jsonl`) in batches of ``batch``. Returns the
        number inserted. Raises ValueError naming the line of a malformed one (the batches before it are
        stored)."""
        pending, n = [], 0
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                pending.append(MemoryRecord.from_json(json.loads(line)))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"line {number}: not a memory record ({err})") from None
            if len(pending) >= batch:
                n += self.insert(pending)
                pending = []
        if pending:
            n += self.insert(pending)
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
