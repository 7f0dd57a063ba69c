"""The robot's memory: a persistent store of the node's memory entries (caption, stamp, pose, robot,
instruction, embedding) with retrieval by text, time window, place and robot (docs/memory.md). No rclpy: the
node (``oxygen_ros/node/memory_service.py``) converts its messages to :class:`MemoryRecord`.

    from oxygen_ros.memory import MemoryQuery, open_store
    with open_store("runs/memory.db") as store:
        for hit in store.query(MemoryQuery(text="red cube", near=(1.0, 2.0, 0.0), radius_m=0.5, k=5)):
            print(hit.score, hit.record.stamp_s, hit.record.text)

Command line: ``python -m oxygen_ros.memory {query,export,import,prune,stats} STORE ...``.
"""

from __future__ import annotations

from pathlib import Path

from oxygen_ros.memory.records import Hit, MemoryQuery, MemoryRecord, Pose
from oxygen_ros.memory.sqlite_store import SqliteMemoryStore
from oxygen_ros.memory.store import MemoryStore, RetentionPolicy

__all__ = ["Hit", "MemoryQuery", "MemoryRecord", "MemoryStore", "Pose", "RetentionPolicy", "SqliteMemoryStore",
           "open_store"]


def open_store(location: Path | str, synchronous: str = "full") -> MemoryStore:
    """The store at ``location``: a SQLite file path (created when missing).

    Raises:
        ValueError: an empty location, or as :class:`SqliteMemoryStore`.
        sqlite3.Error: as :class:`SqliteMemoryStore`.
    """
    if not str(location).strip():
        raise ValueError("the memory store location is empty")
    return SqliteMemoryStore(location, synchronous=synchronous)
