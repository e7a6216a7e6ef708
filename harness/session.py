"""What one `moebench` run keeps across its jobs -- an object passed in, never module state -- and
the end of a sweep.

Owns: `RunSession`: the measured-engine cache (harness.engines.EngineCache), the references
computed so far (harness.reference's memo), the sweep's progress display
(harness.report.SweepProgress) and the sweep's tally -- failed jobs, the failed rows of jobs
whose files could not be written (kept in memory for the table), jobs that failed their
reference check, the jobs this run reached, a table that could not be written. And the end of a
sweep: its table written (`write_sweep_table`), shown (`RunSession.show_table`), judged
(`RunSession.end_sweep`). The CLI makes one session per command and hands it to the Hydra app
(harness.cli) and from there to `harness.runner.run`.

A launcher that runs jobs in other processes (submitit) pickles the task function and the
session with it: the other process gets a fresh one (nothing loaded, no progress display, an
empty tally). What its jobs did is read from their dirs at the end -- the table holds every
written job whatever process ran it; only the rows of a job whose files could not be written
stay in that process.
Does not own: writing a job (harness.results.write_job), the row schema, Hydra.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness import results
from harness.checks import failed_check_jobs
from harness.engines import EngineCache
from harness.report import Reporter, SweepProgress

log = logging.getLogger(__name__)


def write_sweep_table(sweep_dir: Path, unwritten: Sequence[dict] = ()) -> tuple[pd.DataFrame | None, str | None]:
    """Write the sweep's tables (results.parquet, its steps, summary.csv) from its job dirs and the
    failed rows held in memory (`unwritten`): (the table, None); (None, why) when that is
    impossible; (None, None) when no job is left to write (every one retired): then tables
    written before, which held only those jobs' rows, are removed, so no load reads them."""
    try:
        df = results.write_sweep(sweep_dir, extra_rows=list(unwritten), clear_leftovers=True)  # under the CLI's lock
    except results.ResultsError as exc:
        if "no jobs under" in str(exc):
            for name in (results.SWEEP_TABLE, results.SWEEP_STEPS, results.SUMMARY_FILE):
                (sweep_dir / name).unlink(missing_ok=True)
            return None, None
        return None, f"cannot write the sweep table for {sweep_dir}: {exc}"
    except OSError as exc:
        return None, str(exc) if str(sweep_dir) in str(exc) else f"cannot write the sweep table in {sweep_dir}: {exc}"
    return df, None


class RunSession:
    """One command's state across the jobs it runs (see the module docstring)."""

    def __init__(self, progress: SweepProgress | None = None) -> None:
        self.engines = EngineCache()
        self.references: dict[str, Any] = {}        # reference_key -> harness.reference.Reference
        self.progress = progress
        self.quiet = False                          # a job's config asked for quiet (run.quiet)
        self.failed_jobs = 0
        self.unwritten: list[dict] = []             # failed rows of jobs whose files could not be written
        self.check_failed: list[str] = []           # job ids whose reference check failed (harness.checks)
        self.handled_jobs: set[str] = set()         # job ids reached: measured or found current (JobContext.reached)
        self.configs_checked = False                # the finished jobs' configs were checked before the sweep ran
        self.table_error: str | None = None

    # --- progress and the engine ---------------------------------------------------------
    def close_progress(self) -> None:
        """End the progress display (before a table prints, or the run ends)."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def close(self) -> None:
        """The run is over: the progress display ends, the cached engine is freed."""
        self.close_progress()
        self.engines.release()

    def __getstate__(self) -> dict[str, Any]:
        """A fresh session for another process (see the module docstring)."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    # --- the end of a sweep ------------------------------------------------------------------
    def write_table(self, sweep_dir: Path) -> pd.DataFrame | None:
        """`write_sweep_table` with this run's unwritten rows; its error, if any, kept in `table_error`."""
        df, error = write_sweep_table(sweep_dir, self.unwritten)
        if error:
            self.table_error = error
        return df

    def show_table(self, sweep_dir: Path, quiet: bool, note: str = "", as_found: bool = False) -> int:
        """Print the table of the jobs `sweep_dir` holds, for a sweep whose table could not be written:
        this run's (the job dirs, with the failed rows kept in memory), or with `as_found` -- a dir
        this run could not write at all -- whatever the dir holds (`results.load`: its job dirs, then
        its last table). Returns how many jobs it holds (0: nothing to show)."""
        try:
            df = results.load(sweep_dir) if as_found else results.sweep_frame(sweep_dir, extra_rows=self.unwritten)
        except (results.ResultsError, OSError) as exc:
            log.debug("no table to show for %s: %s", sweep_dir, exc)
            return 0
        self.close_progress()
        Reporter(quiet=quiet).sweep_table(df, f"sweep {sweep_dir.name}{note}")
        return int(df["job_id"].nunique())

    def end_sweep(self, sweep_dir: Path, quiet: bool) -> None:
        """After the last job, whatever happened to the others: the sweep table written and shown,
        and its failed jobs and failed reference checks counted from it (so any launcher's)."""
        df = self.write_table(sweep_dir)
        if df is None:
            if self.table_error:     # not written: its jobs are shown all the same, then the CLI's one line
                self.show_table(sweep_dir, quiet, " (not written)")
            return
        failed = df[df["status"] == "failed"]["job_id"].nunique()
        self.failed_jobs = int(failed)
        self.check_failed = failed_check_jobs(df)
        self.close_progress()        # the progress line ends before the table prints
        Reporter(quiet=quiet).sweep_table(df, f"sweep {sweep_dir.name}")
        print(f"sweep table: {sweep_dir / results.SWEEP_TABLE} ({df['job_id'].nunique()} jobs, {failed} failed); "
              f"summary: {sweep_dir / results.SUMMARY_FILE}")


@contextlib.contextmanager
def session_or_own(session: RunSession | None) -> Iterator[RunSession]:
    """`session`, or -- None -- one of the block's own, closed (its engine freed) when the block ends:
    a job run on its own (`harness.runner.run(cfg, ctx, reporter)`) keeps nothing loaded after it."""
    if session is not None:
        yield session
        return
    own = RunSession()
    try:
        yield own
    finally:
        own.close()
