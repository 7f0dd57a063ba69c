"""tools/memory_eval.py end to end: a QA checkpoint from a short run of training/qa.py, the simulated robot and
the oxygen node over DDS, every question of a small hand-made set asked through ~/ask with and without {memory}
(slow: a model, a MuJoCo scene and a node). The measured figures are docs/memory.md's, not asserted here."""
from __future__ import annotations

import json

import pytest

from oxygen_ros.demo_task import questions as qs

pytestmark = [pytest.mark.ros, pytest.mark.dds, pytest.mark.slow]


def test_questions_asked_through_the_node_with_and_without_memory(tmp_path):
    from oxygen_ros.tools import memory_eval
    from oxygen_ros.training import qa

    import test_memory_questions as hand

    episodes = []
    for seed, samples in ((11, hand.HANDED_OVER), (12, hand.timeline((12.0, "the cube is on the middle of the table")))):
        samples = [{"t": s["t"] + 100.0 * seed, "caption": s["caption"]} for s in samples]
        entries = [(f"{seed}-{i}", samples[0]["t"] + 0.5 + 2.0 * i, qs.truth_at(samples, samples[0]["t"] + 0.5 + 2.0 * i))
                   for i in range(5)]
        episodes.append({"episode": str(seed), "seed": seed, "entries": entries, "samples": samples})
    question_set = memory_eval.build_question_set(episodes, "hand-made")
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps(question_set))
    qa.main(["--out", str(tmp_path / "qa"), "--steps", "2", "--episodes", "4", "--eval-episodes", "2",
             "--eval-samples", "2", "--image-sets", "1", "--log-every", "1"])
    checkpoint = tmp_path / "qa" / "checkpoint"
    assert json.loads((checkpoint / "demo_policy.json").read_text())["qa"]["steps"] == 2
    assert memory_eval.main(["--questions", str(questions), "--checkpoint", str(checkpoint),
                             "--out", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval" / "memory_eval.json").read_text())
    assert [row["qid"] for row in result["rows"]] == [q["qid"] for q in question_set["questions"]]
    for row in result["rows"]:
        # the node's {memory} held what recall gives for the question (the tool checks the ids; here: how many)
        assert 1 <= len(row["with_memory"]["memory_entry_ids"]) <= 3
        assert row["with_memory"]["memory_entry_ids"] == sorted(
            row["with_memory"]["memory_entry_ids"], key=lambda e: int(e.split("-")[1]))     # oldest first
    assert result["summary"]["all"]["questions"] == 8
