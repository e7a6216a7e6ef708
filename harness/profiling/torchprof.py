"""Reading a torch.profiler Chrome trace: host->device copy bytes and time.

Owns: `memcpy_summary` (GPU memcpy events when present, else CPU `aten::copy_` ops) and the
units of its metrics. Does not own: running the profiler (harness.passes).
"""
from __future__ import annotations

from typing import Any

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


PROFILER_UNITS = {"memcpy_h2d_bytes": "B", "memcpy_h2d_time_s": "s", "memcpy_events": "count",
                  "cpu_copy_bytes": "B", "cpu_copy_time_s": "s"}
