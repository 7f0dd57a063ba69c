"""Questions about a demo episode, with answers from the simulator's ground truth (docs/memory.md, "Measured:
answers with and without memory"). No rclpy, no model.

An episode's ground truth is the simulator's caption of the scene (:func:`oxygen_ros.demo_task.scene_caption`) sampled
every 20 ms on the node's clock (``tools/evaluate``'s real-time record, ``observed``: ``{"t", "caption", ...}``). The
questions are chosen so that their answer changes from episode to episode and is not in the camera frame when they
are asked (the scene has changed by then), and so that the answer is a word or an age that a memory line
(``<N> s ago: <caption>``, :func:`oxygen_ros.memory.prompt.memory_text`, ages at the time of asking) carries:

=============  ==========================================================  ==========================================
type           question                                                    answer
=============  ==========================================================  ==========================================
``start``      where on the table was the cube first seen?                 the side of the table the cube started on:
                                                                           ``right`` / ``middle`` / ``left`` (the
                                                                           captions' bins of its x: ±5 cm)
``carried``    when did the right gripper last hold the cube in the air?   ``<N> s ago`` at the time of asking (the end
                                                                           of its last carry), or ``never``; right
                                                                           within :data:`TIME_TOLERANCE_S`
``holder_at``  which gripper held the cube <N> s ago?                      ``right`` / ``left`` / ``both`` / ``none``
``last``       which gripper held the cube last?                           ``right`` / ``left`` / ``both`` / ``none``
=============  ==========================================================  ==========================================

A question's times are ages at the time of asking, the node clock's present when the ``~/ask`` goal fills
``{memory}`` (its result's ``memory_stamp``): the question set keeps absolute times (``time_s``, ``answer``
``t=<whole seconds>``) and :meth:`Question.ask_text` / :func:`answer_correct` turn them into ages and back.

The retrieval (:func:`oxygen_ros.memory.prompt.recall`) takes a question that names an age (``holder_at``) to the
entries nearest that time; for the others the question's words are the query, so each question carries caption
words that select the entries it needs (``table``, ``right gripper ... air``, ``gripper``): a question about the
first time (``start``) gets the oldest matching entries, the others the best BM25 matches, equal scores newest first
(what "last" questions need).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

from oxygen_ros.memory.prompt import age_text

QUESTION_TYPES = ("start", "carried", "holder_at", "last")
QUESTIONS = {
    "start": "where on the table was the cube first seen?",
    "carried": "when did the right gripper last hold the cube in the air?",
    "holder_at": "which gripper held the cube {ago}?",
    "last": "which gripper held the cube last?",
}
RIGHT_IN_AIR = "the right gripper holds the cube in the air"
SIDES = ("left", "middle", "right")
HOLDERS = ("right", "left", "both", "none")
NEVER = "never"
UNKNOWN = "unknown"
TIME_TOLERANCE_S = 3.0      # a time answer is right within this of the truth: the memory period (2 s) + rounding
MIN_RUN_S = 0.5             # a hold (or a lift) counts when the simulator shows it this long without a break [s]

# The prompts of the evaluation and of the QA training (tools/memory_eval.py, training/qa.py): with memory the
# node fills {memory}; without, the same prompt says there is none.
PROMPT_WITH_MEMORY = "Memory: {memory}\nQuestion: {instruction}\nAnswer: "
PROMPT_WITHOUT_MEMORY = "Memory: none\nQuestion: {instruction}\nAnswer: "
NO_MEMORY_TEXT = "none"


# ---------------------------------------------------------------------------------------------------
# captions


def caption_holder(caption: str) -> str:
    """Which gripper a caption says holds the cube: ``right`` / ``left`` / ``both`` / ``none`` (the captions of
    :func:`oxygen_ros.demo_task.scene_caption`; anything else: ``none``)."""
    text = " ".join(caption.lower().split())
    if text.startswith("both grippers hold"):
        return "both"
    for side in ("right", "left"):
        if text.startswith(f"the {side} gripper holds"):
            return side
    return "none"


def caption_side(caption: str) -> str | None:
    """The side of the table a caption puts the cube on (``the cube is on the <side> of the table``), else None."""
    match = re.fullmatch(r"the cube is on the (left|middle|right) of the table", " ".join(caption.lower().split()))
    return match.group(1) if match else None


# ---------------------------------------------------------------------------------------------------
# ground truth of one episode


@dataclasses.dataclass(frozen=True)
class Truth:
    """What the simulator says happened in one episode (times on the node clock [s]).

    Attributes:
        start_side: the side of the table the cube lay on at the start.
        first_grasp_s: when a gripper first held the cube (None: never).
        carried_until_s: when the right gripper last held the cube in the air, at the end of the last such hold of
            at least :data:`MIN_RUN_S` (None: never).
        last_holder: the last gripper (or ``both``) that held the cube for at least :data:`MIN_RUN_S`, ``none``.
        start_s, end_s: the first and last sample's time.
    """

    start_side: str
    first_grasp_s: float | None
    carried_until_s: float | None
    last_holder: str
    start_s: float
    end_s: float


def _runs(times: list[float], labels: list) -> list[tuple[object, float, float]]:
    """``(label, start, end)`` of each run of equal consecutive labels."""
    runs = []
    for t, label in zip(times, labels):
        if runs and runs[-1][0] == label:
            runs[-1][2] = t
        else:
            runs.append([label, t, t])
    return [tuple(r) for r in runs]


def episode_truth(samples: list[dict]) -> Truth:
    """The :class:`Truth` of an episode from its simulator samples (``{"t": s, "caption": str}`` in time order).

    Raises:
        ValueError: no samples, samples out of time order, or a first sample whose caption has no side (the cube
            must lie on the table, held by neither gripper, when the episode starts).
    """
    if not samples:
        raise ValueError("an episode without simulator samples has no ground truth")
    times = [float(s["t"]) for s in samples]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("the simulator samples are not in time order")
    captions = [str(s["caption"]) for s in samples]
    start_side = caption_side(captions[0])
    if start_side is None:
        raise ValueError(f"the episode does not start with the cube on the table: {captions[0]!r}")
    holders = [caption_holder(c) for c in captions]
    held = [t for t, h in zip(times, holders) if h != "none"]
    carried = [(start, end) for label, start, end in _runs(times, [" ".join(c.split()) == RIGHT_IN_AIR
                                                                   for c in captions])
               if label and end - start >= MIN_RUN_S]
    holds = [(label, start, end) for label, start, end in _runs(times, holders)
             if label != "none" and end - start >= MIN_RUN_S]
    return Truth(start_side=start_side, first_grasp_s=held[0] if held else None,
                 carried_until_s=carried[-1][1] if carried else None, last_holder=holds[-1][0] if holds else "none",
                 start_s=times[0], end_s=times[-1])


def holder_at(samples: list[dict], t: float) -> str:
    """The holder (:func:`caption_holder`) of the sample nearest ``t``."""
    i = min(range(len(samples)), key=lambda j: abs(float(samples[j]["t"]) - t))
    return caption_holder(samples[i]["caption"])


def truth_at(samples: list[dict], t: float) -> str:
    """The caption of the sample nearest ``t`` (an entry's ground truth at its stamp)."""
    return samples[min(range(len(samples)), key=lambda j: abs(float(samples[j]["t"]) - t))]["caption"]


# ---------------------------------------------------------------------------------------------------
# questions


@dataclasses.dataclass(frozen=True)
class Question:
    """One question about one episode, with its answer and the episode's entries that bear on it.

    Attributes:
        qid: ``<episode>-<type>``.
        episode: the episode's name (its cube seed).
        type: one of :data:`QUESTION_TYPES`.
        text: the question (the ``~/ask`` goal's instruction, and the retrieval's query); ``holder_at``'s has an
            ``{ago}`` field for the age of ``time_s`` at the time of asking (:meth:`ask_text`).
        answer: the true answer: a word, or ``t=<whole seconds>`` for a time (node clock).
        time_s: for ``carried``, the true time [s] (None: never); for ``holder_at``, the time asked about.
        relevant: ids of the episode's memory entries whose ground truth bears on the answer (precision@k).
    """

    qid: str
    episode: str
    type: str
    text: str
    answer: str
    time_s: float | None
    relevant: tuple[str, ...]

    def ask_text(self, now_s: float) -> str:
        """The question as asked at ``now_s`` [s, node clock]: ``holder_at``'s time as an age (``12 s ago``);
        the others as they are."""
        if self.type == "holder_at" and self.time_s is not None:
            return self.text.replace("{ago}", age_text(now_s, self.time_s))
        return self.text

    def shifted(self, offset_s: float) -> Question:
        """The same question about the episode moved ``offset_s`` [s] later (its times and time answer)."""
        time_s = None if self.time_s is None else self.time_s + offset_s
        answer = time_answer(time_s) if self.answer.startswith("t=") and time_s is not None else self.answer
        return dataclasses.replace(self, time_s=time_s, answer=answer)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "relevant": list(self.relevant)}

    @staticmethod
    def from_json(data: dict) -> Question:
        return Question(qid=str(data["qid"]), episode=str(data["episode"]), type=str(data["type"]),
                        text=str(data["text"]), answer=str(data["answer"]),
                        time_s=None if data.get("time_s") is None else float(data["time_s"]),
                        relevant=tuple(data.get("relevant", ())))


def time_answer(t: float) -> str:
    """A time as the answers give it: ``t=<whole seconds>`` (the memory lines' stamp without its tenth)."""
    return f"t={math.floor(t)}"


def episode_questions(episode: str, samples: list[dict], entries: list[tuple[str, float, str]],
                      rng: random.Random) -> list[Question]:
    """The questions of one episode (one of each :data:`QUESTION_TYPES`).

    Args:
        episode: its name (the cube seed).
        samples: the simulator samples (:func:`episode_truth`).
        entries: its memory entries ``(entry_id, stamp [s], caption)``.
        rng: picks the time ``holder_at`` asks about: an entry's stamp, rounded down to whole seconds, so that
            the memory holds an entry within a second of it.

    Raises:
        ValueError: as :func:`episode_truth`, or an episode without memory entries.
    """
    if not entries:
        raise ValueError(f"episode {episode} has no memory entries")
    truth = episode_truth(samples)
    gt = {entry_id: truth_at(samples, stamp) for entry_id, stamp, _ in entries}
    questions = []

    def add(kind: str, text: str, answer: str, time_s: float | None, relevant) -> None:
        questions.append(Question(f"{episode}-{kind}", episode, kind, text, answer, time_s, tuple(relevant)))

    grasp = truth.first_grasp_s if truth.first_grasp_s is not None else math.inf
    add("start", QUESTIONS["start"], truth.start_side, None,
        [e for e, stamp, _ in entries if stamp < grasp and caption_side(gt[e]) == truth.start_side])
    add("carried", QUESTIONS["carried"],
        NEVER if truth.carried_until_s is None else time_answer(truth.carried_until_s), truth.carried_until_s,
        [e for e, _, _ in entries if " ".join(gt[e].split()) == RIGHT_IN_AIR])
    stamps = sorted(stamp for _, stamp, _ in entries)
    asked = float(math.floor(rng.choice(stamps)))
    add("holder_at", QUESTIONS["holder_at"], holder_at(samples, asked), asked,
        [e for e, stamp, _ in entries if abs(stamp - asked) <= 1.0])
    add("last", QUESTIONS["last"], truth.last_holder, None,
        [e for e, _, _ in entries if truth.last_holder != "none" and caption_holder(gt[e]) == truth.last_holder])
    return questions


# ---------------------------------------------------------------------------------------------------
# scoring


def parse_answer(text: str) -> str:
    """A decoded answer normalised: ``<N> s ago`` for an age, ``t=<digits>`` for a time (the first one), else its
    first word (lower case, letters only); "" for nothing."""
    match = re.search(r"(\d+)\s*(?:s|secs?|seconds?)\s+ago\b", text, re.IGNORECASE)
    if match:
        return f"{int(match.group(1))} s ago"
    match = re.search(r"t\s*=\s*(\d+)", text)
    if match:
        return f"t={int(match.group(1))}"
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words else ""


def answer_time(text: str, now_s: float) -> float | None:
    """The time [s, node clock] a decoded answer gives: ``now_s - N`` for ``<N> s ago`` (``now_s``: the time of
    asking), ``T`` for ``t=<T>``; None for no time."""
    given = parse_answer(text)
    if given.endswith(" s ago"):
        return now_s - int(given.split()[0])
    if given.startswith("t="):
        return float(given[2:])
    return None


def answer_correct(question: Question, text: str, now_s: float) -> bool:
    """Whether a decoded answer, given at ``now_s`` [s, node clock], is right: a time (:func:`answer_time`) within
    :data:`TIME_TOLERANCE_S` of the truth (``carried``), else the same word (``never`` for a cube the right gripper
    never carried)."""
    if question.type == "carried" and question.time_s is not None:
        given = answer_time(text, now_s)
        return given is not None and abs(given - question.time_s) <= TIME_TOLERANCE_S
    return parse_answer(text) == question.answer


def precision_at_k(retrieved: list[str], relevant: set[str], k: int) -> float | None:
    """Share of the first ``k`` retrieved ids that are relevant (over ``min(k, len(retrieved))``); None when the
    question has no relevant entry or nothing was retrieved."""
    top = retrieved[:k]
    if not relevant or not top:
        return None
    return sum(e in relevant for e in top) / len(top)


def answer_from_lines(question: Question, lines: list[tuple[float, str]], now_s: float) -> str:
    """The answer that memory lines ``(stamp [s], caption)``, oldest first, give at ``now_s`` [s, the time of
    asking] by a fixed rule — what a reader that copies from them answers (the QA training's target,
    training/qa.py; the evaluation's "lines read by rule"): ``start``: the side in the oldest "on the <side> of the
    table" line, else ``right`` (the likelier start); ``carried``: the age (``<N> s ago``, as the line writes it)
    of the newest line saying the right gripper holds the cube in the air, else ``never``; ``holder_at``: the
    holder in the line nearest the asked time, however far (``unknown`` without lines); ``last``: the holder in
    the newest line that names one, else ``none``. A wrong caption gives a wrong answer, as it would mislead a
    reader."""
    if question.type == "start":
        sides = [caption_side(c) for _, c in lines if caption_side(c)]
        return sides[0] if sides else "right"
    if question.type == "carried":
        held = [stamp for stamp, c in lines if " ".join(c.split()) == RIGHT_IN_AIR]
        return age_text(now_s, held[-1]) if held else NEVER
    if question.type == "holder_at":
        near = [(abs(stamp - question.time_s), c) for stamp, c in lines]
        return caption_holder(min(near)[1]) if near else UNKNOWN
    holders = [caption_holder(c) for _, c in lines if caption_holder(c) != "none"]
    return holders[-1] if holders else "none"
