"""The tidy results store: one observation per row, one Parquet file per job, one table per sweep.

Owns (DESIGN.md §5, §6, §7):
  * the row schema: column names and their Parquet types, metric names and their units;
  * building rows (`make_rows`, `failed_row`);
  * writing one job atomically (`write_job`) and telling whether a job finished
    (`job_complete`, `job_status`), so a re-run sweep can skip finished jobs;
  * reading a job dir, a sweep dir or any tree back into one validated DataFrame (`load`);
  * concatenating a sweep into `results.parquet` and a wide, human `summary.csv`
    (`write_sweep`, `summarize`).

Does not own: measuring (the harness's measurement code produces the numbers), what goes
into a manifest (`harness.manifest`), or deciding that a sweep failed (callers look at the
`status` column of the table `write_sweep` returns and exit non-zero themselves).

    rows = make_rows(factors, device, sweep_id="s1", job_id="0", repeat=0, phase="decode",
                     metrics={"time_s": 1.2, "peak_device_bytes": None}, source="engine")
    write_job(job_dir, rows, manifest)        # rows.parquet, manifest.json, DONE
    df = load("results/")                     # any tree, validated
    df = write_sweep(sweep_dir)               # results.parquet + summary.csv

A job directory holds, written in this order, each atomically (temp file in the same
directory, fsync, `os.replace`):

    rows.parquet     the job's rows
    manifest.json    the manifest (`harness.manifest.collect_manifest`)
    DONE             JSON {"status": "ok" | "failed", "rows": N, ...}; written last

Decisions, recorded here so that readers of the store can rely on them:
  * `value` is float64. None (or NaN) means "not measured" and is stored as Parquet null,
    never as 0 (DESIGN §7.8: device memory on CPU is null, not zero).
  * `cache_capacity` holds the *requested* capacity as a string ("4", "auto"), so sweeps
    that mix integers and "auto" have one Parquet type. A resolved capacity, when wanted,
    is an extra column (e.g. `n_experts_resident`).
  * `repeat`, `context_tokens`, `gen_tokens`, `batch` are nullable int64 (pandas "Int64");
    `emulated` is nullable bool (pandas "boolean"); the other fixed columns are strings.
  * Extra columns (`error`, `profiler`, `host`, `ubatch`, `cache_state`, ...) are kept,
    never dropped. An extra column whose values mix types is stored as strings.
  * A job is *complete* when its DONE marker exists (with rows.parquet and manifest.json
    beside it), whether it finished ok or failed-and-recorded: a recorded failure is a
    result, and a resumed sweep skips it. `job_status` tells the two apart, for a caller
    that wants to retry failures. A job killed before DONE is not complete; temp files
    (`.<name>.*.tmp`) are never read and are removed by the next `write_job` there.
    `load` still reads the rows.parquet of a job killed before DONE (the file is whole,
    being written atomically); a resumed sweep rewrites that job in place.
  * `load` reads every `rows.parquet` (job level) and every `results.parquet` (sweep
    level) under a path. Each (sweep_id, job_id) is taken from exactly one file: job-level
    files first, then sweep-level tables, each group in sorted path order; rows of a job
    already read from an earlier file are dropped. So a sweep dir holding both its job
    dirs and its concatenated table is not double counted, and a sweep table whose job
    dirs were pruned still loads.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

ROW_COLUMNS = ["sweep_id", "job_id", "repeat", "phase", "metric", "value", "unit", "source", "status"]
FACTOR_COLUMNS = ["engine", "model", "placement", "cache_capacity", "cache_policy", "prefetch",
                  "workload", "context_tokens", "gen_tokens", "batch", "dtype"]
DEVICE_COLUMNS = ["device_kind", "device_name", "emulated"]
REQUIRED_COLUMNS = ROW_COLUMNS + FACTOR_COLUMNS + DEVICE_COLUMNS

STATUSES = ("ok", "failed")
SOURCES = ("engine", "client", "model")  # §5: inside the engine, around the request, cost model
PHASES = ("load", "prefill_fresh", "prefill_continuation", "prefill_restored", "decode")
FAILED_PHASE = "job"      # the phase of the row a failed job records
ERROR_METRIC = "error"
ERROR_UNIT = "-"

ROWS_FILE = "rows.parquet"
MANIFEST_FILE = "manifest.json"
DONE_FILE = "DONE"
SWEEP_TABLE = "results.parquet"
SUMMARY_FILE = "summary.csv"
_TMP_SUFFIX = ".tmp"
_META_KEY = b"moebench.schema_version"

METRIC_UNITS: dict[str, str] = {
    "time_s": "s",
    "tokens": "count",
    "tok_per_s": "tok/s",
    "ttft_s": "s",
    "tpot_s_p50": "s",
    "tpot_s_p90": "s",
    "tpot_s_p99": "s",
    "reused_tokens": "count",
    "restore_s": "s",
    "h2d_bytes": "B",
    "d2h_bytes": "B",
    "expert_hits": "count",
    "expert_misses": "count",
    "expert_hit_bytes": "B",
    "expert_miss_bytes": "B",
    "hit_rate": "ratio",
    "byte_hit_rate": "ratio",
    "copy_busy_s": "s",
    "overlap_s": "s",
    "exposed_copy_s": "s",
    "overlap_frac": "ratio",
    "link_gbps": "GB/s",
    "peak_device_bytes": "B",
    "peak_host_rss_bytes": "B",
    "max_abs_logit_diff": "-",
    "token_agreement": "ratio",
}

_INT_COLUMNS = ("repeat", "context_tokens", "gen_tokens", "batch")
_BOOL_COLUMNS = ("emulated",)
# Parquet type of every fixed column (and of the optional `error` column).
COLUMN_TYPES: dict[str, pa.DataType] = {
    **{c: pa.string() for c in REQUIRED_COLUMNS},
    **{c: pa.int64() for c in _INT_COLUMNS},
    **{c: pa.bool_() for c in _BOOL_COLUMNS},
    "value": pa.float64(),
    "error": pa.string(),
}
_NOT_NULL = ("sweep_id", "job_id", "phase", "metric", "source", "status")

Row = dict[str, Any]


class ResultsError(ValueError):
    """Rows, a results file or a results tree that does not fit the schema."""


# ----------------------------------------------------------------------------- rows

def make_rows(factors: Mapping[str, Any], device: Mapping[str, Any], sweep_id: str, job_id: str,
              repeat: int | None, phase: str, metrics: Mapping[str, float | None], source: str, *,
              units: Mapping[str, str] | None = None, extra: Mapping[str, Any] | None = None,
              status: str = "ok") -> list[Row]:
    """One row per metric of one (job, repeat, phase, source).

    `metrics` maps a metric name to a number or None (not measured: stored as null, never 0).
    Units come from `METRIC_UNITS`; a metric outside that table needs its unit in `units`.
    Factor keys outside `FACTOR_COLUMNS`, device keys outside `DEVICE_COLUMNS` and `extra`
    become extra columns.
    """
    base = _base_row(factors, device, sweep_id, job_id, repeat, phase, source, status, extra)
    rows = []
    for metric, value in metrics.items():
        if not isinstance(metric, str) or not metric:
            raise ResultsError(f"metric names must be non-empty strings; got {metric!r}")
        rows.append(_with_metric(base, metric, _as_value(metric, value), _unit_for(metric, units)))
    return rows


def failed_row(factors: Mapping[str, Any], device: Mapping[str, Any], sweep_id: str, job_id: str,
               error: str, *, repeat: int | None = None, source: str = "client",
               extra: Mapping[str, Any] | None = None) -> Row:
    """The row a failed job records: phase "job", metric "error", value null, status "failed",
    and the error text in the `error` column."""
    if not isinstance(error, str) or not error.strip():
        raise ResultsError(f"failed_row needs the error text as a non-empty string; got {error!r}")
    extra = {**(extra or {}), "error": error}
    base = _base_row(factors, device, sweep_id, job_id, repeat, FAILED_PHASE, source, "failed", extra)
    return _with_metric(base, ERROR_METRIC, None, ERROR_UNIT)


def _with_metric(base: Row, metric: str, value: float | None, unit: str) -> Row:
    row = {c: base.get(c) for c in ROW_COLUMNS}  # the schema's column order first
    row.update(metric=metric, value=value, unit=unit)
    row.update((k, v) for k, v in base.items() if k not in row)
    return row


def _base_row(factors: Mapping[str, Any], device: Mapping[str, Any], sweep_id: str, job_id: str,
              repeat: int | None, phase: str, source: str, status: str,
              extra: Mapping[str, Any] | None) -> Row:
    if source not in SOURCES:
        raise ResultsError(f"source must be one of {list(SOURCES)}; got {source!r}")
    if status not in STATUSES:
        raise ResultsError(f"status must be one of {list(STATUSES)}; got {status!r}")
    if not isinstance(phase, str) or not phase:
        raise ResultsError(f"phase must be a non-empty string (e.g. one of {list(PHASES)}); got {phase!r}")
    if repeat is not None and (isinstance(repeat, bool) or not isinstance(repeat, numbers.Integral)):
        raise ResultsError(f"repeat must be an integer or None; got {repeat!r}")
    row: Row = {"sweep_id": _ident("sweep_id", sweep_id), "job_id": _ident("job_id", job_id),
                "repeat": None if repeat is None else int(repeat), "phase": phase,
                "source": source, "status": status}
    extras: Row = {}
    for key, value in factors.items():
        if key in FACTOR_COLUMNS:
            continue
        extras[key] = value
    row.update((c, _factor(c, factors.get(c))) for c in FACTOR_COLUMNS)
    for key, value in device.items():
        if key not in DEVICE_COLUMNS:
            extras[key] = value
    emulated = device.get("emulated")
    if emulated is not None and not isinstance(emulated, bool):
        raise ResultsError(f"device 'emulated' must be True, False or None; got {emulated!r}")
    row.update(device_kind=_opt_str(device.get("device_kind")),
               device_name=_opt_str(device.get("device_name")), emulated=emulated)
    extras.update(extra or {})
    clash = sorted(set(extras) & (set(REQUIRED_COLUMNS) | {"metric", "value", "unit"}))
    if clash:
        raise ResultsError(f"extra columns may not reuse schema column names; got {clash} "
                           f"(schema columns: {REQUIRED_COLUMNS})")
    row.update(extras)
    return row


def _ident(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)) or str(value) == "":
        raise ResultsError(f"{name} must be a non-empty string (or an integer); got {value!r}")
    return str(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _factor(column: str, value: Any) -> Any:
    if value is None:
        return None
    if column in _INT_COLUMNS:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise ResultsError(f"factor {column!r} must be an integer or None; got {value!r}")
    return str(value)  # cache_capacity: the requested value as text ("4", "auto")


def _as_value(metric: str, value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        value = value.item()  # 0-d tensors / arrays
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ResultsError(f"metric {metric!r}: value must be a real number, or None for "
                           f"'not measured'; got {value!r} ({type(value).__name__})")
    value = float(value)
    return None if math.isnan(value) else value


def _unit_for(metric: str, units: Mapping[str, str] | None) -> str:
    known = METRIC_UNITS.get(metric)
    given = (units or {}).get(metric)
    if known is not None:
        if given is not None and given != known:
            raise ResultsError(f"metric {metric!r} has unit {known!r} by contract (DESIGN §5); "
                               f"got unit {given!r}")
        return known
    if not given:
        raise ResultsError(f"metric {metric!r} is not one of the §5 metrics and no unit was given; "
                           f"pass units={{{metric!r}: '<unit>'}}, or use one of {sorted(METRIC_UNITS)}")
    return given


# ----------------------------------------------------------------------------- tables

def rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows as an Arrow table with the schema's column types (extras inferred, mixed -> str)."""
    columns: list[str] = list(REQUIRED_COLUMNS)
    seen = set(columns)
    for i, row in enumerate(rows):
        missing = [c for c in ROW_COLUMNS if c not in row]
        if missing:
            raise ResultsError(f"row {i} lacks columns {missing}; every row needs {ROW_COLUMNS}")
        for key in row:
            if key not in seen:
                seen.add(key)
                columns.append(key)
    data = {c: [row.get(c) for row in rows] for c in columns}
    data["value"] = [_as_value(str(m), v) for m, v in zip(data["metric"], data["value"])]
    return _table(data, columns)


def frame_to_table(df: pd.DataFrame) -> pa.Table:
    """A loaded DataFrame back to an Arrow table with the schema's column types."""
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(f"table lacks columns {missing}; required: {REQUIRED_COLUMNS}")
    return _table({c: df[c] for c in df.columns}, list(df.columns))


def _table(data: Mapping[str, Any], columns: list[str]) -> pa.Table:
    arrays = [_column_array(c, data[c]) for c in columns]
    table = pa.Table.from_arrays(arrays, names=columns)
    bad = set(table.column("status").to_pylist()) - set(STATUSES)
    if bad:
        raise ResultsError(f"column 'status' must be one of {list(STATUSES)}; got {sorted(map(str, bad))}")
    nulls = [c for c in _NOT_NULL if table.column(c).null_count]
    if nulls:
        raise ResultsError(f"columns {nulls} may not be null")
    return table.replace_schema_metadata({_META_KEY: str(SCHEMA_VERSION).encode()})


def _column_array(name: str, values: Any) -> pa.Array:
    if name in COLUMN_TYPES:
        try:
            return pa.array(values, type=COLUMN_TYPES[name], from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise ResultsError(f"column {name!r} must hold {COLUMN_TYPES[name]} (or null); "
                               f"got values like {_sample(values)}: {exc}") from exc
    try:
        array = pa.array(values, from_pandas=True)
        if _plain_type(array.type):
            return array
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        pass
    log.warning("extra column %r mixes types (e.g. %s); storing it as strings", name, _sample(values))
    return pa.array([None if _missing(v) else str(v) for v in values], type=pa.string())


def _plain_type(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t))


def _missing(value: Any) -> bool:
    if value is None or value is pd.NA:
        return True
    return isinstance(value, float) and math.isnan(value)


def _sample(values: Any, n: int = 3) -> str:
    out = []
    for v in values:
        if not _missing(v):
            out.append(repr(v))
        if len(out) == n:
            break
    return "[" + ", ".join(out) + "]"


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
    """"ok" or "failed" for a complete job (see module docstring), None when incomplete."""
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
    module docstring for how a job present in several files is counted once. Raises
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
    `n_repeats` counts the repeats. Engine, client and model values of one metric are kept
    apart by the `source` key (§5: never mixed in one number). A failed job appears as a
    row with status "failed" and its `error` text.
    """
    ok = df[df["status"] == "ok"]
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
