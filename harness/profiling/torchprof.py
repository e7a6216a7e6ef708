"""Reading a torch.profiler Chrome trace: host->device copy bytes and time.

Owns: `memcpy_summary` (GPU memcpy events when present, else the profiling thread's
`aten::copy_` ops) and the units of its metrics, and which CUDA streams copies and kernels ran
on (`copy_streams`, for the GPU check). Does not own: the profiling pass of a job (harness.passes).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
               "unsigned char": 1, "bool": 1}


def memcpy_summary(trace: dict[str, Any]) -> dict[str, float | None]:
    """From a torch.profiler Chrome trace: GPU memcpy events (bytes from their args) when
    present; on the CPU, the `aten::copy_` ops of the thread that profiled (bytes from input dims
    and type) -- named `main_thread_copy_*`, as torch.profiler records no op of a thread started
    before it (the emulated device's copy worker: its expert copies are in the engine's own
    `h2d_expert_bytes`, not here)."""
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
    return {"main_thread_copy_bytes": float(nbytes),
            "main_thread_copy_time_s": sum(e.get("dur", 0) for e in ops) / 1e6,
            "memcpy_events": float(len(ops))}


PROFILER_UNITS = {"memcpy_h2d_bytes": "B", "memcpy_h2d_time_s": "s", "memcpy_events": "count",
                  "main_thread_copy_bytes": "B", "main_thread_copy_time_s": "s"}


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
