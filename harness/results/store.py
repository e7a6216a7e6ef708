"""The file half of the results store: job directories, sweep tables, loading.

Owns (DESIGN.md §6, §7):
  * writing files atomically (temp file in the same directory, fsync, `os.replace`);
  * writing one job (`write_job`: rows.parquet, optional steps.parquet, manifest.json, then
    the DONE record) and reading its record back, verified against the files it lists
    (`read_done`, `inspect_job`, `job_status`, `job_complete`); making a job dir ready for a
    run's files before it is measured (`prepare_job_dir`);
  * reading a job dir, a sweep dir, any tree or one Parquet file back into one validated
    DataFrame (`load`), each (sweep_id, job_id) counted once, and the per-step side table
    (`load_steps`);
  * concatenating a sweep into `results.parquet`, `steps.parquet` and `summary.csv`
    (`write_sweep`).
Does not own: the schema (harness.results.schema), summaries (harness.results.summary),
what goes into a manifest (harness.manifest), or deciding that a sweep failed.

A job directory holds, written in this order, each atomically:

    rows.parquet     the job's rows
    steps.parquet    raw per-step decode latencies (optional)
    manifest.json    the manifest (`harness.manifest.collect_manifest`)
    DONE             JSON {"status", "rows", "config_hash", "files", ...}; written last

Decisions readers rely on:
  * A job is *complete* when its DONE record exists and agrees with the files beside it: the
    row count of rows.parquet and, for every file DONE lists under "files" (rows, steps,
    manifest), its size and SHA-256 -- a rows.parquet damaged after the job finished, even with
    its Parquet footer intact, makes the job incomplete, so a resume measures it again (DONE
    records written before "files" existed are checked by row count alone). A load of such a
    dir names the damaged file. Only complete jobs are read: a job dir without a valid
    DONE -- killed mid-write, or being rewritten by a rerun -- contributes no rows, and its
    job is not read from a sweep table under the same root either (the table may predate it).
  * `load` reads complete job dirs first, then sweep-level tables (`results.parquet`) for
    jobs not found in any job dir; each group in sorted path order; a job is taken from
    exactly one file.
  * Temp files (`.<name>.*.tmp`) are never read, and the next write in their directory
    removes them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.results.schema import (_BOOL_COLUMNS, _INT_COLUMNS, _META_KEY, _NOT_NULL, COLUMN_TYPES,
                                    ADDED_COLUMNS, DONE_FILE, MANIFEST_FILE, REQUIRED_COLUMNS, ROWS_FILE, SCHEMA_VERSION,
                                    STATUSES, STEPS_FILE, SUMMARY_FILE, SWEEP_STEPS, SWEEP_TABLE,
                                    ResultsError, frame_to_table, rows_to_table)
from harness.results.summary import spread_table

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
STEP_COLUMNS = ["sweep_id", "job_id", "repeat", "profiler", "phase", "step", "tpot_s"]


# ----------------------------------------------------------------------------- atomic writes

def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never a part.

    Raises OSError (naming nothing: callers say which file) when the write or rename fails;
    the temp file is removed then."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _file_record(data: bytes) -> dict[str, Any]:
    """What DONE records of one file it vouches for: its size and SHA-256."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(_TMP_SUFFIX)


def remove_temp_files(directory: Path) -> int:
    """Delete temp files left in `directory` by killed writes; returns how many."""
    n = 0
    if directory.is_dir():
        for leftover in directory.iterdir():
            if _is_temp(leftover) and leftover.is_file():
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
                    n += 1
    return n


# ----------------------------------------------------------------------------- jobs

def steps_table(steps: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Per-step latency rows ({sweep_id, job_id, repeat, profiler, phase, step, tpot_s}) as Arrow."""
    types = {"sweep_id": pa.string(), "job_id": pa.string(), "repeat": pa.int64(), "profiler": pa.string(),
             "phase": pa.string(), "step": pa.int64(), "tpot_s": pa.float64()}
    return pa.table({c: pa.array([s.get(c) for s in steps], type=types[c]) for c in STEP_COLUMNS})


def write_job(job_dir: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], manifest: Mapping[str, Any],
              *, config_hash: str | None = None, steps: Sequence[Mapping[str, Any]] | None = None,
              measurement_key: str | None = None) -> None:
    """Write one job: rows.parquet, steps.parquet (when given), manifest.json, then DONE.

    All rows must belong to one (sweep_id, job_id). A DONE from an earlier run is removed
    first, so a crash part-way leaves the job incomplete (never read) rather than mixed.
    `config_hash` (harness.sweep.job_fingerprint) goes into DONE for resume decisions, and
    `measurement_key` (harness.sweep.measurement_key) for a sweep's twin jobs.
    Raises ResultsError for bad rows or manifest, OSError when a file cannot be written.
    """
    job_dir = Path(job_dir)
    if not rows:
        raise ResultsError(f"write_job({job_dir}): no rows; a failed job records failed_row(...)")
    table = rows_to_table(rows)
    jobs = sorted(set(zip(table.column("sweep_id").to_pylist(), table.column("job_id").to_pylist())))
    if len(jobs) != 1:
        raise ResultsError(f"write_job({job_dir}): rows must belong to one (sweep_id, job_id); got {jobs}")
    try:
        manifest_text = json.dumps(manifest, indent=2, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"write_job({job_dir}): manifest is not JSON-serialisable: {exc}") from exc
    status = "failed" if "failed" in table.column("status").to_pylist() else "ok"

    files = {ROWS_FILE: _parquet_bytes(table)}
    if steps:
        files[STEPS_FILE] = _parquet_bytes(steps_table(steps))
    files[MANIFEST_FILE] = (manifest_text + "\n").encode()

    job_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (job_dir / DONE_FILE).unlink()
    remove_temp_files(job_dir)
    if not steps:
        with contextlib.suppress(FileNotFoundError):
            (job_dir / STEPS_FILE).unlink()
    for name, data in files.items():             # rows, steps, manifest: in this order, each atomically
        atomic_write_bytes(job_dir / name, data)
    done = {"status": status, "rows": table.num_rows, "schema_version": SCHEMA_VERSION,
            "sweep_id": jobs[0][0], "job_id": jobs[0][1], "config_hash": config_hash,
            "measurement_key": measurement_key, "files": {name: _file_record(data) for name, data in files.items()}}
    atomic_write_text(job_dir / DONE_FILE, json.dumps(done) + "\n")
    log.debug("wrote job %s (%d rows, %s)", job_dir, table.num_rows, status)


def prepare_job_dir(job_dir: str | os.PathLike[str]) -> None:
    """Make a job dir ready for this run's files before the job is measured: created, shown to be
    writable (a temp file made and removed, so a dir no one may write is found now, not after an
    hour of measuring), and marked incomplete (`invalidate_job`). Raises OSError, with the path,
    when the dir cannot be made or written."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=job_dir, prefix=".probe.", suffix=_TMP_SUFFIX)
    os.close(fd)
    os.unlink(probe)
    invalidate_job(job_dir)


def invalidate_job(job_dir: str | os.PathLike[str]) -> None:
    """Mark a job incomplete (its DONE removed) before it is measured again: until the new
    results are written, no load, table or interrupted sweep reads its old rows -- of another
    config, or a failed attempt -- as this run's. The old files stay until they are replaced."""
    with contextlib.suppress(FileNotFoundError):
        (Path(job_dir) / DONE_FILE).unlink()


def remove_job(job_dir: str | os.PathLike[str]) -> None:
    """Retire a job dir's results (DONE first, so it is never read half-removed): for a job that a
    twin stands in for, whose dir may hold an older config's. Its rows.parquet stays, without DONE
    or manifest, as the mark of an incomplete job, so that until the sweep table is written again
    no load reads the job's older rows from the table; `write_sweep` then deletes it."""
    for name in (DONE_FILE, STEPS_FILE, MANIFEST_FILE):
        with contextlib.suppress(FileNotFoundError):
            (Path(job_dir) / name).unlink()


def _clear_leftovers(job_dirs: Iterable[Path]) -> None:
    """Delete what incomplete jobs left (their rows, steps and manifest): called once the sweep
    table no longer holds their older rows, or holds their failed row instead."""
    for job_dir in job_dirs:
        for name in (ROWS_FILE, STEPS_FILE, MANIFEST_FILE):
            try:
                (job_dir / name).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:      # the table is written; a leftover only stays marked incomplete
                log.warning("cannot remove %s: %s", job_dir / name, exc)


def read_done(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The DONE record of a complete job (see the module docstring), else None."""
    return inspect_job(job_dir)[0]


def inspect_job(job_dir: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str | None]:
    """(the DONE record of a complete job, None), or (None, why not): the why is None when the
    dir holds no DONE record at all (never finished, or being rewritten), and says what is wrong
    when it holds one that its files do not bear out (a file missing, damaged, or another size)."""
    job_dir = Path(job_dir)
    done = _done_record(job_dir)
    if done is None:
        return None, None
    if done.get("status") not in STATUSES:
        return None, f"its {DONE_FILE} record has status {done.get('status')!r}, not one of {list(STATUSES)}"
    for name in (ROWS_FILE, MANIFEST_FILE):
        if not (job_dir / name).is_file():
            return None, f"its {name} is missing"
    listed = done.get("files") if isinstance(done.get("files"), dict) else {}
    for name in (ROWS_FILE, STEPS_FILE, MANIFEST_FILE):     # only the files a job has: never a path DONE names
        if name in listed:
            why = _file_mismatch(job_dir / name, listed[name])
            if why:
                return None, why
    try:
        n = pq.read_metadata(job_dir / ROWS_FILE).num_rows
    except (pa.ArrowException, OSError) as exc:
        return None, f"its {ROWS_FILE} is unreadable ({type(exc).__name__}: {exc})"
    if n != done.get("rows"):
        return None, f"its {ROWS_FILE} holds {n} rows, its {DONE_FILE} records {done.get('rows')}"
    return done, None


def _file_mismatch(path: Path, want: Any, data: bytes | None = None) -> str | None:
    """Why `path` (its bytes, when already read) is not the file DONE recorded (`_file_record`), or None."""
    if not isinstance(want, dict):
        return f"its {DONE_FILE} record of {path.name} is not a size and hash"
    if data is None:
        try:
            size = path.stat().st_size
            if size != want.get("bytes"):           # found without reading the file
                return f"{path} has {size} bytes, its {DONE_FILE} records {want.get('bytes')}"
            data = path.read_bytes()
        except OSError as exc:
            return f"{path} is unreadable ({exc.strerror or exc})"
    got = _file_record(data)
    if got["bytes"] != want.get("bytes"):
        return f"{path} has {got['bytes']} bytes, its {DONE_FILE} records {want.get('bytes')}"
    if got["sha256"] != want.get("sha256"):
        return f"{path} is not the file its {DONE_FILE} records (SHA-256 differs): it changed after the job finished"
    return None


def job_status(job_dir: str | os.PathLike[str]) -> str | None:
    """"ok" or "failed" for a complete job, None when incomplete."""
    done = read_done(job_dir)
    return None if done is None else done["status"]


def job_complete(job_dir: str | os.PathLike[str]) -> bool:
    return read_done(job_dir) is not None


# ----------------------------------------------------------------------------- reading

def load(path: str | os.PathLike[str]) -> pd.DataFrame:
    """One validated DataFrame from a job dir, a sweep dir, any tree, or one Parquet file.

    Raises ResultsError naming every unreadable or invalid file, or when nothing is found.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"results path {root} does not exist")
    if root.is_file():
        if _is_temp(root) or root.suffix != ".parquet":
            raise ResultsError(f"{root}: not a results file; expected {ROWS_FILE}, {SWEEP_TABLE} "
                               "or another .parquet written by harness.results")
        return _read_tables([root], root)
    job_files, incomplete = _job_files(root)
    sweep_files = sorted(p for p in root.rglob(SWEEP_TABLE) if p.is_file())
    if not job_files and not sweep_files:
        raise ResultsError(f"no results under {root}: expected <job>/{ROWS_FILE} (with its {DONE_FILE}) or "
                           f"<sweep>/{SWEEP_TABLE} files (temp files and incomplete jobs are ignored)")
    return _read_tables(job_files + sweep_files, root, skip_jobs=set(incomplete))


def recorded_done(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The DONE record as written, its files not verified (None when there is none): a quick look
    across many jobs before `read_done` verifies the one that matters."""
    return _done_record(Path(job_dir))


def _done_record(job_dir: Path) -> dict[str, Any] | None:
    try:
        done = json.loads((job_dir / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return done if isinstance(done, dict) else None


def _job_files(root: Path) -> tuple[list[Path], dict[tuple[str, str], Path]]:
    """rows.parquet of jobs with a DONE record under root (validated when read: a corrupt file
    there is an error, not a skip), and the (sweep_id, job_id) of incomplete jobs (no DONE), each
    with its dir."""
    complete: list[Path] = []
    incomplete: dict[tuple[str, str], Path] = {}
    for rows_file in sorted(p for p in root.rglob(ROWS_FILE) if p.is_file()):
        if _done_record(rows_file.parent) is not None:
            complete.append(rows_file)
            continue
        log.warning("%s: job is incomplete (no %s); its rows are not read", rows_file.parent, DONE_FILE)
        with contextlib.suppress(pa.ArrowException, OSError, KeyError):
            t = pq.read_table(rows_file, columns=["sweep_id", "job_id"])
            incomplete.update(dict.fromkeys(zip(t.column("sweep_id").to_pylist(), t.column("job_id").to_pylist()),
                                            rows_file.parent))
    return complete, incomplete


def _read_tables(files: Iterable[Path], root: Path, skip_jobs: set[tuple[str, str]] = frozenset(),
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
        return _canonical(pd.DataFrame({c: pd.Series([], dtype=object) for c in REQUIRED_COLUMNS}))
    df = pd.concat(frames, ignore_index=True)
    extras = [c for c in df.columns if c not in REQUIRED_COLUMNS]
    return _canonical(df[REQUIRED_COLUMNS + extras])


def _read_one(file: Path) -> tuple[pd.DataFrame | None, str | None]:
    done = _done_record(file.parent) if file.name == ROWS_FILE else None
    try:
        data = file.read_bytes()
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        return None, f"unreadable Parquet ({type(exc).__name__}: {exc})"
    if done is not None and isinstance(done.get("files"), dict) and ROWS_FILE in done["files"]:
        why = _file_mismatch(file, done["files"][ROWS_FILE], data)      # readable, but not what the job wrote
        if why:
            return None, why
    for name, before in ADDED_COLUMNS.items():
        if name not in table.schema.names:
            table = table.append_column(pa.field(name, pa.string()), _legacy_column(table, before))
    why = _schema_problems(table.schema)
    if why:
        return None, why
    if file.name == ROWS_FILE:
        if done is not None and done.get("rows") != table.num_rows:
            return None, (f"holds {table.num_rows} rows but its {DONE_FILE} records {done.get('rows')}: "
                          "the job dir was changed after the job finished")
    df = table.to_pandas(types_mapper=_pandas_type)
    bad_status = sorted(set(df["status"].dropna()) - set(STATUSES))
    if bad_status:
        return None, f"column 'status' must be one of {list(STATUSES)}; got {bad_status}"
    nulls = [c for c in _NOT_NULL if df[c].isna().any()]
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
    version = (schema.metadata or {}).get(_META_KEY)
    if version is not None and version != str(SCHEMA_VERSION).encode():
        problems.append(f"schema_version {version.decode(errors='replace')}; this code reads "
                        f"{SCHEMA_VERSION}")
    checks = {"value": (pa.types.is_floating, pa.types.is_integer),
              **{c: (pa.types.is_integer,) for c in _INT_COLUMNS},
              **{c: (pa.types.is_boolean,) for c in _BOOL_COLUMNS}}
    for name in schema.names:
        if name not in COLUMN_TYPES:
            continue
        t = schema.field(name).type
        allowed = checks.get(name, (pa.types.is_string, pa.types.is_large_string))
        if not (pa.types.is_null(t) or any(ok(t) for ok in allowed)):
            problems.append(f"column {name!r} has type {t}; allowed: {COLUMN_TYPES[name]} or null")
    return "; ".join(problems) or None


def _pandas_type(t: pa.DataType) -> Any:
    if pa.types.is_integer(t):
        return pd.Int64Dtype()
    if pa.types.is_boolean(t):
        return pd.BooleanDtype()
    return None


def _canonical(df: pd.DataFrame) -> pd.DataFrame:
    """The dtypes `load` promises: value float64, integer columns Int64, emulated boolean."""
    df = df.copy()
    df["value"] = pd.to_numeric(df["value"]).astype("float64")
    for c in _INT_COLUMNS:
        df[c] = df[c].astype("Int64")
    for c in _BOOL_COLUMNS:
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
        df = pq.read_table(f).to_pandas(types_mapper=_pandas_type)
        keys = list(zip(df["sweep_id"], df["job_id"]))
        frames.append(df[[k not in seen for k in keys]])
        seen |= set(keys)
    if not frames:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in STEP_COLUMNS})
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------- sweeps

def write_sweep(sweep_dir: str | os.PathLike[str], extra_rows: Sequence[Mapping[str, Any]] = (),
                clear_leftovers: bool = False) -> pd.DataFrame:
    """Concatenate every complete job under `sweep_dir`, plus `extra_rows` (the failed rows of
    jobs whose own files could not be written; they replace whatever those jobs have on disk),
    into results.parquet, steps.parquet and summary.csv. Returns the long table.

    Reads job dirs only (an older results.parquet is replaced, never read), so running it
    twice gives the same files. With `clear_leftovers` (the sweep's writer, holding its lock:
    another process could be between a job's rows and its manifest), once the table is written,
    the leftovers of two kinds of incomplete job are deleted: a retired one (`remove_job`, or
    killed before its manifest was written: rows without a manifest) and one whose failed row
    `extra_rows` holds (its files could not be written), so `load` of the dir reads that row
    instead of skipping it as incomplete. A job being measured again when a sweep is interrupted
    keeps its older files.
    Raises ResultsError when there is nothing to write and OSError (with the path in its
    message) when a table cannot be written.
    """
    sweep_dir = Path(sweep_dir)
    remove_temp_files(sweep_dir)
    df, n_files, incomplete, replaced = _sweep_frame(sweep_dir, extra_rows)
    _write_or_raise(sweep_dir / SWEEP_TABLE, _parquet_bytes(frame_to_table(df)))
    steps = load_steps(sweep_dir, sweep_tables=False)
    if len(steps):
        _write_or_raise(sweep_dir / SWEEP_STEPS, _parquet_bytes(steps_table(steps.to_dict("records"))))
    _write_or_raise(sweep_dir / SUMMARY_FILE, spread_table(df).to_csv(index=False).encode())
    if clear_leftovers:
        _clear_leftovers(d for key, d in incomplete.items() if key in replaced or not (d / MANIFEST_FILE).is_file())
    n_failed = df.loc[df["status"] == "failed", "job_id"].nunique()
    log.info("sweep %s: %d rows from %d job files (%d failed jobs)", sweep_dir, len(df), n_files, n_failed)
    return df


def sweep_frame(sweep_dir: str | os.PathLike[str], extra_rows: Sequence[Mapping[str, Any]] = ()) -> pd.DataFrame:
    """The table `write_sweep` would write, read from the job dirs with nothing written: what a
    sweep whose dir cannot be written still shows of its finished jobs. Raises ResultsError as
    `write_sweep` does."""
    return _sweep_frame(Path(sweep_dir), extra_rows)[0]


def _sweep_frame(sweep_dir: Path, extra_rows: Sequence[Mapping[str, Any]]
                 ) -> tuple[pd.DataFrame, int, dict[tuple[str, str], Path], set[tuple[str, str]]]:
    """(the sweep's table, how many job files it read, the incomplete jobs, the jobs `extra_rows` replace)."""
    job_files, incomplete = _job_files(sweep_dir)
    extra = _canonical(rows_to_table(list(extra_rows)).to_pandas(types_mapper=_pandas_type)) if extra_rows else None
    if not job_files and extra is None:
        raise ResultsError(f"no jobs under sweep dir {sweep_dir}: expected complete <job>/{ROWS_FILE} files")
    df = _read_tables(job_files, sweep_dir, skip_jobs=incomplete.keys() - _keys(extra), extra=extra)
    return df, len(job_files), incomplete, _keys(extra)


def _keys(df: pd.DataFrame | None) -> set[tuple[str, str]]:
    return set() if df is None else set(zip(df["sweep_id"], df["job_id"]))


def _write_or_raise(path: Path, data: bytes) -> None:
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from exc
