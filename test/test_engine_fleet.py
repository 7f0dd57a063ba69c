"""Many robots on one engine (oxygen_ros/engine/fleet.py): each robot's outputs equal a single-robot
engine's for the same observations, robots come and go at run time, one robot's missing or refused
observations change nothing for the others, earliest deadline first without starvation, KV admission
per robot on the shared pool. CPU, tiny model; no wall-clock assertion."""

import numpy as np
import pytest

from oxygen_ros.engine import Engine, EngineConfig, Observation, RequestStatus
from oxygen_ros.engine.config import MIB
from oxygen_ros.engine.fleet import Fleet, ReleaseClock
from engine_support import MEMORY, SLOTS, SPEECH, ByteIO, engine_config


def frame(robot_seed, seq, slots=SLOTS, instruction="pick up the cube", masked=(), stamp=None):
    """Robot ``robot_seed``'s observation ``seq``: its own images and state (robots share seq numbers,
    so prefix keys must tell them apart)."""
    rng = np.random.default_rng(1000 * robot_seed + seq)
    images = {slot: None if slot in masked else rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
              for slot in slots}
    return Observation(images, instruction, rng.standard_normal(4).astype(np.float32),
                       stamp=0.1 * seq if stamp is None else stamp, seq=seq)


SPEECH_B = dict(SPEECH, max_new_tokens=4, prompt_template="Say: {instruction};\n")

# Robot id -> (config, observation factory): different cameras, tasks, prompts and noise seeds.
ROBOTS = {
    "a": (lambda **kw: engine_config(tasks=[SPEECH, MEMORY], **kw),
          lambda seq: frame(1, seq, masked=("left_wrist_0_rgb",) if seq % 3 == 2 else ())),
    "b": (lambda **kw: engine_config(tasks=[SPEECH_B], camera_slots=["base_0_rgb"],
                                     action={"prompt_template": "Do: {instruction}\n", "noise_seed": 7,
                                             "control_rate_hz": 0.1}, **kw),
          lambda seq: frame(2, seq, slots=("base_0_rgb",), instruction="open the drawer")),
    "c": (lambda **kw: engine_config(tasks=[SPEECH], **kw), lambda seq: frame(3, seq)),
}


def fleet_config(**overrides):
    return engine_config(kv_budget_mb=overrides.pop("kv_budget_mb", 24), **overrides)


def single_run(model, robot, seqs):
    """The single-robot engine's chunks and final events for observations ``seqs`` of ``robot``."""
    make_config, make_obs = ROBOTS[robot]
    engine = Engine(model, ByteIO(model.config), make_config())
    chunks = {}
    events = []
    for seq in seqs:
        result = engine.run_cycle(make_obs(seq))
        chunks[seq] = result.action.actions
        events += result.text_events
    events += engine.flush()[0]
    engine.close()
    return chunks, {(e.task, e.seq): e for e in events if e.final}


def add_robots(fleet, model, robots):
    for robot in robots:
        fleet.add_robot(robot, ByteIO(model.config), ROBOTS[robot][0]())


def collect(result, chunks, events):
    for robot, cycle in result.cycles.items():
        chunks.setdefault(robot, {})[cycle.action.seq] = cycle.action.actions
    for robot in set(result.cycles) | set(result.text_events):
        events.setdefault(robot, []).extend(result.events(robot))


def assert_same(robot, fleet_chunks, fleet_events, single):
    single_chunks, single_final = single
    assert set(fleet_chunks) == set(single_chunks)
    for seq, actions in single_chunks.items():
        np.testing.assert_allclose(fleet_chunks[seq], actions, atol=1e-5, rtol=0, err_msg=f"{robot} {seq}")
    final = {(e.task, e.seq): e for e in fleet_events if e.final}
    assert set(final) == set(single_final)
    for key, event in single_final.items():
        assert event.status == final[key].status == RequestStatus.COMPLETED
        assert final[key].token_ids == event.token_ids, (robot, key)


@pytest.mark.slow     # 6 fleet cycles of 3 robots and 3 single-robot runs, per mask: 40-197 s each at load 2-10
@pytest.mark.parametrize("which", ["bidirectional", "causal"])
def test_each_robot_equals_its_single_robot_engine(model, causal_model, which):
    """Three robots (different cameras, prompts, tasks, noise seeds; the same seq numbers) on one
    fleet: each robot's chunks equal a single-robot engine's within 1e-5 and its greedy text is
    identical, while every cycle made one vision call and one denoising call for all of them and
    decode steps batched requests of several robots."""
    model = model if which == "bidirectional" else causal_model
    fleet = Fleet(model, fleet_config())
    add_robots(fleet, model, ROBOTS)
    counters = fleet.core.runner.counters
    chunks, events, robots_per_step = {}, {}, []
    frames = 6
    for seq in range(frames):
        before = (counters.vision_calls, counters.denoise_calls)
        order = []
        result = fleet.run_cycle({r: ROBOTS[r][1](seq) for r in ROBOTS},
                                 on_action=lambda robot, chunk: order.append(robot))
        assert (counters.vision_calls - before[0], counters.denoise_calls - before[1]) == (1, 1)
        assert sorted(order) == sorted(ROBOTS) and not result.errors
        robots_per_step += result.record.batch_sizes
        collect(result, chunks, events)
    for robot, (flushed, _) in fleet.flush().items():
        events[robot] += flushed
    assert max(robots_per_step) > 3    # requests of several robots (and frames) in one step
    for robot in ROBOTS:
        assert_same(robot, chunks[robot], events[robot], single_run(model, robot, range(frames)))
    fleet.close()
    assert fleet.core.pool.num_used == 0


def test_missing_and_refused_observations_change_nothing_for_other_robots(model):
    """Robot b sends no observation in some cycles and a refused one (unknown camera slot) in
    another: robot a's outputs are still exactly its single-engine outputs, b's refused frame is
    reported in ``errors`` only, and b's running requests keep decoding while b is not served."""
    fleet = Fleet(model, fleet_config())
    add_robots(fleet, model, ["a", "b"])
    chunks, events = {}, {}
    b_seqs = []
    unserved_events = 0
    for seq in range(8):
        observations = {"a": ROBOTS["a"][1](seq)}
        if seq in (0, 1, 5, 7):
            observations["b"] = ROBOTS["b"][1](seq)
            b_seqs.append(seq)
        elif seq == 3:
            bad = ROBOTS["b"][1](seq)
            observations["b"] = Observation({"no_such_camera": bad.images["base_0_rgb"]},
                                            bad.instruction, bad.state, bad.stamp, seq)
        result = fleet.run_cycle(observations)
        if seq == 3:
            assert list(result.errors) == ["b"] and "no_such_camera" in str(result.errors["b"])
            assert "b" not in result.cycles
        unserved_events += len(result.text_events.get("b", []))
        collect(result, chunks, events)
    assert unserved_events > 0        # b's requests advanced in cycles that did not serve b
    for robot, (flushed, _) in fleet.flush().items():
        events[robot] += flushed
    assert_same("a", chunks["a"], events["a"], single_run(model, "a", range(8)))
    assert_same("b", chunks["b"], events["b"], single_run(model, "b", b_seqs))
    fleet.close()


def test_robots_added_and_removed_at_run_time(model):
    """Add b while a runs, remove a with requests in flight: each request of a ends exactly once
    (cancelled), a's pages and share return to the pool, b keeps running unchanged; a can come back
    under the same id; closing the fleet leaves the pool empty."""
    fleet = Fleet(model, fleet_config(decode_steps_per_cycle=1))
    add_robots(fleet, model, ["a"])
    total = fleet.core.pool.num_blocks
    assert fleet.core.unassigned_blocks < total
    events = {}
    chunks = {}
    b_seqs = []
    for seq in range(3):
        collect(fleet.run_cycle({"a": ROBOTS["a"][1](seq)}), chunks, events)
    add_robots(fleet, model, ["b"])
    for seq in range(3, 6):
        collect(fleet.run_cycle({"a": ROBOTS["a"][1](seq), "b": ROBOTS["b"][1](seq)}), chunks, events)
        b_seqs.append(seq)
    lane_a = fleet.robot("a")
    active = {r.request_id for r in lane_a.active_requests}
    assert active                                   # k = 1: a has requests in flight
    removed = fleet.remove_robot("a")
    final = [e for e in removed if e.final]
    assert {e.request_id for e in final} == active and len(final) == len(active)
    assert all(e.status == RequestStatus.CANCELLED for e in final)
    assert "a" not in fleet.robots and "a" not in fleet.core.shares
    with pytest.raises(RuntimeError):
        lane_a.submit("speech")
    with pytest.raises(KeyError):
        fleet.run_cycle({"a": ROBOTS["a"][1](6)})
    # Every request of a ended exactly once over the whole run.
    a_finals = [e.request_id for e in events["a"] + removed if e.final]
    assert len(a_finals) == len(set(a_finals))
    for seq in range(6, 9):
        collect(fleet.run_cycle({"b": ROBOTS["b"][1](seq)}), chunks, events)
        b_seqs.append(seq)
    add_robots(fleet, model, ["a"])                 # back under the same id, a fresh lane
    result = fleet.run_cycle({"a": ROBOTS["a"][1](0), "b": ROBOTS["b"][1](9)})
    collect(result, chunks, events)
    b_seqs.append(9)
    np.testing.assert_allclose(result.cycles["a"].action.actions,
                               single_run(model, "a", [0])[0][0], atol=1e-5, rtol=0)
    for robot, (flushed, _) in fleet.flush().items():
        events[robot] += flushed
    assert_same("b", chunks["b"], events["b"], single_run(model, "b", b_seqs))
    fleet.close()
    assert fleet.core.pool.num_used == 0 and fleet.core.unassigned_blocks == total
    with pytest.raises(RuntimeError):
        fleet.run_cycle({})


def test_earliest_deadline_first_and_no_starvation(model):
    """A robot at 50 Hz and one at 2 Hz on one fleet whose decode step takes a single request
    (max_batch_size 1, k = 1): the fast robot's deadline is always the earliest and it triggers a
    request every frame, yet the slow robot is served at every release, its chunks come in deadline
    order, and its requests still get every other decode step: each completes within 2 x its tokens
    steps of its start."""
    speech = dict(SPEECH, max_new_tokens=4)
    fleet = Fleet(model, fleet_config(decode_steps_per_cycle=1, max_batch_size=1, kv_budget_mb=48))
    configs = {"fast": engine_config(tasks=[speech], max_waiting=1000, kv_budget_mb=24,
                                     action={"control_rate_hz": 50.0}),
               "slow": engine_config(tasks=[speech], max_waiting=1000,
                                     action={"control_rate_hz": 2.0})}
    clock = ReleaseClock()
    for robot, config in configs.items():
        fleet.add_robot(robot, ByteIO(model.config), config)
        clock.add(robot, config.action.control_period_s, 0.0)
    seqs = {"fast": 0, "slow": 0}
    served = {"fast": [], "slow": []}
    slow_steps = {}           # slow request id -> decode steps (fleet cycles) until its final event
    cycles = 0
    now = clock.next_release()
    while now <= 1.0 + 1e-6:       # releases accumulate float error
        due = clock.due(now)
        order = []
        # A virtual clock: deadlines far in the future (fixed_k does not read them).
        result = fleet.run_cycle({r: frame(1 if r == "fast" else 2, seqs[r], stamp=now) for r in due},
                                 {r: 1e9 + d for r, d in due.items()},
                                 on_action=lambda robot, chunk: order.append(robot))
        assert order == list(due)                   # earliest deadline first
        for robot in due:
            served[robot].append(now)
            seqs[robot] += 1
            clock.served(robot, now)
        cycles += 1
        for event in result.events("slow"):
            if event.final:
                slow_steps[event.request_id] = cycles
        for request in fleet.robot("slow").active_requests:
            slow_steps.setdefault(("start", request.request_id), cycles)
        now = clock.next_release()
    assert served["slow"] == [0.0, 0.5, 1.0]
    assert len(served["fast"]) == 51 and clock.skipped == {"fast": 0, "slow": 0}
    finished = [rid for rid in slow_steps if not isinstance(rid, tuple)]
    assert len(finished) >= 2
    for rid in finished:
        assert slow_steps[rid] - slow_steps[("start", rid)] <= 2 * speech["max_new_tokens"]
    assert len(fleet.robot("fast").active_requests) > 20      # the fast robot's backlog is large
    fleet.close()


def test_kv_admission_per_robot_on_the_shared_pool(model):
    """Each robot is admitted against its own share: a robot with room for one request at a time
    never holds more, while its neighbour's requests are admitted every cycle; a share that does not
    fit, or cannot hold the robot's action reserve, is refused and leaves the pool's shares as they
    were."""
    fleet = Fleet(model, fleet_config(kv_budget_mb=16, decode_steps_per_cycle=1))
    pool = fleet.core.pool
    speech = dict(SPEECH, max_new_tokens=12, prompt_template="Say: {instruction};\n")  # one length
    big = fleet.add_robot("big", ByteIO(model.config), engine_config(tasks=[speech], kv_budget_mb=12))
    reserve = big._action_reserve
    charge = big._scheduler.charge(_probe_request(big, speech))
    small_mb = (reserve + charge) * pool.bytes_per_block / MIB
    small = fleet.add_robot("small", ByteIO(model.config),
                            engine_config(tasks=[speech], kv_budget_mb=small_mb))
    assert small._scheduler.language_capacity == charge
    unassigned = fleet.core.unassigned_blocks
    with pytest.raises(ValueError, match="does not fit"):
        fleet.add_robot("huge", ByteIO(model.config), engine_config(tasks=[speech], kv_budget_mb=64))
    with pytest.raises(ValueError, match="action task"):
        fleet.add_robot("tiny", ByteIO(model.config),
                        engine_config(tasks=[speech], kv_budget_mb=pool.bytes_per_block / MIB))
    assert fleet.core.unassigned_blocks == unassigned and set(fleet.core.shares) == {"big", "small"}
    big_running = []
    for seq in range(6):
        fleet.run_cycle({"big": frame(1, seq), "small": frame(2, seq)})
        assert len(small._scheduler.running) <= 1
        assert small._scheduler.committed_blocks <= small._scheduler.language_capacity
        big_running.append(len(big._scheduler.running))
    assert len(small._scheduler.waiting) >= 4
    assert big_running == sorted(big_running) and big_running[-1] >= 5
    assert pool.num_used <= pool.num_blocks
    fleet.close()
    assert pool.num_used == 0


def _probe_request(lane, task):
    """A request of ``task`` on the robot's default observation, for its admission charge."""
    from oxygen_ros.engine.request import Request
    obs = frame(1, 0)
    ids = lane._inputs.prompt_ids(task["prompt_template"], obs)
    return Request(lane.config.task("speech"), 0, 0.0, list(ids), 2 * lane._core.runner.model.config.num_image_tokens,
                   (True, True), 0.0)


def test_fleet_refuses_configs_it_cannot_serve(model):
    with pytest.raises(ValueError, match="unified"):
        Fleet(model, fleet_config(mode="isolated"))
    fleet = Fleet(model, fleet_config())
    with pytest.raises(ValueError, match="block_size"):
        fleet.add_robot("x", ByteIO(model.config), engine_config(block_size=32))
    with pytest.raises(ValueError, match="scheduling"):
        fleet.add_robot("x", ByteIO(model.config), engine_config(scheduling="deadline"))
    fleet.add_robot("x", ByteIO(model.config), engine_config())
    with pytest.raises(ValueError, match="already"):
        fleet.add_robot("x", ByteIO(model.config), engine_config())
    with pytest.raises(ValueError):
        ReleaseClock().add("x", 0.0, 0.0)
    fleet.close()


def test_subtask_state_is_per_robot(model):
    """π0.5's subtask loop on two robots of one fleet: each robot's action prompt carries its own latest
    subtask. Robot a's source request completes on its stop token; robot b's never does (no stop token:
    truncated requests give no subtask), so b keeps the plain prompt while a's carries a's subtask; each
    robot's chunks, subtasks and action prompts equal a single-robot engine's."""
    from test_engine_subtask import LOOP, SOURCE, _first_new, _probe
    from engine_support import observation

    stop = _first_new(_probe(model))
    tasks = {"a": [dict(SOURCE, stop_token_ids=[stop])], "b": [dict(SOURCE, stop_token_ids=[])]}
    make_obs = {"a": lambda seq: observation(seq, "pick up the cube"),
                "b": lambda seq: frame(2, seq, instruction="open the drawer")}
    fleet = Fleet(model, fleet_config(kv_budget_mb=16))
    for robot in make_obs:
        fleet.add_robot(robot, ByteIO(model.config), engine_config(tasks=tasks[robot], action=LOOP))
    singles = {robot: Engine(model, ByteIO(model.config), engine_config(tasks=tasks[robot], action=LOOP))
               for robot in make_obs}
    subtasks = {robot: [] for robot in make_obs}
    for seq in range(5):
        result = fleet.run_cycle({robot: make(seq) for robot, make in make_obs.items()})
        for robot, make in make_obs.items():
            alone = singles[robot].run_cycle(make(seq)).action
            chunk = result.cycles[robot].action
            assert chunk.subtask == alone.subtask and chunk.prompt_ids == alone.prompt_ids, (robot, seq)
            np.testing.assert_allclose(chunk.actions, alone.actions, atol=1e-5, rtol=0)
            subtasks[robot].append(chunk.subtask)
        assert fleet.robot("a").subtask.text == singles["a"].subtask.text
        assert fleet.robot("b").subtask.text == singles["b"].subtask.text
    assert subtasks["a"][-1] is not None                  # a's loop closed ...
    assert subtasks["b"] == [None] * 5                    # ... and its subtask stayed a's
    fleet.close()
    for engine in singles.values():
        engine.close()


def private_accesses(source: str) -> list[str]:
    """``line: expression`` of every access in ``source`` to a private attribute (one leading underscore,
    not a dunder) of an object other than ``self``: ``other._x``, ``self._a._b``, ``f()._x``, and
    ``getattr``/``setattr``/``hasattr``/``delattr`` with a private name; in line order."""
    import ast

    def private(name) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr) and \
                not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append((node.lineno, f"{node.lineno}: {ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and private(node.args[1].value):
            found.append((node.lineno, f"{node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def test_fleet_uses_only_the_lanes_public_surface():
    """oxygen_ros/engine/fleet.py drives each robot's engine through :class:`EngineLane` (``Engine.lane``)
    and public methods only: no private attribute of a lane, an engine, the core or anything but itself."""
    from pathlib import Path

    import oxygen_ros.engine.fleet as fleet_module

    # the check sees what it must (so an empty answer below means something)
    assert private_accesses("def f(self, lane):\n    lane._work.meter = self._m\n    return self._a._b\n") == \
        ["2: lane._work", "3: self._a._b"]
    assert private_accesses("getattr(lane, '_inbox').apply()\nself._lanes[r]._enqueue(f)\n") == \
        ["1: getattr(lane, '_inbox')", "2: self._lanes[r]._enqueue"]
    assert private_accesses("self._core.pool\nlane.observe(obs)\nobj.__class__\n") == []
    assert private_accesses(Path(fleet_module.__file__).read_text()) == []


def test_fleet_server_and_its_clients_use_only_each_others_public_surface():
    """oxygen_ros/engine/fleet_server.py: the server keeps the events it holds for a robot itself
    (``take_queued``) and clients call its public ``run_robot_cycle``: no private attribute of another object."""
    from pathlib import Path

    import oxygen_ros.engine.fleet_server as server_module

    assert private_accesses(Path(server_module.__file__).read_text()) == []
