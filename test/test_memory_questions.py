"""The demo's question set (oxygen_ros/demo_task/questions.py): ground truth and questions from hand-made simulator
samples, answer parsing and scoring, the copy rule (answer_from_lines), the QA fine-tune's generated examples
(training/qa.py), the evaluation's scores (tools/memory_eval.py) and the shipped question set. No rclpy, no model."""
from __future__ import annotations

import json
import random
import re

import pytest

from oxygen_ros.demo_task import questions as qs

T0 = 1_796_500_000.0
ON_RIGHT = "the cube is on the right of the table"
RIGHT_TABLE = "the right gripper holds the cube on the table"
RIGHT_AIR = "the right gripper holds the cube in the air"
BOTH = "both grippers hold the cube"
LEFT_AIR = "the left gripper holds the cube in the air"


def timeline(*segments: tuple[float, str], step: float = 0.02) -> list[dict]:
    """Samples every ``step`` s from ``T0``: each segment ``(duration [s], caption)`` in turn."""
    samples, t = [], 0.0
    for duration, caption in segments:
        end = t + duration
        while t < end - 1e-9:
            samples.append({"t": T0 + t, "caption": caption})
            t = round(t + step, 6)
    return samples


HANDED_OVER = timeline((3.0, ON_RIGHT), (1.0, RIGHT_TABLE), (5.0, RIGHT_AIR), (1.0, BOTH), (4.0, LEFT_AIR))


def test_truth_of_a_hand_over():
    truth = qs.episode_truth(HANDED_OVER)
    assert truth.start_side == "right"
    assert truth.first_grasp_s == pytest.approx(T0 + 3.0)
    assert truth.carried_until_s == pytest.approx(T0 + 8.98)     # the last sample of the carry
    assert truth.last_holder == "left"


def test_truth_ignores_a_flicker_and_a_cube_never_carried():
    # a right grasp that flickers for 0.1 s in the air after it was only held on the table: no carry, last holder right
    samples = timeline((2.0, "the cube is on the middle of the table"), (2.0, RIGHT_TABLE), (0.1, RIGHT_AIR),
                       (0.04, LEFT_AIR), (3.0, "the cube is on the left of the table"))
    truth = qs.episode_truth(samples)
    assert truth.start_side == "middle"
    assert truth.carried_until_s is None
    assert truth.last_holder == "right"
    never = qs.episode_truth(timeline((10.0, ON_RIGHT)))
    assert (never.first_grasp_s, never.carried_until_s, never.last_holder) == (None, None, "none")


@pytest.mark.parametrize("samples, message", [
    ([], "no ground truth"),
    ([{"t": 2.0, "caption": ON_RIGHT}, {"t": 1.0, "caption": ON_RIGHT}], "time order"),
    ([{"t": 1.0, "caption": RIGHT_AIR}], "does not start with the cube on the table"),
])
def test_bad_samples_are_refused(samples, message):
    with pytest.raises(ValueError, match=message):
        qs.episode_truth(samples)


def test_questions_of_an_episode():
    entries = [(f"e{i}", T0 + 1.0 + 2.0 * i, qs.truth_at(HANDED_OVER, T0 + 1.0 + 2.0 * i)) for i in range(7)]
    # stamps 1, 3, 5, 7, 9, 11, 13 s: on the table, right on the table, right in the air x2, both, left x2
    questions = {q.type: q for q in qs.episode_questions("7", HANDED_OVER, entries, random.Random(3))}
    assert set(questions) == set(qs.QUESTION_TYPES)
    assert questions["start"].answer == "right" and questions["start"].relevant == ("e0",)
    assert questions["carried"].answer == qs.time_answer(T0 + 8.98) == "t=1796500008"
    assert questions["carried"].relevant == ("e2", "e3")
    assert questions["last"].answer == "left" and questions["last"].relevant == ("e5", "e6")
    at = questions["holder_at"]
    assert at.time_s in [float(int(stamp)) for _, stamp, _ in entries]
    assert at.text == "which gripper held the cube {ago}?"
    assert at.ask_text(at.time_s + 12.4) == "which gripper held the cube 12 s ago?"
    assert questions["start"].ask_text(T0 + 99.0) == questions["start"].text
    moved = questions["carried"].shifted(100.0)
    assert (moved.time_s, moved.answer) == (T0 + 108.98, "t=1796500108") and moved.relevant == ("e2", "e3")
    assert questions["last"].shifted(100.0) == questions["last"]
    assert at.answer == qs.holder_at(HANDED_OVER, at.time_s)
    assert all(abs(dict((e, s) for e, s, _ in entries)[e] - at.time_s) <= 1.0 for e in at.relevant)
    assert qs.Question.from_json(json.loads(json.dumps(at.to_json()))) == at
    with pytest.raises(ValueError, match="no memory entries"):
        qs.episode_questions("7", HANDED_OVER, [], random.Random(0))


@pytest.mark.parametrize("text, parsed", [
    ("right", "right"), (" Right.", "right"), ("t=1796500008", "t=1796500008"), ("at t = 1796500008.4s", "t=1796500008"),
    ("", ""), ("never", "never"), ("42", ""), ("12 s ago", "12 s ago"), (" 7 seconds ago.", "7 s ago"),
    ("at t=5, 12 s ago", "12 s ago"), ("12 s", "s"),
])
def test_parse_answer(text, parsed):
    assert qs.parse_answer(text) == parsed


def test_answer_correct():
    carried = qs.Question("7-carried", "7", "carried", qs.QUESTIONS["carried"], "t=1796500008", T0 + 8.98, ())
    now = T0 + 20.0
    assert qs.answer_correct(carried, "t=1796500011", now)          # within 3 s
    assert not qs.answer_correct(carried, "t=1796500012", now)
    assert qs.answer_correct(carried, "11 s ago", now)               # 1796500009: 0.02 s off
    assert qs.answer_correct(carried, "14 s ago", now) and not qs.answer_correct(carried, "15 s ago", now)
    assert qs.answer_correct(carried, "9 s ago", now) and not qs.answer_correct(carried, "8 s ago", now)
    assert qs.answer_time("11 s ago", now) == T0 + 9.0 and qs.answer_time("right", now) is None
    assert not qs.answer_correct(carried, "never", now)
    never = qs.Question("8-carried", "8", "carried", qs.QUESTIONS["carried"], "never", None, ())
    assert qs.answer_correct(never, "never", now) and not qs.answer_correct(never, "11 s ago", now)
    last = qs.Question("7-last", "7", "last", qs.QUESTIONS["last"], "left", None, ())
    assert qs.answer_correct(last, "left", now) and not qs.answer_correct(last, "right", now)
    assert not qs.answer_correct(last, "", now)


def test_precision_at_k():
    assert qs.precision_at_k(["a", "b", "c"], {"a", "c"}, 1) == 1.0
    assert qs.precision_at_k(["a", "b", "c"], {"a", "c"}, 3) == pytest.approx(2 / 3)
    assert qs.precision_at_k(["b"], {"a"}, 3) == 0.0
    assert qs.precision_at_k(["a"], set(), 3) is None and qs.precision_at_k([], {"a"}, 3) is None


def test_generated_training_examples_follow_the_copy_rule():
    from oxygen_ros.training import qa

    lines = [(T0 + 1.0, ON_RIGHT), (T0 + 5.0, RIGHT_AIR), (T0 + 7.0, RIGHT_AIR), (T0 + 9.1, BOTH)]
    q = {kind: qs.Question(f"x-{kind}", "x", kind, "", "", T0 + 7.0 if kind == "holder_at" else None, ())
         for kind in qs.QUESTION_TYPES}
    now = T0 + 19.6
    assert qs.answer_from_lines(q["start"], lines, now) == "right"
    assert qs.answer_from_lines(q["carried"], lines, now) == "13 s ago"     # 12.6 s before now
    assert qs.answer_from_lines(q["holder_at"], lines, now) == "right"
    assert qs.answer_from_lines(q["last"], lines, now) == "both"
    assert qs.answer_from_lines(q["carried"], lines[:1], now) == qs.NEVER
    assert qs.answer_from_lines(q["last"], lines[:1], now) == "none"
    examples = qa.make_examples(12, seed=5)
    assert len(examples) == 48
    assert {e.prompt for e in examples if "Memory: none" in e.prompt} == {qs.PROMPT_WITHOUT_MEMORY}
    for example in examples:
        assert example.answer and "{instruction}" in example.prompt
        if example.prompt != qs.PROMPT_WITHOUT_MEMORY:
            assert re.match(r"Memory: \d+ s ago: ", example.prompt) and example.prompt.count("; ") <= 2  # k = 3
        assert "{" not in example.question and not example.answer.startswith("t=")      # ages, asked after the end
    assert [e.answer for e in qa.make_examples(12, seed=5)] == [e.answer for e in examples]   # seeded


def test_scores_of_the_evaluation():
    from oxygen_ros.tools import memory_eval

    def row(kind, with_ok, without_ok, ranked, relevant):
        return {"type": kind, "answer": "right", "ranked": ranked, "relevant": relevant,
                "with_memory": {"correct": with_ok}, "without_memory": {"correct": without_ok}}

    rows = [row("start", True, False, ["a", "b", "c"], ["a"]), row("last", True, True, ["d", "e"], ["e"]),
            row("carried", False, False, ["f"], []), row("holder_at", True, False, ["g", "h", "i"], ["x"])]
    summary = memory_eval.score(rows, 3)
    s = summary["all"]
    assert (s["with_memory"]["right"], s["without_memory"]["right"], s["questions"]) == (3, 1, 4)
    assert s["difference"]["accuracy"] == pytest.approx(0.5)
    assert s["difference"]["ci95"][0] <= 0.5 <= s["difference"]["ci95"][1]
    assert s["p_at_1"] == pytest.approx(1 / 3)                     # a: yes, d: no, g: no (carried: no relevant)
    assert s["p_at_3"] == pytest.approx((1 / 3 + 1 / 2 + 0) / 3)
    assert s["hit_at_3"] == pytest.approx(2 / 3) and s["with_relevant_entries"] == 3
    assert summary["start"]["with_memory"]["ci95"][0] < 1.0
    assert s["best_constant"]["right"] == 4          # one question per type: its own answer is the most common
    assert "| all | 4 | 3 / 4 = 75 %" in memory_eval.format_table(summary, 3)


def test_the_shipped_question_set_is_consistent():
    """Every shipped question's answer is what the question module computes from the shipped ground truth, its
    episode's entries are there, and the set is large enough to measure (>= 60 questions)."""
    from oxygen_ros.tools.memory_eval import SHIPPED_QUESTIONS

    data = json.loads(SHIPPED_QUESTIONS.read_text())
    assert len(data["questions"]) >= 60
    episodes = {e["episode"]: e for e in data["episodes"]}
    for question in map(qs.Question.from_json, data["questions"]):
        episode = episodes[question.episode]
        ids = {e[0] for e in episode["entries"]}
        assert set(question.relevant) <= ids
        truth = episode["truth"]
        if question.type == "start":
            assert question.answer == truth["start_side"]
        elif question.type == "last":
            assert question.answer == truth["last_holder"]
        elif question.type == "carried":
            assert question.answer == (qs.NEVER if truth["carried_until_s"] is None
                                       else qs.time_answer(truth["carried_until_s"]))
        else:       # the caption in force at the time asked (the samples are 20 ms apart: a change at that time aside)
            changes = episode["caption_changes"]
            before = [c for c in changes if c["t"] <= question.time_s]
            in_force = before[-1] if before else changes[0]      # asked before the first sample: the first
            assert question.answer == qs.caption_holder(in_force["caption"]) or any(
                abs(c["t"] - question.time_s) <= 0.02 for c in changes)


def test_a_malformed_question_file_is_refused_before_any_node_starts(tmp_path, capsys):
    from pathlib import Path

    from oxygen_ros.assets import demo_policy_dir
    from oxygen_ros.tools import memory_eval

    shipped = memory_eval.read_question_set(memory_eval.SHIPPED_QUESTIONS)
    assert len(shipped["questions"]) == 96
    bad = {"empty.json": "{}", "text.json": "not json", "none.json": json.dumps({**shipped, "questions": []}),
           "orphan.json": json.dumps({**shipped, "questions": [{**shipped["questions"][0], "episode": "nowhere"}]}),
           "entries.json": json.dumps({**shipped, "episodes": [{**shipped["episodes"][0], "entries": [[1]]}]})}
    first = shipped["episodes"][0]
    bad["inf.json"] = json.dumps({**shipped, "episodes": [{**first, "entries": [["a", float("inf"), "x"]]},
                                                          *shipped["episodes"][1:]]})
    bad["nan_time.json"] = json.dumps({**shipped, "questions": [{**q, "time_s": float("nan")} if q["type"] ==
                                                                "holder_at" else q for q in shipped["questions"]]})
    bad["word_stamp.json"] = json.dumps({**shipped, "episodes": [{**first, "entries": [["a", "abc", "x"]]},
                                                                 *shipped["episodes"][1:]]})
    for name, text in bad.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path)):
            memory_eval.read_question_set(path)
        assert memory_eval.main(["--questions", str(path), "--checkpoint", str(Path(demo_policy_dir())),
                                 "--out", str(tmp_path / "out")]) == 2
        assert "error: --questions" in capsys.readouterr().err
