"""The robot's memory: a persistent store of the node's memory entries (caption, stamp, pose, robot,
instruction, embedding) with retrieval by text, time window, place and robot (docs/memory.md). No rclpy: the
node (``oxygen_ros/node/memory_service.py``) converts its messages to :class:`MemoryRecord`.

    from oxygen_ros.memory import MemoryQuery, open_store
    with open_store("runs/memory.db") as store:
        for hit in store.query(MemoryQuery(text="red cube", near=(1.0, 2.0, 0.0), radius_m=0.5, k=5)):
            print(hit.score, hit.record.stamp_s, hit.record.text)

Backends (:func:`open_store` picks one from the location): a SQLite file (the embedded default,
:class:`SqliteMemoryStore`), milvus-lite or a Milvus server (:class:`~oxygen_ros.memory.milvus_store.
MilvusMemoryStore`, imported when first used: pymilvus takes about a second to import).

Command line: ``python -m oxygen_ros.memory {query,export,import,prune,stats} STORE ...``.
"""

from __future__ import annotations

from pathlib import Path

from oxygen_ros.memory.records import Hit, MemoryQuery, MemoryRecord, Pose
from oxygen_ros.memory.sqlite_store import SqliteMemoryStore
from oxygen_ros.memory.store import DEFAULT_COLLECTION, MemoryStore, RetentionPolicy

__all__ = ["Hit", "MemoryQuery", "MemoryRecord", "MemoryStore", "Pose", "RetentionPolicy", "SqliteMemoryStore",
           "open_store", "parse_location"]

BACKENDS = ("sqlite", "milvus")


def parse_location(location: Path | str) -> tuple[str, str]:
    """The backend and its target of a store location (``memory.store.path``).

    * ``sqlite:PATH`` or a plain ``PATH`` (what every earlier release took): a SQLite file;
    * ``milvus:PATH.db``: milvus-lite, embedded (``PATH.db`` is a directory);
    * ``http://HOST:PORT[/DATABASE]``, ``https://...``, or the same after ``milvus:``: a Milvus server.

    Returns:
        ``("sqlite", path)`` or ``("milvus", path or URI)``.

    Raises:
        ValueError: an empty location or target.
    """
    text = str(location).strip()
    if not text:
        raise ValueError("the memory store location is empty")
    backend, target = "sqlite", text
    if text.startswith(("sqlite:", "milvus:")):
        backend, target = text.split(":", 1)
    elif text.lower().startswith(("http://", "https://")):
        backend = "milvus"
    if not target.strip():
        raise ValueError(f"the memory store location {text!r} names no {backend} target")
    return backend, target


def open_store(location: Path | str, synchronous: str = "full", collection: str = DEFAULT_COLLECTION,
               create: bool = True) -> MemoryStore:
    """The store at ``location`` (:func:`parse_location`): a SQLite file (created when missing), a milvus-lite
    directory (created when missing) or a Milvus server's ``collection`` (created when missing).

    Args:
        location: see :func:`parse_location`.
        synchronous: ``"full"`` or ``"normal"`` (SQLite); a Milvus store takes ``"normal"`` only
            (:class:`~oxygen_ros.memory.milvus_store.MilvusMemoryStore` says why).
        collection: the Milvus collection; not used by SQLite (one file, one store).
        create: False: a store that does not exist yet is refused (FileNotFoundError), not created — for readers
            (a mistyped collection must not leave an empty one on a shared server).

    Raises:
        ValueError: an empty or malformed location, or as the backend's store.
        FileNotFoundError: ``create`` False and no store at ``location`` (SQLite file, milvus-lite directory or
            Milvus collection).
        sqlite3.Error: as :class:`SqliteMemoryStore`.
        RuntimeError: as the backend's store (:class:`~oxygen_ros.memory.milvus_store.MilvusStoreError`: Milvus
            cannot be reached or refuses).
    """
    backend, target = parse_location(location)
    if backend == "milvus":
        from oxygen_ros.memory.milvus_store import MilvusMemoryStore

        return MilvusMemoryStore(target, collection=collection, synchronous=synchronous, create=create)
    if not create and not Path(target).exists():
        raise FileNotFoundError(f"{target} does not exist")
    return SqliteMemoryStore(target, synchronous=synchronous)
