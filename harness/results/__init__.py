"""The tidy results store: one observation per row, one Parquet file per job, one table per sweep.

Five modules, one public face (`from harness import results`):
  * `schema`      -- row columns and their Parquet types; `make_rows`, `failed_row`, Arrow typing;
  * `store`       -- atomic job writes (`write_job`, `read_done`, `job_status`);
  * `reader`      -- `load` of a job dir, sweep dir or tree, `load_steps`;
  * `sweep_table` -- a sweep's tables (`write_sweep`, `sweep_frame`);
  * `summary`     -- medians with spread (`spread_table`, summary.csv) and the wide `summarize`.
Metric names, units and phases are the contract's (`harness.contract`).

    rows = results.make_rows(factors, device, "s1", "0", 0, "decode", {"time_s": 1.2}, "engine")
    results.write_job(job_dir, rows, manifest, config_hash="...")
    df = results.load("results/sweeps/s1")       # validated; incomplete jobs are not read
    df = results.write_sweep(sweep_dir)          # results.parquet + results_steps.parquet + summary.csv

Decisions recorded here so that readers can rely on them:
  * `value` is float64. None (or NaN) means "not measured" and is stored as Parquet null,
    never as 0 (DESIGN §7.8: device memory on CPU is null, not zero).
  * `cache_capacity` holds the *requested* capacity as a string ("4", "auto"); the resolved
    one is the extra column `resolved_capacity`.
  * `repeat`, `context_tokens`, `gen_tokens`, `batch` are nullable int64 (pandas "Int64");
    `emulated` is nullable bool; the other fixed columns are strings. Extra columns are
    kept, never dropped; an extra column whose values mix types is stored as strings.
  * what "complete" means: see `harness.results.store`; how a job present in several files is
    read once: `harness.results.reader`.
"""
from typing import Any

from harness.results.schema import (DEVICE_COLUMNS, DONE_FILE, ERROR_METRIC, FACTOR_COLUMNS, MANIFEST_FILE,
                                    REQUIRED_COLUMNS, ROW_COLUMNS, ROWS_FILE, SCHEMA_VERSION, SOURCES, STATUSES,
                                    STEPS_FILE, SUMMARY_FILE, SWEEP_STEPS, SWEEP_TABLE, ResultsError, Row,
                                    failed_row, frame_to_table, make_rows, rows_to_table)
from harness.results.reader import load, load_steps
from harness.results.store import (atomic_write_bytes, atomic_write_text, inspect_job, invalidate_job, job_complete,
                                   job_status, prepare_job_dir, read_done, recorded_done, remove_job, remove_temp_files,
                                   write_job)
from harness.results.sweep_table import sweep_frame, write_sweep
from harness.results.summary import SUMMARY_KEYS, spread_table, summarize
from harness.contract import FAILED_PHASE, METRIC_UNITS, PHASES


def __getattr__(name: str) -> Any:
    """CONFIG_COLUMNS, made on first use: it asks the engine registry for the engines' knob columns."""
    if name == "CONFIG_COLUMNS":
        from harness.results import schema
        value = globals()["CONFIG_COLUMNS"] = schema.CONFIG_COLUMNS
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CONFIG_COLUMNS", "DEVICE_COLUMNS", "DONE_FILE", "ERROR_METRIC", "FACTOR_COLUMNS", "FAILED_PHASE", "MANIFEST_FILE",
    "METRIC_UNITS", "PHASES", "REQUIRED_COLUMNS", "ROW_COLUMNS", "ROWS_FILE", "SCHEMA_VERSION", "SOURCES",
    "STATUSES", "STEPS_FILE", "SUMMARY_FILE", "SUMMARY_KEYS", "SWEEP_STEPS", "SWEEP_TABLE", "ResultsError",
    "Row", "atomic_write_bytes", "atomic_write_text", "inspect_job", "invalidate_job", "failed_row", "frame_to_table",
    "job_complete", "job_status", "load", "load_steps", "make_rows", "prepare_job_dir", "read_done", "recorded_done", "remove_job",
    "remove_temp_files", "rows_to_table", "spread_table", "summarize", "sweep_frame", "write_job", "write_sweep",
]
