"""A sweep's tables: every complete job of a sweep dir concatenated into `results.parquet`,
`steps.parquet` and `summary.csv` (`write_sweep`), or the same table with nothing written
(`sweep_frame`).

Owns: building the sweep table from the job dirs (plus the failed rows of jobs whose own files
could not be written) and, for the sweep's writer, deleting what incomplete jobs left once the
table no longer needs it. Does not own: job dirs (harness.results.store), reading
(harness.results.reader) or the summary's statistics (harness.results.summary).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.results.reader import canonical, load_steps, pandas_type, read_tables, scan_job_files
from harness.results.schema import (MANIFEST_FILE, ROWS_FILE, SUMMARY_FILE, SWEEP_STEPS, SWEEP_TABLE, ResultsError,
                                    frame_to_table, rows_to_table)
from harness.results.store import atomic_write_bytes, parquet_bytes, remove_leftovers, remove_temp_files, steps_table
from harness.results.summary import spread_table

log = logging.getLogger(__name__)


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
    _write_or_raise(sweep_dir / SWEEP_TABLE, parquet_bytes(frame_to_table(df)))
    steps = load_steps(sweep_dir, sweep_tables=False)
    if len(steps):
        _write_or_raise(sweep_dir / SWEEP_STEPS, parquet_bytes(steps_table(steps.to_dict("records"))))
    _write_or_raise(sweep_dir / SUMMARY_FILE, spread_table(df).to_csv(index=False).encode())
    if clear_leftovers:
        remove_leftovers(d for key, d in incomplete.items() if key in replaced or not (d / MANIFEST_FILE).is_file())
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
    job_files, incomplete = scan_job_files(sweep_dir)
    extra = canonical(rows_to_table(list(extra_rows)).to_pandas(types_mapper=pandas_type)) if extra_rows else None
    if not job_files and extra is None:
        raise ResultsError(f"no jobs under sweep dir {sweep_dir}: expected complete <job>/{ROWS_FILE} files")
    df = read_tables(job_files, sweep_dir, skip_jobs=incomplete.keys() - _keys(extra), extra=extra)
    return df, len(job_files), incomplete, _keys(extra)


def _keys(df: pd.DataFrame | None) -> set[tuple[str, str]]:
    return set() if df is None else set(zip(df["sweep_id"], df["job_id"]))


def _write_or_raise(path: Path, data: bytes) -> None:
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from exc
