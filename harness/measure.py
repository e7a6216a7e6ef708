"""Measurement in one place: synchronised timers, memory peaks per phase, counter deltas.

Owns: the sync discipline (device work is timed after a synchronise, never with
time.time()), resetting and reading device and host memory peaks, and per-phase
differences of the engine's cumulative counters.
Does not own: which phases exist (harness.scenario) or storage (harness.results).

    with PhaseProbe(device, counters_fn) as probe:
        ... run the phase ...
    probe.time_s, probe.peak_device_bytes, probe.peak_device_reserved_bytes, probe.peak_host_rss_bytes,
    probe.counters, probe.cpu_time_s, probe.starvation (cpu_util, starved, reason)
    peak, live = cpu_allocation_peak(lambda: eng.prefill(sess, rows))   # the emulated device's transients
    transient_peak(device_kind, lambda: eng.prefill(sess, rows))        # either device

CPU time per phase: the process doing the phase's work (`cpu_pid`: this one -- every thread of
it, `time.process_time()` -- or another, a llama-server, read from `/proc/PID/stat`) and the
threads it was allowed give `cpu_time_s`, `cpu_util` and the `starved` judgement (`starvation`:
the rule and its threshold live there and nowhere else).

Device peaks are per phase: both CUDA peak counters are reset when the phase starts.
`peak_device_bytes` is torch's allocated peak (tensors), `peak_device_reserved_bytes` the
caching allocator's reserved peak (segments it took from the driver: what a device budget
caps, engine.devices); on the CPU both are None, never 0, and so they are for an engine whose
device memory is another process's (`allocator=False`: a llama.cpp server), which this
process's allocator does not see.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import json
import tempfile

import psutil
import torch


def sync(device_kind: str) -> None:
    if device_kind == "cuda":
        torch.cuda.synchronize()


class HostPeak:
    """Peak resident set size over a window.

    Linux: write 5 to /proc/self/clear_refs to reset VmHWM, read VmHWM at the end (exact).
    Elsewhere, or where clear_refs is not writable: a sampling thread (every 2 ms)."""

    def __init__(self) -> None:
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._peak = 0
        self.method = "vmhwm"

    @staticmethod
    def _vmhwm() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            if self._vmhwm() is None:
                raise OSError("no VmHWM")
        except OSError:
            self.method = "sampled"
            proc = psutil.Process(os.getpid())
            self._peak = proc.memory_info().rss

            def sample() -> None:
                while not self._stop.wait(0.002):
                    self._peak = max(self._peak, proc.memory_info().rss)

            self._sampler = threading.Thread(target=sample, daemon=True)
            self._sampler.start()

    def stop(self) -> int:
        if self._sampler is None:
            return self._vmhwm() or 0
        self._stop.set()
        self._sampler.join()
        return max(self._peak, psutil.Process(os.getpid()).memory_info().rss)


# --- CPU time and starvation ------------------------------------------------------------------
# A phase is `starved` when the process doing its work ran on a CPU for less than this share of
# one core over the window: at least three quarters of the measured time it was stopped,
# descheduled or paged out, so its time_s is mostly waiting, not the work. One core, not all the
# threads it was allowed: a phase whose ops are too small to split (a tiny model's decode) keeps
# one thread busy whatever run.threads is, and that is not starvation. A quarter, not a half: a
# core fairly shared with one other busy process gives each about half, which is contention (the
# machine_busy column says so), not a stopped measurement; a SIGSTOPped or hung process is near 0.
STARVED_BELOW = 0.25
# Too short to judge: the window must span this many ticks of the CPU-time clock (/proc counts in
# 1/CLK_TCK s, 10 ms on most kernels: 0.5 s) and at least MIN_JUDGED_S (below a few scheduler
# periods, one preemption alone decides the ratio).
MIN_JUDGED_TICKS = 50
MIN_JUDGED_S = 0.1


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def cpu_time_s(pid: int | None = None) -> float | None:
    """CPU time (user + system, every thread) process `pid` has used, s: this process's from
    `time.process_time()` (None or our own pid), another's from /proc/PID/stat; None when that
    process is gone or /proc is not there."""
    if pid is None or pid == os.getpid():
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _clock_ticks()    # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return None


def cpu_resolution_s(pid: int | None = None) -> float:
    """The granularity of `cpu_time_s(pid)`."""
    if pid is None or pid == os.getpid():
        return time.get_clock_info("process_time").resolution
    return 1.0 / _clock_ticks()


@dataclass(frozen=True)
class Starvation:
    """A window's CPU share and the judgement on it; `reason` says why `starved` is null (not
    judged) or what was seen when it is True."""
    cpu_util: float | None
    starved: bool | None
    reason: str | None


def starvation(cpu_s: float | None, time_s: float, threads: int | None, resolution_s: float,
               on_cpu: bool = True) -> Starvation:
    """cpu_util = cpu_s / (time_s x threads), and whether the window was starved (`STARVED_BELOW`
    of one core); null with the reason where the window cannot be judged."""
    if cpu_s is None:
        return Starvation(None, None, "no CPU time for the process doing the work (gone, or no /proc)")
    util = cpu_s / (time_s * threads) if time_s > 0 and threads else None
    if not on_cpu:
        return Starvation(util, None, "the work runs on a GPU: its host threads' CPU time does not measure it")
    shortest = max(MIN_JUDGED_S, MIN_JUDGED_TICKS * resolution_s)
    if time_s < shortest:
        return Starvation(util, None, f"window {time_s:.3f} s is shorter than {shortest:.2f} s, too short to judge "
                                      f"with a CPU clock of {resolution_s:.3g} s")
    share = cpu_s / time_s                           # cores' worth of CPU over the window
    if share < STARVED_BELOW:
        return Starvation(util, True, f"the process doing the work ran {cpu_s:.3f} s of CPU in {time_s:.3f} s "
                                      f"({share:.0%} of one core, under {STARVED_BELOW:.0%}): stopped or "
                                      "descheduled for most of the window")
    return Starvation(util, False, None)


class PhaseProbe:
    """Times one phase and records its memory peaks, counter deltas and CPU time."""

    def __init__(self, device_kind: str, counters: Callable[[], dict[str, int]] | None,
                 allocator: bool = True, cpu_pid: int | None = None, threads: int | None = None) -> None:
        """allocator: the engine's device memory is this process's (torch's peaks are its peaks).
        cpu_pid: the process doing the work (None: this one); threads: how many it was allowed
        (None: torch's intra-op threads)."""
        self.device_kind = device_kind
        self._peaks = allocator and device_kind == "cuda"
        self._counters = counters
        self._cpu_pid = cpu_pid
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.time_s = 0.0
        self.peak_device_bytes: int | None = None
        self.peak_device_reserved_bytes: int | None = None
        self.peak_host_rss_bytes: int | None = None
        self.counters: dict[str, int] | None = None
        self.cpu_time_s: float | None = None
        self.starvation = Starvation(None, None, "not measured")

    def __enter__(self) -> "PhaseProbe":
        sync(self.device_kind)
        if self._peaks:
            torch.cuda.reset_peak_memory_stats()
        self._host = HostPeak()
        self._host.start()
        self._before = self._counters() if self._counters else None
        self._cpu0 = cpu_time_s(self._cpu_pid)
        self._t0 = self.t_start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        sync(self.device_kind)
        self.t_end = time.perf_counter()
        cpu1 = cpu_time_s(self._cpu_pid)
        self.time_s = self.t_end - self._t0
        if self._cpu0 is not None and cpu1 is not None:
            self.cpu_time_s = cpu1 - self._cpu0
        self.starvation = starvation(self.cpu_time_s, self.time_s, self.threads, cpu_resolution_s(self._cpu_pid),
                                     on_cpu=self.device_kind != "cuda")
        if self._counters is not None:
            after = self._counters()
            self.counters = {k: after[k] - self._before[k] for k in after}
        if self._peaks:
            self.peak_device_bytes = torch.cuda.max_memory_allocated()
            self.peak_device_reserved_bytes = torch.cuda.max_memory_reserved()
        self.peak_host_rss_bytes = self._host.stop()


def cpu_allocation_peak(fn: Callable[[], Any]) -> tuple[int, int]:
    """(peak, live): the most bytes of CPU-allocator memory that `fn` had allocated at once, and
    how many of them were still allocated when it returned.

    Read from torch.profiler's memory events (profile_memory=True), which record every
    allocation and free of torch's CPU allocator while profiling -- kernel workspaces that
    never surface as Python tensors included -- in time order; memory allocated before `fn`
    does not count. A diagnostic (the profiler slows `fn` down), not a timed measurement."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live = peak = 0
    for e in mem:
        live += int(e["args"]["Bytes"])
        peak = max(peak, live)
    return peak, live


def transient_peak(device_kind: str, fn: Callable[[], Any]) -> int:
    """The most bytes `fn` held allocated at once beyond what was allocated before it: the CUDA
    allocator's peak minus its starting point, or on the CPU (the emulated device)
    `cpu_allocation_peak`'s peak."""
    if device_kind != "cuda":
        return cpu_allocation_peak(fn)[0]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def percentile(samples: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no samples."""
    if not samples:
        return None
    s = sorted(samples)
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def rates(c: dict[str, int] | None) -> dict[str, float | None]:
    """hit_rate and byte_hit_rate from counter deltas; None when nothing was looked up."""
    if c is None:
        return {"hit_rate": None, "byte_hit_rate": None}
    n = c["expert_hits"] + c["expert_misses"]
    b = c["expert_hit_bytes"] + c["expert_miss_bytes"]
    return {"hit_rate": c["expert_hits"] / n if n else None,
            "byte_hit_rate": c["expert_hit_bytes"] / b if b else None}


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
