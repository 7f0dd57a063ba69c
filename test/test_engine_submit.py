"""Requests on demand (``Engine.submit``): started from the next cycle's observation with the submitted
instruction or prompt, ended by exactly one final event on every path (completed, cancelled before or after
it started, cancelled with its task, dropped for an over-long prompt, withdrawn at close), with the KV pool
empty afterwards. No wall-clock assertions."""

import threading

import pytest
import torch

from oxygen_ros.engine import Engine, RequestStatus
from oxygen_ros.models import load_model
from engine_support import SPEECH, ByteIO, engine_config, observation

# A speech task without a trigger: it runs only on request, so every request of it is a submitted one.
ON_DEMAND = dict(SPEECH, trigger={}, max_new_tokens=5)


@pytest.fixture(scope="module")
def model():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def _engine(model, tasks=(ON_DEMAND,), **overrides):
    return Engine(model, ByteIO(model.config), engine_config("unified", list(tasks), **overrides))


def _finals(events):
    return [e for e in events if e.final]


def _run(engine, seqs, instruction="pick up the cube"):
    events = []
    for seq in seqs:
        events += engine.run_cycle(observation(seq, instruction)).text_events
    return events


def test_submitted_request_uses_the_submitted_instruction_and_ends_once(model):
    asked = _engine(model)
    request_id = asked.submit("speech", instruction="open the drawer")
    events = _run(asked, [1])
    (request,) = asked.active_requests
    obs = observation(1)
    assert request.request_id == request_id and request.obs_seq == 1
    assert request.prompt_ids == ByteIO(model.config).prompt_ids(ON_DEMAND["prompt_template"],
                                                                        "open the drawer", obs.state)
    flushed, _ = asked.flush()
    events += flushed
    assert {e.request_id for e in events} == {request_id}
    (final,) = _finals(events)
    assert final.status == RequestStatus.COMPLETED and final.seq == 1 and len(final.token_ids) == 5
    assert asked.pool.num_used == 0
    # The same request triggered by an observation whose instruction is the submitted one decodes the
    # same tokens.
    triggered = _engine(model, [dict(ON_DEMAND, trigger={"every_n_frames": 1})])
    reference = triggered.run_cycle(observation(1, "open the drawer")).text_events
    reference += triggered.flush()[0]
    (expected,) = _finals(reference)
    assert final.token_ids == expected.token_ids


def test_submitted_prompt_template_replaces_the_tasks(model):
    engine = _engine(model)
    request_id = engine.submit("speech", prompt_template="Describe: {instruction}\n")
    engine.run_cycle(observation(1))
    (request,) = [r for r in engine.active_requests if r.request_id == request_id]
    processor = ByteIO(model.config)
    assert request.prompt_ids == processor.prompt_ids("Describe: {instruction}\n", "pick up the cube", None)
    assert _finals(engine.flush()[0])[0].status == RequestStatus.COMPLETED


def test_cancel_before_the_next_cycle_ends_it_without_an_observation(model):
    engine = _engine(model)
    request_id = engine.submit("speech")
    assert engine.cancel(request_id)
    events, _ = engine.take_events()
    (final,) = events
    assert (final.request_id, final.final, final.status, final.seq) == \
        (request_id, True, RequestStatus.CANCELLED, -1)
    assert not _run(engine, [1]) and not engine.active_requests     # it never starts
    assert not engine.cancel(request_id)


def test_cancel_while_decoding_and_cancel_task_with_submissions_waiting(model):
    engine = _engine(model, [dict(ON_DEMAND, max_new_tokens=40)])
    first = engine.submit("speech")
    events = _run(engine, [1])
    assert any(e.request_id == first and not e.final for e in events)
    assert engine.cancel(first)
    second = engine.submit("speech")
    assert engine.cancel_task("speech") == 1     # the waiting submission (the first is already cancelled)
    events = _run(engine, [2])
    finals = {e.request_id: e for e in _finals(events)}
    assert finals[first].status == RequestStatus.CANCELLED and finals[first].seq == 1
    assert finals[second].status == RequestStatus.CANCELLED and finals[second].seq == -1
    assert engine.pool.num_used == 0 and not engine.active_requests


def test_over_long_submitted_instruction_is_dropped_and_the_cycle_still_acts(model):
    engine = _engine(model)
    request_id = engine.submit("speech", instruction="x" * (model.config.max_token_len + 1))
    result = engine.run_cycle(observation(3))
    assert result.action.actions.shape[0] == model.config.action_horizon
    (final,) = _finals(result.text_events)
    assert (final.request_id, final.status, final.seq) == (request_id, RequestStatus.DROPPED, 3)


def test_invalid_submissions_are_refused_and_close_ends_the_waiting_ones(model):
    engine = _engine(model)
    with pytest.raises(KeyError):
        engine.submit("no_such_task")
    with pytest.raises(ValueError, match="instruction"):
        engine.submit("speech", prompt_template="no placeholder")
    waiting = engine.submit("speech")
    (final,) = engine.close()
    assert (final.request_id, final.status) == (waiting, RequestStatus.CANCELLED)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit("speech")


def test_a_template_with_an_unknown_field_is_refused_at_submission(model):
    """The template an ~/ask goal brings is checked when it is submitted: an unknown field, a positional
    field or an unbalanced brace never reaches a cycle."""
    engine = _engine(model)
    for template in ("Describe {instruction} in {language}", "{instruction} {}", "{instruction} {",
                     "{instruction.upper}", "{{instruction}}", "{state:{instruction}}", "{instruction!z}",
                     "{instruction:>99999999}"):
        with pytest.raises(ValueError, match="template"):
            engine.submit("speech", prompt_template=template)
    assert engine.active_requests == []
    assert engine.run_cycle(observation(1)).text_events == []


class _FailingPromptIO(ByteIO):
    """Byte prompts, except that building one for the instruction ``boom`` raises (a prompt builder's
    failure that no check at submission could see)."""

    def prompt_ids(self, template, instruction, state):
        if instruction == "boom":
            raise KeyError("boom")
        return super().prompt_ids(template, instruction, state)


def test_a_request_whose_prompt_fails_ends_alone_and_the_cycle_goes_on(model):
    """The unit of failure is the request: a submission whose prompt cannot be built ends as dropped
    with the reason; the cycle still acts, and a valid submission of the same cycle runs to its end."""
    engine = Engine(model, _FailingPromptIO(model.config), engine_config("unified", [ON_DEMAND]))
    bad = engine.submit("speech", instruction="boom")
    good = engine.submit("speech", instruction="open the drawer")
    result = engine.run_cycle(observation(3))
    assert result.action.actions.shape[0] == model.config.action_horizon
    (dropped,) = [e for e in _finals(result.text_events) if e.request_id == bad]
    assert dropped.status == RequestStatus.DROPPED and "KeyError" in dropped.reason and dropped.seq == 3
    events = result.text_events + _run(engine, [4, 5]) + engine.flush()[0]
    (final,) = [e for e in _finals(events) if e.request_id == good]
    assert final.status == RequestStatus.COMPLETED and len(final.token_ids) == 5
    assert len(engine.metrics_records.cycles) == 3 and engine.pool.num_used == 0


def test_submissions_from_other_threads_each_end_once(model):
    """Submit and cancel from a second thread while cycles run: every id gets exactly one final event."""
    engine = _engine(model, [dict(ON_DEMAND, max_new_tokens=3)])
    ids: list[int] = []
    done = threading.Event()

    def asker():
        for i in range(12):
            request_id = engine.submit("speech", instruction=f"question {i}")
            ids.append(request_id)
            if i % 3 == 0:
                engine.cancel(request_id)
        done.set()

    thread = threading.Thread(target=asker)
    thread.start()
    events, seq = [], 0
    while not done.is_set() or seq < 2:
        seq += 1
        events += engine.run_cycle(observation(seq)).text_events
    thread.join()
    events += _run(engine, [seq + 1])
    events += engine.flush()[0]
    finals = [e.request_id for e in _finals(events)]
    assert sorted(finals) == sorted(ids)
    assert engine.pool.num_used == 0
