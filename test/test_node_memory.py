"""The node's memory over loopback DDS (tiny preset): entries carry the robot's pose when a pose sample lies near
their observation and say so when none does, every published entry reaches the store, ~/query_memory answers
from it, and the store survives a cleanup and configure (a node restart). One node serves the module."""
from __future__ import annotations

import re

import pytest

from node_support import Harness, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

PUBLISH_HZ = 10.0
BASE_S = 1000.0
MAX_AGE_S = 0.3


def _stamp(index: int) -> float:
    return BASE_S + index / PUBLISH_HZ


def _seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from geometry_msgs.msg import PoseStamped
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    store = tmp_path_factory.mktemp("memory") / "memory.db"
    h = Harness(tiny_parameters(**{
        "memory.trigger.every_s": 0.5, "memory.store.path": str(store), "memory.pose.topic": "robot_pose",
        "memory.pose.max_age_s": MAX_AGE_S, "memory.pose.fixed_frame": "map"}), publish_hz=PUBLISH_HZ)
    h.stamp_seconds = _stamp
    h.store_path = store
    h.publish_pose = True
    h.pose_frame = "map"
    h.pose_stamps = []
    publisher = h.robot.create_publisher(PoseStamped, "robot_pose", QoSProfile(
        depth=10, reliability=ReliabilityPolicy.RELIABLE))

    def publish_pose():
        # the pose of the frame last sent, its x = its stamp's offset from BASE_S (so a match can be checked)
        if not h.publish_pose or h._frame_index == 0:
            return
        stamp_s = _stamp(h._frame_index)
        msg = PoseStamped()
        msg.header.frame_id = h.pose_frame
        msg.header.stamp.sec, nanosec = divmod(round(stamp_s * 1e9), 10**9)
        msg.header.stamp.nanosec = nanosec
        msg.pose.position.x, msg.pose.position.y = stamp_s - BASE_S, 2.0
        publisher.publish(msg)
        h.pose_stamps.append(stamp_s)

    h.robot.create_timer(1.0 / PUBLISH_HZ, publish_pose)
    assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
    assert h.chunks_flow(timeout=30.0)
    yield h
    h.close()


def _query(harness, **fields):
    from oxygen_ros.srv import QueryMemory

    client = getattr(harness, "_query_client", None)
    if client is None:
        client = harness._query_client = harness.robot.create_client(QueryMemory, "oxygen_node/query_memory")
    assert client.wait_for_service(timeout_sec=10.0)
    request = QueryMemory.Request()
    for name, value in fields.items():
        setattr(request, name, value)
    future = client.call_async(request)
    assert wait_for(future.done, 10.0), "no answer from ~/query_memory"
    return future.result()


def test_entries_carry_the_pose_nearest_their_observation(harness):
    assert wait_for(lambda: sum(m.has_pose for m in list(harness.received["memory"])) >= 2, 60.0), \
        [m.has_pose for m in harness.received["memory"]]
    robot = harness.namespace.strip("/")
    for entry in [m for m in list(harness.received["memory"]) if m.has_pose]:
        observed, posed = _seconds(entry.header.stamp), _seconds(entry.pose.header.stamp)
        assert entry.robot == robot
        assert entry.pose.header.frame_id == "map"
        assert abs(posed - observed) <= MAX_AGE_S + 1e-6
        assert entry.pose.pose.position.x == pytest.approx(posed - BASE_S, abs=1e-6)
        assert entry.pose.pose.position.y == 2.0 and entry.pose.pose.orientation.w == 1.0


def test_without_a_pose_near_the_observation_the_entry_says_so(harness):
    harness.publish_pose = False
    try:
        assert wait_for(lambda: harness.pose_stamps and any(
            not m.has_pose and _seconds(m.header.stamp) > harness.pose_stamps[-1] + MAX_AGE_S
            for m in list(harness.received["memory"])), 60.0)
    finally:
        harness.publish_pose = True
    entry = next(m for m in list(harness.received["memory"])
                 if not m.has_pose and _seconds(m.header.stamp) > harness.pose_stamps[-1] + MAX_AGE_S)
    assert entry.pose.header.frame_id == "" and entry.pose.pose.position.x == 0.0
    assert entry.robot == harness.namespace.strip("/")


def test_a_pose_in_another_frame_is_dropped_and_counted(harness):
    harness.pose_frame = "odom"
    try:
        assert wait_for(lambda: harness.node._topics.memory_service.drops.counts().get("pose_wrong_frame", 0) >= 2,
                        10.0)
    finally:
        harness.pose_frame = "map"

    def reported(key):
        return [int(v.value) for message in list(harness.received["diagnostics"])[-3:] for status in message.status
                for v in status.values if v.key == key]

    # counted on /diagnostics, with the entries stored
    assert wait_for(lambda: any(n >= 2 for n in reported("memory pose_wrong_frame")), 10.0)
    assert wait_for(lambda: any(n >= 1 for n in reported("memory_stored")), 10.0)


def test_query_memory_answers_from_the_store(harness):
    from builtin_interfaces.msg import Time
    from geometry_msgs.msg import Point

    published = {m.entry_id: m for m in list(harness.received["memory"])}
    assert wait_for(lambda: _query(harness, k=1000).entries and
                    set(published) <= {e.entry_id for e in _query(harness, k=1000).entries}, 20.0)
    everything = _query(harness, k=1000)
    assert everything.success and len(everything.scores) == len(everything.entries)
    stamps = [_seconds(e.header.stamp) for e in everything.entries]
    assert stamps == sorted(stamps, reverse=True)       # no text: newest first
    oldest = _query(harness, k=2, oldest_first=True)
    assert [e.entry_id for e in oldest.entries] == [e.entry_id for e in everything.entries[::-1][:2]]
    for entry in everything.entries:
        if entry.entry_id in published:
            sent = published[entry.entry_id]
            assert (entry.text, entry.has_pose, entry.robot) == (sent.text, sent.has_pose, sent.robot)
            assert _seconds(entry.header.stamp) == pytest.approx(_seconds(sent.header.stamp), abs=1e-6)
    posed = next(e for e in everything.entries if e.has_pose)
    x = posed.pose.pose.position.x
    near = _query(harness, use_place=True, position=Point(x=x, y=2.0, z=0.0), radius_m=0.01, k=1000)
    assert near.success and posed.entry_id in {e.entry_id for e in near.entries}
    assert all(abs(e.pose.pose.position.x - x) <= 0.01 for e in near.entries)
    stamp = posed.header.stamp
    window = _query(harness, since=stamp, until=Time(sec=stamp.sec, nanosec=stamp.nanosec), k=1000)
    assert [e.entry_id for e in window.entries] == [posed.entry_id]
    assert _query(harness, robot="another_robot").entries == []
    worded = next((e for e in everything.entries if re.search(r"\w", e.text)), None)
    if worded is not None:      # the tiny model's random weights may caption without a word
        word = re.findall(r"\w+", worded.text)[0]
        found = _query(harness, text=word, k=1000)
        assert found.success and worded.entry_id in {e.entry_id for e in found.entries}
        assert all(s > 0 for s in found.scores)
    refused = _query(harness, use_place=True, radius_m=0.0)
    assert not refused.success and "radius" in refused.message


def test_ask_fills_memory_from_the_store_and_lists_the_entries(harness):
    from action_msgs.msg import GoalStatus
    from oxygen_ros.action import Ask
    from rclpy.action import ActionClient

    from oxygen_ros.memory import SqliteMemoryStore

    client = ActionClient(harness.robot, Ask, harness.topic("oxygen_node/ask"))
    try:
        assert client.wait_for_server(timeout_sec=20.0)
        too_many = client.send_goal_async(Ask.Goal(task="speech", instruction="where was the cube?", memory_k=1001,
                                                   prompt_template="Memory: {memory}. Question: {instruction}"))
        assert wait_for(too_many.done, 30.0) and not too_many.result().accepted
        sent = client.send_goal_async(Ask.Goal(task="speech", instruction="where was the cube?", memory_k=3,
                                               prompt_template="Memory: {memory}. Question: {instruction}"))
        assert wait_for(sent.done, 30.0)
        handle = sent.result()
        assert handle.accepted
        answer = handle.get_result_async()
        assert wait_for(answer.done, 90.0)
        response = answer.result()
    finally:
        client.destroy()
    result = response.result
    assert response.status == GoalStatus.STATUS_SUCCEEDED, result.message
    assert len(result.memory_entry_ids) == 3
    asked_s = _seconds(result.memory_stamp)      # the ages' time of asking
    assert abs(asked_s - harness.robot.get_clock().now().nanoseconds * 1e-9) < 120.0
    with SqliteMemoryStore(harness.store_path) as store:
        used = store.get(result.memory_entry_ids)
    assert [r.entry_id for r in used] == list(result.memory_entry_ids)     # all stored
    assert [r.stamp_s for r in used] == sorted(r.stamp_s for r in used)      # in the prompt: oldest first
    assert all(r.robot == harness.namespace.strip("/") for r in used)


def test_the_store_survives_a_cleanup_and_configure(harness):
    from oxygen_ros.memory import SqliteMemoryStore

    before = {e.entry_id for e in _query(harness, k=1000).entries}
    assert harness.change_state("deactivate") and harness.change_state("cleanup")
    with SqliteMemoryStore(harness.store_path) as store:     # closed by cleanup: everything written
        assert before <= {r.entry_id for r in store.records(embeddings=False)}
        with_embedding = [r for r in store.records() if r.embedding is not None]
        assert with_embedding and all(r.embedding.shape == (256,) for r in with_embedding)
    assert harness.change_state("configure") and harness.change_state("activate")
    assert before <= {e.entry_id for e in _query(harness, k=1000).entries}


def test_the_store_survives_a_kill_9_of_the_node_process(tmp_path):
    import os
    import signal
    import threading

    import rclpy
    from oxygen_ros.msg import MemoryEntry
    from rclpy.context import Context
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from node_support import RobotSide, start_executable
    from oxygen_ros.memory import SqliteMemoryStore

    namespace = f"/memory_kill_{os.getpid()}"
    store_path = tmp_path / "killed.db"
    process = start_executable(tmp_path, namespace, overrides=(f"memory.store.path:={store_path}",
                                                               "memory.trigger.every_s:=0.5"))
    context = Context()
    rclpy.init(context=context)
    side = RobotSide(context, namespace, base_s=3000)
    published = []
    side.node.create_subscription(MemoryEntry, "oxygen_node/memory", lambda m: published.append(m.entry_id),
                                  QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(side.node)

    def spin():
        try:
            executor.spin()
        except ExternalShutdownException:
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    stored_before: set[str] = set()
    try:
        def stored() -> set[str]:
            if not store_path.exists():
                return set()
            with SqliteMemoryStore(store_path) as store:
                return {r.entry_id for r in store.records(embeddings=False)}

        # three published entries in the store while the node runs (the writer thread commits each batch)
        assert wait_for(lambda: process.poll() is None and len(published) >= 3 and
                        set(published[:3]) <= (stored_before := stored()), 120.0, 0.2), \
            (process.poll(), published, stored_before)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30.0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        executor.shutdown(timeout_sec=5.0)
        thread.join(timeout=5.0)
        side.node.destroy_node()
        context.try_shutdown()
        context.destroy()
    with SqliteMemoryStore(store_path) as store:
        assert store._read.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        after = {r.entry_id for r in store.records(embeddings=False)}
    assert stored_before <= after
    assert set(published) - after <= set(published[-2:])   # at most what was in flight when killed


def test_a_store_that_cannot_be_opened_fails_configure_with_the_reason(tmp_path):
    not_a_database = tmp_path / "memory.db"
    not_a_database.write_bytes(b"this is not an SQLite file" * 100)
    h = Harness(tiny_parameters(**{"memory.store.path": str(not_a_database)}))
    try:
        # the reason is recorded inside the configure callback, the state changes when the callback has returned
        assert wait_for(lambda: h.node.configure_error is not None and h.node.lifecycle_state != "configuring", 30.0)
        assert h.node.lifecycle_state == "unconfigured"
        assert "not a database" in h.node.configure_error
        assert h.node.engine is None       # refused before the model was loaded
    finally:
        h.close()


def test_a_milvus_store_behind_the_same_service(tmp_path):
    """memory.store.path milvus:PATH.db: the node writes its entries to milvus-lite and ~/query_memory answers from
    it; Milvus refuses memory.store.synchronous full (the default) at configure, with the reason."""
    from oxygen_ros.memory.milvus_store import MilvusMemoryStore

    location = tmp_path / "milvus.db"
    refused = Harness(tiny_parameters(**{"memory.store.path": f"milvus:{location}"}))
    try:
        assert wait_for(lambda: refused.node.configure_error is not None, 30.0)
        assert "synchronous to 'normal'" in refused.node.configure_error
        assert refused.node.engine is None
    finally:
        refused.close()
    h = Harness(tiny_parameters(**{"memory.trigger.every_s": 0.5, "memory.store.path": f"milvus:{location}",
                                   "memory.store.synchronous": "normal", "memory.store.collection": "robot_one"}))
    try:
        assert wait_for(lambda: h.node.lifecycle_state == "active", 60.0), "autostart did not reach active"
        assert h.chunks_flow(timeout=30.0)
        assert wait_for(lambda: len(_query(h, k=10).entries) >= 2, 60.0), "no entries reached the Milvus store"
        answer = _query(h, k=1000)
        assert answer.success and [_seconds(e.header.stamp) for e in answer.entries] == \
            sorted((_seconds(e.header.stamp) for e in answer.entries), reverse=True)
        words = re.findall(r"\w+", answer.entries[0].text.lower())
        if words:       # a caption of the random-weight model may hold no word
            assert answer.entries[0].entry_id in {e.entry_id for e in _query(h, text=words[0], k=1000).entries}
        assert h.change_state("deactivate") and h.change_state("cleanup")
        with MilvusMemoryStore(str(location), collection="robot_one") as store:    # closed by cleanup
            stored = {r.entry_id: r for r in store.records()}
            assert {e.entry_id for e in answer.entries} <= set(stored)
            assert all(r.embedding is not None and r.embedding.shape == (256,) for r in stored.values())
    finally:
        h.close()
