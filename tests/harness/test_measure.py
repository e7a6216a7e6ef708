"""harness.measure on the CPU: device peaks are null, never 0; CPU allocation peaks are real."""
from __future__ import annotations

import pytest
import torch

from harness.measure import PhaseProbe, cpu_allocation_peak


def test_device_peaks_are_null_on_cpu():
    with PhaseProbe("cpu", lambda: {"h2d_bytes": 0}) as probe:
        torch.ones(1000).sum()
    assert probe.peak_device_bytes is None and probe.peak_device_reserved_bytes is None
    assert probe.peak_host_rss_bytes > 0 and probe.counters == {"h2d_bytes": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_peaks_are_this_processs_allocators_or_null():
    """On a GPU: torch's peaks for an engine in this process; null, not 0, for one whose device
    memory is another process's (a llama.cpp server), which this process's allocator cannot see."""
    with PhaseProbe("cuda", None) as own:
        torch.ones(1 << 20, device="cuda")
    with PhaseProbe("cuda", None, allocator=False) as server:
        torch.ones(1 << 20, device="cuda")
    assert own.peak_device_bytes >= 4 << 20
    assert server.peak_device_bytes is None and server.peak_device_reserved_bytes is None


def test_cpu_allocation_peak_sees_temporaries():
    def work() -> torch.Tensor:
        a = torch.empty(1 << 20, dtype=torch.uint8)       # 1 MiB, freed before the end
        b = torch.empty(1 << 18, dtype=torch.uint8)       # 256 KiB, returned
        del a
        return b
    kept = []
    peak, live = cpu_allocation_peak(lambda: kept.append(work()))
    assert peak >= (1 << 20) + (1 << 18) and (1 << 18) <= live < (1 << 20)
