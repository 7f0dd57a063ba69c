"""π0.5's subtask loop in the engine (oxygen_ros/engine/subtask.py): the source task's latest request that ended
on a stop token conditions the next cycle's action prompt; the plain prompt before it and after a new
instruction; truncated requests and questions with their own instruction give no subtask; with the loop off the
action chunk is the same as without it; configuration errors name the field."""

import numpy as np
import pytest
import torch

from oxygen_ros.engine import Engine, EngineConfig, RequestStatus
from oxygen_ros.engine.subtask import fill_subtask
from oxygen_ros.models import load_model
from engine_support import MEMORY, ByteIO, engine_config, observation

PLAIN = "Task: {instruction}, State: {state};\nAction: "
WITH_SUBTASK = "Task: {instruction}, Subtask: {subtask}, State: {state};\nAction: "
# Temperature sampling: the tiny random model's logits are so peaked that its text repeats one token up to
# temperature ~30; a seeded sample at 100 is as reproducible (each request's generator is seeded with
# seed + observation seq) and varies, so a stop token can end a request after some text.
SOURCE = {"name": "speech", "prompt_template": "Task: {instruction}, State: {state};\nSubtask: ",
          "trigger": {"on_new_instruction": True}, "max_new_tokens": 8, "stop_token_ids": [],
          "sampling": {"temperature": 100.0, "seed": 3}}
LOOP = {"prompt_template": PLAIN, "control_rate_hz": 0.1, "subtask_task": "speech",
        "subtask_prompt_template": WITH_SUBTASK}


@pytest.fixture(scope="module")
def model():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def _probe(model, instruction="pick up the cube", submit=False):
    """The tokens the source request of observation 0 generates without a stop token (seeded, so the same in
    every engine), triggered or (``submit``) asked with ``instruction``."""
    source = dict(SOURCE, trigger={}) if submit else SOURCE
    engine = Engine(model, ByteIO(model.config), engine_config("unified", [source]))
    if submit:
        engine.submit("speech", instruction=instruction)
    events = engine.run_cycle(observation(0, "pick up the cube" if submit else instruction)).text_events
    events += engine.flush()[0]
    ids = [e for e in events if e.final][0].token_ids
    assert len(ids) == SOURCE["max_new_tokens"], ids
    return ids


def _first_new(ids, start=1):
    """The first token at index ``start`` or later that did not come before it (a stop token that ends the
    request after ``start`` or more tokens of text)."""
    for k in range(start, len(ids)):
        if ids[k] not in ids[:k]:
            return ids[k]
    raise AssertionError(f"no new token in {ids}")


@pytest.fixture(scope="module")
def stop_token(model):
    """A token the source request generates after its first and not before: as its stop token the request
    ends on it, after some text."""
    return _first_new(_probe(model))


def _plain_ids(io, obs):
    return tuple(io.prompt_ids(PLAIN, obs.instruction, obs.state))


def _loop_engine(model, stop_token, mode="unified", engine=None, **source):
    stops = list(stop_token) if isinstance(stop_token, (list, tuple)) else [stop_token]
    tasks = [dict(SOURCE, stop_token_ids=stops, **source)]
    return Engine(model, ByteIO(model.config), engine_config(mode, tasks, action=LOOP, **(engine or {})))


def _run(engine, seqs, instruction="pick up the cube"):
    """(chunk, final text events) per cycle of observations ``seqs``."""
    out = []
    for seq in seqs:
        result = engine.run_cycle(observation(seq, instruction))
        out.append((result.action, [e for e in result.text_events if e.final]))
    return out


@pytest.mark.parametrize("mode", ["unified", "shared_prefix", "isolated"])
def test_a_completed_subtask_conditions_the_next_action_prompt(model, stop_token, mode):
    io = ByteIO(model.config)
    engine = _loop_engine(model, stop_token, mode)
    cycles = _run(engine, range(4))
    finals = [(i, e) for i, (_, events) in enumerate(cycles) for e in events]
    assert len(finals) == 1
    cycle, final = finals[0]
    assert final.status == RequestStatus.COMPLETED and final.token_ids[-1] == stop_token
    subtask = final.text.strip()
    assert subtask and engine.subtask.text == subtask and engine.subtask.updates == 1
    for i, (chunk, _) in enumerate(cycles):
        obs = observation(i)
        if i <= cycle:      # before the request ended: the plain prompt, no subtask
            assert chunk.subtask is None and chunk.prompt_ids == _plain_ids(io, obs)
        else:               # the next cycles: the template with {subtask} = the completed text
            want = io.prompt_ids(WITH_SUBTASK.replace("{subtask}", subtask.replace("{", "{{").replace("}", "}}")),
                                 obs.instruction, obs.state)
            assert chunk.subtask == subtask and chunk.prompt_ids == tuple(want)
    assert cycle < 3
    engine.close()


def test_the_subtask_prompt_changes_the_chunk_and_the_plain_prompt_does_not(model, stop_token):
    """Same observation, same noise: the loop before a subtask gives the loop-off chunk bit for bit; with a
    subtask the prompt (and so the chunk) differs. In the bidirectional model the action prompt and the speech
    prompt are different prefixes, so only the vision encoding is shared: one vision call per cycle."""
    off = Engine(model, ByteIO(model.config), engine_config("unified", [dict(SOURCE, stop_token_ids=[stop_token])]))
    on = _loop_engine(model, stop_token)
    off_cycles, on_cycles = _run(off, range(4)), _run(on, range(4))
    assert off.counters.vision_calls == on.counters.vision_calls == 4
    for (a, _), (b, _) in zip(off_cycles, on_cycles):
        assert a.subtask is None and a.prompt_ids == _plain_ids(ByteIO(model.config), observation(a.seq))
        if b.subtask is None:
            assert np.array_equal(a.actions, b.actions)
        else:
            assert b.prompt_ids != a.prompt_ids and not np.array_equal(a.actions, b.actions)
    assert on_cycles[-1][0].subtask is not None
    off.close()
    on.close()


def test_loop_off_keeps_the_action_prompt_and_the_sharing(model):
    """Without subtask_task nothing changes: the plain prompt every cycle and, with the speech task's prompt
    equal to the action prompt, one prefill shared by both (the counters of today's sharing)."""
    speech = dict(SOURCE, prompt_template=PLAIN, trigger={"every_n_frames": 1}, max_new_tokens=2)
    engine = Engine(model, ByteIO(model.config), engine_config("unified", [speech]))
    assert not engine.subtask.enabled
    for seq in range(3):
        chunk = engine.run_cycle(observation(seq)).action
        assert chunk.subtask is None and chunk.prompt_ids == _plain_ids(ByteIO(model.config), observation(seq))
    assert engine.counters.vision_calls == 3 and engine.counters.prefill_calls == 3
    assert engine.subtask.text is None and engine.subtask.updates == 0
    engine.close()


def test_a_new_instruction_clears_the_subtask(model, stop_token):
    io = ByteIO(model.config)
    engine = _loop_engine(model, stop_token)
    _run(engine, range(4))
    assert engine.subtask.text is not None
    obs = observation(4, "open the drawer")
    chunk = engine.run_cycle(obs).action
    assert chunk.subtask is None and chunk.prompt_ids == _plain_ids(io, obs)
    assert engine.subtask.text is None and engine.subtask.instruction == "open the drawer"
    engine.close()


def test_a_request_of_an_older_instruction_gives_no_subtask(model, stop_token):
    """The source request of instruction A still runs when B arrives (not cancelled): its completion
    belongs to A and leaves B without a subtask."""
    late = _first_new(_probe(model), start=2)    # one decode step per cycle: it ends in cycle 1 or later
    engine = _loop_engine(model, late, engine={"decode_steps_per_cycle": 1}, trigger={"every_n_frames": 1000})
    engine.run_cycle(observation(0, "pick up the cube"))          # frame 0 fires: one request for A
    finals = []
    for seq in range(1, 5):
        result = engine.run_cycle(observation(seq, "open the drawer"))
        finals += [e for e in result.text_events if e.final]
        assert result.action.subtask is None
    assert [(e.seq, e.status, e.token_ids[-1]) for e in finals] == [(0, RequestStatus.COMPLETED, late)]
    assert engine.subtask.text is None and engine.subtask.updates == 0
    engine.close()


def test_truncated_cancelled_and_asked_requests_give_no_subtask(model, stop_token):
    io = ByteIO(model.config)
    # truncated at max_new_tokens: completed, but not on a stop token
    engine = _loop_engine(model, _first_new(_probe(model), start=2), max_new_tokens=2)
    cycles = _run(engine, range(3))
    finals = [e for _, events in cycles for e in events]
    assert [e.status for e in finals] == [RequestStatus.COMPLETED] and len(finals[0].token_ids) == 2
    assert all(chunk.subtask is None for chunk, _ in cycles) and engine.subtask.text is None
    engine.close()
    # cancelled: a new instruction cancels the running request of the old one
    engine = _loop_engine(model, _first_new(_probe(model), start=2), engine={"decode_steps_per_cycle": 1},
                          cancel_on_new_instruction=True)
    engine.run_cycle(observation(0, "pick up the cube"))
    events = engine.run_cycle(observation(1, "open the drawer")).text_events
    assert [e.status for e in events if e.final and e.seq == 0] == [RequestStatus.CANCELLED]
    assert engine.subtask.text is None
    engine.close()


def test_a_question_with_its_own_instruction_gives_no_subtask(model, stop_token):
    """An Engine.submit with its own instruction (e.g. ~/ask) answers a question, even when it ends on a stop
    token; the same task's request without one is the robot's high-level inference."""
    io = ByteIO(model.config)
    asked = _probe(model, "what do you see?", submit=True)
    engine = _loop_engine(model, (stop_token, _first_new(asked)), trigger={})
    engine.submit("speech", instruction="what do you see?")
    cycles = _run(engine, range(4))
    finals = [e for _, events in cycles for e in events]
    assert len(finals) == 1 and finals[0].status == RequestStatus.COMPLETED
    assert finals[0].token_ids[-1] in (stop_token, _first_new(asked)) and finals[0].text.strip()
    assert engine.subtask.text is None
    assert all(chunk.subtask is None and chunk.prompt_ids == _plain_ids(io, observation(chunk.seq))
               for chunk, _ in cycles)
    engine.close()
    engine = _loop_engine(model, stop_token, trigger={})
    engine.submit("speech")
    cycles = _run(engine, range(4))
    assert engine.subtask.text is not None and cycles[-1][0].subtask == engine.subtask.text
    engine.close()


def test_the_causal_mask_shares_the_image_prefill(stop_token):
    """With the causal prompt mask the image KV is prefilled once per cycle and each prompt forks it: the
    action prompt with the subtask and the source task's prompt are two forks of one image node."""
    causal = load_model("pi05_tiny", dtype=torch.float32, seed=7)
    causal.config = causal.config.replace(prompt_mask="causal")
    stop = _first_new(_probe(causal))
    io = ByteIO(causal.config)
    tasks = [dict(SOURCE, stop_token_ids=[stop], trigger={"every_n_frames": 1})]
    engine = Engine(causal, ByteIO(causal.config),
                    engine_config("unified", tasks, action=LOOP, decode_steps_per_cycle=1))
    checked = 0
    for seq in range(4):
        obs = observation(seq)
        before = engine.counters.prefilled_tokens
        chunk = engine.run_cycle(obs).action
        if chunk.subtask is None:
            continue
        # one image block, then the action prompt with the subtask and the speech prompt on top of it
        speech_ids = io.prompt_ids(SOURCE["prompt_template"], obs.instruction, obs.state)
        assert engine.counters.prefilled_tokens - before == \
            2 * causal.config.num_image_tokens + len(chunk.prompt_ids) + len(speech_ids)
        checked += 1
    assert checked and engine.counters.vision_calls == 4
    engine.close()


def test_braces_in_a_subtask_stay_literal():
    assert fill_subtask(WITH_SUBTASK, "x{y}").format(instruction="i", state="s") == \
        "Task: i, Subtask: x{y}, State: s;\nAction: "
    assert fill_subtask(WITH_SUBTASK, "grasp the cube") == WITH_SUBTASK.replace("{subtask}", "grasp the cube")


@pytest.mark.parametrize("action, tasks, message", [
    ({"subtask_task": "speech", "subtask_prompt_template": WITH_SUBTASK}, [MEMORY],
     "action.subtask_task: no language task named 'speech' (language tasks: ['memory'])"),
    ({"subtask_task": "memory", "subtask_prompt_template": WITH_SUBTASK}, [MEMORY],
     "action.subtask_task: 'memory' is a memory task"),
    ({"subtask_task": "speech"}, [SOURCE], "action.subtask_prompt_template is empty"),
    ({"subtask_task": "speech", "subtask_prompt_template": PLAIN}, [SOURCE],
     "action.subtask_prompt_template must contain {subtask}"),
    ({"subtask_prompt_template": "Subtask: {subtask}"}, [SOURCE],
     "action.subtask_prompt_template must contain {instruction}"),
])
def test_configuration_errors_name_the_field(action, tasks, message):
    with pytest.raises(ValueError) as error:
        EngineConfig.from_dict({"camera_slots": ["base_0_rgb"], "action": dict(action, prompt_template=PLAIN),
                                "language_tasks": tasks})
    assert message in str(error.value)
