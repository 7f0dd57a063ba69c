"""Memory in a language prompt: the ``{memory}`` field of an ``~/ask`` prompt template (docs/memory.md,
"Answers from memory"). No rclpy.

* :func:`recall` — the entries for a question: those nearest the time it names (``t=<seconds>``), else the best
  BM25 matches of its words, else the newest.
* :func:`memory_text` — those entries as one line of text, oldest first, each with its time (and place).
* :func:`fill_memory` — a template with ``{memory}`` replaced by that text, its other fields kept.
"""

from __future__ import annotations

import re
import string

from oxygen_ros.memory.records import MemoryQuery, MemoryRecord
from oxygen_ros.memory.store import MemoryStore

MEMORY_FIELD = "memory"
DEFAULT_K = 5
# a time in a question, written as the memory lines write it: t=<seconds>, optionally followed by s
TIME_IN_QUESTION = re.compile(r"(?<![\w.])t\s*=\s*([-+]?\d+(?:\.\d+)?)(?!\d|\.\d)")


def question_time(question: str) -> float | None:
    """The time a question names in the memory lines' own notation, ``t=<seconds>`` (optionally ``s``; the node's
    clock, as :func:`memory_text` writes it), e.g. ``"which gripper held the cube at t=1012?"`` -> 1012.0; None
    when it names none. The first such time counts."""
    match = TIME_IN_QUESTION.search(question)
    return float(match.group(1)) if match else None


def nearest_in_time(store: MemoryStore, t_s: float, k: int, robot: str | None = None) -> list[MemoryRecord]:
    """The ``k`` stored records whose stamps are nearest ``t_s`` [s] (ties: the earlier first), nearest first
    (:attr:`MemoryQuery.near_time_s <oxygen_ros.memory.records.MemoryQuery>`). ``robot``: that robot's only.
    Raises ValueError for ``k`` < 1 or a ``t_s`` that is not finite, and the store's errors."""
    return [hit.record for hit in store.query(MemoryQuery(near_time_s=t_s, robot=robot, k=k))]


def recall(store: MemoryStore, question: str, k: int = DEFAULT_K, robot: str | None = None) -> list[MemoryRecord]:
    """At most ``k`` stored records for ``question``. A question that names a time as the memory lines write it
    (``t=<seconds>``, :func:`question_time`) gets the ``k`` records nearest that time (:func:`nearest_in_time`;
    its words do not rank them); any other gets those whose captions share words with it, best BM25 first; when
    none does (or the question has no words), the ``k`` newest. ``robot``: that
    robot's only (None: all). Raises ValueError for ``k`` < 1, and the store's errors."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t_s = question_time(question)
    if t_s is not None:
        records = nearest_in_time(store, t_s, k, robot)
        if records:
            return records
    hits = store.query(MemoryQuery(text=question, robot=robot, k=k)) if question.strip() else []
    if not hits:
        hits = store.query(MemoryQuery(robot=robot, k=k))
    return [hit.record for hit in hits]


def memory_text(records: list[MemoryRecord]) -> tuple[str, list[str]]:
    """``(text, entry ids)``: the records oldest first as ``t=<stamp>s [at (x, y)]: <caption>`` joined by
    ``"; "`` (one line: a prompt's newline can end it), and their ids in the same order; ``("", [])`` for none.
    Captions are stripped of surrounding whitespace and newlines."""
    ordered = sorted(records, key=lambda r: (r.stamp_s, r.entry_id))
    parts = []
    for record in ordered:
        place = "" if record.pose is None else " at ({:.1f}, {:.1f})".format(*record.pose.position[:2])
        caption = " ".join(record.text.split())
        parts.append(f"t={record.stamp_s:.1f}s{place}: {caption}")
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
