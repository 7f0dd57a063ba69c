"""The memory store in Milvus: milvus-lite (embedded, no server) or a Milvus server (docs/memory.md, "Milvus").

One :class:`MilvusMemoryStore` talks to Milvus through pymilvus's ``MilvusClient``, whichever the location:

* ``PATH.db`` (``memory.store.path: milvus:PATH.db``): milvus-lite, Milvus's pure-Python engine, run inside
  this process (a gRPC server on 127.0.0.1 in a thread; ``PATH.db`` is its data directory, locked by one process);
* ``http(s)://HOST:PORT[/DATABASE]``: a Milvus server (Milvus standalone, a cluster, or milvus-lite's own
  ``milvus-lite server``); the token, when the server wants one, comes from the environment variable
  ``OXYGEN_MILVUS_TOKEN`` (never from a parameter, so that it does not show in logs).

Layout (schema version :data:`SCHEMA_VERSION`: its field names and types, checked when a collection is opened):

* collection ``<collection>``: one row per record — ``entry_id`` (VARCHAR primary key), ``stamp_s``, ``robot``,
  ``text`` (VARCHAR analysed by Milvus's ``standard`` analyzer, the input of a BM25 function), ``sparse`` (the
  BM25 function's output, a sparse inverted index with the BM25 metric), ``instruction``, ``camera_names`` (JSON),
  ``has_pose`` and the pose (``frame_id``, ``x y z`` [m], ``qx qy qz qw``, ``pose_stamp_s``; 0 / "" without a
  pose), ``embedding_width`` (0 = no embedding);
* collection ``<collection>_embedding_<width>`` per embedding width: ``entry_id``, the filter fields (``stamp_s``,
  ``robot``, ``has_pose``, ``x y z``) and ``embedding`` (FLOAT_VECTOR, a FLAT index: exact cosine, as the SQLite
  store's scan). An entry counts as stored once its row in ``<collection>`` is written (its embedding row is
  written first; one without a main row is never returned);
* collection ``<collection>_words``: per caption word, how many entries hold it (updated after each write): the
  document frequencies of the BM25 word rule, which Milvus's API does not give.

Queries answer as :class:`~oxygen_ros.memory.sqlite_store.SqliteMemoryStore` does (the filters, the ranking, the
BM25 word rule of :class:`~oxygen_ros.memory.records.MemoryQuery`); docs/memory.md lists where they differ (BM25's
constants and document statistics, word splitting, ties, transactions, durability).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import urlparse

import numpy as np

from oxygen_ros.memory.records import Hit, MemoryQuery, MemoryRecord, Pose
from oxygen_ros.memory.store import DEFAULT_COLLECTION, MemoryStore, RetentionPolicy, near_duplicates

SCHEMA_VERSION = 1
TOKEN_ENV = "OXYGEN_MILVUS_TOKEN"       # the server's token ("user:password" or an API key), when it wants one
TIMEOUT_S = 30.0                        # connection and per-call timeout [s]
MAX_K = 16384                           # Milvus's largest top-k (queryNode.maxTopK default)
MAX_ID_BYTES = 1024                     # entry_id, robot and frame_id: VARCHAR limits [UTF-8 bytes]
MAX_TEXT_BYTES = 65535                  # text, instruction, camera_names: Milvus's largest VARCHAR [UTF-8 bytes]
_DESCRIPTION = f"oxygen_ros memory store, schema {SCHEMA_VERSION}"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_WORD = re.compile(r"\w+", re.UNICODE)   # milvus-lite's standard analyzer: \w+ runs of the lower-cased text
_PAGE = 4096                             # rows per query page / ids per filter list
# milvus-lite searches the rows of its in-memory table (up to 128 MiB of them before it writes a segment) by brute
# force, every query (0.5 s for a BM25 search of 10^4 rows here, 0.02 s once they are in an indexed segment): a
# store on milvus-lite (embedded, or behind `milvus-lite server`) flushes a collection after this many rows were
# written to it
LITE_FLUSH_ROWS = 1024
_FIELDS = ["entry_id", "stamp_s", "robot", "text", "instruction", "camera_names", "has_pose", "frame_id",
           "x", "y", "z", "qx", "qy", "qz", "qw", "pose_stamp_s", "embedding_width"]
_EMBEDDING_FIELDS = ["entry_id", "stamp_s", "robot", "has_pose", "x", "y", "z", "embedding"]
_LITE_LOCK = threading.Lock()
_LITE_USERS: dict[str, int] = {}          # milvus-lite data directory -> stores of this process using it


class MilvusStoreError(RuntimeError):
    """Milvus refused or failed a call (the server's message), or cannot be reached."""


def _milvus():
    """pymilvus, imported on first use (it imports pandas and grpc: ~1 s)."""
    try:
        import pymilvus
    except ImportError as err:       # pragma: no cover - pinned in requirements/python.txt
        raise RuntimeError(f"the Milvus memory store needs pymilvus and milvus-lite ({err})") from None
    return pymilvus


def lite_path(uri: str) -> Path | None:
    """The milvus-lite data directory of ``uri`` (a ``*.db`` path), or None for a server URI.

    Raises:
        ValueError: neither an ``http(s)://`` URI nor a path ending in ``.db``, or credentials in the URI.
    """
    scheme = urlparse(uri).scheme.lower()
    if scheme in ("http", "https"):
        parsed = urlparse(uri)
        if parsed.username or parsed.password:
            raise ValueError(f"the Milvus URI must not hold credentials (they would show in logs): set the "
                             f"environment variable {TOKEN_ENV} instead")
        if not parsed.hostname:
            raise ValueError(f"the Milvus URI {uri!r} names no host")
        return None
    if "://" in uri:
        raise ValueError(f"a Milvus location is http(s)://HOST:PORT or a milvus-lite PATH.db, got {uri!r}")
    if not uri.endswith(".db"):
        raise ValueError(f"a milvus-lite location must end in .db (pymilvus's rule), got {uri!r}")
    return Path(uri).absolute()


class MilvusMemoryStore(MemoryStore):
    """A :class:`~oxygen_ros.memory.store.MemoryStore` in Milvus (see the module docstring).

    Args:
        uri: ``PATH.db`` (milvus-lite: a directory, created with its parent when missing, reopened with its
            records when present) or ``http(s)://HOST:PORT[/DATABASE]`` (a Milvus server; token from
            ``OXYGEN_MILVUS_TOKEN``).
        collection: the collection's name (letters, digits, underscores; the embedding collections add
            ``_embedding_<width>``); created when missing.
        synchronous: must be ``"normal"``: the client cannot make a write durable against a power loss
            (milvus-lite writes its log to the OS on every write but does not fsync it; a server is as durable
            as its deployment), so ``"full"`` is refused rather than not kept.
        timeout_s: connection and per-call timeout [s].
        create: False: refuse (FileNotFoundError) a milvus-lite directory or collection that does not exist
            instead of creating it (readers: the command line's query, export, prune and stats).

    Raises:
        ValueError: a malformed ``uri`` or ``collection``, ``synchronous`` not ``"normal"``, or a collection of
            another layout or schema version.
        FileNotFoundError: ``create`` False and no such milvus-lite directory or collection.
        MilvusStoreError: the server cannot be reached within ``timeout_s`` or refuses (a wrong token), or
            milvus-lite cannot open ``PATH.db`` (another process holds it, not a milvus-lite directory).
    """

    def __init__(self, uri: str, collection: str = DEFAULT_COLLECTION, synchronous: str = "normal",
                 timeout_s: float = TIMEOUT_S, create: bool = True):
        if synchronous != "normal":
            raise ValueError(f"synchronous {synchronous!r} cannot be kept by a Milvus store: it writes without "
                             "an fsync per commit (a committed entry survives a process crash, not a power loss); "
                             "set synchronous to 'normal' (memory.store.synchronous)")
        if not _NAME.fullmatch(collection):
            raise ValueError(f"a Milvus collection name is a letter or _ then letters, digits or _ (at most 200), "
                             f"got {collection!r}")
        self.uri, self.collection, self.timeout_s = str(uri), collection, float(timeout_s)
        self.lite = lite_path(self.uri)
        if not create and self.lite is not None and not self.lite.exists():
            raise FileNotFoundError(f"{self.lite} does not exist")
        self._write_lock = threading.Lock()
        self._unflushed: dict[str, int] = {}
        self._closed = True
        token = "" if self.lite is not None else os.environ.get(TOKEN_ENV, "")
        pymilvus = _milvus()
        if self.lite is not None:
            self.lite.parent.mkdir(parents=True, exist_ok=True)
            if self.lite.exists() and not self.lite.is_dir():
                raise ValueError(f"{self.lite} is a file, not a milvus-lite directory (a SQLite store? use "
                                 f"sqlite:{self.lite})")
            with _LITE_LOCK:
                if not _LITE_USERS.get(str(self.lite)):
                    _check_unlocked(self.lite)
                _LITE_USERS[str(self.lite)] = _LITE_USERS.get(str(self.lite), 0) + 1
        try:
            self._client = self._call(pymilvus.MilvusClient, str(self.lite) if self.lite else self.uri,
                                      token=token, timeout=self.timeout_s)
            self.server_version = str(self._call(self._client.get_server_version, timeout=self.timeout_s))
            # milvus-lite, embedded or behind its `milvus-lite server` ("milvus_lite-3.2.2"): flushed by the store
            self.lite_engine = self.lite is not None or self.server_version.startswith("milvus_lite")
            self._closed = False
            self._open_collection(create)
        except BaseException:
            self.close()
            raise

    # ---- connection and layout --------------------------------------------------------------------

    def _call(self, function, *args, **kwargs):
        """``function(*args, **kwargs)`` with pymilvus's errors as :class:`MilvusStoreError`."""
        pymilvus = _milvus()
        try:
            return function(*args, **kwargs)
        except pymilvus.MilvusException as err:
            raise MilvusStoreError(f"Milvus ({self._where()}): {err.message or err}") from None

    def _where(self) -> str:
        return f"milvus-lite {self.lite}" if self.lite is not None else self.uri

    def _open_collection(self, create: bool) -> None:
        exists = self._call(self._client.has_collection, self.collection, timeout=self.timeout_s)
        if not exists and not create:
            raise FileNotFoundError(f"no memory store collection {self.collection!r} in {self._where()}")
        if exists:
            description = self._call(self._client.describe_collection, self.collection, timeout=self.timeout_s)
            found = [(f["name"], int(f["type"])) for f in description.get("fields", [])]
            if found != self._layout():
                raise ValueError(f"the Milvus collection {self.collection!r} ({self._where()}) is not a memory "
                                 f"store of schema version {SCHEMA_VERSION} (its fields: {[n for n, _ in found]})")
        else:
            self._create_main()
        self._call(self._client.load_collection, self.collection, timeout=self.timeout_s)
        if not self._has(self._vocabulary()):
            self._create_vocabulary()
        self._call(self._client.load_collection, self._vocabulary(), timeout=self.timeout_s)
        prefix = self._embedding_collection(0)[:-1]
        for name in self._call(self._client.list_collections, timeout=self.timeout_s):
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                self._call(self._client.load_collection, name, timeout=self.timeout_s)

    @staticmethod
    def _layout() -> list[tuple[str, int]]:
        """The main collection's ``(field name, Milvus type)`` list: the schema version's mark (milvus-lite keeps
        no collection description)."""
        data_type = _milvus().DataType
        types = {"entry_id": data_type.VARCHAR, "stamp_s": data_type.DOUBLE, "robot": data_type.VARCHAR,
                 "text": data_type.VARCHAR, "sparse": data_type.SPARSE_FLOAT_VECTOR,
                 "instruction": data_type.VARCHAR, "camera_names": data_type.VARCHAR, "has_pose": data_type.BOOL,
                 "frame_id": data_type.VARCHAR, "embedding_width": data_type.INT64}
        order = ["entry_id", "stamp_s", "robot", "text", "sparse", "instruction", "camera_names", "has_pose",
                 "frame_id", "x", "y", "z", "qx", "qy", "qz", "qw", "pose_stamp_s", "embedding_width"]
        return [(name, int(types.get(name, data_type.DOUBLE))) for name in order]

    def _create_main(self) -> None:
        pymilvus = _milvus()
        data_type = pymilvus.DataType
        schema = pymilvus.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False,
                                                     description=_DESCRIPTION)
        schema.add_field("entry_id", data_type.VARCHAR, max_length=MAX_ID_BYTES, is_primary=True)
        schema.add_field("stamp_s", data_type.DOUBLE)
        schema.add_field("robot", data_type.VARCHAR, max_length=MAX_ID_BYTES)
        schema.add_field("text", data_type.VARCHAR, max_length=MAX_TEXT_BYTES, enable_analyzer=True,
                         analyzer_params={"tokenizer": "standard", "filter": ["lowercase"]})
        schema.add_field("sparse", data_type.SPARSE_FLOAT_VECTOR)
        schema.add_field("instruction", data_type.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("camera_names", data_type.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("has_pose", data_type.BOOL)
        schema.add_field("frame_id", data_type.VARCHAR, max_length=MAX_ID_BYTES)
        for name in ("x", "y", "z", "qx", "qy", "qz", "qw", "pose_stamp_s"):
            schema.add_field(name, data_type.DOUBLE)
        schema.add_field("embedding_width", data_type.INT64)
        schema.add_function(pymilvus.Function(name="text_bm25", function_type=pymilvus.FunctionType.BM25,
                                              input_field_names=["text"], output_field_names=["sparse"]))
        index = self._client.prepare_index_params()
        index.add_index(field_name="sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25")
        self._create(self.collection, schema, index)

    def _vocabulary(self) -> str:
        return f"{self.collection}_words"

    def _create_vocabulary(self) -> None:
        """``<collection>_words``: per caption word, the number of entries whose caption holds it (the
        document frequency the BM25 word rule needs; Milvus's API gives none). ``unused`` is there because a
        Milvus collection needs a vector field."""
        pymilvus = _milvus()
        data_type = pymilvus.DataType
        schema = pymilvus.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("word", data_type.VARCHAR, max_length=MAX_ID_BYTES, is_primary=True)
        schema.add_field("entries", data_type.INT64)
        schema.add_field("unused", data_type.FLOAT_VECTOR, dim=2)
        index = self._client.prepare_index_params()
        index.add_index(field_name="unused", index_type="FLAT", metric_type="L2")
        self._create(self._vocabulary(), schema, index)

    def _embedding_collection(self, width: int) -> str:
        return f"{self.collection}_embedding_{width}"

    def _create_embedding(self, width: int) -> None:
        pymilvus = _milvus()
        data_type = pymilvus.DataType
        name = self._embedding_collection(width)
        schema = pymilvus.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False,
                                                     description=f"{_DESCRIPTION}, embeddings of width {width}")
        schema.add_field("entry_id", data_type.VARCHAR, max_length=MAX_ID_BYTES, is_primary=True)
        schema.add_field("stamp_s", data_type.DOUBLE)
        schema.add_field("robot", data_type.VARCHAR, max_length=MAX_ID_BYTES)
        schema.add_field("has_pose", data_type.BOOL)
        for axis in "xyz":
            schema.add_field(axis, data_type.DOUBLE)
        schema.add_field("embedding", data_type.FLOAT_VECTOR, dim=width)
        index = self._client.prepare_index_params()
        index.add_index(field_name="embedding", index_type="FLAT", metric_type="COSINE")
        self._create(name, schema, index)
        self._call(self._client.load_collection, name, timeout=self.timeout_s)

    def _create(self, name: str, schema, index) -> None:
        """Create collection ``name`` and its index. A Milvus server's index is waited for; milvus-lite builds
        it at once and lacks the call pymilvus's wait starts with (AllocTimestamp: an error logged, then 0.5 s
        polls)."""
        self._call(self._client.create_collection, name, schema=schema, timeout=self.timeout_s)
        self._call(self._client.create_index, name, index, timeout=self.timeout_s, sync=not self.lite_engine)

    def _has(self, name: str) -> bool:
        return bool(self._call(self._client.has_collection, name, timeout=self.timeout_s))

    # ---- writing ----------------------------------------------------------------------------------

    def insert(self, records: Iterable[MemoryRecord]) -> int:
        records = list({r.entry_id: r for r in records}.values())      # the last of an id wins, as in SQLite
        rows = [self._row(r) for r in records]
        if not rows:
            return 0
        embedded: dict[int, list[dict]] = {}
        for record, row in zip(records, rows):
            if row["embedding_width"]:
                embedded.setdefault(row["embedding_width"], []).append(
                    {**{k: row[k] for k in _EMBEDDING_FIELDS[:-1]},
                     "embedding": np.asarray(record.embedding, np.float32).ravel().tolist()})
        with self._write_lock:
            self._check_open()
            old = self._stored([row["entry_id"] for row in rows])
            for width, side in embedded.items():
                if not self._has(self._embedding_collection(width)):
                    self._create_embedding(width)
                for start in range(0, len(side), _PAGE):
                    self._call(self._client.upsert, self._embedding_collection(width), side[start:start + _PAGE],
                               timeout=self.timeout_s)
            for start in range(0, len(rows), _PAGE):
                self._call(self._client.upsert, self.collection, rows[start:start + _PAGE], timeout=self.timeout_s)
            stale: dict[int, list[str]] = {}
            for row in rows:
                width = old[row["entry_id"]][0] if row["entry_id"] in old else 0
                if width and width != row["embedding_width"]:
                    stale.setdefault(width, []).append(row["entry_id"])
            for width, ids in stale.items():
                self._delete(self._embedding_collection(width), ids)
            change: Counter = Counter()
            for row in rows:
                change.update(_words(row["text"]))
            for _, text in old.values():
                change.subtract(_words(text))
            self._count_words(change)
            self._written(self.collection, len(rows))
            self._written(self._vocabulary(), len(change))
            for width, side in embedded.items():
                self._written(self._embedding_collection(width), len(side))
        return len(rows)

    def _written(self, collection: str, rows: int) -> None:
        """Count ``rows`` written to ``collection``; milvus-lite (embedded or its server): flush it (a segment,
        indexed) at :data:`LITE_FLUSH_ROWS`. A Milvus server seals and indexes its segments itself."""
        if not self.lite_engine:
            return
        self._unflushed[collection] = self._unflushed.get(collection, 0) + rows
        if self._unflushed[collection] >= LITE_FLUSH_ROWS:
            self._call(self._client.flush, collection, timeout=self.timeout_s)
            self._unflushed[collection] = 0

    @staticmethod
    def _row(record: MemoryRecord) -> dict:
        """The main collection's row of ``record``. Raises ValueError for a value Milvus cannot hold."""
        for name, value, limit in (("entry_id", record.entry_id, MAX_ID_BYTES), ("robot", record.robot, MAX_ID_BYTES),
                                   ("text", record.text, MAX_TEXT_BYTES),
                                   ("instruction", record.instruction, MAX_TEXT_BYTES),
                                   ("frame_id", "" if record.pose is None else record.pose.frame_id, MAX_ID_BYTES)):
            size = len(value.encode("utf-8"))
            if size > limit:
                raise ValueError(f"memory record {record.entry_id[:64]!r}: {name} is {size} bytes, more than the "
                                 f"Milvus store's {limit}")
        if not record.entry_id:
            raise ValueError("a memory record's entry_id must not be empty in a Milvus store")
        if not math.isfinite(record.stamp_s):
            raise ValueError(f"memory record {record.entry_id!r}: stamp_s must be finite, got {record.stamp_s}")
        cameras = json.dumps(list(record.camera_names))
        if len(cameras.encode("utf-8")) > MAX_TEXT_BYTES:
            raise ValueError(f"memory record {record.entry_id!r}: camera_names longer than {MAX_TEXT_BYTES} bytes")
        pose = record.pose
        row = {"entry_id": record.entry_id, "stamp_s": float(record.stamp_s), "robot": record.robot,
               "text": record.text, "instruction": record.instruction, "camera_names": cameras,
               "has_pose": pose is not None, "frame_id": "" if pose is None else pose.frame_id}
        position = (0.0, 0.0, 0.0) if pose is None else tuple(map(float, pose.position))
        orientation = (0.0, 0.0, 0.0, 0.0) if pose is None else tuple(map(float, pose.orientation))
        if pose is not None and not all(math.isfinite(v) for v in position):
            raise ValueError(f"memory record {record.entry_id!r}: pose position must be finite, got {position}")
        row.update(zip(("x", "y", "z"), position))
        row.update(zip(("qx", "qy", "qz", "qw"), orientation))
        row["pose_stamp_s"] = 0.0 if pose is None else float(pose.stamp_s)
        width = 0
        if record.embedding is not None:
            embedding = np.asarray(record.embedding, np.float32).ravel()
            width = int(embedding.size)
            if not 2 <= width <= 32768:
                raise ValueError(f"memory record {record.entry_id!r}: a Milvus store keeps embeddings of width "
                                 f"2..32768, got {width}")
            if not np.all(np.isfinite(embedding)):
                raise ValueError(f"memory record {record.entry_id!r}: the embedding has a non-finite value")
        row["embedding_width"] = width
        return row

    def _stored(self, ids: list[str]) -> dict[str, tuple[int, str]]:
        """``entry_id -> (embedding_width, text)`` of the stored ones of ``ids``."""
        found = {}
        for start in range(0, len(ids), _PAGE):
            chunk = ids[start:start + _PAGE]
            rows = self._call(self._client.query, self.collection, filter=_ids_expr(chunk),
                              output_fields=["entry_id", "embedding_width", "text"], timeout=self.timeout_s)
            found.update((row["entry_id"], (int(row["embedding_width"]), row["text"])) for row in rows)
        return found

    def _word_counts(self, words: list[str]) -> dict[str, int]:
        """``word -> entries`` of the vocabulary (words never counted left out)."""
        counts = {}
        for start in range(0, len(words), _PAGE):
            expr = f"word in [{', '.join(_string(w) for w in words[start:start + _PAGE])}]"
            rows = self._call(self._client.query, self._vocabulary(), filter=expr, output_fields=["word", "entries"],
                              timeout=self.timeout_s)
            counts.update((row["word"], int(row["entries"])) for row in rows)
        return counts

    def _count_words(self, change: Counter) -> None:
        """Add ``change`` (word -> entries added, negative for removed) to the vocabulary's counts. A word count
        is read, then written: two writers at once (two robots on one server) can lose one's change."""
        change = {w: n for w, n in change.items() if n and len(w.encode("utf-8")) <= MAX_ID_BYTES}
        if not change:
            return
        counts = self._word_counts(sorted(change))
        rows, gone = [], []
        for word, n in change.items():
            total = counts.get(word, 0) + n
            if total > 0:
                rows.append({"word": word, "entries": total, "unused": [0.0, 0.0]})
            elif word in counts:
                gone.append(word)
        for start in range(0, len(rows), _PAGE):
            self._call(self._client.upsert, self._vocabulary(), rows[start:start + _PAGE], timeout=self.timeout_s)
        for start in range(0, len(gone), _PAGE):
            expr = f"word in [{', '.join(_string(w) for w in gone[start:start + _PAGE])}]"
            self._call(self._client.delete, self._vocabulary(), filter=expr, timeout=self.timeout_s)

    def _delete(self, collection: str, ids: list[str]) -> None:
        for start in range(0, len(ids), _PAGE):
            self._call(self._client.delete, collection, filter=_ids_expr(ids[start:start + _PAGE]),
                       timeout=self.timeout_s)

    def _remove(self, ids: list[str]) -> None:
        """Delete ``ids``: the main rows first (then they are gone), then their embedding rows and word counts."""
        stored = self._stored(ids)
        self._delete(self.collection, ids)
        by_width: dict[int, list[str]] = {}
        change: Counter = Counter()
        for entry_id, (width, text) in stored.items():
            if width:
                by_width.setdefault(width, []).append(entry_id)
            change.subtract(_words(text))
        for width, chunk in by_width.items():
            self._delete(self._embedding_collection(width), chunk)
        self._count_words(change)

    def prune(self, policy: RetentionPolicy, now_s: float | None = None) -> dict[str, int]:
        removed = {"age": 0, "count": 0, "duplicate": 0}
        if not policy.active:
            return removed
        with self._write_lock:
            self._check_open()
            rows = list(self._scan("", ["entry_id", "stamp_s", "robot", "text", "has_pose", "frame_id", "x", "y",
                                        "z"]))
            gone: set[str] = set()
            if policy.max_age_s and rows:
                if now_s is None:
                    now_s = max(row["stamp_s"] for row in rows)
                old = [row["entry_id"] for row in rows if row["stamp_s"] < now_s - policy.max_age_s]
                removed["age"] = len(old)
                gone.update(old)
            if policy.duplicate_radius_m:
                posed = [(r["entry_id"], r["stamp_s"], r["robot"], r["text"], r["frame_id"], r["x"], r["y"], r["z"])
                         for r in rows if r["has_pose"] and r["entry_id"] not in gone]
                duplicates = near_duplicates(posed, policy.duplicate_radius_m, policy.duplicate_text_similarity)
                removed["duplicate"] = len(duplicates)
                gone.update(duplicates)
            if policy.max_count:
                left = sorted((r["stamp_s"], r["entry_id"]) for r in rows if r["entry_id"] not in gone)
                excess = len(left) - policy.max_count
                if excess > 0:
                    removed["count"] = excess
                    gone.update(entry_id for _, entry_id in left[:excess])
            if gone:
                self._remove(sorted(gone))
        return removed

    # ---- reading ----------------------------------------------------------------------------------

    def _scan(self, expr: str, fields: list[str], collection: str | None = None,
              key: str = "entry_id") -> Iterator[dict]:
        """Every row of ``collection`` (default: the main one; ``key`` its primary key) passing ``expr``, with
        ``fields``: pages of :data:`_PAGE` rows in primary-key order, each after the last key of the one before
        (pymilvus's own query iterator writes that key into its filter unescaped, and a key with a quote breaks
        it)."""
        fields = list(dict.fromkeys([key, *fields]))
        last = None
        while True:
            clauses = [] if last is None else [f"{key} > {_string(last)}"]
            if expr:
                clauses.append(f"({expr})")
            page = self._call(self._client.query, collection or self.collection, filter=" and ".join(clauses),
                              output_fields=fields, limit=_PAGE, iterator="True", timeout=self.timeout_s)
            yield from page
            if len(page) < _PAGE:
                return
            last = page[-1][key]

    @staticmethod
    def _filters(query: MemoryQuery) -> str | None:
        """The Milvus filter expression of the time, robot and place-box filters ("" = none; None = nothing
        can pass: a window starting at +inf or ending at -inf)."""
        clauses = []
        for bound, op, empty in ((query.since_s, ">=", math.inf), (query.until_s, "<=", -math.inf)):
            if bound is None or bound == -empty:
                continue
            if bound == empty:          # (a NaN bound: refused by MemoryQuery)
                return None
            clauses.append(f"stamp_s {op} {_number(bound)}")
        if query.robot is not None:
            clauses.append(f"robot == {_string(query.robot)}")
        if query.near is not None:
            clauses.append("has_pose == true")
            for axis, centre in zip("xyz", query.near):
                clauses.append(f"{axis} >= {_number(centre - query.radius_m)} and "
                               f"{axis} <= {_number(centre + query.radius_m)}")
        return " and ".join(clauses)

    def _place(self, query: MemoryQuery, expr: str) -> dict[str, float]:
        """``entry_id -> stamp_s`` of the entries passing the filters and within ``query.radius_m`` of
        ``query.near`` (the box of the expression, then the exact Euclidean distance)."""
        centre = tuple(float(v) for v in query.near)
        return {row["entry_id"]: row["stamp_s"]
                for row in self._scan(expr, ["entry_id", "stamp_s", "x", "y", "z"])
                if math.dist((row["x"], row["y"], row["z"]), centre) <= query.radius_m}

    def query(self, query: MemoryQuery) -> list[Hit]:
        if query.k > MAX_K:
            raise ValueError(f"k must be <= {MAX_K} with a Milvus store (Milvus's largest top-k), got {query.k}")
        expr = self._filters(query)
        self._check_open()
        if expr is None:
            return []
        candidates = None if query.near is None else self._place(query, expr)
        if candidates is not None and not candidates:
            return []
        terms = self._weighted_terms(query.text) if query.text.strip() else []
        if query.text.strip() and not terms:
            return []
        if terms and not query.oldest_first:
            ranked = self._ranked(self.collection, "sparse", " ".join(terms), expr, query.k, candidates)
        elif query.embedding is not None:
            target = np.asarray(query.embedding, dtype=np.float32).ravel()
            norm = float(np.linalg.norm(target))
            if norm == 0 or not np.isfinite(norm):
                raise ValueError("the query embedding must be finite and not all zero")
            name = self._embedding_collection(target.size)
            if not 2 <= target.size <= 32768 or not self._has(name):
                return []
            ranked = self._ranked(name, "embedding", target.tolist(), expr, query.k, candidates)
        else:     # ranked by time: nearest near_time_s, oldest first (the text's matches) or newest first
            if terms:         # Milvus has no order by time: every row passing the filters, matched here
                wanted = set(terms)
                stamps = {row["entry_id"]: row["stamp_s"]
                          for row in self._scan(expr, ["entry_id", "stamp_s", "text"])
                          if (candidates is None or row["entry_id"] in candidates) and wanted & _words(row["text"])}
            else:
                stamps = candidates if candidates is not None else \
                    {row["entry_id"]: row["stamp_s"] for row in self._scan(expr, ["entry_id", "stamp_s"])}
            t = query.near_time_s
            if t is not None:
                key = lambda item: (abs(item[1] - t), item[1], item[0])         # noqa: E731
            elif query.oldest_first:
                key = lambda item: (item[1], item[0])                           # noqa: E731
            else:
                key = lambda item: (-item[1], _descending(item[0]))             # noqa: E731
            ranked = [(entry_id, 0.0) for entry_id, _ in heapq.nsmallest(query.k, stamps.items(), key=key)]
        records = {r.entry_id: r for r in self._get([entry_id for entry_id, _ in ranked], embeddings=False)}
        return [Hit(records[entry_id], score) for entry_id, score in ranked if entry_id in records]

    def _weighted_terms(self, text: str) -> list[str]:
        """The words of a text query worth matching (as the SQLite store: those in fewer than half of the
        entries, by the vocabulary's counts; all of them when every one is such a word), split and lower-cased
        as milvus-lite's standard analyzer does."""
        terms = sorted(_words(text))
        if not terms:
            return terms
        total = self.count()
        counts = self._word_counts(terms)
        weighted = [t for t in terms if 2 * counts.get(t, 0) < total]
        return weighted or terms

    def _ranked(self, collection: str, field: str, data, expr: str, k: int,
                candidates: dict[str, float] | None) -> list[tuple[str, float]]:
        """The best ``k`` ``(entry_id, score)`` of a search of ``field`` (BM25 or cosine) among the rows
        passing ``expr`` (and among ``candidates`` when given), best first; ties newest first."""
        results: list[tuple[str, float, float]] = []
        if candidates is None:
            chunks = [expr]
        else:
            ids = sorted(candidates)
            chunks = [f"({expr}) and {_ids_expr(ids[start:start + _PAGE])}" for start in range(0, len(ids), _PAGE)]
        for chunk in chunks:
            answer = self._call(self._client.search, collection, data=[data], anns_field=field, limit=k,
                                filter=chunk, output_fields=["stamp_s"], timeout=self.timeout_s)
            for hit in answer[0]:
                score = float(hit["distance"])
                # BM25 scores are >= 0; Milvus answers the score, milvus-lite 3.2.2 its negative
                results.append((hit["entry_id"], abs(score) if field == "sparse" else score,
                                float(hit["entity"]["stamp_s"])))
        best = heapq.nsmallest(k, results, key=lambda r: (-r[1], -r[2], r[0]))
        return [(entry_id, score) for entry_id, score, _ in best]

    def get(self, entry_ids: Iterable[str]) -> list[MemoryRecord]:
        wanted = list(entry_ids)
        self._check_open()
        found = {r.entry_id: r for r in self._get(wanted, embeddings=True)}
        return [found[i] for i in wanted if i in found]

    def _get(self, ids: list[str], embeddings: bool) -> list[MemoryRecord]:
        rows = []
        unique = sorted(set(ids))
        for start in range(0, len(unique), _PAGE):
            rows += self._call(self._client.query, self.collection, filter=_ids_expr(unique[start:start + _PAGE]),
                               output_fields=_FIELDS, timeout=self.timeout_s)
        vectors = self._embeddings(rows) if embeddings else {}
        return [self._record(row, vectors.get(row["entry_id"])) for row in rows]

    def _embeddings(self, rows: list[dict]) -> dict[str, np.ndarray]:
        """``entry_id -> embedding`` of the rows with one."""
        by_width: dict[int, list[str]] = {}
        for row in rows:
            if row["embedding_width"]:
                by_width.setdefault(int(row["embedding_width"]), []).append(row["entry_id"])
        vectors = {}
        for width, ids in by_width.items():
            for start in range(0, len(ids), _PAGE):
                found = self._call(self._client.query, self._embedding_collection(width),
                                   filter=_ids_expr(ids[start:start + _PAGE]), output_fields=["entry_id", "embedding"],
                                   timeout=self.timeout_s)
                vectors.update((row["entry_id"], np.asarray(row["embedding"], np.float32)) for row in found)
        return vectors

    def records(self, embeddings: bool = True) -> Iterator[MemoryRecord]:
        self._check_open()
        rows = sorted(self._scan("", _FIELDS), key=lambda row: (row["stamp_s"], row["entry_id"]))
        vectors: dict[str, np.ndarray] = {}
        if embeddings:
            for width in sorted({int(row["embedding_width"]) for row in rows} - {0}):
                for row in self._scan("", ["entry_id", "embedding"], collection=self._embedding_collection(width)):
                    vectors[row["entry_id"]] = np.asarray(row["embedding"], np.float32)
        for row in rows:
            yield self._record(row, vectors.get(row["entry_id"]) if row["embedding_width"] else None)

    @staticmethod
    def _record(row: dict, embedding: np.ndarray | None) -> MemoryRecord:
        pose = None
        if row["has_pose"]:
            pose = Pose(row["frame_id"], (row["x"], row["y"], row["z"]), (row["qx"], row["qy"], row["qz"], row["qw"]),
                        row["pose_stamp_s"])
        return MemoryRecord(row["entry_id"], row["stamp_s"], row["text"], row["robot"], row["instruction"],
                            tuple(json.loads(row["camera_names"])), pose, embedding)

    def count(self) -> int:
        self._check_open()
        rows = self._call(self._client.query, self.collection, filter="", output_fields=["count(*)"],
                          timeout=self.timeout_s)
        return int(rows[0]["count(*)"])

    def stats(self) -> dict:
        self._check_open()
        entries = with_pose = embedded = 0
        robots: set[str] = set()
        oldest = newest = None
        for row in self._scan("", ["stamp_s", "robot", "has_pose", "embedding_width"]):
            entries += 1
            with_pose += bool(row["has_pose"])
            embedded += bool(row["embedding_width"])
            robots.add(row["robot"])
            oldest = row["stamp_s"] if oldest is None else min(oldest, row["stamp_s"])
            newest = row["stamp_s"] if newest is None else max(newest, row["stamp_s"])
        size = None
        if self.lite is not None:
            size = sum(p.stat().st_size for p in self.lite.rglob("*") if p.is_file())
        return {"backend": "milvus-lite" if self.lite is not None else "milvus", "uri": self._where(),
                "server_version": self.server_version, "collection": self.collection, "entries": entries, "with_pose": with_pose,
                "with_embedding": embedded, "robots": len(robots), "oldest_s": oldest, "newest_s": newest,
                "bytes": size}

    def close(self) -> None:
        with self._write_lock:
            if getattr(self, "_released", False):
                return
            self._released = True
            self._closed = True
            client = getattr(self, "_client", None)
            if client is not None:
                try:
                    client.close()
                except Exception:      # noqa: BLE001 - a dead server cannot refuse a close that matters
                    pass
            if self.lite is not None:
                with _LITE_LOCK:
                    users = _LITE_USERS.get(str(self.lite), 1) - 1
                    if users > 0:
                        _LITE_USERS[str(self.lite)] = users
                        return
                    _LITE_USERS.pop(str(self.lite), None)
                # the embedded engine (its server thread and the directory's lock) goes with the last store
                from milvus_lite.server_manager import server_manager_instance
                server_manager_instance.release_server(str(self.lite))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the memory store {self._where()} ({self.collection}) is closed")


def _words(text: str) -> set[str]:
    """The words of ``text`` as milvus-lite's standard analyzer splits them: ``\\w+`` runs of the lower-cased
    text."""
    return set(_WORD.findall(text.lower()))


def _check_unlocked(directory: Path) -> None:
    """Raise MilvusStoreError when another process holds milvus-lite's lock of ``directory`` (an advisory
    ``flock`` of ``directory/LOCK`` while a process has it open): milvus-lite opens a data directory in one
    process at a time, and its own refusal reaches the client only as "Open local milvus failed"."""
    lock = directory / "LOCK"
    if not lock.is_file():
        return
    import fcntl

    with open(lock, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MilvusStoreError(f"milvus-lite {directory} is open in another process (one process at a time): "
                                   "stop it, or serve the directory with `milvus-lite server` and use its "
                                   "http:// URI from every process") from None
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _descending(text: str) -> tuple[int, ...]:
    """A key that sorts strings in descending order inside an ascending sort."""
    return tuple(-ord(c) for c in text) + (1,)


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string(text: str) -> str:
    """``text`` as a Milvus filter string literal (double quotes; backslash, quote, newline, carriage return and
    tab escaped: the escapes milvus-lite and the Milvus server both read)."""
    return '"' + "".join(_ESCAPES.get(c, c) for c in text) + '"'


def _number(value: float) -> str:
    """A finite ``value`` as a Milvus filter number literal (Python's shortest round-trip form)."""
    return repr(float(value))


def _ids_expr(ids: list[str]) -> str:
    """The filter expression ``entry_id in [...]`` of ``ids``."""
    return f"entry_id in [{', '.join(_string(i) for i in ids)}]"
