"""Memory policy (admission, drop, wait, preemption, cancel), triggers, sampling, streaming,
fixed-k and deadline scheduling. No wall-clock assertions."""

import dataclasses
import time

import numpy as np
import pytest
import torch

from oxygen_ros.engine import Engine, EngineConfig, RequestStatus
from oxygen_ros.models import load_model
from engine_support import MEMORY, SPEECH, ByteIO, engine_config, observation

ONE_CAM = ("left_wrist_0_rgb",)


@pytest.fixture(scope="module")
def model():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def _engine(model, tasks, **overrides):
    return Engine(model, ByteIO(model.config), engine_config("unified", tasks, **overrides))


def _statuses(events):
    return {e.request_id: e.status for e in events if e.final}


def test_pool_returns_to_empty_and_pages_free_at_once(model):
    engine = _engine(model, [SPEECH])
    for seq in range(3):
        engine.run_cycle(observation(seq, masked=ONE_CAM))
    assert engine.pool.num_used > 0                     # requests still decoding hold pages
    running = [r for r in engine.active_requests if r.status == RequestStatus.RUNNING]
    used = engine.pool.num_used
    assert engine.cancel(running[-1].request_id)
    assert engine.pool.num_used < used                  # freed at once, not at the next cycle
    events, _ = engine.flush()
    assert engine.pool.num_used == 0 and not engine.active_requests
    assert RequestStatus.CANCELLED in _statuses(events).values()
    assert engine.metrics()["peak_pool_bytes"] <= engine.metrics()["pool_capacity_bytes"]


def test_too_small_budget_drops_or_waits_while_every_cycle_acts(model):
    probe = _engine(model, [])
    reserve = probe._action_reserve  # pages kept for the action task
    page = probe.pool.bytes_per_block
    # Room for the action reserve plus a bit more than one speech request.
    budget = (reserve + 22) * page
    for policy in ("drop", "wait"):
        task = dict(SPEECH, admission=policy, max_new_tokens=12, max_wait_s=0.25)
        engine = _engine(model, [task], kv_budget_mb=budget / 2**20, decode_steps_per_cycle=1)
        events = []
        for seq in range(6):
            result = engine.run_cycle(observation(seq, masked=ONE_CAM))
            assert result.action.actions.shape == (model.config.action_horizon, 32)
            assert engine.pool.num_used <= engine.pool.num_blocks
            events += result.text_events
        events += engine.flush()[0]
        statuses = list(_statuses(events).values())
        assert len(statuses) == 6                        # every request ended with a status
        assert RequestStatus.DROPPED in statuses and RequestStatus.COMPLETED in statuses
        assert engine.pool.num_used == 0


def test_higher_priority_preempts(model):
    low = dict(SPEECH, name="chatter", priority=0, max_new_tokens=20)
    # The pool holds one request at a time: alarm(0) runs first (priority), chatter(0) then runs,
    # and alarm(3) must preempt it.
    high = dict(SPEECH, name="alarm", priority=5, max_new_tokens=2,
                trigger={"every_n_frames": 3})
    probe = _engine(model, [])
    budget = (probe._action_reserve + 26) * probe.pool.bytes_per_block
    engine = _engine(model, [low, high], kv_budget_mb=budget / 2**20, decode_steps_per_cycle=1)
    events = []
    for seq in range(4):
        events += engine.run_cycle(observation(seq, masked=ONE_CAM)).text_events
    events += engine.flush()[0]
    by_task = {(e.task, e.seq): e.status for e in events if e.final}
    assert RequestStatus.PREEMPTED in [s for (t, _), s in by_task.items() if t == "chatter"]
    assert by_task[("alarm", 0)] == by_task[("alarm", 3)] == RequestStatus.COMPLETED


def test_new_instruction_cancels_speech(model):
    task = dict(SPEECH, max_new_tokens=30, cancel_on_new_instruction=True,
                trigger={"on_new_instruction": True})
    engine = _engine(model, [task])
    first = engine.run_cycle(observation(0, masked=ONE_CAM))
    assert len(engine.active_requests) == 1
    second = engine.run_cycle(observation(1, instruction="stop", masked=ONE_CAM))
    final = [e for e in second.text_events if e.final]
    assert [e.status for e in final] == [RequestStatus.CANCELLED]
    assert final[0].seq == 0 and len(engine.active_requests) == 1
    assert not [e for e in first.text_events if e.final]
    engine.close()
    assert engine.pool.num_used == 0
    with pytest.raises(RuntimeError):
        engine.run_cycle(observation(2))


def test_streaming_partial_events_add_up_to_the_final_text(model):
    engine = _engine(model, [dict(SPEECH, max_new_tokens=5)])
    events = engine.run_cycle(observation(0, masked=ONE_CAM)).text_events
    events += engine.flush()[0]
    partial = [e for e in events if not e.final]
    final = [e for e in events if e.final]
    assert len(final) == 1 and final[0].status == RequestStatus.COMPLETED
    assert "".join(e.delta for e in partial + final) == final[0].text
    assert len(final[0].token_ids) == 5


def test_fixed_k_runs_exactly_k_steps_per_cycle(model):
    engine = _engine(model, [dict(SPEECH, max_new_tokens=30)], decode_steps_per_cycle=3)
    for seq in range(3):
        record = engine.run_cycle(observation(seq, masked=ONE_CAM)).record
        assert record.decode_steps == 3
        assert record.batch_sizes == [seq + 1] * 3      # cross-frame continuous batching
    engine.close()


def test_deadline_mode_spends_only_the_slack(model):
    engine = _engine(model, [dict(SPEECH, max_new_tokens=30)], scheduling="deadline",
                     min_decode_steps_per_cycle=0)
    # A deadline already past: the action chunk still comes out, no decode step is taken.
    record = engine.run_cycle(observation(0, masked=ONE_CAM), deadline=time.perf_counter()).record
    assert record.decode_steps == 0 and record.deadline_missed
    # A generous deadline: decode steps run (and are measured for the estimate).
    record = engine.run_cycle(observation(1, masked=ONE_CAM),
                              deadline=time.perf_counter() + 60.0).record
    assert record.decode_steps > 0
    assert engine._estimator.estimate_decode(2) is not None
    engine.close()


def test_overloaded_control_loop_still_advances_language_by_the_minimum_steps(model):
    engine = _engine(model, [dict(SPEECH, max_new_tokens=4)], scheduling="deadline")
    assert engine.config.min_decode_steps_per_cycle == 1
    finals = []
    for seq in range(8):   # every deadline already past: no slack at all
        result = engine.run_cycle(observation(seq, masked=ONE_CAM), deadline=time.perf_counter())
        assert result.record.decode_steps == 1 and result.action is not None
        finals += [e for e in result.text_events if e.final]
    assert finals and all(e.status == RequestStatus.COMPLETED for e in finals)
    engine.close()


@pytest.mark.parametrize("tasks", [[dict(SPEECH, max_new_tokens=3)],
                                   [dict(SPEECH, max_new_tokens=3), MEMORY]])
def test_overloaded_control_loop_still_admits_language_with_its_own_prefill(model, tasks):
    # Every language prompt here differs from the action prompt ("... Subtask: "), so each request
    # needs its own prefill, which no slack pays for: before the guaranteed minimum admission,
    # every such request waited until max_wait_s dropped it (language vanished under overload).
    tasks = [dict(task, prompt_template="Task: {instruction}. Subtask: ", max_wait_s=1e9)
             for task in tasks]
    engine = _engine(model, tasks, scheduling="deadline")
    assert engine.config.min_admissions_per_cycle == 1
    events = []
    for seq in range(12):   # every deadline already past: no slack at all
        result = engine.run_cycle(observation(seq, masked=ONE_CAM), deadline=time.perf_counter())
        assert result.record.overloaded and result.action is not None
        assert engine._scheduler.forced_admissions <= 1      # the minimum, not more
        events += result.text_events
    triggered = {e.request_id for e in events} | {r.request_id for r in engine.active_requests}
    finals = [e for e in events if e.final]
    assert finals and all(e.status == RequestStatus.COMPLETED for e in finals)
    assert engine.metrics()["overloaded_cycles"] == 12
    # Nothing was lost: the rest complete once there is time, each with one final event.
    finals += [e for e in engine.flush()[0] if e.final]
    assert len(finals) == len(triggered) and {e.request_id for e in finals} == triggered
    assert all(e.status == RequestStatus.COMPLETED for e in finals)
    engine.close()


def test_guaranteed_admission_can_be_turned_off(model):
    task = dict(SPEECH, prompt_template="Task: {instruction}. Subtask: ", max_wait_s=0.25)
    engine = _engine(model, [task], scheduling="deadline", min_admissions_per_cycle=0)
    events = []
    for seq in range(6):
        events += engine.run_cycle(observation(seq, masked=ONE_CAM),
                                   deadline=time.perf_counter()).text_events
    # Without the minimum, no slack means no admission: each request waits until its task's
    # max_wait_s drops it (the behaviour the minimum exists to prevent).
    finals = [e for e in events if e.final]
    assert finals and all(e.status == RequestStatus.DROPPED for e in finals)
    engine.close()


def test_triggers_and_seeded_sampling(model):
    sampled = dict(SPEECH, name="sampled", trigger={"every_s": 0.25},
                   sampling={"temperature": 1.0, "seed": 3})
    runs = []
    for _ in range(2):
        engine = _engine(model, [sampled])
        events = []
        for seq in range(4):       # stamps 0.0, 0.1, 0.2, 0.3 s -> fires at 0.0 and 0.3
            events += engine.run_cycle(observation(seq, masked=ONE_CAM)).text_events
        events += engine.flush()[0]
        runs.append({e.seq: e.token_ids for e in events if e.final})
    assert sorted(runs[0]) == [0, 3]
    assert runs[0] == runs[1]


def test_warm_up_leaves_no_trace(model):
    """A warmed-up engine then runs exactly like a fresh one: same chunks, same text, same
    triggers (the first real observation still counts as a new instruction), nothing pooled."""
    speech_on_instruction = {**SPEECH, "trigger": {"on_new_instruction": True}}
    warm, fresh = _engine(model, [speech_on_instruction]), _engine(model, [speech_on_instruction])
    assert warm.warm_up(observation(99)) > 0
    assert warm.pool.num_used == 0 and warm.pool.peak_used_bytes == 0 and warm.counters.vision_calls == 1
    assert warm.metrics()["frames"] == 0 and not warm.active_requests
    events = []
    for seq in range(3):
        a, b = warm.run_cycle(observation(seq)), fresh.run_cycle(observation(seq))
        assert np.array_equal(a.action.actions, b.action.actions)
        assert [(e.task, e.delta, e.final) for e in a.text_events] == \
            [(e.task, e.delta, e.final) for e in b.text_events]
        events += a.text_events
    assert [e.task for e in events if e.final] == ["speech"]    # fired by the first real instruction
    warm.close()
    with pytest.raises(RuntimeError, match="closed"):
        warm.warm_up(observation(5))


def test_config_validation_and_yaml(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("mode: shared_prefix\ncamera_slots: [a, b]\nlanguage_tasks:\n"
                    "  - {name: speech, prompt_template: '{instruction}', "
                    "trigger: {every_n_frames: 2}, stop_token_ids: [1, 7]}\n")
    config = EngineConfig.from_yaml(path)
    assert config.mode == "shared_prefix" and config.task("speech").stop_token_ids == (1, 7)
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig.from_dict({"modes": "unified"})
    with pytest.raises(ValueError, match="mode"):
        EngineConfig.from_dict({"mode": "fast"})
    with pytest.raises(ValueError, match="trigger is required"):
        EngineConfig.from_dict({"language_tasks": [{"name": "x", "prompt_template": "{instruction}"}]})
    # An empty trigger: the task runs only on request (Engine.submit; test_engine_submit.py).
    on_request = EngineConfig.from_dict({"language_tasks": [{"name": "x", "prompt_template": "{instruction}",
                                                             "trigger": {}}]}).task("x").trigger
    assert (on_request.every_n_frames, on_request.every_s, on_request.on_new_instruction) == (None, None, False)
    with pytest.raises(ValueError, match="unique"):
        dataclasses.replace(config, language_tasks=config.language_tasks * 2)
    for bad, where in (({"cuda_graphs": "no"}, "cuda_graphs"),
                       ({"language_tasks": [{"name": "x", "prompt_template": "{instruction}",
                                             "trigger": {"on_new_instruction": "false"}}]}, "on_new_instruction")):
        with pytest.raises(ValueError, match=where):
            EngineConfig.from_dict(bad)


def test_bad_observation_is_a_clear_error(model):
    engine = _engine(model, [])
    with pytest.raises(ValueError, match="no camera"):
        engine.run_cycle(observation(0, masked=("base_0_rgb", "left_wrist_0_rgb")))
    obs = observation(1)
    obs.images = {"top": obs.images["base_0_rgb"]}
    with pytest.raises(ValueError, match="not in camera_slots"):
        engine.run_cycle(obs)


def test_step_cost_estimate_is_online_and_conservative():
    from oxygen_ros.engine.scheduler import StepCostEstimator

    estimator = StepCostEstimator(quantile=0.9, window=4)
    assert estimator.estimate_decode(4) is None and estimator.estimate_prefill(10) is None
    assert estimator.fitting_batch(6, 1.0) == 1          # nothing measured: learn with one request
    for seconds in (0.010, 0.010, 0.010, 0.020):
        estimator.observe_decode(2, seconds)
    assert estimator.estimate_decode(2) == pytest.approx(0.017)       # p90 of the window
    for seconds in (0.010, 0.010, 0.010, 0.010):
        estimator.observe_decode(2, seconds)                          # the outlier left the window
    assert estimator.estimate_decode(2) == pytest.approx(0.010)
    assert estimator.estimate_decode(1) == pytest.approx(0.010)       # nearest larger measured
    assert estimator.estimate_decode(8) == pytest.approx(0.040)       # linear above the largest
    assert estimator.fitting_batch(8, 0.025) == 5                     # 5 x 0.005 fits, 6 not
    assert estimator.fitting_batch(8, 0.001) == 0
    estimator.observe_decode(8, 0.020)
    assert estimator.estimate_decode(5) == pytest.approx(0.020)
    estimator.observe_prefill(100, 0.5)
    assert estimator.estimate_prefill(10) == pytest.approx(0.05)


@pytest.mark.parametrize("mode", ["unified", "shared_prefix"])
@pytest.mark.parametrize("prompt", ["Task: {instruction}. Subtask: ",
                                    "Task: {instruction}, State: {state};\nAction: "])
def test_same_prompt_speech_and_memory_share_one_prefix_with_both_needs(model, mode, prompt):
    # Speech listed first: its prefix job (no pooled state) must not shadow memory's need.
    speech = dict(SPEECH, prompt_template=prompt, max_new_tokens=3)
    memory = dict(SPEECH, name="memory", kind="memory", prompt_template=prompt, max_new_tokens=3)
    engine = Engine(model, ByteIO(model.config),
                    engine_config(mode, [speech, memory], decode_steps_per_cycle=3))
    entries = []
    for seq in range(2):
        result = engine.run_cycle(observation(seq, masked=ONE_CAM))
        entries += result.memory_entries
    entries += engine.flush()[1]
    assert [e.seq for e in entries] == [0, 1]
    for entry in entries:
        assert entry.embedding is not None and entry.embedding.shape == (model.config.vlm_width,)


def test_metrics_records_are_bounded_and_totals_stay_exact():
    from oxygen_ros.engine.metrics import CycleRecord, EngineMetrics, RequestRecord

    def cycle(seq):
        return CycleRecord(seq=seq, frame_latency_s=0.1 + 0.001 * seq, action_latency_s=0.05,
                           encode_s=0.01, prefill_s=0.02, denoise_s=0.02, decode_s=0.03,
                           decode_steps=2, batch_sizes=[seq % 4 + 1, 1], vision_calls=1,
                           images_encoded=2, prefilled_tokens=100, generated_tokens=3,
                           deadline_missed=seq % 5 == 0, pool_used_bytes=1000 * (seq % 7))

    window, total = 8, 100
    metrics = EngineMetrics(action_horizon=10, pool_capacity_bytes=10**6, window=window)
    records = [cycle(seq) for seq in range(total)]
    for seq, record in enumerate(records):
        metrics.add_cycle(record)
        metrics.add_request(RequestRecord(seq, "speech", "completed" if seq % 3 else "dropped",
                                          3, 0.01 * seq, 0.02 * seq))
    assert len(metrics.cycles) == window and len(metrics.requests) == window
    assert [c.seq for c in metrics.cycles] == list(range(total - window, total))
    summary = metrics.summary()
    busy = sum(r.frame_latency_s for r in records)
    batches = [b for r in records for b in r.batch_sizes]
    assert summary["frames"] == total
    assert summary["frame_latency_s"]["mean"] == pytest.approx(busy / total)
    assert summary["action_rate_hz"] == pytest.approx(10 * total / busy)
    assert summary["tokens_per_s"] == pytest.approx(3 * total / busy)
    assert summary["deadline_misses"] == sum(r.deadline_missed for r in records)
    assert summary["mean_batch_size"] == pytest.approx(sum(batches) / len(batches))
    assert summary["max_batch_size"] == 4
    assert summary["mean_decode_steps_per_frame"] == pytest.approx(2.0)
    assert summary["phase_mean_s"]["decode_s"] == pytest.approx(0.03)
    assert summary["requests_by_status"] == {"completed": 66, "dropped": 34}
    assert summary["peak_pool_bytes"] == 6000
    assert summary["window"] == {"size": window, "cycles": window, "requests": window}
    # Percentiles cover the window only.
    assert summary["frame_latency_s"]["p50"] == pytest.approx(
        float(np.median([r.frame_latency_s for r in records[-window:]])))
    metrics.reset()
    assert metrics.summary()["frames"] == 0 and not metrics.cycles and not metrics.requests
    with pytest.raises(ValueError):
        EngineMetrics(10, 10**6, window=0)


def test_engine_metrics_window_comes_from_the_config(model):
    engine = _engine(model, [dict(SPEECH, max_new_tokens=1)], metrics_window=3)
    for seq in range(5):
        engine.run_cycle(observation(seq, masked=ONE_CAM))
    assert len(engine.metrics_records.cycles) == 3 and len(engine.metrics_records.requests) == 3
    summary = engine.metrics()
    assert summary["frames"] == 5 and summary["requests_by_status"] == {"completed": 5}
    engine.reset_metrics()
    assert engine.metrics()["frames"] == 0
