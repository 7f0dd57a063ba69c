"""Memory in a language prompt: the ``{memory}`` field of an ``~/ask`` prompt template (docs/memory.md,
"Answers from memory"). No rclpy.

* :func:`recall` — the entries for a question: those nearest the time it names (``t=<seconds>``, or ``<N> s ago``
  when the time of asking is given), else the entries its words match — oldest first for a question about the
  first time (``first``, ``earliest``), else best BM25 first — else the newest (the oldest for a first time).
* :func:`memory_text` — those entries as one line of text, oldest first, each with its time (its age at the time
  of asking, ``<N> s ago``, or its stamp, ``t=<seconds>s``) and place.
* :func:`fill_memory` — a template with ``{memory}`` replaced by that text, its other fields kept.
"""

from __future__ import annotations

import math
import re
import string

from oxygen_ros.memory.records import MemoryQuery, MemoryRecord
from oxygen_ros.memory.store import MemoryStore

MEMORY_FIELD = "memory"
DEFAULT_K = 5
# a time in a question, written as the memory lines write it: t=<seconds>, optionally followed by s
TIME_IN_QUESTION = re.compile(r"(?<![\w.])t\s*=\s*([-+]?\d+(?:\.\d+)?)(?!\d|\.\d)")
# an age in a question, as the memory lines write it at the time of asking: <N> s ago (or sec / second(s))
AGE_IN_QUESTION = re.compile(r"(?<![\w.+-])(\d+(?:\.\d+)?)\s*(?:s|secs?|seconds?)\s+ago\b", re.IGNORECASE)
# a question about the first time something was seen or done: its matches are read oldest first
FIRST_IN_QUESTION = re.compile(r"\b(?:first|earliest|initially|originally)\b", re.IGNORECASE)


def question_time(question: str, now_s: float | None = None) -> float | None:
    """The time [s] a question names in the memory lines' notation: ``t=<seconds>`` (the node's clock, e.g.
    ``"which gripper held the cube at t=1012?"`` -> 1012.0), else, when ``now_s`` (the time of asking [s]) is
    given, an age ``<N> s ago`` -> ``now_s - N`` (``"... 12 s ago?"`` with ``now_s`` 1012.0 -> 1000.0; a signed
    ``-3 s ago`` is no age). None when it names neither. A ``t=`` time counts before an age, the first of each
    kind."""
    match = TIME_IN_QUESTION.search(question)
    if match:
        return float(match.group(1))
    if now_s is not None:
        match = AGE_IN_QUESTION.search(question)
        if match:
            return now_s - float(match.group(1))
    return None


def age_text(now_s: float, stamp_s: float) -> str:
    """How long before ``now_s`` a stamp is, as the memory lines and time answers write it: ``"<N> s ago"``, N
    whole seconds, rounded to the nearest, halves up (a stamp after ``now_s``, a clock that is behind: ``"0 s
    ago"``). Raises ValueError for a time that is not finite."""
    if not (math.isfinite(now_s) and math.isfinite(stamp_s)):
        raise ValueError(f"times must be finite, got now {now_s} and stamp {stamp_s}")
    return f"{max(0, math.floor(now_s - stamp_s + 0.5))} s ago"


def nearest_in_time(store: MemoryStore, t_s: float, k: int, robot: str | None = None) -> list[MemoryRecord]:
    """The ``k`` stored records whose stamps are nearest ``t_s`` [s] (ties: the earlier first), nearest first
    (:attr:`MemoryQuery.near_time_s <oxygen_ros.memory.records.MemoryQuery>`). ``robot``: that robot's only.
    Raises ValueError for ``k`` < 1 or a ``t_s`` that is not finite, and the store's errors."""
    return [hit.record for hit in store.query(MemoryQuery(near_time_s=t_s, robot=robot, k=k))]


def recall(store: MemoryStore, question: str, k: int = DEFAULT_K, robot: str | None = None,
           now_s: float | None = None) -> list[MemoryRecord]:
    """At most ``k`` stored records for ``question``. A question that names a time as the memory lines write it
    (:func:`question_time`: ``t=<seconds>``, or ``<N> s ago`` given ``now_s``, the time of asking [s]) gets the
    ``k`` records nearest that time (:func:`nearest_in_time`; its words do not rank them); any other gets those
    whose captions share words with it: for a question about the first time (``first``, ``earliest``,
    ``initially``, ``originally``) the oldest of them, else the best BM25 first (equal scores newest first); when
    none does (or the question has no words), the ``k`` newest (the ``k`` oldest for a question about the first
    time). ``robot``: that robot's only (None: all). Raises ValueError for ``k`` < 1, and the store's errors."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t_s = question_time(question, now_s)
    if t_s is not None and math.isfinite(t_s):
        records = nearest_in_time(store, t_s, k, robot)
        if records:
            return records
    first = FIRST_IN_QUESTION.search(question) is not None
    hits = store.query(MemoryQuery(text=question, robot=robot, k=k, oldest_first=first)) if question.strip() else []
    if not hits:
        hits = store.query(MemoryQuery(robot=robot, k=k, oldest_first=first))
    return [hit.record for hit in hits]


def memory_text(records: list[MemoryRecord], now_s: float | None = None) -> tuple[str, list[str]]:
    """``(text, entry ids)``: the records oldest first as ``<N> s ago [at (x, y)]: <caption>`` (:func:`age_text`)
    when ``now_s``, the time of asking [s], is given, else ``t=<stamp>s [at (x, y)]: <caption>``, joined by
    ``"; "`` (one line: a prompt's newline can end it), and their ids in the same order; ``("", [])`` for none.
    Captions are stripped of surrounding whitespace and newlines. Ages keep a small model's answer to "when" a
    copy of one number token (the demo's tokenizer writes 0-199 as one token; a ten-digit stamp is ten).
    Raises ValueError for a ``now_s`` that is not finite."""
    if now_s is not None and not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s}")
    ordered = sorted(records, key=lambda r: (r.stamp_s, r.entry_id))
    parts = []
    for record in ordered:
        place = "" if record.pose is None else " at ({:.1f}, {:.1f})".format(*record.pose.position[:2])
        caption = " ".join(record.text.split())
        when = f"t={record.stamp_s:.1f}s" if now_s is None else age_text(now_s, record.stamp_s)
        parts.append(f"{when}{place}: {caption}")
    return "; ".join(parts), [r.entry_id for r in ordered]


def has_memory_field(template: str) -> bool:
    """Whether ``template`` has a ``{memory}`` field (``{{memory}}`` is literal text, not the field). Raises
    ValueError for a template ``str.format`` cannot parse."""
    return any(name == MEMORY_FIELD for _, name, _, _ in string.Formatter().parse(template))


def fill_memory(template: str, text: str) -> str:
    """``template`` with each ``{memory}`` field replaced by ``text`` (its braces doubled, so the result is
    still a template), literal text and the other fields as they were. Raises ValueError for a template
    ``str.format`` cannot parse."""
    out = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is None:
            continue
        if name == MEMORY_FIELD:
            out.append(text.replace("{", "{{").replace("}", "}}"))
        else:
            out.append("{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}")
    return "".join(out)
