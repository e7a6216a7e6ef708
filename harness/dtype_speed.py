"""Whether this machine runs a model's dtype fast: a CPU without native bf16/fp16
instructions (AVX2-only) emulates their matmuls, far slower than fp32, and even a CPU with them
(AVX512-BF16, AMX) may read bf16 weights in a matrix-vector product slower than fp32.

Owns: `dtype_speed(dtype, device)` -- a short probe (a few ms per dtype: one square GEMM for
prefill-shaped work, one matrix-vector product for decode-shaped work, each timed as the best of
a few calls) of how fast `dtype` does the *same work* as float32 on this device, cached per
process -- and the warning rule: a run whose dtype is slower than float32 at either shape is told
which phase it slows and by how much. The CPU's instruction flags ride along as context.
Does not own: the calibrated dtype rates of the cost model (harness.costmodel.calibrate, whose
micro-benchmarks this reuses) or setting the dtype (the config).

    speed = dtype_speed("bfloat16", "cpu")
    if speed.warning(): reporter.warn(speed.warning())
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from engine.dtypes import DTYPES

SLOW = 0.9              # a dtype doing the same work at under 0.9x float32's speed is "slow"
GEMM_N = 512            # the probe's sizes: small enough for a few ms, big enough to hit the kernels
GEMV_MIB = 8
REPEATS = 3
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "f16c")


@dataclass(frozen=True)
class DtypeSpeed:
    dtype: str
    device: str
    gemm_speedup: float | None      # dtype's time for a GEMM / float32's, inverted (>1: faster)
    gemv_speedup: float | None      # the same for a matrix-vector product on the same matrix shape
    cpu_flags: tuple[str, ...]
    unsupported: bool = False       # the device could not run a matmul in this dtype at all

    def slow(self) -> list[tuple[str, float]]:
        """(phase, speedup) of the phases this dtype makes slower than float32 would."""
        out = []
        if self.gemm_speedup is not None and self.gemm_speedup < SLOW:
            out.append(("prefill", self.gemm_speedup))
        if self.gemv_speedup is not None and self.gemv_speedup < SLOW:
            out.append(("decode", self.gemv_speedup))
        return out

    def warning(self) -> str | None:
        if self.unsupported:
            return f"warning: model.dtype={self.dtype} cannot run a matmul on {self.device} here"
        slow = self.slow()
        if not slow:
            return None
        parts = ", ".join(f"{phase} ({'GEMM' if phase == 'prefill' else 'matrix-vector'} work at "
                          f"{s:.2f}x float32's speed)" for phase, s in slow)
        native = [f for f in self.cpu_flags if "bf16" in f or "fp16" in f]
        why = (f"this CPU has {', '.join(native)}" if native else
               "this CPU has no native bf16/fp16 matmul instructions, so they are emulated") \
            if self.device == "cpu" else "measured on the device"
        return (f"warning: model.dtype={self.dtype} is slower than float32 on {self.device} for {parts}; "
                f"{why} (probe: {GEMM_N}^2 GEMM, {GEMV_MIB} MiB GEMV). Its speeds are real for this dtype, "
                "but float32 would run faster here (see docs/measurement.md: Threads and the CPU)")

    def as_extra(self) -> dict:
        return {"dtype_gemm_speedup": self.gemm_speedup, "dtype_gemv_speedup": self.gemv_speedup}

    def as_dict(self) -> dict:
        return asdict(self)


def cpu_flags() -> tuple[str, ...]:
    """The matmul-relevant instruction flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(x for x in FLAGS if x in have)
    except OSError:
        pass
    return ()


@functools.lru_cache(maxsize=None)
def dtype_speed(dtype: str, device: str) -> DtypeSpeed:
    """How fast `dtype` does float32's work on `device` ("cpu" or "cuda"); float32 itself is 1.0
    without a probe. Cached: one probe per (dtype, device) per process."""
    from harness.costmodel.calibrate import gemm_rates, gemv_rates
    flags = cpu_flags() if device == "cpu" else ()
    if DTYPES[dtype] == DTYPES["float32"]:
        return DtypeSpeed(dtype, device, 1.0, 1.0, flags)
    names = ["float32", dtype]
    gemm = gemm_rates(device, names, (GEMM_N,), REPEATS)
    # the same 8 MiB matrix in both dtypes, as cached as each other: a probe of milliseconds at a run's
    # start, not calibration's cold read (hundreds of MiB on a large-L3 host, seconds a dtype)
    gemv = gemv_rates(device, names, GEMV_MIB, REPEATS, cold=False)
    if dtype not in gemv:
        return DtypeSpeed(dtype, device, None, None, flags, unsupported=True)
    # GEMM rates are FLOP/s of the same work; GEMV rates are bytes/s of weight reads, so the same
    # matrix shape in a narrower dtype reads fewer bytes: time ratio = (bytes/rate) per dtype
    gemm_speedup = gemm[f"{dtype}@{GEMM_N}"] / gemm[f"float32@{GEMM_N}"]
    size = DTYPES[dtype].itemsize
    gemv_speedup = (gemv[dtype] / size) / (gemv["float32"] / 4)
    return DtypeSpeed(dtype, device, round(gemm_speedup, 3), round(gemv_speedup, 3), flags)
