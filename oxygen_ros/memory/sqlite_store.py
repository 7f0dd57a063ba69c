"""The embedded memory store: one SQLite file (docs/memory.md says why SQLite).

Layout (schema version 1, ``PRAGMA user_version``):

* ``entries``: one row per record — ``entry_id`` (unique), ``stamp_s``, ``robot``, ``text``, ``instruction``,
  ``camera_names`` (JSON), the pose (``frame_id`` NULL when the entry has none; ``x y z`` [m], ``qx qy qz qw``,
  ``pose_stamp_s``) and ``embedding`` (float32 little-endian bytes, NULL when none); indexes on ``stamp_s``
  and ``(robot, stamp_s)``.
* ``entries_fts``: an FTS5 index of ``text`` (external content, kept in step by triggers), ranked by BM25;
  ``entries_vocab`` its per-word document counts, ``entries_count`` the number of entries (kept by triggers).
* ``entries_place``: an R*Tree of the positions (entries with a pose), the place filter's first step.

Durability: write-ahead log (``journal_mode=WAL``) and ``synchronous=FULL`` by default: each
:meth:`SqliteMemoryStore.insert` is one transaction, on disk when it returns; a process killed at any moment
(kill -9) leaves every committed transaction and none of the one in flight (test/test_memory_store.py).
``synchronous="normal"`` trades the last commits before a power loss (not a process crash) for fewer fsyncs.

Threads: one connection writes (inserts, prunes) and another reads (queries), each behind its own lock; WAL
lets a query run while a write is in progress and read what was committed before it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from oxygen_ros.memory.records import Hit, MemoryQuery, MemoryRecord, Pose
from oxygen_ros.memory.store import MemoryStore, RetentionPolicy, near_duplicates, words

SCHEMA_VERSION = 1
SYNCHRONOUS = ("full", "normal")
_COLUMNS = ("e.entry_id, e.stamp_s, e.robot, e.text, e.instruction, e.camera_names, e.frame_id, e.x, e.y, e.z, "
            "e.qx, e.qy, e.qz, e.qw, e.pose_stamp_s")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    entry_id TEXT NOT NULL UNIQUE,
    stamp_s REAL NOT NULL,
    robot TEXT NOT NULL,
    text TEXT NOT NULL,
    instruction TEXT NOT NULL,
    camera_names TEXT NOT NULL,
    frame_id TEXT,
    x REAL, y REAL, z REAL, qx REAL, qy REAL, qz REAL, qw REAL, pose_stamp_s REAL,
    embedding BLOB
);
CREATE INDEX IF NOT EXISTS entries_stamp ON entries(stamp_s);
CREATE INDEX IF NOT EXISTS entries_robot_stamp ON entries(robot, stamp_s);
CREATE VIRTUAL TABLE IF NOT EXISTS entries_fts USING fts5(text, content='entries', content_rowid='id');
CREATE VIRTUAL TABLE IF NOT EXISTS entries_vocab USING fts5vocab(entries_fts, 'row');
CREATE VIRTUAL TABLE IF NOT EXISTS entries_place USING rtree(id, min_x, max_x, min_y, max_y, min_z, max_z);
CREATE TABLE IF NOT EXISTS entries_count (n INTEGER NOT NULL);
INSERT INTO entries_count SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM entries_count);
CREATE TRIGGER IF NOT EXISTS entries_insert AFTER INSERT ON entries BEGIN
    UPDATE entries_count SET n = n + 1;
    INSERT INTO entries_fts(rowid, text) VALUES (new.id, new.text);
    INSERT INTO entries_place SELECT new.id, new.x, new.x, new.y, new.y, new.z, new.z
        WHERE new.frame_id IS NOT NULL;
END;
CREATE TRIGGER IF NOT EXISTS entries_delete AFTER DELETE ON entries BEGIN
    UPDATE entries_count SET n = n - 1;
    INSERT INTO entries_fts(entries_fts, rowid, text) VALUES ('delete', old.id, old.text);
    DELETE FROM entries_place WHERE id = old.id;
END;
"""
# R*Tree coordinates are float32: the place box is widened by this much [m] (plus a relative margin) so that
# rounding never drops an entry; the exact distance test follows on the float64 columns.
_BOX_MARGIN_M = 1e-3
_SCAN_BATCH = 4096     # embeddings scanned per batch (bounds the memory of an embedding query)


class SqliteMemoryStore(MemoryStore):
    """The embedded :class:`~oxygen_ros.memory.store.MemoryStore` (see the module docstring).

    Args:
        path: the database file; created (with its directory) when missing, reopened with its records when
            present.
        synchronous: ``"full"`` (a committed insert survives a power loss) or ``"normal"`` (it survives a
            process crash).

    Raises:
        ValueError: ``synchronous`` is not one of :data:`SYNCHRONOUS`, or the file holds another schema version.
        sqlite3.Error: the file is not a database, or cannot be created or opened.
        RuntimeError: this SQLite lacks FTS5 or R*Tree.
    """

    def __init__(self, path: Path | str, synchronous: str = "full"):
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {list(SYNCHRONOUS)}, got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write_lock, self._read_lock = threading.Lock(), threading.Lock()
        self._write = self._connect(synchronous)
        try:
            version = self._write.execute("PRAGMA user_version").fetchone()[0]
            tables = self._write.execute("SELECT count(*) FROM sqlite_master WHERE name = 'entries'").fetchone()[0]
            if tables and version != SCHEMA_VERSION:
                raise ValueError(f"{self.path} holds memory store schema version {version}; this code reads "
                                 f"version {SCHEMA_VERSION}")
            try:
                with self._write:
                    self._write.executescript(_SCHEMA)
                    self._write.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except sqlite3.OperationalError as err:
                if "no such module" in str(err):
                    raise RuntimeError(f"this SQLite ({sqlite3.sqlite_version}) lacks a module the memory store "
                                       f"needs: {err}") from None
                raise
            self._read = self._connect(synchronous)
        except BaseException:
            self._write.close()
            raise
        self._closed = False

    def _connect(self, synchronous: str) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0, isolation_level=None)
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        return connection

    # ---- writing ---------------------------------------------------------------------------------

    def insert(self, records: Iterable[MemoryRecord]) -> int:
        rows = [self._row(r) for r in records]
        if not rows:
            return 0
        with self._write_lock:
            self._check_open()
            self._write.execute("BEGIN IMMEDIATE")
            try:
                self._write.executemany("DELETE FROM entries WHERE entry_id = ?", [(row[0],) for row in rows])
                self._write.executemany(
                    "INSERT INTO entries (entry_id, stamp_s, robot, text, instruction, camera_names, frame_id, "
                    "x, y, z, qx, qy, qz, qw, pose_stamp_s, embedding) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
                self._write.execute("COMMIT")
            except BaseException:
                self._write.execute("ROLLBACK")
                raise
        return len(rows)

    @staticmethod
    def _row(record: MemoryRecord) -> tuple:
        pose = record.pose
        place = (None,) * 9 if pose is None else (pose.frame_id, *map(float, pose.position),
                                                   *map(float, pose.orientation), float(pose.stamp_s))
        embedding = None if record.embedding is None else \
            np.ascontiguousarray(record.embedding, dtype="<f4").ravel().tobytes()
        return (record.entry_id, float(record.stamp_s), record.robot, record.text, record.instruction,
                json.dumps(list(record.camera_names)), *place, embedding)

    def prune(self, policy: RetentionPolicy, now_s: float | None = None) -> dict[str, int]:
        removed = {"age": 0, "count": 0, "duplicate": 0}
        if not policy.active:
            return removed
        with self._write_lock:
            self._check_open()
            db = self._write
            db.execute("BEGIN IMMEDIATE")
            try:
                if policy.max_age_s:
                    if now_s is None:
                        now_s = db.execute("SELECT max(stamp_s) FROM entries").fetchone()[0]
                    if now_s is not None:
                        removed["age"] = db.execute("DELETE FROM entries WHERE stamp_s < ?",
                                                    (now_s - policy.max_age_s,)).rowcount
                if policy.duplicate_radius_m:
                    rows = db.execute("SELECT entry_id, stamp_s, robot, text, frame_id, x, y, z FROM entries "
                                      "WHERE frame_id IS NOT NULL").fetchall()
                    ids = near_duplicates(rows, policy.duplicate_radius_m, policy.duplicate_text_similarity)
                    db.executemany("DELETE FROM entries WHERE entry_id = ?", [(i,) for i in ids])
                    removed["duplicate"] = len(ids)
                if policy.max_count:
                    excess = db.execute("SELECT count(*) FROM entries").fetchone()[0] - policy.max_count
                    if excess > 0:
                        removed["count"] = db.execute(
                            "DELETE FROM entries WHERE id IN (SELECT id FROM entries ORDER BY stamp_s, id LIMIT ?)",
                            (excess,)).rowcount
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return removed

    # ---- reading ---------------------------------------------------------------------------------

    def query(self, query: MemoryQuery) -> list[Hit]:
        where, params = self._filters(query)
        with self._read_lock:
            self._check_open()
            db = self._read
            terms = self._weighted_terms(db, sorted(words(query.text)))
            if terms:
                match = " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
                score, order = (("0.0", "e.stamp_s, e.entry_id") if query.oldest_first else
                                ("-bm25(entries_fts)", "bm25(entries_fts), e.stamp_s DESC"))
                sql = (f"SELECT {_COLUMNS}, {score} FROM entries_fts JOIN entries e "
                       f"ON e.id = entries_fts.rowid WHERE entries_fts MATCH ?{''.join(' AND ' + w for w in where)} "
                       f"ORDER BY {order} LIMIT ?")
                rows = db.execute(sql, [match, *params, query.k]).fetchall()
                return [Hit(self._record(row[:-1]), float(row[-1])) for row in rows]
            if query.text.strip():      # words asked, none searchable (punctuation only): nothing matches
                return []
            clause = (" WHERE " + " AND ".join(where)) if where else ""
            if query.near_time_s is not None:
                return self._near_time_query(db, query, clause, params)
            if query.embedding is None:
                order = "e.stamp_s, e.entry_id" if query.oldest_first else "e.stamp_s DESC, e.id DESC"
                rows = db.execute(f"SELECT {_COLUMNS} FROM entries e{clause} ORDER BY {order} "
                                  "LIMIT ?", [*params, query.k]).fetchall()
                return [Hit(self._record(row), 0.0) for row in rows]
            return self._embedding_query(db, query, clause, params)

    @staticmethod
    def _weighted_terms(db: sqlite3.Connection, terms: list[str]) -> list[str]:
        """The words of a text query worth matching: those in fewer than half of the entries. BM25's inverse
        document frequency, ``log((N - n + 0.5) / (n + 0.5))``, is <= 0 for a word in ``n >= N / 2`` of ``N``
        entries (FTS5 then weighs it ~1e-6): such a word ("the", "a") changes no ranking but makes the match
        set, and the cost, the whole store. All of ``terms`` when every one is such a word."""
        if not terms:
            return terms
        total = db.execute("SELECT n FROM entries_count").fetchone()[0]
        counts = dict(db.execute(f"SELECT term, doc FROM entries_vocab WHERE term IN ({','.join('?' * len(terms))})",
                                 terms).fetchall())
        weighted = [t for t in terms if 2 * counts.get(t, 0) < total]
        return weighted or terms

    @staticmethod
    def _filters(query: MemoryQuery) -> tuple[list[str], list]:
        where, params = [], []
        if query.since_s is not None:
            where.append("e.stamp_s >= ?")
            params.append(query.since_s)
        if query.until_s is not None:
            where.append("e.stamp_s <= ?")
            params.append(query.until_s)
        if query.robot is not None:
            where.append("e.robot = ?")
            params.append(query.robot)
        if query.near is not None:
            x, y, z = query.near
            r = query.radius_m + _BOX_MARGIN_M + 1e-6 * max(abs(x), abs(y), abs(z))
            where.append("e.id IN (SELECT id FROM entries_place WHERE min_x <= ? AND max_x >= ? AND min_y <= ? AND "
                         "max_y >= ? AND min_z <= ? AND max_z >= ?)")
            params += [x + r, x - r, y + r, y - r, z + r, z - r]
            where.append("(e.x - ?) * (e.x - ?) + (e.y - ?) * (e.y - ?) + (e.z - ?) * (e.z - ?) <= ?")
            params += [x, x, y, y, z, z, query.radius_m ** 2]
        return where, params

    def _near_time_query(self, db: sqlite3.Connection, query: MemoryQuery, clause: str, params: list) -> list[Hit]:
        """The ``k`` filtered entries nearest ``query.near_time_s``: the ``k`` nearest at or before it and the ``k``
        nearest after it (two index range scans), merged."""
        t, sep = query.near_time_s, " AND " if clause else " WHERE "
        rows = []
        for side, order in (("<=", "DESC"), (">", "ASC")):
            rows += db.execute(f"SELECT {_COLUMNS} FROM entries e{clause}{sep}e.stamp_s {side} ? "
                               f"ORDER BY e.stamp_s {order}, e.entry_id LIMIT ?", [*params, t, query.k]).fetchall()
        records = sorted((self._record(row) for row in rows),
                         key=lambda r: (abs(r.stamp_s - t), r.stamp_s, r.entry_id))
        return [Hit(record, 0.0) for record in records[:query.k]]

    def _embedding_query(self, db: sqlite3.Connection, query: MemoryQuery, clause: str, params: list) -> list[Hit]:
        """Cosine similarity of ``query.embedding`` to every filtered entry with an embedding of its width,
        scanned in batches of :data:`_SCAN_BATCH`; the best ``k``."""
        target = np.asarray(query.embedding, dtype=np.float32).ravel()
        norm = float(np.linalg.norm(target))
        if norm == 0 or not np.isfinite(norm):
            raise ValueError("the query embedding must be finite and not all zero")
        target = target / norm
        width_bytes = target.size * 4
        sep = " AND " if clause else " WHERE "
        cursor = db.execute(f"SELECT e.id, e.embedding FROM entries e{clause}{sep}length(e.embedding) = ?",
                            [*params, width_bytes])
        best_ids, best_scores = np.empty(0, np.int64), np.empty(0, np.float32)
        while batch := cursor.fetchmany(_SCAN_BATCH):
            ids = np.fromiter((row[0] for row in batch), np.int64, len(batch))
            matrix = np.frombuffer(b"".join(row[1] for row in batch), dtype="<f4").reshape(len(batch), -1)
            norms = np.linalg.norm(matrix, axis=1)
            scores = (matrix @ target) / np.where(norms > 0, norms, np.inf)
            best_ids, best_scores = np.concatenate([best_ids, ids]), np.concatenate([best_scores, scores])
            if best_ids.size > query.k:
                keep = np.argpartition(-best_scores, query.k - 1)[:query.k]
                best_ids, best_scores = best_ids[keep], best_scores[keep]
        order = np.argsort(-best_scores, kind="stable")
        hits = []
        for i in order:
            row = db.execute(f"SELECT {_COLUMNS} FROM entries e WHERE e.id = ?", (int(best_ids[i]),)).fetchone()
            hits.append(Hit(self._record(row), float(best_scores[i])))
        return hits

    def get(self, entry_ids: Iterable[str]) -> list[MemoryRecord]:
        wanted = list(entry_ids)
        found: dict[str, MemoryRecord] = {}
        with self._read_lock:
            self._check_open()
            for start in range(0, len(wanted), 500):
                chunk = wanted[start:start + 500]
                rows = self._read.execute(f"SELECT {_COLUMNS}, e.embedding FROM entries e WHERE e.entry_id IN "
                                          f"({','.join('?' * len(chunk))})", chunk).fetchall()
                for row in rows:
                    found[row[0]] = self._record(row[:-1], row[-1])
        return [found[i] for i in wanted if i in found]

    def records(self, embeddings: bool = True) -> Iterator[MemoryRecord]:
        with self._read_lock:
            self._check_open()
            rows = self._read.execute(f"SELECT {_COLUMNS}, {'e.embedding' if embeddings else 'NULL'} FROM entries e "
                                      "ORDER BY e.stamp_s, e.id").fetchall()
        for row in rows:
            yield self._record(row[:-1], row[-1])

    @staticmethod
    def _record(row, embedding: bytes | None = None) -> MemoryRecord:
        (entry_id, stamp_s, robot, text, instruction, cameras, frame_id, x, y, z, qx, qy, qz, qw, pose_stamp) = row
        pose = None if frame_id is None else Pose(frame_id, (x, y, z), (qx, qy, qz, qw), pose_stamp)
        return MemoryRecord(entry_id, stamp_s, text, robot, instruction, tuple(json.loads(cameras)), pose,
                            None if embedding is None else np.frombuffer(embedding, dtype="<f4").copy())

    def count(self) -> int:
        with self._read_lock:
            self._check_open()
            return self._read.execute("SELECT n FROM entries_count").fetchone()[0]

    def stats(self) -> dict:
        with self._read_lock:
            self._check_open()
            entries, with_pose, robots, oldest, newest, embedded = self._read.execute(
                "SELECT count(*), count(frame_id), count(DISTINCT robot), min(stamp_s), max(stamp_s), "
                "count(embedding) FROM entries").fetchone()
        size = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())
        return {"backend": "sqlite", "path": str(self.path), "entries": entries, "with_pose": with_pose,
                "with_embedding": embedded, "robots": robots, "oldest_s": oldest, "newest_s": newest, "bytes": size}

    def checkpoint(self) -> None:
        """Move the write-ahead log into the database file and truncate it (the file alone then holds
        everything: for a copy, or a size measurement)."""
        with self._write_lock:
            self._check_open()
            self._write.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            if getattr(self, "_closed", True):
                return
            self._closed = True
            self._read.close()
            self._write.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the memory store {self.path} is closed")
