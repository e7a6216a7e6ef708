"""The machine's RAM read bandwidth, measured apart from every engine's kernels: the roofline's
weight-read figure on the CPU (harness.roofline, benchmarks/bench_roofline.py).

A GEMV rate measures a kernel, not the machine: torch's fp32 GEMV reads weights on one core on
some CPUs, so a roofline built on it sat below what llama.cpp achieved (docs/cpu_experts.md). A
STREAM-class read is the limit every engine's weight reads share.

Owns: `read_bandwidth(threads)` -- each of READERS over an fp32 buffer of at least
READ_LLC_MULTIPLE x the last-level cache (and at least READ_MIN_MIB), the best of READ_PASSES
passes after a warm-up, at `threads` intra-op threads and at all the cores this process may use;
the higher reader's figure is the bandwidth (a bound takes the best any reader reached: torch.sum
threads but reads one stream per thread, which leaves a core below its share here; the BLAS GEMV
reads several rows at once but on one core only) -- with its method and every reader's figure in
words (`ReadBandwidth.method`), measured once per process per thread count (the machine does not
change within a run; a busy moment is what best-of-passes guards against). Does not own: the
bound (harness.roofline), timing (harness.costmodel.calibrate.best_time).

    rb = read_bandwidth(threads=2)
    rb.gbps, rb.all_cores_gbps, rb.method
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.costmodel.calibrate import best_time, last_level_cache_bytes
from harness.machine import available_cores

READ_MIN_MIB = 256
READ_LLC_MULTIPLE = 4          # well beyond the cache: a host's caches can keep more of 2x than reported
READ_PASSES = 7
MV_COLS = 4096                 # the GEMV reader's matrix: the buffer as [rows, MV_COLS]
READERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch.sum": lambda buf, ones: buf.sum(),
    "torch.mv": lambda buf, ones: torch.mv(buf.view(-1, MV_COLS), ones),      # BLAS GEMV by a ones vector
}


@dataclass(frozen=True)
class ReadBandwidth:
    """RAM read GB/s (bytes read / s) at `threads` threads and at all `all_cores` cores: the best
    reader's; `readers` and `all_cores_readers` hold each reader's."""

    gbps: float
    threads: int
    all_cores_gbps: float
    all_cores: int
    buffer_mib: int
    passes: int = READ_PASSES
    readers: tuple[tuple[str, float], ...] = ()
    all_cores_readers: tuple[tuple[str, float], ...] = ()

    @property
    def method(self) -> str:
        def each(rs: tuple[tuple[str, float], ...]) -> str:
            return f" ({', '.join(f'{name} {v:.1f}' for name, v in rs)})" if rs else ""
        return (f"STREAM-class read: the best of {', '.join(READERS)} over {self.buffer_mib} MiB fp32 "
                f"(>= {READ_LLC_MULTIPLE}x the last-level cache), best of {self.passes} passes each: "
                f"{self.gbps:.1f} GB/s at {self.threads} thread(s){each(self.readers)}, "
                f"{self.all_cores_gbps:.1f} GB/s at all {self.all_cores} cores{each(self.all_cores_readers)}")


def buffer_mib() -> int:
    """The read buffer's size: READ_LLC_MULTIPLE x the last-level cache, at least READ_MIN_MIB."""
    llc = last_level_cache_bytes() or 0
    return max(READ_MIN_MIB, -(-READ_LLC_MULTIPLE * llc // (1 << 20)))


def _read_gbps(threads: int, mib: int, passes: int) -> tuple[tuple[str, float], ...]:
    """Read GB/s of each of READERS over `mib` MiB at `threads` intra-op threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones((mib << 20) // 4, dtype=torch.float32)    # written once: every page is resident
        ones = torch.ones(MV_COLS)
        return tuple((name, buf.numel() * 4 / best_time(lambda: read(buf, ones), passes) / 1e9)
                     for name, read in READERS.items())
    finally:
        torch.set_num_threads(before)


_cached_gbps = functools.cache(_read_gbps)


def read_bandwidth(threads: int | None = None, passes: int = READ_PASSES, fresh: bool = False) -> ReadBandwidth:
    """The machine's read bandwidth at `threads` (default: torch's current count) and at all cores;
    `fresh`: measured again rather than this process's earlier figure (a benchmark that takes the
    better of a reading before and after its timed repeats)."""
    threads = threads or torch.get_num_threads()
    cores, mib = available_cores(), buffer_mib()
    read = _read_gbps if fresh else _cached_gbps
    mine, every = read(threads, mib, passes), read(cores, mib, passes)
    return ReadBandwidth(gbps=max(v for _, v in mine), threads=threads, all_cores_gbps=max(v for _, v in every),
                         all_cores=cores, buffer_mib=mib, passes=passes, readers=mine, all_cores_readers=every)


__all__ = ["ReadBandwidth", "buffer_mib", "read_bandwidth"]
