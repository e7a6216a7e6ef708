"""Reading results back: one validated DataFrame from a job dir, a sweep dir, any tree or one
Parquet file (`load`), and the per-step side table (`load_steps`).

Owns (DESIGN.md §6, §7): which files a load reads and in what order, counting each
(sweep_id, job_id) once, validating each file against the schema and against its job's DONE
record, reading files older than a column (`ADDED_COLUMNS`), and the dtypes a load promises.
Does not own: writing (harness.results.store, harness.results.sweep_table) or the schema
(harness.results.schema).

Decisions readers rely on:
  * Only complete jobs are read (harness.results.store says what complete means): a job dir
    without a valid DONE -- killed mid-write, or being rewritten by a rerun -- contributes no
    rows, and its job is not read from a sweep table under the same root either (the table
    may predate it). A load of a damaged job dir names the damaged file.
  * `load` reads complete job dirs first, then sweep-level tables (`results.parquet`) for
    jobs not found in any job dir; each group in sorted path order; a job is taken from
    exactly one file.
  * Temp files (`.<name>.*.tmp`) are never read.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.results.schema import (BOOL_COLUMNS, INT_COLUMNS, META_KEY, NOT_NULL_COLUMNS, COLUMN_TYPES, added_column_values,
                                    DONE_FILE, REQUIRED_COLUMNS, ROWS_FILE, SCHEMA_VERSION, STATUSES, STEPS_FILE,
                                    SWEEP_STEPS, SWEEP_TABLE, ResultsError)
from harness.results.store import STEP_COLUMNS, done_record, file_mismatch, is_temp_file, read_done

log = logging.getLogger(__name__)


def load(path: str | os.PathLike[str]) -> pd.DataFrame:
    """One validated DataFrame from a job dir, a sweep dir, any tree, or one Parquet file.

    Raises ResultsError naming every unreadable or invalid file, or when nothing is found.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"results path {root} does not exist")
    if root.is_file():
        if is_temp_file(root) or root.suffix != ".parquet":
            raise ResultsError(f"{root}: not a results file; expected {ROWS_FILE}, {SWEEP_TABLE} "
                               "or another .parquet written by harness.results")
        return read_tables([root], root)
    job_files, incomplete = scan_job_files(root)
    sweep_files = sorted(p for p in root.rglob(SWEEP_TABLE) if p.is_file())
    if not job_files and not sweep_files:
        raise ResultsError(f"no results under {root}: expected <job>/{ROWS_FILE} (with its {DONE_FILE}) or "
                           f"<sweep>/{SWEEP_TABLE} files (temp files and incomplete jobs are ignored)")
    return read_tables(job_files + sweep_files, root, skip_jobs=set(incomplete))


def scan_job_files(root: Path) -> tuple[list[Path], dict[tuple[str, str], Path]]:
    """rows.parquet of jobs with a DONE record under root (validated when read: a corrupt file
    there is an error, not a skip), and the (sweep_id, job_id) of incomplete jobs (no DONE), each
    with its dir."""
    complete: list[Path] = []
    incomplete: dict[tuple[str, str], Path] = {}
    for rows_file in sorted(p for p in root.rglob(ROWS_FILE) if p.is_file()):
        if done_record(rows_file.parent) is not None:
            complete.append(rows_file)
            continue
        log.warning("%s: job is incomplete (no %s); its rows are not read", rows_file.parent, DONE_FILE)
        with contextlib.suppress(pa.ArrowException, OSError, KeyError):
            t = pq.read_table(rows_file, columns=["sweep_id", "job_id"])
            incomplete.update(dict.fromkeys(zip(t.column("sweep_id").to_pylist(), t.column("job_id").to_pylist()),
                                            rows_file.parent))
    return complete, incomplete


def read_tables(files: Iterable[Path], root: Path, skip_jobs: set[tuple[str, str]] = frozenset(),
                 extra: pd.DataFrame | None = None) -> pd.DataFrame:
    frames: list[pd.DataFrame] = []
    problems: list[str] = []
    seen_jobs: set[tuple[str, str]] = set(skip_jobs)
    if extra is not None and len(extra):
        frames.append(extra)
        seen_jobs |= set(zip(extra["sweep_id"], extra["job_id"]))
    job_file_of: dict[tuple[str, str], Path] = {}      # the job file each key was first read from
    for file in files:
        frame, why = _read_one(file)
        if why:
            problems.append(f"{file}: {why}")
            continue
        assert frame is not None
        keys = list(zip(frame["sweep_id"], frame["job_id"]))
        if file.name == ROWS_FILE:   # two job files of one key are two runs, of which only one is read
            for key in dict.fromkeys(keys):
                if key in job_file_of and job_file_of[key] != file:
                    log.warning("%s and %s hold the same job (sweep_id=%r, job_id=%r); only the first is read",
                                job_file_of[key].parent, file.parent, *key)
                job_file_of.setdefault(key, file)
        dup = pd.Series([k in seen_jobs for k in keys], index=frame.index, dtype=bool)
        if dup.any():
            log.debug("%s: %d rows of jobs already read (or incomplete); skipped", file, int(dup.sum()))
            frame = frame[~dup]
        seen_jobs.update(keys)
        if len(frame):
            frames.append(frame)
    if problems:
        raise ResultsError(f"cannot load results under {root}: {len(problems)} invalid file(s):\n  "
                           + "\n  ".join(problems))
    if not frames:
        return canonical(pd.DataFrame({c: pd.Series([], dtype=object) for c in REQUIRED_COLUMNS}))
    df = pd.concat(frames, ignore_index=True)
    extras = [c for c in df.columns if c not in REQUIRED_COLUMNS]
    return canonical(df[REQUIRED_COLUMNS + extras])


def _read_one(file: Path) -> tuple[pd.DataFrame | None, str | None]:
    done = done_record(file.parent) if file.name == ROWS_FILE else None
    try:
        data = file.read_bytes()
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        return None, f"unreadable Parquet ({type(exc).__name__}: {exc})"
    if done is not None and isinstance(done.get("files"), dict) and ROWS_FILE in done["files"]:
        why = file_mismatch(file, done["files"][ROWS_FILE], data)      # readable, but not what the job wrote
        if why:
            return None, why
    for name, before in added_column_values().items():
        if name not in table.schema.names:
            table = table.append_column(pa.field(name, pa.string()), _legacy_column(table, before))
    why = _schema_problems(table.schema)
    if why:
        return None, why
    if file.name == ROWS_FILE:
        if done is not None and done.get("rows") != table.num_rows:
            return None, (f"holds {table.num_rows} rows but its {DONE_FILE} records {done.get('rows')}: "
                          "the job dir was changed after the job finished")
    df = table.to_pandas(types_mapper=pandas_type)
    bad_status = sorted(set(df["status"].dropna()) - set(STATUSES))
    if bad_status:
        return None, f"column 'status' must be one of {list(STATUSES)}; got {bad_status}"
    nulls = [c for c in NOT_NULL_COLUMNS if df[c].isna().any()]
    if nulls:
        return None, f"columns {nulls} have nulls; they may not"
    return df, None


def _legacy_column(table: pa.Table, before: dict[str, str]) -> pa.Array:
    """A column a file predates: per row, what its engine always did then (`before`), else null."""
    engines = table.column("engine").to_pylist() if "engine" in table.schema.names else [None] * table.num_rows
    return pa.array([before.get(e) for e in engines], type=pa.string())


def _schema_problems(schema: pa.Schema) -> str | None:
    problems = []
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        problems.append(f"missing columns {missing} (required: {REQUIRED_COLUMNS})")
    version = (schema.metadata or {}).get(META_KEY)
    if version is not None and version != str(SCHEMA_VERSION).encode():
        problems.append(f"schema_version {version.decode(errors='replace')}; this code reads "
                        f"{SCHEMA_VERSION}")
    checks = {"value": (pa.types.is_floating, pa.types.is_integer),
              **{c: (pa.types.is_integer,) for c in INT_COLUMNS},
              **{c: (pa.types.is_boolean,) for c in BOOL_COLUMNS}}
    for name in schema.names:
        if name not in COLUMN_TYPES:
            continue
        t = schema.field(name).type
        allowed = checks.get(name, (pa.types.is_string, pa.types.is_large_string))
        if not (pa.types.is_null(t) or any(ok(t) for ok in allowed)):
            problems.append(f"column {name!r} has type {t}; allowed: {COLUMN_TYPES[name]} or null")
    return "; ".join(problems) or None


def pandas_type(t: pa.DataType) -> Any:
    if pa.types.is_integer(t):
        return pd.Int64Dtype()
    if pa.types.is_boolean(t):
        return pd.BooleanDtype()
    return None


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    """The dtypes `load` promises: value float64, integer columns Int64, emulated boolean."""
    df = df.copy()
    df["value"] = pd.to_numeric(df["value"]).astype("float64")
    for c in INT_COLUMNS:
        df[c] = df[c].astype("Int64")
    for c in BOOL_COLUMNS:
        df[c] = df[c].astype("boolean")
    return df.reset_index(drop=True)


def load_steps(path: str | os.PathLike[str], sweep_tables: bool = True) -> pd.DataFrame:
    """The per-step decode latencies under a job dir, sweep dir or tree (complete jobs only, then
    sweep-level step tables for jobs not found in a job dir), or from one steps Parquet file:
    one row per (job, repeat, profiler, step)."""
    root = Path(path)
    if root.is_file():
        files = [root]
    else:
        files = [f for f in sorted(root.rglob(STEPS_FILE)) if read_done(f.parent) is not None]
        files += sorted(root.rglob(SWEEP_STEPS)) if sweep_tables else []
    frames, seen = [], set()
    for f in files:
        df = pq.read_table(f).to_pandas(types_mapper=pandas_type)
        keys = list(zip(df["sweep_id"], df["job_id"]))
        frames.append(df[[k not in seen for k in keys]])
        seen |= set(keys)
    if not frames:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in STEP_COLUMNS})
    return pd.concat(frames, ignore_index=True)
