"""The row schema of the tidy results store (DESIGN.md §5, §6): column names and their Parquet
types, building rows (`make_rows`, `failed_row`) and typing them as Arrow tables
(`rows_to_table`, `frame_to_table`). Metric names, units and phases come from
`harness.contract`. Does not own: files (harness.results.store) or summaries
(harness.results.summary).

    rows = make_rows(factors, device, sweep_id="s1", job_id="0", repeat=0, phase="decode",
                     metrics={"time_s": 1.2, "peak_device_bytes": None}, source="engine")
"""
from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import pyarrow as pa

from harness.contract import FAILED_PHASE, METRIC_UNITS, PHASES


log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

ROW_COLUMNS = ["sweep_id", "job_id", "repeat", "phase", "metric", "value", "unit", "source", "status"]
FACTOR_COLUMNS = ["engine", "model", "placement", "cache_capacity", "cache_policy", "prefetch",
                  "workload", "context_tokens", "gen_tokens", "batch", "dtype", "expert_quant", "kv_dtype"]
# factor columns added after schema v1 was first written: a file without one reads, for each engine's
# rows, what that engine declares its rows held before the column existed (its adapter's
# `columns_before`: our engine ran exact experts only until experts.quant and kept its KV in the
# model's dtype until kv.dtype; other engines' weights and caches are their knobs) and null for any
# other, so old baselines stay comparable with new runs of the same configuration
ADDED_COLUMNS = ("expert_quant", "kv_dtype")
DEVICE_COLUMNS = ["device_kind", "device_name", "emulated"]
# the columns that tell one configuration from another beside the factors: a cache given in bytes
# (cache_capacity "bytes"), placement options, the micro-batch, the token source, the expert-cache
# start, the thread count, a load's arrival process, rate and concurrency (load=none: null); then every
# registered engine's knob columns (CONFIG_COLUMNS)
JOB_COLUMNS = ("cache_capacity_bytes", "placement_options", "ubatch", "token_source", "expert_cache_mode", "threads",
               "load", "load_rate", "load_max_concurrency")
REQUIRED_COLUMNS = ROW_COLUMNS + FACTOR_COLUMNS + DEVICE_COLUMNS

STATUSES = ("ok", "failed")
# §5: inside the engine, around the request, cost model; plus external profilers' own readings
SOURCES = ("engine", "client", "model", "nsys", "torch")
ERROR_METRIC = "error"
ERROR_UNIT = "-"

ROWS_FILE = "rows.parquet"
MANIFEST_FILE = "manifest.json"
DONE_FILE = "DONE"
SWEEP_TABLE = "results.parquet"
SUMMARY_FILE = "summary.csv"
STEPS_FILE = "steps.parquet"           # per job: raw per-step decode latencies
SWEEP_STEPS = "results_steps.parquet"   # per sweep: every job's steps
META_KEY = b"moebench.schema_version"


INT_COLUMNS = ("repeat", "context_tokens", "gen_tokens", "batch")
BOOL_COLUMNS = ("emulated",)
# Parquet type of every fixed column (and of the optional `error` column).
COLUMN_TYPES: dict[str, pa.DataType] = {
    **{c: pa.string() for c in REQUIRED_COLUMNS},
    **{c: pa.int64() for c in INT_COLUMNS},
    **{c: pa.bool_() for c in BOOL_COLUMNS},
    "value": pa.float64(),
    "error": pa.string(),
}
NOT_NULL_COLUMNS = ("sweep_id", "job_id", "phase", "metric", "source", "status")

Row = dict[str, Any]


def added_column_values() -> dict[str, dict[str, str]]:
    """ADDED_COLUMNS -> {engine: the value its rows held before the column existed}, as the
    registered engine adapters declare it (harness.engines.registry)."""
    from harness.engines.registry import columns_before
    before = columns_before()
    return {column: before.get(column, {}) for column in ADDED_COLUMNS}


def config_columns() -> list[str]:
    """Every row column that tells one configuration from another: the factors, what a job adds
    beside them (JOB_COLUMNS), and every registered engine's knob columns (llama.cpp's -ngl, its
    GGUF type ...). What tables, comparisons and plots group by, so no two settings pool into one
    number. `CONFIG_COLUMNS` is this list, made on first use (it asks the engine registry)."""
    from harness.engines.registry import knob_columns
    return list(dict.fromkeys([*FACTOR_COLUMNS, *JOB_COLUMNS, *knob_columns()]))


def __getattr__(name: str) -> Any:
    if name == "CONFIG_COLUMNS":
        value = globals()["CONFIG_COLUMNS"] = config_columns()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
               extra: Mapping[str, Any] | None = None, phase: str = FAILED_PHASE) -> Row:
    """The row a failure records: phase "job" (or the part that failed, e.g. a profiling pass),
    metric "error", value null, status "failed", and the error text in the `error` column."""
    if not isinstance(error, str) or not error.strip():
        raise ResultsError(f"failed_row needs the error text as a non-empty string; got {error!r}")
    extra = {**(extra or {}), "error": error}
    base = _base_row(factors, device, sweep_id, job_id, repeat, phase, source, "failed", extra)
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
    if column in INT_COLUMNS:
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
    nulls = [c for c in NOT_NULL_COLUMNS if table.column(c).null_count]
    if nulls:
        raise ResultsError(f"columns {nulls} may not be null")
    return table.replace_schema_metadata({META_KEY: str(SCHEMA_VERSION).encode()})


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
