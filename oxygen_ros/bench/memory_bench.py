"""What the memory store costs (docs/memory.md, "Cost"): insert and query latency and size at 10^4, 10^5 and
10^6 entries on this machine, for each backend.

    python -m oxygen_ros.bench.memory_bench [--sizes 10000 100000 1000000] [--embedding-width 256]
        [--backend sqlite|milvus] [--milvus-uri http://HOST:PORT]
        [--dir /tmp/oxygen-memory-bench] [--out docs/bench/memory_store_cpu.json]

``--backend sqlite`` (default): a SQLite file (:class:`~oxygen_ros.memory.sqlite_store.SqliteMemoryStore`);
``--backend milvus``: milvus-lite in this process, a ``memory_<n>.db`` directory in ``--dir``
(:class:`~oxygen_ros.memory.milvus_store.MilvusMemoryStore`), or with ``--milvus-uri`` a running Milvus server
(collection ``memory_bench_<n>``, dropped after; token from ``OXYGEN_MILVUS_TOKEN``; size not measured).

For each size it fills a fresh store with synthetic entries in batches of 1000 (captions from a small vocabulary of objects, colours and places; stamps
0.5 s apart; poses on a 100 m x 100 m random walk; four robots; float32 embeddings), then times:

* ``insert_1``: one entry per transaction (what the node's writer does at one entry per memory period), with
  ``synchronous=full`` (fsync per commit; SQLite only) and ``normal``; median and 95th percentile of
  ``--inserts``;
* queries (``k`` = 10), median and 95th percentile of ``--queries`` each, with varied parameters: ``text``
  (two words, BM25), ``question`` (the two words in "where did you see the ...?": "the" is in every caption and
  is not matched, the other words in none), ``time`` (a 10-minute window), ``place`` (2 m radius),
  ``combined`` (text + place + 1-hour window + robot), ``embedding`` (cosine scan of every entry; only up to
  ``--scan-max`` entries);
* ``prune_duplicates``: one near-duplicate pass (radius 0.5 m, the same words) over the whole store;
* ``bytes``: the file after a checkpoint (SQLite), the data directory (milvus-lite), and per entry;
* ``rss``: the process's resident memory with the filled store open, after the queries (``VmRSS``; milvus-lite
  keeps its engine and its indexes in this process).

Times are wall clock (``time.perf_counter``) on a machine that may be shared: the report names the load
(``os.getloadavg``) before and after each size.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sqlite3
import statistics
import time
from pathlib import Path

import numpy as np

from oxygen_ros.bench.table import Column, fmt, print_table, write_json
from oxygen_ros.memory import MemoryQuery, MemoryRecord, MemoryStore, Pose, RetentionPolicy, SqliteMemoryStore

COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
OBJECTS = ("cube", "mug", "ball", "bottle", "box", "plate", "chair", "book", "phone", "towel", "cup", "shoe")
PLACES = ("table", "shelf", "counter", "floor", "sink", "desk", "bed", "sofa", "drawer", "bin")
VERBS = ("on the", "near the", "under the", "next to the", "in the gripper above the")
ROBOTS = ("r1", "r2", "r3", "r4")
FILL_BATCH = 1000


def synthetic(n: int, width: int, seed: int = 0, start: int = 0):
    """``n`` synthetic records (ids ``start``.. ``start + n - 1``) in batches of :data:`FILL_BATCH`."""
    rng = np.random.default_rng(seed + start)
    position = np.zeros(3)
    for first in range(start, start + n, FILL_BATCH):
        count = min(FILL_BATCH, start + n - first)
        steps = rng.normal(0.0, 0.3, size=(count, 3)) * (1.0, 1.0, 0.0)
        walk = np.clip(position + np.cumsum(steps, axis=0), -50.0, 50.0)
        position = walk[-1]
        picks = rng.integers(0, 1 << 30, size=(count, 4))
        embeddings = rng.standard_normal((count, width), dtype=np.float32)
        batch = []
        for j in range(count):
            i = first + j
            c, o, v, p = picks[j]
            text = f"a {COLOURS[c % len(COLOURS)]} {OBJECTS[o % len(OBJECTS)]} {VERBS[v % len(VERBS)]} " \
                   f"{PLACES[p % len(PLACES)]}"
            stamp = 0.5 * i
            batch.append(MemoryRecord(f"e{i}", stamp, text, ROBOTS[i % len(ROBOTS)], "tidy up", ("base_0_rgb",),
                                      Pose("map", tuple(walk[j]), (0.0, 0.0, 0.0, 1.0), stamp), embeddings[j]))
        yield batch


def _percentiles(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3


def _timed(calls) -> tuple[float, float]:
    times = []
    for call in calls:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return _percentiles(times)


def _remove(path: Path) -> None:
    for stale in path.parent.glob(path.name + "*"):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()


def _rss_bytes() -> int:
    """This process's resident memory [bytes] (``VmRSS`` of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


class Backend:
    """Opens the stores of one backend: ``sqlite``, or ``milvus`` (milvus-lite in ``directory``, or the server
    at ``milvus_uri``)."""

    def __init__(self, name: str, milvus_uri: str | None = None):
        self.name, self.milvus_uri = name, milvus_uri

    def path(self, directory: Path, n: int) -> Path:
        return directory / f"memory_{n}.db"

    def open(self, directory: Path, n: int, synchronous: str) -> MemoryStore:
        if self.name == "sqlite":
            return SqliteMemoryStore(self.path(directory, n), synchronous=synchronous)
        from oxygen_ros.memory.milvus_store import MilvusMemoryStore

        return MilvusMemoryStore(self.milvus_uri or str(self.path(directory, n)), collection=f"memory_bench_{n}")

    def clear(self, directory: Path, n: int) -> None:
        """Remove the store of size ``n`` (its file or directory, or its server collections)."""
        if self.milvus_uri is None:
            _remove(self.path(directory, n))
            return
        from pymilvus import MilvusClient

        client = MilvusClient(self.milvus_uri, token=os.environ.get("OXYGEN_MILVUS_TOKEN", ""))
        for name in client.list_collections():
            if name == f"memory_bench_{n}" or name.startswith(f"memory_bench_{n}_embedding_"):
                client.drop_collection(name)
        client.close()


def measure(n: int, width: int, directory: Path, inserts: int, queries: int, scan_max: int, seed: int,
            backend: Backend = Backend("sqlite")) -> dict:
    """The figures of one store of ``n`` entries (see the module docstring); the store is deleted after."""
    path = backend.path(directory, n)
    backend.clear(directory, n)
    row: dict = {"entries": n, "embedding_width": width, "backend": backend.name,
                 "load_before": os.getloadavg()[0]}
    store = backend.open(directory, n, "full" if backend.name == "sqlite" else "normal")
    try:
        start = time.perf_counter()
        for batch in synthetic(n, width, seed):
            store.insert(batch)
        row["fill_s"] = time.perf_counter() - start
        row["fill_per_s"] = n / row["fill_s"]
        if isinstance(store, SqliteMemoryStore):
            store.checkpoint()
        if backend.milvus_uri is None:
            row["bytes"] = _bytes(path)
            row["bytes_per_entry"] = row["bytes"] / n
        one = [r for batch in synthetic(inserts, width, seed, start=n) for r in batch]
        if backend.name == "sqlite":
            row["insert_1_full_ms"] = _timed([lambda r=r: store.insert([r]) for r in one[: inserts // 2]])
            store.close()
            store = backend.open(directory, n, "normal")
        row["insert_1_normal_ms"] = _timed([lambda r=r: store.insert([r]) for r in one[inserts // 2:]])
        rng = np.random.default_rng(seed + 1)
        span = 0.5 * n
        positions = np.array([h.record.pose.position for h in store.query(MemoryQuery(k=1000))])

        def texts():
            return [f"{COLOURS[rng.integers(len(COLOURS))]} {OBJECTS[rng.integers(len(OBJECTS))]}"
                    for _ in range(queries)]

        def places():
            return [tuple(positions[rng.integers(len(positions))]) for _ in range(queries)]

        row["query_text_ms"] = _timed([lambda t=t: store.query(MemoryQuery(text=t)) for t in texts()])
        row["query_question_ms"] = _timed([lambda t=t: store.query(MemoryQuery(text=f"where did you see the {t}?"))
                                           for t in texts()])
        windows = rng.uniform(0, max(span - 600.0, 1.0), size=queries)
        row["query_time_ms"] = _timed([lambda s=s: store.query(MemoryQuery(since_s=s, until_s=s + 600.0))
                                       for s in windows])
        row["query_place_ms"] = _timed([lambda p=p: store.query(MemoryQuery(near=p, radius_m=2.0)) for p in places()])
        combined = [MemoryQuery(text=t, near=p, radius_m=5.0, since_s=s, until_s=s + 3600.0, robot="r1")
                    for t, p, s in zip(texts(), places(), rng.uniform(0, max(span - 3600.0, 1.0), size=queries))]
        row["query_combined_ms"] = _timed([lambda q=q: store.query(q) for q in combined])
        if n <= scan_max:
            targets = rng.standard_normal((max(3, queries // 10), width), dtype=np.float32)
            row["query_embedding_ms"] = _timed([lambda e=e: store.query(MemoryQuery(embedding=e)) for e in targets])
        start = time.perf_counter()
        removed = store.prune(RetentionPolicy(duplicate_radius_m=0.5))
        row["prune_duplicates_s"] = time.perf_counter() - start
        row["pruned"] = removed["duplicate"]
        row["rss_bytes"] = _rss_bytes()
    finally:
        store.close()
        backend.clear(directory, n)
    row["load_after"] = os.getloadavg()[0]
    return row


COLUMNS = [
    Column("entries", 9, lambda r: f"{r['entries']:,}"),
    Column("fill/s", 9, lambda r: fmt(r["fill_per_s"], ",.0f")),
    Column("B/entry", 9, lambda r: fmt(r.get("bytes_per_entry"), ".0f")),
    Column("ins full", 13, lambda r: "{:.1f}/{:.1f}".format(*r["insert_1_full_ms"]) if "insert_1_full_ms" in r else "-"),
    Column("ins normal", 13, lambda r: "{:.2f}/{:.2f}".format(*r["insert_1_normal_ms"])),
    Column("text", 13, lambda r: "{:.1f}/{:.1f}".format(*r["query_text_ms"])),
    Column("question", 13, lambda r: "{:.1f}/{:.1f}".format(*r["query_question_ms"])),
    Column("time", 13, lambda r: "{:.1f}/{:.1f}".format(*r["query_time_ms"])),
    Column("place", 13, lambda r: "{:.1f}/{:.1f}".format(*r["query_place_ms"])),
    Column("combined", 13, lambda r: "{:.1f}/{:.1f}".format(*r["query_combined_ms"])),
    Column("embedding", 15, lambda r: "{:.0f}/{:.0f}".format(*r["query_embedding_ms"])
           if "query_embedding_ms" in r else "-"),
    Column("prune s", 9, lambda r: fmt(r["prune_duplicates_s"], ".1f")),
    Column("RSS MiB", 9, lambda r: fmt(r["rss_bytes"] / 2**20, ".0f")),
    Column("load", 11, lambda r: f"{r['load_before']:.1f}-{r['load_after']:.1f}"),
]


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform.processor`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.memory_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--embedding-width", type=int, default=256,
                        help="float32 values per embedding (256: pi05_tiny; pi05's 2048 is 8x the bytes)")
    parser.add_argument("--inserts", type=int, default=200, help="single-entry inserts timed (half per mode)")
    parser.add_argument("--queries", type=int, default=50, help="queries timed per kind")
    parser.add_argument("--scan-max", type=int, default=100_000, help="largest store whose embedding scan is timed")
    parser.add_argument("--backend", choices=("sqlite", "milvus"), default="sqlite",
                        help="sqlite (a file) or milvus (milvus-lite in --dir, or the server of --milvus-uri)")
    parser.add_argument("--milvus-uri", help="http(s)://HOST:PORT of a Milvus server (with --backend milvus)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/oxygen-memory-bench"), help="where the stores go")
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 2 <= args.inserts <= 2 * FILL_BATCH:
        parser.error(f"--inserts must be in 2..{2 * FILL_BATCH}")
    if args.milvus_uri and args.backend != "milvus":
        parser.error("--milvus-uri needs --backend milvus")
    backend = Backend(args.backend, args.milvus_uri)
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    versions = {"sqlite": sqlite3.sqlite_version}
    if args.backend == "milvus":
        from importlib.metadata import version

        versions.update(pymilvus=version("pymilvus"), milvus_lite=version("milvus-lite"))
    results = {"machine": {"platform": platform.platform(), "processor": _cpu_name(),
                           "cpus": os.cpu_count(), **versions, "free_bytes": free},
               "args": vars(args), "rows": []}
    for n in args.sizes:
        results["rows"].append(measure(n, args.embedding_width, args.dir, args.inserts, args.queries,
                                       args.scan_max, args.seed, backend))
        print(f"{n:,} entries done", flush=True)
        if args.out is not None:
            write_json(args.out, results)
    print("latencies in ms: median/p95; fill/s: entries per second in batches of 1000")
    print_table(COLUMNS, results["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
