"""The machine's RAM read bandwidth, measured apart from every engine's kernels: the roofline's
weight-read figure on the CPU (harness.roofline, benchmarks/bench_roofline.py).

A GEMV rate measures a kernel, not the machine: torch's fp32 GEMV reads weights on one core on
some CPUs, so a roofline built on it sat below what llama.cpp achieved (docs/cpu_experts.md). A
STREAM-class read is the limit every engine's weight reads share.

Owns: `read_bandwidth(threads)` -- `torch.sum` over an fp32 buffer of at least READ_LLC_MULTIPLE x
the last-level cache (and at least READ_MIN_MIB), the best of READ_PASSES passes after a warm-up,
at `threads` intra-op threads and at all the cores this process may use -- with its method in
words (`ReadBandwidth.method`), measured once per process per thread count (the machine does not
change within a run; a busy moment is what best-of-passes guards against). Does not own: the
bound (harness.roofline), timing (harness.costmodel.calibrate.best_time).

    rb = read_bandwidth(threads=2)
    rb.gbps, rb.all_cores_gbps, rb.method
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from harness.costmodel.calibrate import best_time, last_level_cache_bytes
from harness.machine import available_cores

READ_MIN_MIB = 256
READ_LLC_MULTIPLE = 4          # well beyond the cache: a host's caches can keep more of 2x than reported
READ_PASSES = 7


@dataclass(frozen=True)
class ReadBandwidth:
    """RAM read GB/s (bytes read / s) at `threads` threads and at all `all_cores` cores."""

    gbps: float
    threads: int
    all_cores_gbps: float
    all_cores: int
    buffer_mib: int
    passes: int = READ_PASSES

    @property
    def method(self) -> str:
        return (f"STREAM-class read: torch.sum over {self.buffer_mib} MiB fp32 (>= {READ_LLC_MULTIPLE}x the "
                f"last-level cache), best of {self.passes} passes: {self.gbps:.1f} GB/s at {self.threads} "
                f"thread(s), {self.all_cores_gbps:.1f} GB/s at all {self.all_cores} cores")


def buffer_mib() -> int:
    """The read buffer's size: READ_LLC_MULTIPLE x the last-level cache, at least READ_MIN_MIB."""
    llc = last_level_cache_bytes() or 0
    return max(READ_MIN_MIB, -(-READ_LLC_MULTIPLE * llc // (1 << 20)))


def _read_gbps(threads: int, mib: int, passes: int) -> float:
    """Read GB/s of `torch.sum` over `mib` MiB at `threads` intra-op threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones((mib << 20) // 4, dtype=torch.float32)      # written once: every page is resident
        return x.numel() * 4 / best_time(lambda: x.sum(), passes) / 1e9
    finally:
        torch.set_num_threads(before)


_cached_gbps = functools.cache(_read_gbps)


def read_bandwidth(threads: int | None = None, passes: int = READ_PASSES, fresh: bool = False) -> ReadBandwidth:
    """The machine's read bandwidth at `threads` (default: torch's current count) and at all cores;
    `fresh`: measured again rather than this process's earlier figure (a benchmark that takes the
    better of a reading before and after its timed repeats)."""
    threads = threads or torch.get_num_threads()
    cores, mib = available_cores(), buffer_mib()
    gbps = _read_gbps if fresh else _cached_gbps
    return ReadBandwidth(gbps=gbps(threads, mib, passes), threads=threads, all_cores_gbps=gbps(cores, mib, passes),
                         all_cores=cores, buffer_mib=mib, passes=passes)


__all__ = ["ReadBandwidth", "buffer_mib", "read_bandwidth"]
