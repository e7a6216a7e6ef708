"""Instrumented passes that run *after* a job's speed measurements, so the speed table
never comes from an instrumented run (DESIGN.md §7.5). They live beside the runner, which
calls them; the readers of their outputs (interval arithmetic, the nsys SQLite export, torch
profiler traces) live in harness.profiling and know nothing of scenarios.

Owns:
- the timeline pass: one more cold repeat with the in-process Timeline (and NVTX ranges
  when asked) attached; per phase copy_busy_s / overlap_s / exposed_copy_s / overlap_frac
  / link_gbps, and the Chrome/Perfetto trace JSON (`run.trace=true`);
- the routing-trace pass (`run.record_trace=true`);
- the torch.profiler pass (`run.profiler=torch`): a Chrome trace plus memcpy bytes/time;
- the Nsight Systems relaunch (`run.profiler=nsys`).
Does not own: the phases themselves (harness.scenario), rows (harness.runner), the paired
copy ablation (harness.ablation).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.nvtx_ranges import NvtxRanges
from engine.timeline import Instruments, Timeline
from harness.engines.base import EngineAdapter as Adapter
from harness.profiling import nsys
from harness.profiling.torchprof import memcpy_summary
from harness.scenario import RepeatResult, run_repeat
from workloads.base import WorkloadSample

log = logging.getLogger(__name__)
NSYS_CHILD_ENV = "MOEBENCH_NSYS_CHILD"


def timeline_pass(eng: Adapter, sample: WorkloadSample, gen_tokens: int, nvtx_on: bool,
                  trace_path: Path | None, warm_with: WorkloadSample | None = None) -> RepeatResult | None:
    """One instrumented repeat, from the expert-cache state the measured repeats start from
    (`warm_with`: run_repeat's); None when the engine has no instrumentation hook."""
    tl = Timeline(eng.device_kind)
    inst = Instruments(tl, NvtxRanges()) if nvtx_on else tl
    if not eng.set_instrument(inst):
        return None
    try:
        res = run_repeat(eng, sample, gen_tokens, keep_logits=False, timeline=tl, warm_with=warm_with)
    finally:
        eng.set_instrument(None)
    if trace_path is not None:
        tl.collect()
        trace_path.write_text(json.dumps(tl.chrome_trace(markers=res.windows)))
    return res


def trace_pass(eng: Adapter, sample: WorkloadSample, gen_tokens: int, path: Path) -> RepeatResult | None:
    """One cold repeat with the routing recorder attached; saves the DESIGN §3 trace file.
    None when the engine exposes no routing (transformers)."""
    from engine.trace import TraceRecorder, save_trace

    engine = getattr(eng, "engine", None)
    if engine is None:
        return None
    rec = TraceRecorder(engine)
    try:
        res = run_repeat(eng, sample, gen_tokens, keep_logits=False)
    finally:
        rec.detach()
    save_trace(path, rec.trace())
    return res


def torch_profile_pass(eng: Adapter, sample: WorkloadSample, gen_tokens: int, trace_path: Path,
                       warm_with: WorkloadSample | None = None) -> tuple[RepeatResult, dict[str, float | None]]:
    """One repeat under torch.profiler (from the measured repeats' expert-cache state, `warm_with`);
    exports a Chrome trace and sums its memcpy events."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device_kind == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        res = run_repeat(eng, sample, gen_tokens, keep_logits=False, warm_with=warm_with)
    prof.export_chrome_trace(str(trace_path))
    return res, memcpy_summary(json.loads(trace_path.read_text()))


def under_nsys() -> bool:
    return os.environ.get(NSYS_CHILD_ENV) == "1"


def relaunch_under_nsys(job_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """Run this job again under `nsys profile` (capture range = cudaProfilerStart/Stop around
    the measured window) and return the export's tidy rows (source=nsys)."""
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
