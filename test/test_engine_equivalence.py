"""unified == isolated: same action chunks and greedy text; sharing is real (work counters)."""

import numpy as np
import torch

from oxygen_ros.engine import Engine, RequestStatus
from oxygen_ros.models.reference import reference_generate
from engine_support import MEMORY, SPEECH, ByteIO, engine_config, observation

FRAMES = 20


_RUNS = {}


def _run(model, mode, frames=FRAMES):
    """Run (and memoise: several tests read the same run) ``frames`` cycles in ``mode``."""
    key = (id(model), mode, frames)
    if key not in _RUNS:
        _RUNS[key] = _fresh_run(model, mode, frames)
    return _RUNS[key]


def _fresh_run(model, mode, frames):
    engine = Engine(model, ByteIO(model.config),
                    engine_config(mode, [SPEECH, MEMORY]))
    actions, records, events = [], [], []
    for seq in range(frames):
        # Every third frame has its wrist camera masked.
        result = engine.run_cycle(observation(seq, masked=("left_wrist_0_rgb",) if seq % 3 else ()))
        actions.append(result.action.actions)
        records.append(result.record)
        events += result.text_events
    events += engine.flush()[0]
    final = {(e.task, e.seq): e for e in events if e.final}
    return engine, actions, records, final


def test_unified_equals_isolated(model):
    _, iso_actions, _, iso_text = _run(model, "isolated")
    _, uni_actions, uni_records, uni_text = _run(model, "unified")
    assert len(iso_actions) == len(uni_actions) == FRAMES
    for a, b in zip(iso_actions, uni_actions):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert set(iso_text) == set(uni_text)
    assert len(uni_text) == FRAMES + FRAMES // 2       # speech every frame, memory every 2nd
    for key, event in iso_text.items():
        assert event.status == uni_text[key].status == RequestStatus.COMPLETED
        assert event.token_ids == uni_text[key].token_ids, key
    # unified really batched requests of different frames together.
    assert max(b for r in uni_records for b in r.batch_sizes) > 1


def test_greedy_text_matches_the_cache_free_reference(model):
    """The first speech request's tokens equal the model's own cache-free greedy decoding."""
    _, _, _, text = _run(model, "unified", frames=1)
    obs = observation(0)
    proc = ByteIO(model.config)
    images = [obs.images[s] for s in ("base_0_rgb", "left_wrist_0_rgb")]
    features = model.encode_images(proc.images_to_pixels(images))
    ids = torch.tensor([proc.prompt_ids(SPEECH["prompt_template"], obs.instruction, obs.state)])
    embeds = torch.cat((features.reshape(1, -1, features.shape[-1]), model.embed_tokens(ids)), 1)
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
    reference = reference_generate(model, embeds, mask, SPEECH["max_new_tokens"])
    assert text[("speech", 0)].token_ids == reference[0].tolist()


def test_sharing_counters(model):
    _, _, records, _ = _run(model, "unified")
    _, _, iso_records, _ = _run(model, "isolated")
    proc = ByteIO(model.config)
    for seq, (uni, iso) in enumerate(zip(records, iso_records)):
        obs = observation(seq, masked=("left_wrist_0_rgb",) if seq % 3 else ())
        image_tokens = 256 * sum(v is not None for v in obs.images.values())
        action = len(proc.prompt_ids(SPEECH["prompt_template"], obs.instruction, obs.state))
        memory = len(proc.prompt_ids(MEMORY["prompt_template"], obs.instruction, obs.state))
        memory_fires = seq % 2 == 0
        # unified: one vision call; speech shares the action prefix; memory has its own prompt.
        assert uni.vision_calls == 1
        assert uni.prefilled_tokens == image_tokens + action + memory_fires * (image_tokens + memory)
        # isolated: one vision call and one full prefill per task.
        assert iso.vision_calls == 2 + memory_fires
        assert iso.prefilled_tokens == 2 * (image_tokens + action) + \
            memory_fires * (image_tokens + memory)


def test_causal_prompt_prefills_images_once_and_forks(causal_model):
    engine, uni_actions, records, uni_text = _run(causal_model, "unified", frames=4)
    _, iso_actions, _, iso_text = _run(causal_model, "isolated", frames=4)
    proc = ByteIO(causal_model.config)
    for seq, record in enumerate(records):
        obs = observation(seq, masked=("left_wrist_0_rgb",) if seq % 3 else ())
        image_tokens = 256 * sum(v is not None for v in obs.images.values())
        action = len(proc.prompt_ids(SPEECH["prompt_template"], obs.instruction, obs.state))
        memory = len(proc.prompt_ids(MEMORY["prompt_template"], obs.instruction, obs.state))
        assert record.vision_calls == 1
        assert record.prefilled_tokens == image_tokens + action + (seq % 2 == 0) * memory
    for a, b in zip(iso_actions, uni_actions):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for key, event in iso_text.items():
        assert event.token_ids == uni_text[key].token_ids
    assert engine.pool.num_used == 0
