"""Trace files and length datasets: the files a load spec names, their formats and their readers.

Owns: `read_trace` (a `load.trace_file`: arrivals and, optionally, lengths) and `read_dataset` (a
`load.dataset_file`: lengths without arrivals), the columns each accepts -- Mooncake's
(`timestamp` in ms, `input_length`, `output_length`), Azure's LLM inference traces' (`TIMESTAMP`,
`ContextTokens`, `GeneratedTokens`) and `timestamp_s` -- and refusing a bad row in one line naming
the load key, the file and the line. The length columns are one list for both kinds of file, read
by one function. Does not own: checking a spec or sampling a schedule from what is read
(harness.serving.load). Pure Python and numpy.

    from harness.serving.trace_files import read_dataset, read_trace
    trace = read_trace("conv.jsonl")       # Trace: arrival_s from 0, input_len / output_len or None
    lengths = read_dataset("lengths.csv")  # {"input": int64 [N], "output": int64 [N]}, in the file's order
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["Trace", "read_trace", "read_dataset", "SUFFIXES", "SIDES", "TIME_COLUMNS", "LENGTH_COLUMNS"]

SUFFIXES = (".jsonl", ".csv")              # what a trace or a length dataset may be
SIDES = ("input", "output")


@dataclass(frozen=True)
class Trace:
    """A trace file's requests in arrival order: arrivals from 0 and, where the file has them, lengths."""

    arrival_s: np.ndarray               # float64 [N], sorted, arrival_s[0] == 0
    input_len: Optional[np.ndarray]     # int64 [N]; None: the file has no input lengths
    output_len: Optional[np.ndarray]    # int64 [N]; None: the file has no output lengths


def _parse_number(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(v)
    return float(v)


def _parse_datetime_ns(v: Any) -> int:
    if not isinstance(v, str):
        raise ValueError(v)
    return int(np.datetime64(v.strip(), "ns").astype(np.int64))


# time column -> (what it holds, its parser, seconds per parsed unit)
TIME_COLUMNS: dict[str, tuple[str, Callable[[Any], float | int], float]] = {
    "timestamp": ("a number of milliseconds", _parse_number, 1e-3),             # Mooncake's traces
    "timestamp_s": ("a number of seconds", _parse_number, 1.0),
    "TIMESTAMP": ("a date-time YYYY-MM-DD HH:MM:SS[.fraction]", _parse_datetime_ns, 1e-9),   # Azure's
}
INPUT_COLUMNS = ("input_length", "ContextTokens")
OUTPUT_COLUMNS = ("output_length", "GeneratedTokens")
LENGTH_COLUMNS = dict(zip(SIDES, (INPUT_COLUMNS, OUTPUT_COLUMNS)))   # side -> its columns, either name


@dataclass(frozen=True)
class _File:
    """A trace or length-dataset file being read: its path and the load key that named it (errors say both)."""

    key: str            # trace_file | dataset_file
    path: Path

    def error(self, what: str, line: Optional[int] = None) -> ValueError:
        return ValueError(f"load.{self.key}: {self.path.name}{'' if line is None else f' line {line}'}: {what}")


def _rows(f: _File) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) for each request of a .jsonl (one object a line) or .csv (a header row);
    a file without one is refused."""
    rows = []
    if f.path.suffix.lower() == ".csv":
        with f.path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh, skipinitialspace=True)
            reader.fieldnames = [c.strip() for c in reader.fieldnames or []]
            rows = [(reader.line_num, row) for row in reader if any(v not in (None, "") for v in row.values())]
    else:
        with f.path.open(encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                if not isinstance(row, dict):
                    raise f.error(f"allowed a JSON object per line, got {line.strip()[:60]!r}", line_no)
                rows.append((line_no, row))
    if not rows:
        raise ValueError(f"load.{f.key}: allowed a file with at least one request, got {str(f.path)!r} (no rows)")
    return rows


def _one_column(f: _File, row: dict[str, Any], names: Sequence[str], what: str) -> Optional[str]:
    found = [c for c in names if c in row]
    if len(found) > 1:
        raise f.error(f"allowed one {what} column of {', '.join(names)}, got {' and '.join(found)}")
    return found[0] if found else None


def _cell(f: _File, line: int, row: dict[str, Any], col: str) -> Any:
    v = row.get(col)
    if v is None or v == "":
        raise f.error(f"allowed a value in column {col!r} (the first row has one), got none", line)
    return v


def _length(f: _File, line: int, col: str, v: Any) -> int:
    try:
        n = int(v.strip()) if isinstance(v, str) else int(v) if float(v).is_integer() else None
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(v, bool) or n < 1:
        raise f.error(f"allowed an integer >= 1 in column {col!r}, got {v!r}", line)
    return n


def _lengths(f: _File, rows: list[tuple[int, dict[str, Any]]]) -> dict[str, np.ndarray]:
    """side -> int64 [N], in the file's order, for each side whose length column the first row has."""
    cols = {side: _one_column(f, rows[0][1], names, f"{side} length") for side, names in LENGTH_COLUMNS.items()}
    return {side: np.array([_length(f, line, col, _cell(f, line, row, col)) for line, row in rows], dtype=np.int64)
            for side, col in cols.items() if col}


def read_trace(path: str | Path) -> Trace:
    """A trace file's requests, sorted by arrival (stable: equal timestamps keep the file's order).

    One time column: `timestamp` (milliseconds, as Mooncake's traces), `timestamp_s` (seconds) or
    `TIMESTAMP` (a date-time, as Azure's LLM inference traces); optionally `input_length` or
    `ContextTokens`, and `output_length` or `GeneratedTokens` (integers >= 1). Other columns
    (Mooncake's `hash_ids`) are ignored. A .jsonl holds one JSON object a line; a .csv a header row.
    The columns of the first row are the file's columns: every row must fill them."""
    f = _File("trace_file", Path(path))
    rows = _rows(f)
    first = rows[0][1]
    time_col = _one_column(f, first, tuple(TIME_COLUMNS), "time")
    if time_col is None:
        raise f.error(f"allowed a time column timestamp (ms), timestamp_s (s) or TIMESTAMP (date-time), "
                      f"got columns {', '.join(map(str, first))}")
    what, parse, seconds = TIME_COLUMNS[time_col]
    times = []
    for line, row in rows:
        v = _cell(f, line, row, time_col)
        try:
            t = parse(v)
        except (TypeError, ValueError):
            t = math.nan
        if isinstance(t, float) and not math.isfinite(t):
            raise f.error(f"allowed {what} in column {time_col!r}, got {v!r}", line)
        times.append(t)
    lengths = _lengths(f, rows)
    raw = np.array(times)                          # int64 ns for date-times: exact before the shift
    order = np.argsort(raw, kind="stable")
    arrival_s = ((raw[order] - raw[order[0]]) * seconds).astype(np.float64)
    got = {side: v[order] for side, v in lengths.items()}
    return Trace(arrival_s, got.get("input"), got.get("output"))


def read_dataset(path: str | Path, sides: Sequence[str] = SIDES) -> dict[str, np.ndarray]:
    """A length dataset's rows in the file's order: side -> int64 [N] for each of `sides`, which
    the file must have a column for. The columns are the length columns of a trace file
    (`input_length` or `ContextTokens`, `output_length` or `GeneratedTokens`, integers >= 1),
    read by the same rules; any time column, and every other column, is ignored -- so a Mooncake or
    Azure trace is a length dataset too."""
    f = _File("dataset_file", Path(path))
    rows = _rows(f)
    got = _lengths(f, rows)
    for side in sides:
        if side not in got:
            raise f.error(f"allowed a column {' or '.join(LENGTH_COLUMNS[side])} for the {side} lengths, "
                          f"got columns {', '.join(map(str, rows[0][1]))}")
    return {side: got[side] for side in sides}
