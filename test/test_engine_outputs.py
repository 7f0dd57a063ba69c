"""Provenance of the engine's outputs: the observation's tag comes back on every output produced from it,
text events carry their index within their request, a memory request is emitted once (its entry on its
final event), and a new instruction cancels the tasks that ask for it in the engine alone."""

import pytest
import torch

from oxygen_ros.engine import Engine, RequestStatus
from oxygen_ros.models import load_model
from engine_support import MEMORY, SPEECH, ByteIO, engine_config, observation


@pytest.fixture(scope="module")
def model():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def _tagged(seq, instruction="pick up the cube"):
    obs = observation(seq, instruction)
    obs.tag = ("tag", seq)      # any object; the engine never reads it
    return obs


def test_every_output_carries_the_tag_of_its_observation(model):
    tasks = [dict(SPEECH, max_new_tokens=5), dict(MEMORY, max_new_tokens=3)]
    engine = Engine(model, ByteIO(model.config), engine_config("unified", tasks))
    chunks, events = [], []
    for seq in range(4):
        result = engine.run_cycle(_tagged(seq), on_action=chunks.append)
        assert result.action.tag == ("tag", seq)
        events += result.text_events
    events += engine.flush()[0]
    assert [c.tag for c in chunks] == [("tag", seq) for seq in range(4)]
    assert events and all(e.tag == ("tag", e.seq) for e in events)
    entries = [e.memory for e in events if e.memory is not None]
    assert [m.seq for m in entries] == [0, 2]
    assert all(m.tag == ("tag", m.seq) for m in entries)
    assert engine.pool.num_used == 0


def test_events_carry_their_index_and_memory_comes_once(model):
    tasks = [dict(SPEECH, max_new_tokens=5), dict(MEMORY, max_new_tokens=3)]
    engine = Engine(model, ByteIO(model.config), engine_config("unified", tasks))
    events = engine.run_cycle(_tagged(0)).text_events + engine.flush()[0]
    by_request = {}
    for event in events:
        by_request.setdefault(event.request_id, []).append(event)
    assert {es[0].kind for es in by_request.values()} == {"speech", "memory"}
    for request_events in by_request.values():
        assert [e.index for e in request_events] == list(range(len(request_events)))
        assert [e.final for e in request_events] == [False] * (len(request_events) - 1) + [True]
        assert all(e.memory is None for e in request_events[:-1])
        final = request_events[-1]
        assert final.status == RequestStatus.COMPLETED
        assert (final.memory is not None) == (final.kind == "memory")
        if final.memory is not None:
            assert final.memory.request_id == final.request_id and final.memory.text == final.text


def test_a_new_instruction_cancels_only_the_tasks_that_ask_for_it(model):
    speech = dict(SPEECH, max_new_tokens=40, cancel_on_new_instruction=True)
    memory = dict(MEMORY, max_new_tokens=40, trigger={"every_n_frames": 1})
    engine = Engine(model, ByteIO(model.config),
                    engine_config("unified", [speech, memory], decode_steps_per_cycle=1))
    first = engine.run_cycle(_tagged(0, "pick up the cube")).text_events
    second = engine.run_cycle(_tagged(1, "open the drawer")).text_events
    cancelled = [e for e in first + second if e.final and e.status == RequestStatus.CANCELLED]
    assert [(e.task, e.seq, e.tag) for e in cancelled] == [("speech", 0, ("tag", 0))]
    running = {(r.task.name, r.obs_seq) for r in engine.active_requests}
    assert ("memory", 0) in running and ("speech", 1) in running
    engine.close()
