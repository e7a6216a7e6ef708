"""Instrumented passes that run *after* a job's speed measurements, so the speed table
never comes from an instrumented run (DESIGN.md §7.5).

Owns:
- the timeline pass: one more cold repeat with the in-process Timeline (and NVTX ranges
  when asked) attached; per phase copy_busy_s / overlap_s / exposed_copy_s / overlap_frac
  / link_gbps, and the Chrome/Perfetto trace JSON (`run.trace=true`);
- the copy ablation: `exposed_copy_ablation_s` = phase time with this placement minus the
  same phase with every expert resident (medians over repeats, same prompt);
- the torch.profiler pass (`run.profiler=torch`): a Chrome trace plus memcpy bytes/time;
- the Nsight Systems relaunch (`run.profiler=nsys`).
Does not own: the phases themselves (harness.scenario) or rows (harness.runner).
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from engine.nvtx_ranges import NvtxRanges
from engine.timeline import Instruments, Timeline
from harness.engines import Adapter
from harness.profiling import nsys
from harness.scenario import RepeatResult, run_repeat
from workloads.base import WorkloadSample

log = logging.getLogger(__name__)
NSYS_CHILD_ENV = "MOEBENCH_NSYS_CHILD"


def timeline_pass(eng: Adapter, sample: WorkloadSample, gen_tokens: int, nvtx_on: bool,
                  trace_path: Path | None) -> RepeatResult | None:
    """One instrumented repeat; None when the engine has no instrumentation hook."""
    tl = Timeline(eng.device_kind)
    inst = Instruments(tl, NvtxRanges()) if nvtx_on else tl
    if not eng.set_instrument(inst):
        return None
    try:
        res = run_repeat(eng, sample, gen_tokens, keep_logits=False, timeline=tl)
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


def ablation(measured: list[RepeatResult], resident: list[RepeatResult]) -> dict[str, float]:
    """Per phase: median time with this placement minus median time with experts resident."""
    def medians(runs: list[RepeatResult]) -> dict[str, float]:
        by: dict[str, list[float]] = {}
        for r in runs:
            for p in r.phases:
                by.setdefault(p.phase, []).append(p.client["time_s"])
        return {k: statistics.median(v) for k, v in by.items()}
    m, r = medians(measured), medians(resident)
    return {phase: m[phase] - r[phase] for phase in m if phase in r}


def torch_profile_pass(eng: Adapter, sample: WorkloadSample, gen_tokens: int,
                       trace_path: Path) -> tuple[RepeatResult, dict[str, float | None]]:
    """One repeat under torch.profiler; exports a Chrome trace and sums its memcpy events."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device_kind == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        res = run_repeat(eng, sample, gen_tokens, keep_logits=False)
    prof.export_chrome_trace(str(trace_path))
    return res, memcpy_summary(json.loads(trace_path.read_text()))


DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
               "unsigned char": 1, "bool": 1}


def memcpy_summary(trace: dict[str, Any]) -> dict[str, float | None]:
    """From a torch.profiler Chrome trace: GPU memcpy events (bytes from their args) when
    present; on the CPU, `aten::copy_` ops (bytes from input dims and type)."""
    gpu = [e for e in trace.get("traceEvents", []) if e.get("cat") == "gpu_memcpy"]
    if gpu:
        h2d = [e for e in gpu if "HtoD" in e.get("name", "")]
        return {"memcpy_h2d_bytes": float(sum(e.get("args", {}).get("bytes", 0) for e in h2d)),
                "memcpy_h2d_time_s": sum(e.get("dur", 0) for e in h2d) / 1e6,
                "memcpy_events": float(len(gpu))}
    ops = [e for e in trace.get("traceEvents", []) if e.get("cat") == "cpu_op" and e.get("name") == "aten::copy_"]
    nbytes = 0
    for e in ops:
        args = e.get("args", {})
        dims, types = args.get("Input Dims") or [[]], args.get("Input type") or [""]
        numel = 1
        for d in dims[0] or []:
            numel *= d
        nbytes += numel * DTYPE_BYTES.get(types[0], 0)
    return {"cpu_copy_bytes": float(nbytes), "cpu_copy_time_s": sum(e.get("dur", 0) for e in ops) / 1e6,
            "memcpy_events": float(len(ops))}


def memcpy_streams(trace: dict[str, Any], nbytes: int) -> list[int]:
    """CUPTI stream ids of the host->device memcpy events of exactly `nbytes` in a
    torch.profiler Chrome trace (CUPTI ids, not torch's `Stream.stream_id`: to name a stream,
    copy a marker of a unique size on it inside the profile)."""
    return [e["args"].get("stream") for e in trace.get("traceEvents", [])
            if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and e.get("args", {}).get("bytes") == nbytes]


def kernel_streams(trace: dict[str, Any]) -> set[int]:
    """CUPTI stream ids that ran at least one kernel in a torch.profiler Chrome trace."""
    return {e.get("args", {}).get("stream") for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"}


def copy_streams(run: Any, copy_stream: Any, nbytes: int, marker_bytes: int = 12345) -> dict[str, Any]:
    """Which CUDA streams `run()`'s host->device copies of `nbytes` ran on: profiles a marker
    copy of `marker_bytes` on `copy_stream` followed by `run()`, and returns {"marker": the
    copy stream's CUPTI ids (one), "copies": the ids of every `nbytes` copy, "kernels": the
    ids that ran kernels}."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    src = torch.empty(marker_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(marker_bytes, dtype=torch.uint8, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(copy_stream):
            dst.copy_(src, non_blocking=True)
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        trace = json.loads(Path(f"{d}/trace.json").read_text())
    return {"marker": memcpy_streams(trace, marker_bytes), "copies": memcpy_streams(trace, nbytes),
            "kernels": kernel_streams(trace)}


PROFILER_UNITS = {"memcpy_h2d_bytes": "B", "memcpy_h2d_time_s": "s", "memcpy_events": "count",
                  "cpu_copy_bytes": "B", "cpu_copy_time_s": "s"}


def under_nsys() -> bool:
    return os.environ.get(NSYS_CHILD_ENV) == "1"


def relaunch_under_nsys(job_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """Run this job again under `nsys profile` (capture range = cudaProfilerStart/Stop around
    the measured window) and return the export's tidy rows (source=nsys)."""
    exe = nsys.find_nsys()        # a clear NsysNotFound when Nsight Systems is not installed
    child_dir = job_dir / "nsys_child"
    argv = [sys.executable, "-m", "harness.cli", *overrides, f"hydra.run.dir={child_dir}", "run.quiet=true"]
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
