"""The file I/O half of the results store: job directories, sweep tables, loading.

Owns (DESIGN.md §6, §7):
  * writing files atomically (temp file in the same directory, fsync, `os.replace`);
  * writing one job (`write_job`: rows.parquet, manifest.json, then the DONE marker) and
    telling whether a job finished (`job_complete`, `job_status`);
  * reading a job dir, a sweep dir, any tree or one Parquet file back into one validated
    DataFrame (`load`), each (sweep_id, job_id) counted once;
  * concatenating a sweep into `results.parquet` and a wide `summary.csv`
    (`write_sweep`, `summarize`).

Does not own: the schema, row building or typing rows as Arrow tables (`harness.results`,
imported from here), what goes into a manifest (`harness.manifest`), or deciding that a
sweep failed (callers look at the `status` column).

Callers use these through `harness.results`, which re-exports them (`results.load(path)`);
the file layout and the decisions readers rely on (what "complete" means, how `load`
counts a job present in several files) are documented in `harness.results`.
"""
from __future__ import annotations

import contextlib
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

from harness.results import (_BOOL_COLUMNS, _INT_COLUMNS, _META_KEY, _NOT_NULL, COLUMN_TYPES,
                             DEVICE_COLUMNS, DONE_FILE, FACTOR_COLUMNS, FAILED_PHASE,
                             MANIFEST_FILE, METRIC_UNITS, PHASES, REQUIRED_COLUMNS, ROWS_FILE,
                             SCHEMA_VERSION, STATUSES, SUMMARY_FILE, SWEEP_TABLE, ResultsError,
                             frame_to_table, rows_to_table)

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"


# ----------------------------------------------------------------------------- atomic writes

def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never a part."""
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


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(_TMP_SUFFIX)


# ----------------------------------------------------------------------------- jobs

def write_job(job_dir: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]],
              manifest: Mapping[str, Any]) -> None:
    """Write one job: rows.parquet, then manifest.json, then the DONE marker, each atomically.

    All rows must belong to one (sweep_id, job_id). A stale DONE from an earlier run is
    removed first, so a crash part-way leaves the job incomplete rather than mixed.
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

    job_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (job_dir / DONE_FILE).unlink()
    _atomic_write_bytes(job_dir / ROWS_FILE, _parquet_bytes(table))
    _atomic_write_bytes(job_dir / MANIFEST_FILE, (manifest_text + "\n").encode())
    done = {"status": status, "rows": table.num_rows, "schema_version": SCHEMA_VERSION,
            "sweep_id": jobs[0][0], "job_id": jobs[0][1]}
    _atomic_write_bytes(job_dir / DONE_FILE, (json.dumps(done) + "\n").encode())
    for leftover in job_dir.iterdir():  # temp files of killed earlier runs
        if _is_temp(leftover) and leftover.is_file():
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    log.debug("wrote job %s (%d rows, %s)", job_dir, table.num_rows, status)


def job_status(job_dir: str | os.PathLike[str]) -> str | None:
    """"ok" or "failed" for a complete job (see `harness.results`), None when incomplete."""
    job_dir = Path(job_dir)
    if not ((job_dir / ROWS_FILE).is_file() and (job_dir / MANIFEST_FILE).is_file()):
        return None
    try:
        done = json.loads((job_dir / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    status = done.get("status") if isinstance(done, dict) else None
    return status if status in STATUSES else None


def job_complete(job_dir: str | os.PathLike[str]) -> bool:
    """True when the job finished and was recorded, ok or failed; a resumed sweep skips it."""
    return job_status(job_dir) is not None


# ----------------------------------------------------------------------------- reading

def load(path: str | os.PathLike[str]) -> pd.DataFrame:
    """One validated DataFrame from a job dir, a sweep dir, any tree, or one Parquet file.

    Reads every rows.parquet and results.parquet below `path` (never temp files); see the
    `harness.results` docstring for how a job present in several files is counted once. Raises
    ResultsError naming every unreadable or invalid file, or when nothing is found.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"results path {root} does not exist")
    if root.is_file():
        if _is_temp(root) or root.suffix != ".parquet":
            raise ResultsError(f"{root}: not a results file; expected {ROWS_FILE}, {SWEEP_TABLE} "
                               "or another .parquet written by harness.results")
        return _read_tables([root], root)
    job_files = sorted(p for p in root.rglob(ROWS_FILE) if p.is_file())
    sweep_files = sorted(p for p in root.rglob(SWEEP_TABLE) if p.is_file())
    if not job_files and not sweep_files:
        raise ResultsError(f"no results under {root}: expected <job>/{ROWS_FILE} or "
                           f"<sweep>/{SWEEP_TABLE} files (temp files are ignored)")
    return _read_tables(job_files + sweep_files, root)


def _read_tables(files: Iterable[Path], root: Path) -> pd.DataFrame:
    frames: list[pd.DataFrame] = []
    problems: list[str] = []
    seen_jobs: set[tuple[str, str]] = set()
    for file in files:
        frame, why = _read_one(file)
        if why:
            problems.append(f"{file}: {why}")
            continue
        assert frame is not None
        keys = list(zip(frame["sweep_id"], frame["job_id"]))
        dup = pd.Series([k in seen_jobs for k in keys], index=frame.index, dtype=bool)
        if dup.any():
            log.debug("%s: %d rows of jobs already read from another file; skipped", file, int(dup.sum()))
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
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        return None, f"unreadable Parquet ({type(exc).__name__}: {exc})"
    why = _schema_problems(table.schema)
    if why:
        return None, why
    df = table.to_pandas(types_mapper=_pandas_type)
    bad_status = sorted(set(df["status"].dropna()) - set(STATUSES))
    if bad_status:
        return None, f"column 'status' must be one of {list(STATUSES)}; got {bad_status}"
    nulls = [c for c in _NOT_NULL if df[c].isna().any()]
    if nulls:
        return None, f"columns {nulls} have nulls; they may not"
    return df, None


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


# ----------------------------------------------------------------------------- sweeps

def write_sweep(sweep_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """Concatenate every job under `sweep_dir` into results.parquet and summary.csv.

    Reads the job-level rows.parquet files only (they are the truth; an older
    results.parquet is replaced, never read), so running it twice gives the same files.
    Returns the long table.
    """
    sweep_dir = Path(sweep_dir)
    job_files = sorted(p for p in sweep_dir.rglob(ROWS_FILE) if p.is_file())
    if not job_files:
        raise ResultsError(f"no jobs under sweep dir {sweep_dir}: expected <job>/{ROWS_FILE} files")
    df = _read_tables(job_files, sweep_dir)
    _atomic_write_bytes(sweep_dir / SWEEP_TABLE, _parquet_bytes(frame_to_table(df)))
    _atomic_write_bytes(sweep_dir / SUMMARY_FILE, summarize(df).to_csv(index=False).encode())
    n_failed = df.loc[df["status"] == "failed", "job_id"].nunique()
    log.info("sweep %s: %d rows from %d job files (%d failed jobs)", sweep_dir, len(df),
             len(job_files), n_failed)
    return df


SUMMARY_KEYS = ["sweep_id", "job_id", *FACTOR_COLUMNS, *DEVICE_COLUMNS, "phase", "source"]


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Wide table: one row per (job, phase, source), one column per metric.

    Values are medians over repeats of status-ok rows (nulls ignored; all-null stays null);
    rows from instrumented runs (a `profiler` column other than "none") are left out.
    `n_repeats` counts the repeats. Engine, client and model values of one metric are kept
    apart by the `source` key (§5: never mixed in one number). A failed job appears as a
    row with status "failed" and its `error` text.
    """
    ok = df[df["status"] == "ok"]
    if "profiler" in ok.columns:   # §7.5: speed tables come from runs with instrumentation off
        ok = ok[ok["profiler"].isna() | (ok["profiler"] == "none")]
    wide = (ok.groupby([*SUMMARY_KEYS, "metric"], dropna=False, sort=False)["value"].median()
            .unstack("metric"))
    n_repeats = ok.groupby(SUMMARY_KEYS, dropna=False, sort=False)["repeat"].nunique()
    wide = wide.assign(n_repeats=n_repeats).reset_index()
    metrics = [m for m in METRIC_UNITS if m in wide.columns]
    metrics += sorted(c for c in wide.columns
                      if c not in metrics and c not in SUMMARY_KEYS and c != "n_repeats")
    wide["status"] = "ok"
    wide["error"] = pd.NA
    failed = df[df["status"] == "failed"]
    failed = failed.assign(error=failed["error"] if "error" in failed.columns else pd.NA)
    failed = failed[[*SUMMARY_KEYS, "status", "error"]].drop_duplicates()
    columns = [*SUMMARY_KEYS, "status", "n_repeats", *metrics, "error"]
    parts = [p for p in (wide.reindex(columns=columns), failed.reindex(columns=columns)) if len(p)]
    if not parts:
        return pd.DataFrame(columns=columns)
    out = pd.concat(parts, ignore_index=True)
    job_order = {j: i for i, j in enumerate(dict.fromkeys(zip(df["sweep_id"], df["job_id"])))}
    phase_rank = {p: i for i, p in enumerate(PHASES)}
    out["_job"] = [job_order[k] for k in zip(out["sweep_id"], out["job_id"])]
    out["_phase"] = [phase_rank.get(p, len(PHASES) + (p == FAILED_PHASE)) for p in out["phase"]]
    out = out.sort_values(["_job", "_phase", "phase", "source"], kind="stable")
    out["n_repeats"] = out["n_repeats"].astype("Int64")
    return out.drop(columns=["_job", "_phase"]).reset_index(drop=True)