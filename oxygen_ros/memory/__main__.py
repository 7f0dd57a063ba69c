"""``python -m oxygen_ros.memory``: ask, export, import, prune and describe a memory store (docs/memory.md).

    python -m oxygen_ros.memory query STORE [--text WORDS] [--since S] [--until S] [--near X Y Z --radius M]
                                            [--robot NAME] [-k K] [--json]
    python -m oxygen_ros.memory export STORE [-o FILE.jsonl] [--no-embeddings]
    python -m oxygen_ros.memory import STORE FILE.jsonl
    python -m oxygen_ros.memory prune STORE [--max-age-s S] [--max-count N] [--duplicate-radius-m M]
                                            [--duplicate-text-similarity F] [--now S]
    python -m oxygen_ros.memory stats STORE

STORE is a location as ``memory.store.path`` takes it (``oxygen_ros.memory.parse_location``): a SQLite file
(``PATH`` or ``sqlite:PATH``), ``milvus:PATH.db`` (milvus-lite) or ``http(s)://HOST:PORT`` (a Milvus server, token
from ``OXYGEN_MILVUS_TOKEN``); ``--collection NAME`` (before the command) names the Milvus collection.

Errors (a missing store for query/export/prune/stats, a malformed query) end with one line
``oxygen_ros memory: error: ...`` and status 1; bad arguments with the usage and status 2.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

from oxygen_ros.memory import MemoryQuery, RetentionPolicy, open_store, parse_location
from oxygen_ros.memory.store import DEFAULT_COLLECTION

PROG = "python -m oxygen_ros.memory"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="the robot's memory store (docs/memory.md)")
    parser.add_argument("--collection", default=DEFAULT_COLLECTION, help="the Milvus collection (Milvus stores only)")
    sub = parser.add_subparsers(dest="command", required=True)
    query = sub.add_parser("query", help="the best entries for a query")
    query.add_argument("store", help="SQLite file, milvus:PATH.db or http(s)://HOST:PORT")
    query.add_argument("--text", default="", help="words to match in the captions (BM25)")
    query.add_argument("--since", type=float, help="observation stamps at or after this [s]")
    query.add_argument("--until", type=float, help="observation stamps at or before this [s]")
    query.add_argument("--near", type=float, nargs=3, metavar=("X", "Y", "Z"), help="a place [m]")
    query.add_argument("--radius", type=float, default=0.0, help="the place's radius [m]")
    query.add_argument("--robot", help="this robot's entries only")
    query.add_argument("-k", type=int, default=10, help="most entries (default 10)")
    query.add_argument("--oldest-first", action="store_true", help="the matches oldest first, not best or newest")
    query.add_argument("--json", action="store_true", help="one JSON object per hit (without embeddings)")
    export = sub.add_parser("export", help="every entry as JSON lines, oldest first")
    export.add_argument("store", help="SQLite file, milvus:PATH.db or http(s)://HOST:PORT")
    export.add_argument("-o", "--output", type=Path, help="file to write (default: standard output)")
    export.add_argument("--no-embeddings", action="store_true", help="leave the embeddings out")
    load = sub.add_parser("import", help="insert the entries of an export")
    load.add_argument("store", help="SQLite file, milvus:PATH.db or http(s)://HOST:PORT")
    load.add_argument("input", type=Path)
    prune = sub.add_parser("prune", help="remove entries by a retention policy (each rule off at 0)")
    prune.add_argument("store", help="SQLite file, milvus:PATH.db or http(s)://HOST:PORT")
    prune.add_argument("--max-age-s", type=float, default=0.0)
    prune.add_argument("--max-count", type=int, default=0)
    prune.add_argument("--duplicate-radius-m", type=float, default=0.0)
    prune.add_argument("--duplicate-text-similarity", type=float, default=1.0)
    prune.add_argument("--now", type=float, help="the present for --max-age-s [s] (default: the newest entry's stamp)")
    stats = sub.add_parser("stats", help="counts, time span and size")
    stats.add_argument("store", help="SQLite file, milvus:PATH.db or http(s)://HOST:PORT")
    return parser


def _run(args) -> int:
    backend, _target = parse_location(args.store)
    if args.command == "query" and args.radius and not args.near:
        raise ValueError("--radius needs --near X Y Z (the place the radius is around)")
    # only import creates a store: the others refuse a missing file, directory or collection (a mistyped
    # collection must not leave an empty one behind); a Milvus store takes synchronous "normal" only
    with open_store(args.store, synchronous="normal" if backend == "milvus" else "full",
                    collection=args.collection, create=args.command == "import") as store:
        if args.command == "query":
            query = MemoryQuery(text=args.text, since_s=args.since, until_s=args.until,
                                near=tuple(args.near) if args.near else None, radius_m=args.radius,
                                robot=args.robot, k=args.k, oldest_first=args.oldest_first)
            for hit in store.query(query):
                record = hit.record
                if args.json:
                    print(json.dumps({"score": hit.score, **record.to_json(embeddings=False)}, ensure_ascii=False))
                    continue
                place = "no pose" if record.pose is None else \
                    "({:.2f}, {:.2f}, {:.2f}) in {}".format(*record.pose.position, record.pose.frame_id)
                print(f"{hit.score:8.3f}  {record.stamp_s:.3f} s  {record.robot or '-'}  {place}  "
                      f"{record.entry_id}  {record.text!r}")
        elif args.command == "export":
            if args.output is None:
                store.export_jsonl(sys.stdout, embeddings=not args.no_embeddings)
            else:
                with args.output.open("w", encoding="utf-8") as stream:
                    n = store.export_jsonl(stream, embeddings=not args.no_embeddings)
                print(f"exported {n} entries to {args.output}", file=sys.stderr)
        elif args.command == "import":
            with args.input.open(encoding="utf-8") as stream:
                print(f"imported {store.import_jsonl(stream)} entries into {args.store}")
        elif args.command == "prune":
            policy = RetentionPolicy(args.max_age_s, args.max_count, args.duplicate_radius_m,
                                     args.duplicate_text_similarity)
            removed = store.prune(policy, now_s=args.now)
            print(f"removed {sum(removed.values())} entries ({', '.join(f'{k} {v}' for k, v in removed.items())}); "
                  f"{store.count()} left")
        else:
            print(json.dumps(store.stats(), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (OSError, ValueError, RuntimeError, sqlite3.Error) as err:
        print(f"oxygen_ros memory: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
