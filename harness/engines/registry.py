"""The engine plugin family's registry, and what core code asks of every registered engine.

Owns: `ENGINES` (name -> "module:Class", lazily imported; third-party adapters through the
entry-point group `moebench.engines`) and the questions the rest of the harness puts to the
registered adapters' declarations -- never to their names: their knob columns (`knob_columns`,
the config columns a results table groups by), the values their rows held before a config column
existed (`columns_before`), their sub-commands (`commands`, dispatched by `moebench <words>`),
the engines that have a capability (`engines_with`) and the one the cost model predicts
(`predicted_engine`). Importing this module imports no adapter; each question imports the
adapters it asks (light: an adapter's module loads torch only when it builds an engine). Does
not own: the interface (harness.engines.base) or the engine cache (harness.engines).

    from harness.engines.registry import ENGINES, engines_with
    ENGINES.get("hf").uses_placement             # False
    engines_with("kv_treatments")                # the engines that apply kv.dtype
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from engine.registry import Registry

ENGINES = Registry("engine", "moebench.engines", {
    "moebench": "harness.engines.moebench:MoebenchAdapter",
    "hf": "harness.engines.hf:HFAdapter",
    "llamacpp": "harness.llamacpp.adapter:LlamaCppAdapter",       # llama.cpp's package: remove it and this line
})

__all__ = ["ENGINES", "Command", "CommandTable", "columns_before", "commands", "engines_with", "knob_columns", "predicted_engine"]


@dataclass(frozen=True)
class Command:
    """An engine's sub-command: `target` ("module:function", called with the words after it) and
    the line `moebench --help` shows (its arguments, what it does)."""

    target: str
    args: str
    summary: str


def _adapters() -> Iterator[tuple[str, type]]:
    for name in ENGINES.names():
        yield name, ENGINES.get(name)


def knob_columns() -> list[str]:
    """Every registered engine's knob columns (its configuration beside the factors), in
    registry order, each once."""
    return list(dict.fromkeys(c for _, cls in _adapters() for c in cls.knob_columns))


def columns_before() -> dict[str, dict[str, str]]:
    """column -> {engine: the value that engine's rows held before the column existed}."""
    out: dict[str, dict[str, str]] = {}
    for name, cls in _adapters():
        for column, value in cls.columns_before.items():
            out.setdefault(column, {})[name] = value
    return out


def engines_with(capability: str) -> list[str]:
    """The registered engines that declare `capability` (an EngineAdapter class attribute) true."""
    return [name for name, cls in _adapters() if getattr(cls, capability)]


def predicted_engine() -> str:
    """The engine whose time the cost model predicts (`cost_model`): its rows carry that engine."""
    found = engines_with("cost_model")
    if len(found) != 1:
        raise LookupError(f"the cost model predicts one engine; registered engines declaring cost_model: {found}")
    return found[0]


def commands() -> dict[str, Command]:
    """`moebench <words>` -> its Command, for every registered engine's sub-commands."""
    out: dict[str, Command] = {}
    for name, cls in _adapters():
        for words, command in cls.commands.items():
            if words in out and out[words] != command:
                raise ValueError(f"engines declare the sub-command {words!r} twice ({name}: {command.target}; "
                                 f"another: {out[words].target})")
            out[words] = command
    return out


COMMAND_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


class CommandTable(Mapping[str, str]):
    """The CLI's sub-commands: its own, then the engines' (asked of the registry on first need).
    Only plain words can name an engine's command -- an override (`key=value`, `-m`, `+key`,
    `~key`), a path, or words after one of the CLI's own commands never do -- so a run's or an own
    command's arguments are told apart without importing an adapter."""

    def __init__(self, own: Mapping[str, str]) -> None:
        self._own = dict(own)
        self._all: dict[str, str] | None = None

    def _table(self) -> dict[str, str]:
        if self._all is None:
            self._all = {**self._own, **{k: c.target for k, c in commands().items() if k not in self._own}}
        return self._all

    def __contains__(self, words: object) -> bool:
        if not isinstance(words, str):
            return False
        if words in self._own:
            return True
        parts = words.split(" ")
        if parts[0] in self._own or not all(COMMAND_WORD.fullmatch(p) for p in parts):
            return False
        return words in self._table()

    def __getitem__(self, words: str) -> str:
        return self._own[words] if words in self._own else self._table()[words]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())
