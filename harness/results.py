"""The tidy results store: one observation per row, one Parquet file per job, one table per sweep.

Owns (DESIGN.md §5, §6, §7):
  * the row schema: column names and their Parquet types, metric names and their units;
  * building rows (`make_rows`, `failed_row`) and typing them as Arrow tables (`rows_to_table`).

Re-exports, from `harness.store` (the file I/O half, which imports the schema from here):
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

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa


log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

ROW_COLUMNS = ["sweep_id", "job_id", "repeat", "phase", "metric", "value", "unit", "source", "status"]
FACTOR_COLUMNS = ["engine", "model", "placement", "cache_capacity", "cache_policy", "prefetch",
                  "workload", "context_tokens", "gen_tokens", "batch", "dtype"]
DEVICE_COLUMNS = ["device_kind", "device_name", "emulated"]
REQUIRED_COLUMNS = ROW_COLUMNS + FACTOR_COLUMNS + DEVICE_COLUMNS

STATUSES = ("ok", "failed")
# §5: inside the engine, around the request, cost model; plus external profilers' own readings
SOURCES = ("engine", "client", "model", "nsys", "torch")
PHASES = ("load", "prefill_fresh", "prefill_continuation", "prefill_restored", "decode")
FAILED_PHASE = "job"      # the phase of the row a failed job records
ERROR_METRIC = "error"
ERROR_UNIT = "-"

ROWS_FILE = "rows.parquet"
MANIFEST_FILE = "manifest.json"
DONE_FILE = "DONE"
SWEEP_TABLE = "results.parquet"
SUMMARY_FILE = "summary.csv"
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
    # beyond §5: prefetch accounting and the copy ablation (profiling issue)
    "prefetch_issued": "count",
    "prefetch_used": "count",
    "prefetch_wasted_bytes": "B",
    "exposed_copy_ablation_s": "s",
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


# ----------------------------------------------------------------------------- store (re-exported)

# The file I/O half lives in harness.store, which imports the schema from here. Its public
# names are re-exported lazily (PEP 562) so that `harness.results` stays the one public face
# (DESIGN.md: `harness.results.load(path)`) and either module can be imported first without
# a circular import.
_STORE_NAMES = ("write_job", "job_status", "job_complete", "load", "write_sweep", "summarize",
                "SUMMARY_KEYS")

if TYPE_CHECKING:
    from harness.store import (SUMMARY_KEYS, job_complete, job_status, load, summarize,
                               write_job, write_sweep)


def __getattr__(name: str) -> Any:
    if name in _STORE_NAMES:
        from harness import store
        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_STORE_NAMES})
