"""The reading walk from a camera frame to its ActionChunk through ``engine/`` and ``models/`` stays short.

Issue 37 measured how far a reader travels to follow one observation to its action chunk: a *step* is a move to
another file — into a function the path calls, or back to its caller — reading each function once, and the walk
ends when the chunk is handed out (``on_action``). This test takes the walk from a profile of a real cycle
(pi05_tiny, random weights, the default engine configuration: unified mode, real-time chunking off, no language
task), so it follows what runs, not what a reader guesses:

- functions of ``oxygen_ros/engine`` and ``oxygen_ros/models`` entered during the cycle, in call order, first
  entry only (a loop over layers is read once);
- functions a reader does not open are not steps: at most three statements in the body (docstring not
  counted: accessors, forwards), dunder methods other than ``__call__`` (data constructors), comprehensions
  and lambdas;
- the file sequence of those entries and of the returns to the nearest counted caller, with repeats of the same
  file merged; steps = moves in it, files = distinct files.

Measured this way the tree before the one-loop restructuring (commit bfa623e~1) read 56 steps over 16 files; the
issue's own count by hand was 57 over 18. Goal: at most 45 steps over 14 files.
"""
from __future__ import annotations

import ast
import functools
import os
import sys

import pytest
import torch

import oxygen_ros
from engine_support import ByteIO, engine_config, observation, tiny_model
from oxygen_ros.engine import Engine

PACKAGE = os.path.dirname(os.path.realpath(oxygen_ros.__file__))
MAX_STEPS, MAX_FILES = 45, 14


@functools.lru_cache(maxsize=None)
def _read_file(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


@functools.lru_cache(maxsize=None)
def opened_file(path: str, qualname: str, first_line: int) -> str | None:
    """The package-relative file of a function a reader opens on the walk, None for one they do not."""
    path = os.path.realpath(path)
    if not path.startswith(PACKAGE + os.sep) or "<" in qualname:
        return None
    rel = os.path.relpath(path, PACKAGE)
    name = qualname.rsplit(".", 1)[-1]
    if not rel.startswith(("engine" + os.sep, "models" + os.sep)) or (name.startswith("__") and name != "__call__"):
        return None
    for node in ast.walk(_read_file(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and first_line in (
                node.lineno, *(d.lineno for d in node.decorator_list[:1])):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body = body[1:]
            statements = sum(isinstance(n, ast.stmt) for b in body for n in ast.walk(b))
            return rel if statements > 3 else None
    return None


def reading_walk(engine: Engine, obs) -> tuple[list[str], set[tuple[str, str]]]:
    """``(file sequence with repeats merged, functions read)`` of one cycle of ``engine`` on ``obs``, up to the
    hand-out of its action chunk."""
    read: set[tuple[str, str]] = set()
    files: list[str] = []
    stack: list[tuple[str | None, object]] = []

    def visit(rel: str) -> None:
        if not files or files[-1] != rel:
            files.append(rel)

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call":
            rel = opened_file(code.co_filename, code.co_qualname, code.co_firstlineno)
            first = rel is not None and (rel, code.co_qualname) not in read
            if first:
                read.add((rel, code.co_qualname))
                visit(rel)
            stack.append((rel if first else None, frame))
        elif event == "return" and stack and stack[-1][1] is frame:
            rel, _ = stack.pop()
            caller = next((r for r, _ in reversed(stack) if r is not None), None)
            if rel is not None and caller is not None:
                visit(caller)

    sys.setprofile(profile)
    try:
        engine.run_cycle(obs, on_action=lambda chunk: sys.setprofile(None))
    finally:
        sys.setprofile(None)
    return files, read


@pytest.fixture(scope="module")
def walk():
    torch.manual_seed(0)
    model = tiny_model(0)
    engine = Engine(model, ByteIO(model.config), engine_config(mode="unified", tasks=()))
    engine.warm_up(observation(0))
    engine.run_cycle(observation(1))
    return reading_walk(engine, observation(2))


def test_the_camera_to_chunk_walk_is_within_its_budget(walk):
    files, read = walk
    steps, distinct = len(files) - 1, set(files)
    assert steps <= MAX_STEPS and len(distinct) <= MAX_FILES, (
        f"camera -> ActionChunk walk: {steps} steps over {len(distinct)} files, {len(read)} functions "
        f"(budget {MAX_STEPS} / {MAX_FILES}):\n" + " -> ".join(files))


def test_the_walk_goes_from_the_facade_through_the_model_and_back(walk):
    files, read = walk
    # It starts at the facade, crosses the loop, the model's prefill and denoising, and ends in the loop.
    assert files[0] == os.path.join("engine", "engine.py") and files[-1] == os.path.join("engine", "cycle.py")
    names = {name for _, name in read}
    assert {"ControlLoop.run", "ControlLoop._act", "VLAModel.prefill", "VLAModel.denoise"} <= names
    # Language work happens after the chunk is handed out: none of it is on the walk.
    assert not {"ControlLoop._language", "ControlLoop._start", "ControlLoop._report"} & names
