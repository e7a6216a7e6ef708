"""Hydra callback: at the end of a multirun, join every job into the sweep table.

Owns: writing `<sweep dir>/results.parquet` + `summary.csv` (harness.results.write_sweep)
after the last job, whatever happened to the others, and flagging failures so the CLI
exits non-zero. Works for any launcher: it reads the job dirs, not process memory.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness import results
from harness.report import Reporter

log = logging.getLogger(__name__)
STATE = {"failed_jobs": 0, "sweep_dir": None}


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        reporter = Reporter(quiet=bool(config.run.quiet))
        try:
            df = results.write_sweep(sweep_dir)
        except results.ResultsError as exc:
            log.error("could not write the sweep table for %s: %s", sweep_dir, exc)
            STATE["failed_jobs"] += 1
            return
        failed = df[df["status"] == "failed"]["job_id"].nunique()
        STATE["failed_jobs"], STATE["sweep_dir"] = int(failed), str(sweep_dir)
        reporter.summary(df, f"sweep {sweep_dir.name}")
        print(f"sweep table: {sweep_dir / 'results.parquet'} ({df['job_id'].nunique()} jobs, {failed} failed); "
              f"summary: {sweep_dir / 'summary.csv'}")
