"""Measurement in one place: synchronised timers, memory peaks per phase, counter deltas.

Owns: the sync discipline (device work is timed after a synchronise, never with
time.time()), resetting and reading device and host memory peaks, and per-phase
differences of the engine's cumulative counters.
Does not own: which phases exist (harness.scenario) or storage (harness.results).

    with PhaseProbe(device, counters_fn) as probe:
        ... run the phase ...
    probe.time_s, probe.peak_device_bytes, probe.peak_device_reserved_bytes, probe.peak_host_rss_bytes,
    probe.counters
    peak, live = cpu_allocation_peak(lambda: eng.prefill(sess, rows))   # the emulated device's transients
    transient_peak(device_kind, lambda: eng.prefill(sess, rows))        # either device

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


class PhaseProbe:
    """Times one phase and records its memory peaks and counter deltas."""

    def __init__(self, device_kind: str, counters: Callable[[], dict[str, int]] | None,
                 allocator: bool = True) -> None:
        """allocator: the engine's device memory is this process's (torch's peaks are its peaks)."""
        self.device_kind = device_kind
        self._peaks = allocator and device_kind == "cuda"
        self._counters = counters
        self.time_s = 0.0
        self.peak_device_bytes: int | None = None
        self.peak_device_reserved_bytes: int | None = None
        self.peak_host_rss_bytes: int | None = None
        self.counters: dict[str, int] | None = None

    def __enter__(self) -> "PhaseProbe":
        sync(self.device_kind)
        if self._peaks:
            torch.cuda.reset_peak_memory_stats()
        self._host = HostPeak()
        self._host.start()
        self._before = self._counters() if self._counters else None
        self._t0 = self.t_start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        sync(self.device_kind)
        self.t_end = time.perf_counter()
        self.time_s = self.t_end - self._t0
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
