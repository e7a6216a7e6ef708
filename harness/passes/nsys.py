"""The `nsys` pass (`run.profiler=nsys`): the job run again under Nsight Systems, its export's
rows (source=nsys) added to the job's.

Owns: relaunching the job under `nsys profile` in a child process (`relaunch_under_nsys`; the
capture range is cudaProfilerStart/Stop around the child's measured repeats), telling the child
it is the profiled run (`under_nsys`, the environment variable `NSYS_CHILD_ENV`) and that range
(`CudaProfilerRange`, which the speed pass opens around its repeats). Does not own: reading the
export (harness.profiling.nsys), the child's repeats (harness.passes.speed).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.lazy import lazy_module
from harness.passes.base import Pass, RunContext

if TYPE_CHECKING:
    import torch
else:                  # the pass's declaration loads without torch (moebench --help, config checks)
    torch = lazy_module("torch", globals())

log = logging.getLogger(__name__)
NSYS_CHILD_ENV = "MOEBENCH_NSYS_CHILD"


def under_nsys() -> bool:
    """Whether this process is the job's run under Nsight Systems (the pass's child)."""
    return os.environ.get(NSYS_CHILD_ENV) == "1"


def relaunch_under_nsys(job_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """Run this job again under `nsys profile` (capture range = cudaProfilerStart/Stop around
    the measured window) and return the export's tidy rows (source=nsys)."""
    from harness.profiling import nsys           # pandas: loaded by the run that profiles
    exe = nsys.find_nsys()        # a clear NsysNotFound when Nsight Systems is not installed
    # the child's own results go to a directory of their own, removed after: only its trace is
    # kept (in the job dir), so no store reads the profiled run's rows as a job (a dir inside the
    # job's would be); quoted, as a sweep job's dir name holds '=' and ','
    with tempfile.TemporaryDirectory(prefix="moebench-nsys-child-") as child_dir:
        argv = [sys.executable, "-m", "harness.cli", *overrides, f"hydra.run.dir='{child_dir}'", "run.quiet=true"]
        cmd = nsys.nsys_command(job_dir, argv, nsys=exe)
        log.info("profiling under Nsight Systems: %s", " ".join(cmd))
        proc = subprocess.run(cmd, env={**os.environ, NSYS_CHILD_ENV: "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nsys run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return nsys.nsys_rows(nsys.trace_sqlite(job_dir), prefix="moebench")


class CudaProfilerRange:
    """cudaProfilerStart/Stop around the measured window when running under nsys."""

    def __enter__(self) -> "CudaProfilerRange":
        if under_nsys() and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if under_nsys() and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


class NsysPass(Pass):
    name = "nsys"
    summary = "run.profiler=nsys: the job again under Nsight Systems; its copy and kernel rows"
    uses_engine = False               # a child process loads its own

    flag = ("profiler", "nsys")

    def skip_reason(self, ctx: RunContext) -> str | None:
        if reason := super().skip_reason(ctx):
            return reason
        if under_nsys():
            return "this is the run Nsight Systems profiles: its parent's nsys pass records the rows"
        return None

    def run(self, ctx: RunContext) -> None:
        for r in relaunch_under_nsys(ctx.job_dir, list(ctx.job.ctx.overrides or [])):
            ctx.emit(None, r["scope"], {r["metric"]: r["value"]}, "nsys", "nsys", units={r["metric"]: r["unit"]})
