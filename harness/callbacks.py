"""Hydra callback: at the end of a multirun, join every job into the sweep table.

Owns: writing `<sweep dir>/results.parquet`, `results_steps.parquet` and `summary.csv`
(harness.results.write_sweep) after the last job, whatever happened to the others -- with the
failed rows of jobs whose own files could not be written, held in memory (`STATE["unwritten"]`;
in-process launchers only) -- and flagging failures so the CLI exits non-zero: a failed job, a job
whose reference check failed (`STATE["check_failed"]`, read from the table, so any launcher's), or
a table that could not be written (the CLI prints `STATE["table_error"]` as one line). Works for
any launcher: it reads the job dirs, not process memory, for everything that was written.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness import results
from harness.checks import failed_check_jobs
from harness.report import Reporter, close_progress

log = logging.getLogger(__name__)
STATE: dict[str, Any] = {"failed_jobs": 0, "sweep_dir": None, "unwritten": [], "table_error": None,
                         "check_failed": [],      # job ids whose reference check failed (harness.checks)
                         "handled_jobs": set()}   # job ids this process measured or found current (same hash):
                                                  # added as each is reached (JobContext.reached), before its DONE


def write_sweep_table(sweep_dir: Path, quiet: bool) -> pd.DataFrame | None:
    """Write the sweep's tables; None (with STATE["table_error"] set) when that is impossible, and
    None when no job is left to write (every one retired): then tables written before, which held
    only those jobs' rows, are removed, so no load reads them."""
    try:
        df = results.write_sweep(sweep_dir, extra_rows=STATE["unwritten"], clear_leftovers=True)   # under the CLI's lock
    except results.ResultsError as exc:
        if "no jobs under" in str(exc):
            for name in (results.SWEEP_TABLE, results.SWEEP_STEPS, results.SUMMARY_FILE):
                (sweep_dir / name).unlink(missing_ok=True)
            return None
        STATE["table_error"] = f"cannot write the sweep table for {sweep_dir}: {exc}"
        return None
    except OSError as exc:
        STATE["table_error"] = str(exc) if str(sweep_dir) in str(exc) else f"cannot write the sweep table in {sweep_dir}: {exc}"
        return None
    STATE["sweep_dir"] = str(sweep_dir)
    return df


def show_sweep_table(sweep_dir: Path, quiet: bool, note: str = "", as_found: bool = False) -> int:
    """Print the table of the jobs `sweep_dir` holds, for a sweep whose table could not be written:
    this run's (the job dirs, with the failed rows kept in memory), or with `as_found` -- a dir
    this run could not write at all -- whatever the dir holds (`results.load`: its job dirs, then
    its last table). Returns how many jobs it holds (0: nothing to show)."""
    try:
        df = results.load(sweep_dir) if as_found else results.sweep_frame(sweep_dir, extra_rows=STATE["unwritten"])
    except (results.ResultsError, OSError) as exc:
        log.debug("no table to show for %s: %s", sweep_dir, exc)
        return 0
    close_progress()
    Reporter(quiet=quiet).sweep_table(df, f"sweep {sweep_dir.name}{note}")
    return int(df["job_id"].nunique())


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        quiet = bool(config.run.quiet)
        df = write_sweep_table(sweep_dir, quiet)
        if df is None:
            if STATE["table_error"]:     # not written: its jobs are shown all the same, then the CLI's one line
                show_sweep_table(sweep_dir, quiet, " (not written)")
            return
        failed = df[df["status"] == "failed"]["job_id"].nunique()
        STATE["failed_jobs"] = int(failed)
        STATE["check_failed"] = failed_check_jobs(df)
        close_progress()                 # the progress line ends before the table prints
        Reporter(quiet=quiet).sweep_table(df, f"sweep {sweep_dir.name}")
        print(f"sweep table: {sweep_dir / results.SWEEP_TABLE} ({df['job_id'].nunique()} jobs, {failed} failed); "
              f"summary: {sweep_dir / results.SUMMARY_FILE}")
