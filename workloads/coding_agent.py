"""Coding-agent sessions: tools as JSON schemas, repository files, a growing history.

Owns: the agent's system prompt with eight tool definitions (`TOOLS`, JSON Schema
objects serialised with ``json.dumps``), and `conversation`, which lays out one agent
session over real source files of this machine's standard library (the "repository"):

    head    system prompt + <tools> (never trimmed)
    middle  files open in the editor, then turns of: user request, assistant tool call
            (JSON), tool result quoting real source, short assistant reply -- oldest
            first; trimming drops the oldest (repository context, older turns)
    tail    the measured user request + generation prompt (never trimmed)
    next    the tool result the agent's call would get, then further turns

Does not own: tokenization or exact lengths (``workloads.base``), the file corpus
(``workloads.corpus``). Tool results of `run_tests` are a fixed pytest-style summary
(nothing is executed); every other result quotes files as they are on disk.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from workloads import corpus
from workloads.base import GENERATION_PROMPT, Segment, Conversation, first_paragraph, pick, turn
from workloads.corpus import Definition

NAME = "coding_agent"
OPEN_FILES = 2           # files shown as repository context before the history
OPEN_FILE_LINES = 150    # lines of each open file
EXCERPT_LINES = 60       # lines of a read_file result in the history
MIN_TURNS = 6            # history turns always generated (the oldest are trimmed first)


def _fn(name: str, description: str, properties: dict[str, Any],
        required: list[str]) -> dict[str, Any]:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required}}


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_PATH = {"type": "string", "description": "Relative to the repo root."}
TOOLS: tuple[dict[str, Any], ...] = (
    _fn("read_file", "Read a text file, optionally a line range.",
        {"path": _PATH, "start_line": {"type": "integer", "minimum": 1},
         "end_line": {"type": "integer", "minimum": 1}},
        ["path"]),
    _fn("write_file", "Create or overwrite a file.",
        {"path": _PATH, "content": _STR}, ["path", "content"]),
    _fn("list_dir", "List a directory.",
        {"path": _PATH, "pattern": {"type": "string", "description": "Glob, e.g. *.py"}},
        ["path"]),
    _fn("grep", "Search files for a regex; returns path:line: text.",
        {"pattern": _STR, "path": _PATH, "max_results": {"type": "integer", "minimum": 1}},
        ["pattern"]),
    _fn("run_tests", "Run pytest on some tests.",
        {"paths": {"type": "array", "items": _STR}, "keyword": _STR, "fail_fast": _BOOL},
        []),
    _fn("run_shell", "Run a shell command; returns its output.",
        {"command": _STR, "timeout_s": {"type": "integer", "minimum": 1}}, ["command"]),
    _fn("apply_patch", "Apply a unified diff.",
        {"patch": _STR, "check_only": _BOOL}, ["patch"]),
    _fn("git_diff", "Show uncommitted changes.",
        {"paths": {"type": "array", "items": _STR}, "staged": _BOOL}, []),
)

_FINAL_REQUESTS = (
    "The tests for {module} started failing after yesterday's change to {path}. Read "
    "`{qualname}` there, find the bug, fix it with apply_patch and run the tests again.",
    "Add precise type hints to `{qualname}` in {path} without changing its behaviour, "
    "then show me the git diff.",
    "Refactor `{qualname}` in {path} so it is easier to follow; keep the behaviour "
    "identical, and run the tests for {module} when you are done.",
    "Explain what `{qualname}` in {path} does, find every caller in the repository, and "
    "tell me whether it handles empty input correctly.",
)
_READ_REQUESTS = (
    "Open {path} and show me `{qualname}`.",
    "How does `{qualname}` in {path} work?",
    "I suspect `{name}` in {path} mishandles an edge case. Can you take a look?",
    "Before we change anything, read `{qualname}` in {path}.",
)


def tool_schemas() -> list[dict[str, Any]]:
    """A fresh copy of the tool definitions in the system prompt."""
    return json.loads(json.dumps(TOOLS))


def system_prompt() -> str:
    """The head of every session: instructions, then one JSON schema per line in <tools>."""
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    return turn("system", (
        "You are a coding agent in a checkout of the CPython standard library (Lib/) at "
        "/repo. Act only through the tools below: to call one, reply with one JSON object, "
        '{"tool": <name>, "arguments": {...}}, on its own line; the result comes back in a '
        "tool message. Make the smallest change that solves the task and run the relevant "
        f"tests before saying you are done.\n\n# Tools\n<tools>\n{tools}\n</tools>"))


def _call(tool: str, **arguments: Any) -> str:
    return turn("assistant", json.dumps({"tool": tool, "arguments": arguments}))


def _pick_def(rng: np.random.Generator, path: str) -> Definition:
    defs = corpus.definitions(path)
    functions = [d for d in defs if d.kind == "def"]
    return pick(rng, functions or defs)


def _read_result(d: Definition, max_lines: int) -> str:
    end = min(d.end_lineno, d.lineno + max_lines - 1)
    return turn("tool", f"{d.path} lines {d.lineno}-{end}:\n"
                        f"{corpus.definition_source(d, max_lines)}")


def _read_turn(rng: np.random.Generator, d: Definition) -> str:
    end = min(d.end_lineno, d.lineno + EXCERPT_LINES - 1)
    ask = pick(rng, _READ_REQUESTS).format(path=d.path, qualname=d.qualname, name=d.name)
    if d.docstring:
        reply = f"`{d.qualname}` (lines {d.lineno}-{end}): {first_paragraph(d.docstring)}"
    else:
        reply = (f"`{d.qualname}` spans lines {d.lineno}-{d.end_lineno} of {d.path}; it has "
                 f"no docstring, so the code above is the only description.")
    return (turn("user", ask)
            + _call("read_file", path=d.path, start_line=d.lineno, end_line=end)
            + _read_result(d, EXCERPT_LINES) + turn("assistant", reply))


def _grep_turn(d: Definition) -> str:
    word = re.compile(rf"\b{re.escape(d.name)}\b")
    hits = [f"{d.path}:{i}: {line.strip()}"
            for i, line in enumerate(corpus.source_lines(d.path), start=1) if word.search(line)]
    return (turn("user", f"Where is `{d.name}` referenced in {d.path}?")
            + _call("grep", pattern=rf"\b{d.name}\b", path=d.path, max_results=20)
            + turn("tool", "\n".join(hits[:20]) + (f"\n... {len(hits) - 20} more matches"
                                                    if len(hits) > 20 else ""))
            + turn("assistant", f"`{d.name}` appears on {len(hits)} lines of {d.path}; it is "
                                f"defined on line {d.lineno}."))


def _list_turn(d: Definition) -> str:
    folder = os.path.dirname(d.path) or "."
    names = sorted(n for n in os.listdir(corpus.stdlib_root() / folder) if n.endswith(".py"))
    shown = "\n".join(names[:60]) + (f"\n... {len(names) - 60} more" if len(names) > 60 else "")
    return (turn("user", f"What else lives in {folder}/?")
            + _call("list_dir", path=folder, pattern="*.py")
            + turn("tool", shown)
            + turn("assistant", f"{folder}/ holds {len(names)} Python files; "
                                f"{os.path.basename(d.path)} is the one we were looking at."))


def _tests_turn(rng: np.random.Generator, d: Definition) -> str:
    stem = d.module.rsplit(".", 1)[-1]
    n = int(rng.integers(5, 80))
    secs = float(rng.uniform(0.2, 9.0))
    bar = "=" * 24
    report = (f"{bar} test session starts {bar}\ncollected {n} items\n\n"
              f"test/test_{stem}.py {'.' * n} [100%]\n\n{bar} {n} passed in {secs:.2f}s {bar}")
    return (turn("user", f"Run the tests for {d.module}.")
            + _call("run_tests", paths=[f"test/test_{stem}.py"], fail_fast=True)
            + turn("tool", report)
            + turn("assistant", f"All {n} tests for {d.module} pass."))


def _history(rng: np.random.Generator) -> Iterator[Segment]:
    """Endless agent turns, one segment each, over files in seeded order."""
    for path in corpus.iter_files(rng):
        d = _pick_def(rng, path)
        kind = rng.random()
        if kind < 0.55:
            text = _read_turn(rng, d)
        elif kind < 0.75:
            text = _grep_turn(d)
        elif kind < 0.87:
            text = _list_turn(d)
        else:
            text = _tests_turn(rng, d)
        yield Segment(text, (path,))


def _open_files(rng: np.random.Generator) -> Iterator[Segment]:
    for path in itertools.islice(corpus.iter_files(rng), OPEN_FILES):
        lines = corpus.source_lines(path)[:OPEN_FILE_LINES]
        yield Segment(turn("system", f'Open in the editor:\n<file path="{path}">\n'
                                     + "\n".join(lines) + "\n</file>"), (path,))


def conversation(rng: np.random.Generator) -> Conversation:
    """One agent session whose measured turn asks for work on a seeded stdlib function."""
    target = _pick_def(rng, next(corpus.iter_files(rng)))
    request = pick(rng, _FINAL_REQUESTS).format(
        path=target.path, qualname=target.qualname, module=target.module)
    mid_rng, cont_rng = rng.spawn(2)
    return Conversation(
        head=system_prompt(),
        middle=itertools.chain(_open_files(mid_rng), _history(mid_rng)),
        tail=turn("user", request) + GENERATION_PROMPT,
        continuation=itertools.chain(
            [Segment(_read_result(target, 400), (target.path,))], _history(cont_rng)),
        keep="newest",
        min_segments=OPEN_FILES + MIN_TURNS,
        sources=(target.path,),
        head_label="system prompt and tool schemas",
        meta={"tools": [t["name"] for t in TOOLS], "target": target.path,
              "target_definition": target.qualname},
    )
