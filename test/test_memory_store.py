"""The memory store (oxygen_ros/memory): retrieval by text, time, place and robot on hand-made entries, the
retention policy, export and import, durability across a reopen and a kill -9 in the middle of writing, the CLI.

The tests of what both backends promise alike run on each (``backend``: a SQLite file, and a collection of
milvus-lite, Milvus's embedded engine, in one data directory per module: starting it costs about a second);
SQLite's and Milvus's own promises (durability, the server path, their limits) have tests of their own."""
from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from oxygen_ros.memory import MemoryQuery, MemoryRecord, Pose, RetentionPolicy, SqliteMemoryStore, parse_location
from oxygen_ros.memory.__main__ import main as cli

BACKENDS = ("sqlite", "milvus")


def _record(entry_id, stamp_s, text, xyz=None, robot="r1", embedding=None, frame="map"):
    pose = None if xyz is None else Pose(frame, tuple(map(float, xyz)), (0.0, 0.0, 0.0, 1.0), stamp_s)
    return MemoryRecord(entry_id, stamp_s, text, robot, "hand over the cube", ("cam_high",), pose,
                        None if embedding is None else np.asarray(embedding, np.float32))


# A kitchen at x ~ 0, a shelf at x ~ 5, a table at x ~ 10; robot r2 elsewhere; one entry without a pose.
ENTRIES = [
    _record("a", 10.0, "a red cube on the kitchen counter", (0.0, 0.0, 0.0), embedding=[1, 0, 0]),
    _record("b", 20.0, "an empty kitchen counter", (0.3, 0.1, 0.0), embedding=[0.9, 0.1, 0]),
    _record("c", 30.0, "a blue mug on the shelf", (5.0, 0.0, 0.0), embedding=[0, 1, 0]),
    _record("d", 40.0, "the red cube in the left gripper", (10.0, 0.0, 0.0), embedding=[0, 0, 1]),
    _record("e", 50.0, "a green ball on the table", (10.2, 0.0, 0.0), robot="r2", embedding=[0, 0.7, 0.7]),
    _record("f", 60.0, "a red cube seen by a robot that did not know where it was"),
]


@pytest.fixture(scope="module")
def milvus_dir(tmp_path_factory):
    """One milvus-lite data directory for the module, its engine kept running by a store held open."""
    from oxygen_ros.memory.milvus_store import MilvusMemoryStore

    path = tmp_path_factory.mktemp("milvus") / "memory.db"
    with MilvusMemoryStore(str(path), collection="keep_running"):
        yield path


_TEST_NUMBER = itertools.count()


class Stores:
    """Opens stores of one backend: ``open(name)`` is the same store for the same name (within a test)."""

    def __init__(self, backend, tmp_path, request):
        self.backend, self.tmp_path, self._request = backend, tmp_path, request
        self._prefix = f"t{next(_TEST_NUMBER)}_"

    def location(self, name):
        if self.backend == "sqlite":
            return str(self.tmp_path / f"{name}.db")
        return f"milvus:{self._request.getfixturevalue('milvus_dir')}"

    def collection(self, name):
        return self._prefix + name

    def open(self, name="memory"):
        if self.backend == "sqlite":
            return SqliteMemoryStore(self.tmp_path / f"{name}.db")
        from oxygen_ros.memory.milvus_store import MilvusMemoryStore

        return MilvusMemoryStore(str(self._request.getfixturevalue("milvus_dir")), collection=self.collection(name))


@pytest.fixture(params=BACKENDS)
def stores(request, tmp_path):
    return Stores(request.param, tmp_path, request)


@pytest.fixture
def store(stores):
    with stores.open() as s:
        s.insert(ENTRIES)
        yield s


def _ids(hits):
    return [h.record.entry_id for h in hits]


def test_text_query_ranks_by_bm25_and_finds_every_matching_caption(store):
    hits = store.query(MemoryQuery(text="red cube", k=10))
    assert set(_ids(hits)) == {"a", "d", "f"}
    assert all(h.score > 0 for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    # words in half or more of the entries weigh nothing in BM25 (its IDF) and are not matched: "red", "cube",
    # "on", "the" here; "kitchen counter" ranks the shorter caption first (BM25's length normalisation)
    assert _ids(store.query(MemoryQuery(text="red cube on the kitchen counter"))) == ["b", "a"]
    assert _ids(store.query(MemoryQuery(text="Gripper holding the red cube")))[0] == "d"
    assert _ids(store.query(MemoryQuery(text="mug?", k=10))) == ["c"]
    assert store.query(MemoryQuery(text="giraffe", k=10)) == []
    assert store.query(MemoryQuery(text="?!", k=10)) == []


def test_time_window_without_text_is_newest_first(store):
    hits = store.query(MemoryQuery(since_s=20.0, until_s=40.0))
    assert _ids(hits) == ["d", "c", "b"]
    assert all(h.score == 0.0 for h in hits)
    assert _ids(store.query(MemoryQuery(k=2))) == ["f", "e"]


def test_place_query_keeps_entries_within_the_radius_only(store):
    assert sorted(_ids(store.query(MemoryQuery(near=(0.0, 0.0, 0.0), radius_m=0.5)))) == ["a", "b"]
    # b is 0.316 m from the origin: just outside a 0.3 m radius, inside 0.32 m
    assert _ids(store.query(MemoryQuery(near=(0.0, 0.0, 0.0), radius_m=0.3))) == ["a"]
    assert sorted(_ids(store.query(MemoryQuery(near=(0.0, 0.0, 0.0), radius_m=0.32)))) == ["a", "b"]
    # the entry without a pose never matches a place
    assert "f" not in _ids(store.query(MemoryQuery(near=(0.0, 0.0, 0.0), radius_m=1e6)))


def test_combined_text_time_place_robot(store):
    hits = store.query(MemoryQuery(text="red cube", near=(10.0, 0.0, 0.0), radius_m=1.0))
    assert _ids(hits) == ["d"]
    assert sorted(_ids(store.query(MemoryQuery(text="red cube", since_s=35.0)))) == ["d", "f"]
    assert _ids(store.query(MemoryQuery(near=(10.0, 0.0, 0.0), radius_m=1.0, robot="r2"))) == ["e"]
    assert _ids(store.query(MemoryQuery(text="table", robot="r1"))) == []


def test_embedding_query_ranks_by_cosine(store):
    hits = store.query(MemoryQuery(embedding=np.array([1.0, 0.05, 0.0], np.float32), k=2))
    assert _ids(hits) == ["a", "b"]
    assert hits[0].score == pytest.approx(1.0 / np.linalg.norm([1.0, 0.05, 0.0]), rel=1e-5)
    # a query of another width matches nothing; the filters still apply
    assert store.query(MemoryQuery(embedding=np.ones(4, np.float32))) == []
    assert _ids(store.query(MemoryQuery(embedding=np.array([0, 0, 1], np.float32), robot="r2"))) == ["e"]


def test_bad_queries_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="radius"):
        MemoryQuery(near=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="k must"):
        MemoryQuery(k=0)
    with pytest.raises(ValueError, match="after"):
        MemoryQuery(since_s=2.0, until_s=1.0)
    with pytest.raises(ValueError, match="not both"):
        MemoryQuery(text="cube", embedding=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="duplicate_text_similarity"):
        RetentionPolicy(duplicate_text_similarity=0.0)


def test_records_round_trip_with_pose_embedding_and_replacement(store):
    [a] = store.get(["a"])
    assert a == ENTRIES[0]
    np.testing.assert_array_equal(a.embedding, ENTRIES[0].embedding)
    assert store.get(["f"])[0].pose is None
    store.insert([_record("a", 11.0, "a yellow cube", (0.0, 0.0, 0.0))])
    assert store.count() == len(ENTRIES)
    assert _ids(store.query(MemoryQuery(text="yellow"))) == ["a"]
    assert store.query(MemoryQuery(text="counter")) and "a" not in _ids(store.query(MemoryQuery(text="counter")))


def test_prune_by_age_count_and_near_duplicates(stores):
    with stores.open("prune") as store:
        store.insert(ENTRIES)
        assert store.prune(RetentionPolicy(max_age_s=35.0), now_s=60.0) == {"age": 2, "count": 0, "duplicate": 0}
        assert sorted(r.entry_id for r in store.records()) == ["c", "d", "e", "f"]
        assert store.prune(RetentionPolicy(max_count=3))["count"] == 1
        assert sorted(r.entry_id for r in store.records()) == ["d", "e", "f"]
        # the FTS and place indexes follow the deletions
        assert store.query(MemoryQuery(text="mug")) == []
        assert store.query(MemoryQuery(near=(5.0, 0.0, 0.0), radius_m=0.5)) == []

    with stores.open("duplicates") as store:
        store.insert([
            _record("old", 1.0, "A red cube on the table.", (1.0, 1.0, 0.0)),
            _record("new", 2.0, "a red cube on the table", (1.1, 1.0, 0.0)),
            _record("far", 0.5, "a red cube on the table", (3.0, 1.0, 0.0)),         # another place
            _record("other", 0.7, "a blue cube on the table", (1.0, 1.0, 0.0)),      # another caption
            _record("r2", 0.8, "a red cube on the table", (1.0, 1.0, 0.0), robot="r2"),   # another robot
            _record("odom", 0.9, "a red cube on the table", (1.0, 1.0, 0.0), frame="odom"),   # another frame
            _record("nopose", 0.6, "a red cube on the table"),                       # place unknown
        ])
        removed = store.prune(RetentionPolicy(duplicate_radius_m=0.2))
        assert removed == {"age": 0, "count": 0, "duplicate": 1}
        assert "old" not in {r.entry_id for r in store.records()} and store.count() == 6
        # "a blue cube on the table" shares 5 of 7 words with the kept red one: alike at 0.7
        assert store.prune(RetentionPolicy(duplicate_radius_m=0.2, duplicate_text_similarity=0.7))["duplicate"] == 1
        assert "other" not in {r.entry_id for r in store.records()}


def test_export_import_and_reopen(stores):
    with stores.open() as store:
        store.insert(ENTRIES)
        stream = io.StringIO()
        assert store.export_jsonl(stream) == len(ENTRIES)
    lines = stream.getvalue().splitlines()
    assert json.loads(lines[0])["entry_id"] == "a" and json.loads(lines[0])["pose"]["position"] == [0.0, 0.0, 0.0]
    assert json.loads(lines[0])["embedding"] == [1.0, 0.0, 0.0]
    # reopened: everything is there, and its indexes answer
    with stores.open() as store:
        assert store.count() == len(ENTRIES)
        assert _ids(store.query(MemoryQuery(text="mug"))) == ["c"]
        originals = list(store.records())
    with stores.open("copy") as copy:
        assert copy.import_jsonl(io.StringIO(stream.getvalue())) == len(ENTRIES)
        copied = list(copy.records())
        assert copied == originals
        for mine, theirs in zip(copied, originals):
            assert (mine.embedding is None) == (theirs.embedding is None)
            if mine.embedding is not None:
                np.testing.assert_array_equal(mine.embedding, theirs.embedding)
        with pytest.raises(ValueError, match="line 2"):
            copy.import_jsonl(io.StringIO(lines[0] + "\n{\"text\": 1}\n"))


_WRITER = textwrap.dedent("""
    import sys
    from oxygen_ros.memory import MemoryRecord, Pose, SqliteMemoryStore
    import numpy as np
    store = SqliteMemoryStore(sys.argv[1])
    i = 0
    while True:
        store.insert([MemoryRecord(f"e{i}", float(i), f"caption number {i}", "r1", "", ("cam",),
                                   Pose("map", (float(i), 0.0, 0.0)), np.full(512, i, np.float32))])
        print(i, flush=True)     # committed
        i += 1
""")


def _killed_writer(script, path, meanwhile=lambda committed: None):
    """Run the writer ``script`` on ``path`` (it prints the index of each insert once it returned) and SIGKILL it
    after 40 inserts; ``meanwhile(index)`` runs as each is reported. Returns the last index reported."""
    process = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        committed = -1
        for line in process.stdout:
            committed = int(line)
            meanwhile(committed)
            if committed >= 40:
                break
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    assert committed >= 40
    return committed


def test_sqlite_kill_9_mid_write_loses_at_most_the_entry_being_written(tmp_path):
    path = tmp_path / "killed.db"
    committed = _killed_writer(_WRITER, path)
    with SqliteMemoryStore(path) as store:
        ids = {r.entry_id for r in store.records(embeddings=False)}
        # every insert reported committed is there; at most the ones after it (in flight or committed
        # but not yet reported) besides
        assert {f"e{i}" for i in range(committed + 1)} <= ids
        assert store._read.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert "e7" in _ids(store.query(MemoryQuery(text="7", k=100)))
        store.insert([_record("after", 1e6, "written after the crash")])
        assert store.count() == len(ids) + 1


def test_cli_query_prune_export_stats(stores, tmp_path, capsys):
    with stores.open("cli") as store:
        store.insert(ENTRIES)
    path, name = stores.location("cli"), ["--collection", stores.collection("cli")]
    assert cli(name + ["query", path, "--text", "red cube", "--near", "10", "0", "0", "--radius", "1", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["entry_id"] for line in lines] == ["d"]
    assert cli(name + ["query", path, "--text", "red cube", "--oldest-first", "-k", "2", "--json"]) == 0
    assert [json.loads(line)["entry_id"] for line in capsys.readouterr().out.splitlines()] == ["a", "d"]
    assert cli(name + ["stats", path]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 6 and stats["with_pose"] == 5 and stats["robots"] == 2 and stats["bytes"] > 0
    assert stats["backend"] == {"sqlite": "sqlite", "milvus": "milvus-lite"}[stores.backend]
    out = tmp_path / "out.jsonl"
    assert cli(name + ["export", path, "-o", str(out), "--no-embeddings"]) == 0
    assert len(out.read_text().splitlines()) == 6 and "embedding" not in out.read_text()
    assert cli(name + ["prune", path, "--max-count", "4"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    prefix = "milvus:" if stores.backend == "milvus" else ""
    assert cli(name + ["query", prefix + str(tmp_path / "missing.db")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli(name + ["query", path, "--near", "0", "0", "0"]) == 1
    assert "radius" in capsys.readouterr().err
    assert cli(name + ["query", path, "--radius", "2"]) == 1
    assert "--near" in capsys.readouterr().err
    # readers never create a store: a mistyped collection is refused and not left behind
    typo = ["--collection", stores.collection("typo")]
    for command in (["query", path, "--text", "cube"], ["stats", path], ["export", path]):
        assert cli(typo + command) == (1 if stores.backend == "milvus" else 0)
    if stores.backend == "milvus":
        assert "no memory store collection" in capsys.readouterr().err
        with stores.open("cli") as store:
            assert not store._client.has_collection(stores.collection("typo"))


def test_memory_prompt_recall_text_and_template(store):
    from oxygen_ros.memory.prompt import fill_memory, has_memory_field, memory_text, recall

    # the question's weighted words find the kitchen captions (best BM25 first), else the newest entries
    assert {r.entry_id for r in recall(store, "the red cube at the kitchen?", k=2)} == {"a", "b"}
    assert [r.entry_id for r in recall(store, "giraffe", k=2)] == ["f", "e"]
    assert [r.entry_id for r in recall(store, "", k=1, robot="r2")] == ["e"]
    text, ids = memory_text(recall(store, "mug gripper", k=2))
    # oldest first, with time and place; one line
    assert ids == ["c", "d"]
    assert text == "t=30.0s at (5.0, 0.0): a blue mug on the shelf; t=40.0s at (10.0, 0.0): the red cube in the " \
                   "left gripper"
    assert memory_text([ENTRIES[5]])[0] == "t=60.0s: a red cube seen by a robot that did not know where it was"
    assert memory_text([]) == ("", [])
    template = "Memory: {memory}\nQ: {instruction} {{memory}} {state}"
    assert has_memory_field(template) and not has_memory_field("Q: {instruction} {{memory}}")
    filled = fill_memory(template, "t=1.0s: a {weird} caption")
    assert filled == "Memory: t=1.0s: a {{weird}} caption\nQ: {instruction} {{memory}} {state}"
    assert filled.format(instruction="where?", state="s") == "Memory: t=1.0s: a {weird} caption\nQ: where? {memory} s"


def test_memory_prompt_recall_of_a_question_that_names_a_time(store):
    from oxygen_ros.memory.prompt import question_time, recall

    # the memory lines' notation t=<seconds> (s optional, a sentence's full stop after it); nothing else
    assert question_time("which gripper held the cube at t=1012?") == 1012.0
    assert question_time("what was on the table at t = 12.5 s.") == 12.5
    assert question_time("at t=3. and then?") == 3.0
    assert question_time("restart=5 or at=7") is None
    assert question_time("where is the cube?") is None
    # the entries nearest the time, nearest first (ties: the earlier first), whatever the words say
    assert [r.entry_id for r in recall(store, "what was seen at t=33s?", k=2)] == ["c", "d"]
    assert [r.entry_id for r in recall(store, "the giraffe at t=45", k=3)] == ["d", "e", "c"]
    assert [r.entry_id for r in recall(store, "at t=45", k=3, robot="r1")] == ["d", "c", "f"]
    assert [r.entry_id for r in recall(store, "the red cube at t=1000", k=1)] == ["f"]
    assert [r.entry_id for r in recall(store, "at t=-5", k=2)] == ["a", "b"]
    assert [r.entry_id for r in recall(store, "at t=45", k=1, robot="nobody")] == []


def test_memory_prompt_recall_near_a_time_among_more_entries_than_one_query_returns(stores):
    from oxygen_ros.memory.prompt import nearest_in_time

    # 200 entries 10 ms apart after t = 99.5 s and two long before: the nearest are the oldest of the dense run,
    # not the newest a time window would return first
    entries = [_record(f"n{i:03d}", 100.0 + 0.01 * i, "the cube on the table") for i in range(200)]
    entries += [_record("old1", 10.0, "the cube on the table"), _record("old2", 20.0, "the cube on the table")]
    with stores.open("dense") as dense:
        dense.insert(entries)
        assert [r.entry_id for r in nearest_in_time(dense, 99.5, 3)] == ["n000", "n001", "n002"]
        assert [r.entry_id for r in nearest_in_time(dense, 60.0, 2)] == ["old2", "n000"]
        with pytest.raises(ValueError):
            nearest_in_time(dense, 60.0, 0)
        assert [h.record.entry_id for h in dense.query(MemoryQuery(near_time_s=15.0, until_s=99.0, k=5))] == \
            ["old1", "old2"]
    for bad in (dict(near_time_s=float("nan")), dict(near_time_s=1.0, text="cube"),
                dict(near_time_s=1.0, embedding=np.ones(3, np.float32))):
        with pytest.raises(ValueError):
            MemoryQuery(**bad)



def test_oldest_first_ranks_the_text_matches_by_time(store):
    # "red cube" matches a, d and f: by time, not by BM25 (score 0); the filters still apply
    hits = store.query(MemoryQuery(text="red cube", k=2, oldest_first=True))
    assert _ids(hits) == ["a", "d"] and all(h.score == 0.0 for h in hits)
    assert _ids(store.query(MemoryQuery(text="red cube", since_s=15.0, k=5, oldest_first=True))) == ["d", "f"]
    assert _ids(store.query(MemoryQuery(text="giraffe", k=5, oldest_first=True))) == []
    assert _ids(store.query(MemoryQuery(k=3, oldest_first=True))) == ["a", "b", "c"]
    assert _ids(store.query(MemoryQuery(robot="r2", k=3, oldest_first=True))) == ["e"]
    assert _ids(store.query(MemoryQuery(text="red cube", near=(10.0, 0.0, 0.0), radius_m=0.5, k=5,
                                        oldest_first=True))) == ["d"]
    for bad in (dict(oldest_first=True, near_time_s=1.0), dict(oldest_first=True, embedding=np.ones(3, np.float32)),
                dict(since_s=float("nan")), dict(until_s=float("nan"), text="cube")):
        with pytest.raises(ValueError):
            MemoryQuery(**bad)


def test_memory_prompt_ages_and_questions_about_the_first_time(store):
    from oxygen_ros.memory.prompt import age_text, memory_text, question_time, recall

    # ages at the time of asking, whole seconds, rounded; a stamp after it (a clock behind): 0 s ago
    assert age_text(100.0, 87.6) == "12 s ago" and age_text(100.0, 100.4) == "0 s ago"
    assert age_text(100.0, 97.5) == "3 s ago" and age_text(100.0, 86.5) == "14 s ago"      # halves up
    with pytest.raises(ValueError):
        age_text(float("nan"), 1.0)
    text, ids = memory_text(recall(store, "mug gripper", k=2), now_s=52.4)
    assert ids == ["c", "d"]
    assert text == "22 s ago at (5.0, 0.0): a blue mug on the shelf; 12 s ago at (10.0, 0.0): the red cube in the " \
                   "left gripper"
    with pytest.raises(ValueError):
        memory_text([ENTRIES[0]], now_s=float("inf"))
    # an age in the question counts from the time of asking; without one, it is no time; t= wins
    assert question_time("which gripper held the cube 12 s ago?", now_s=52.0) == 40.0
    assert question_time("what did you see 7 seconds ago", now_s=52.0) == 45.0
    assert question_time("which gripper held the cube 12 s ago?") is None
    assert question_time("at t=3 or 12 s ago", now_s=52.0) == 3.0
    assert question_time("held -3 s ago", now_s=52.0) is None and question_time("+3 s ago", now_s=52.0) is None
    assert [r.entry_id for r in recall(store, "what was seen 20 s ago?", k=2, now_s=52.0)] == ["c", "d"]
    # a question about the first time: the oldest matching entries; the same words otherwise: best BM25 first
    assert [r.entry_id for r in recall(store, "which kitchen counter did you see first?", k=1)] == ["a"]
    assert [r.entry_id for r in recall(store, "which kitchen counter did you see?", k=1)] == ["b"]   # shorter
    assert [r.entry_id for r in recall(store, "the earliest mug or left gripper", k=3)] == ["c", "d"]
    assert [r.entry_id for r in recall(store, "what came first?", k=2)] == ["a", "b"]     # no word matches
    assert [r.entry_id for r in recall(store, "what came?", k=2)] == ["f", "e"]


@pytest.mark.ros
def test_writer_drops_and_counts_beyond_its_queue_then_stores_what_is_queued(tmp_path):
    import threading

    from oxygen_ros.node.inputs import DropCounter
    from oxygen_ros.node.memory_service import MemoryWriter

    class SlowStore(SqliteMemoryStore):
        release = threading.Event()

        def insert(self, records):
            self.release.wait(10.0)
            return super().insert(records)

    warnings = []
    drops = DropCounter(warnings.append, what="memory")
    writer = MemoryWriter(SlowStore(tmp_path / "slow.db"), 2, RetentionPolicy(), 60.0, lambda: 0.0, drops,
                          lambda message: None)
    assert writer.put(ENTRIES[0])
    # the writer holds ENTRIES[0] inside the blocked insert once the queue is empty again
    deadline = time.monotonic() + 10.0
    while not writer._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.put(ENTRIES[1]) and writer.put(ENTRIES[2])
    assert not writer.put(ENTRIES[3])      # the queue holds 2: dropped, counted, warned
    assert drops.counts() == {"memory_queue_full": 1} and "memory_queue_full" in warnings[0]
    SlowStore.release.set()
    writer.close()
    assert writer.written == 3
    with SqliteMemoryStore(tmp_path / "slow.db") as store:
        assert sorted(r.entry_id for r in store.records()) == ["a", "b", "c"]


def test_store_locations_pick_the_backend():
    assert parse_location("runs/memory.db") == ("sqlite", "runs/memory.db")          # as every earlier release
    assert parse_location("sqlite:runs/m.db") == ("sqlite", "runs/m.db")
    assert parse_location("milvus:runs/m.db") == ("milvus", "runs/m.db")
    assert parse_location("http://milvus:19530") == ("milvus", "http://milvus:19530")
    assert parse_location("milvus:https://milvus:443/robots") == ("milvus", "https://milvus:443/robots")
    for bad in ("", "  ", "milvus:", "sqlite: "):
        with pytest.raises(ValueError, match="empty|names no"):
            parse_location(bad)


# ---- Milvus's own promises and limits ----------------------------------------------------------------------

_MILVUS_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from oxygen_ros.memory import MemoryRecord, Pose
    from oxygen_ros.memory.milvus_store import MilvusMemoryStore
    store = MilvusMemoryStore(sys.argv[1])
    i = 0
    while True:
        store.insert([MemoryRecord(f"e{i}", float(i), f"caption number {i}", "r1", "", ("cam",),
                                   Pose("map", (float(i), 0.0, 0.0)), np.full(512, i + 1, np.float32))])
        print(i, flush=True)     # written
        i += 1
""")


def test_milvus_lite_kill_9_mid_write_keeps_every_reported_insert_and_refuses_a_second_process(tmp_path):
    """milvus-lite writes each insert to its log and flushes it to the OS before returning (no fsync: a process
    crash keeps it, a power loss may not); one process at a time opens a data directory."""
    from oxygen_ros.memory.milvus_store import MilvusMemoryStore, MilvusStoreError

    def second_process(committed):
        if committed == 5:
            with pytest.raises(MilvusStoreError, match="open in another process"):
                MilvusMemoryStore(str(path))

    path = tmp_path / "killed.db"
    committed = _killed_writer(_MILVUS_WRITER, path, second_process)
    with MilvusMemoryStore(str(path)) as store:
        ids = {r.entry_id for r in store.records(embeddings=False)}
        assert {f"e{i}" for i in range(committed + 1)} <= ids
        assert "e7" in _ids(store.query(MemoryQuery(text="7", k=100)))
        [e7] = store.get(["e7"])
        np.testing.assert_array_equal(e7.embedding, np.full(512, 8, np.float32))
        assert _ids(store.query(MemoryQuery(embedding=np.full(512, 1, np.float32), near=(7.0, 0.0, 0.0),
                                            radius_m=0.5))) == ["e7"]
        store.insert([_record("after", 1e6, "written after the crash")])
        assert store.count() == len(ids) + 1


def _free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_milvus_server_uri_shares_one_collection_between_robots(tmp_path):
    """The server path (``http://HOST:PORT``) through milvus-lite's own gRPC server, in a process of its own:
    two clients (two robots' nodes) on one collection see each other's entries."""
    from oxygen_ros.memory import open_store

    port = _free_port()
    log = tmp_path / "server.log"
    with log.open("w") as out:      # a file, not a pipe: a pipe nobody reads would stop a talkative server
        server = subprocess.Popen([sys.executable, "-u", "-m", "milvus_lite", "server", "--data-dir",
                                   str(tmp_path / "server"), "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60.0
        while "listening" not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "listening" in log.read_text(), log.read_text()
        uri = f"http://127.0.0.1:{port}"
        with open_store(uri, synchronous="normal", collection="robots") as one, \
                open_store(f"milvus:{uri}", synchronous="normal", collection="robots") as two:
            one.insert(ENTRIES[:4])
            two.insert(ENTRIES[4:])
            assert one.count() == two.count() == len(ENTRIES)
            assert _ids(two.query(MemoryQuery(text="red cube", near=(10.0, 0.0, 0.0), radius_m=1.0))) == ["d"]
            assert _ids(one.query(MemoryQuery(near=(10.0, 0.0, 0.0), radius_m=1.0, robot="r2"))) == ["e"]
            assert _ids(one.query(MemoryQuery(embedding=np.array([1.0, 0.05, 0.0], np.float32), k=2))) == ["a", "b"]
            assert two.prune(RetentionPolicy(max_count=4))["count"] == 2
            assert sorted(r.entry_id for r in one.records()) == ["c", "d", "e", "f"]
            stats = one.stats()
            assert stats["backend"] == "milvus" and stats["bytes"] is None and stats["entries"] == 4
            assert stats["server_version"].startswith("milvus_lite") and one.lite_engine     # flushed as embedded
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_milvus_refuses_bad_locations_and_settings_with_the_reason(tmp_path, milvus_dir, monkeypatch):
    from oxygen_ros.memory import open_store
    from oxygen_ros.memory.milvus_store import MilvusMemoryStore, MilvusStoreError

    with pytest.raises(ValueError, match="credentials"):
        open_store("http://user:secret@127.0.0.1:19530", synchronous="normal")
    with pytest.raises(ValueError, match=r"end in \.db"):
        open_store("milvus:runs/memory", synchronous="normal")
    with pytest.raises(ValueError, match="synchronous 'full'"):
        open_store(f"milvus:{milvus_dir}")
    with pytest.raises(ValueError, match="collection name"):
        MilvusMemoryStore(str(milvus_dir), collection="robot-1")
    SqliteMemoryStore(tmp_path / "sqlite.db").close()
    with pytest.raises(ValueError, match="not a milvus-lite directory"):
        MilvusMemoryStore(str(tmp_path / "sqlite.db"))
    # a collection that is not a memory store is left alone
    from pymilvus import MilvusClient

    other = MilvusClient(str(milvus_dir))
    other.create_collection("somebody_elses", dimension=4)
    with pytest.raises(ValueError, match="not a memory store of schema version 1"):
        MilvusMemoryStore(str(milvus_dir), collection="somebody_elses")
    # no server: a clear error within the timeout, not a hang; the token comes from the environment only
    monkeypatch.setenv("OXYGEN_MILVUS_TOKEN", "root:Milvus")
    with pytest.raises(MilvusStoreError, match="127.0.0.1"):
        MilvusMemoryStore(f"http://127.0.0.1:{_free_port()}", timeout_s=2.0)


def test_milvus_limits_and_filter_literals(milvus_dir):
    from oxygen_ros.memory.milvus_store import MAX_K, MAX_TEXT_BYTES, MilvusMemoryStore

    with MilvusMemoryStore(str(milvus_dir), collection="limits") as store:
        store.insert(ENTRIES)
        # a batch with a value Milvus cannot hold is refused whole, before anything is written
        with pytest.raises(ValueError, match="text is 65536 bytes"):
            store.insert([_record("g", 70.0, "fits"), _record("h", 80.0, "x" * (MAX_TEXT_BYTES + 1))])
        with pytest.raises(ValueError, match="width 2..32768"):
            store.insert([_record("g", 70.0, "fits", embedding=[1.0])])
        assert store.count() == len(ENTRIES) and store.get(["g"]) == []
        with pytest.raises(ValueError, match=f"<= {MAX_K}"):
            store.query(MemoryQuery(k=MAX_K + 1))
        # quotes, backslashes and newlines in ids and robots are literals of the filter, not its syntax
        odd = [_record('say "hi"\\', 1.0, "an odd robot's entry", (0.0, 0.0, 0.0), robot='r"2\\\n or true'),
               _record("it's", 2.0, "another odd one", robot="r1")]
        store.insert(odd)
        assert _ids(store.query(MemoryQuery(robot='r"2\\\n or true'))) == ['say "hi"\\']
        assert [r.entry_id for r in store.get(["it's", 'say "hi"\\', "nobody"])] == ["it's", 'say "hi"\\']
        assert store.prune(RetentionPolicy(max_count=len(ENTRIES)))["count"] == 2
        assert store.get(["it's", 'say "hi"\\']) == []
        # an entry replaced without its embedding leaves no embedding behind
        store.insert([_record("a", 10.0, "a red cube on the kitchen counter", (0.0, 0.0, 0.0))])
        assert store.get(["a"])[0].embedding is None
        assert "a" not in _ids(store.query(MemoryQuery(embedding=np.array([1.0, 0.0, 0.0], np.float32))))
        # the word counts of the BM25 word rule follow every insert, replacement and removal
        from collections import Counter

        from oxygen_ros.memory.milvus_store import _words

        expected = Counter(w for r in store.records(embeddings=False) for w in _words(r.text))
        counted = {row["word"]: row["entries"] for row in store._scan("", ["entries"], store._vocabulary(), key="word")}
        assert counted == dict(expected)
