"""harness.measure on the CPU: device peaks are null, never 0; CPU allocation peaks are real."""
from __future__ import annotations

import torch

from harness.measure import PhaseProbe, cpu_allocation_peak


def test_device_peaks_are_null_on_cpu():
    with PhaseProbe("cpu", lambda: {"h2d_bytes": 0}) as probe:
        torch.ones(1000).sum()
    assert probe.peak_device_bytes is None and probe.peak_device_reserved_bytes is None
    assert probe.peak_host_rss_bytes > 0 and probe.counters == {"h2d_bytes": 0}


def test_cpu_allocation_peak_sees_temporaries():
    def work() -> torch.Tensor:
        a = torch.empty(1 << 20, dtype=torch.uint8)       # 1 MiB, freed before the end
        b = torch.empty(1 << 18, dtype=torch.uint8)       # 256 KiB, returned
        del a
        return b
    kept = []
    peak, live = cpu_allocation_peak(lambda: kept.append(work()))
    assert peak >= (1 << 20) + (1 << 18) and (1 << 18) <= live < (1 << 20)
