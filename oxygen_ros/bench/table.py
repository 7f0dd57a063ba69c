"""What the benchmarks share for their results: the fixed-width table on stdout and the JSON file.

A table is a list of :class:`Column`: each has a title, a width in characters, a function from a result
row (a dict of the JSON's ``rows``) to the cell's text and an alignment (``oxygen_ros/bench/engine_bench.py``
and ``oxygen_ros/bench/fleet_bench.py`` print theirs with it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable


@dataclass(frozen=True)
class Column:
    """One table column: ``title``, ``width`` (characters, the title's and every cell's), ``cell`` (row dict
    -> text; :func:`fmt` shows a missing value as ``-``) and ``align`` (``>`` right, ``<`` left)."""

    title: str
    width: int
    cell: Callable[[dict], str]
    align: str = ">"


def fmt(value, spec: str) -> str:
    """``value`` formatted with ``spec`` (``format`` mini-language), ``-`` for None."""
    return "-" if value is None else format(value, spec)


def print_table(columns: list[Column], rows: Iterable[dict]) -> None:
    """Print the header, a rule and one line per row."""
    def line(texts: list[str]) -> str:
        return "".join(f"{text:{c.align}{c.width}}" for c, text in zip(columns, texts))

    header = line([c.title for c in columns])
    print(header)
    print("-" * len(header))
    for row in rows:
        print(line([c.cell(row) for c in columns]))


def write_json(out: Path, results: dict) -> None:
    """Write ``results`` to ``out`` (its folder created), indented; values JSON lacks are written as text."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
