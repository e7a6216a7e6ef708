"""Calibration reads weights cold: the GEMV and RAM rates' buffers are at least twice the
last-level cache the CPU reports (Linux sysfs), so a rate is RAM's and not the cache's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.costmodel import calibrate
from harness.costmodel.calibrate import cold_mib, gemv_matrix, last_level_cache_bytes


def sysfs(root: Path, sizes: dict[int, str]) -> Path:
    """A cpu0/cache tree in sysfs's format: index<i>/size per cache (e.g. "48K", "480M")."""
    for i, size in sizes.items():
        (root / f"index{i}").mkdir(parents=True)
        (root / f"index{i}" / "size").write_text(size + "\n")
    return root


def test_the_largest_reported_cache_is_the_last_level(tmp_path):
    # a real host's sysfs (a 2-core Intel Xeon VM): L1d 48K, L1i 64K, L2 2048K, L3 491520K
    tree = sysfs(tmp_path, {0: "48K", 1: "64K", 2: "2048K", 3: "491520K"})
    assert last_level_cache_bytes(tree) == 480 << 20
    assert last_level_cache_bytes(sysfs(tmp_path / "m", {0: "32K", 3: "1M"})) == 1 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None          # a system that reports no caches


def test_an_unreadable_size_is_refused_naming_the_file(tmp_path):
    tree = sysfs(tmp_path, {0: "48 kB"})
    with pytest.raises(ValueError, match=r"index0/size: '48 kB' \(expected e.g."):
        last_level_cache_bytes(tree)


def test_a_buffer_is_raised_to_twice_the_last_level_cache(tmp_path):
    tree = sysfs(tmp_path, {0: "48K", 3: "491520K"})
    assert cold_mib(64, tree) == 960                      # --quick's 64 MiB GEMV read 28 GB/s from that L3
    assert cold_mib(2048, tree) == 2048                   # already cold: as asked
    assert cold_mib(1, sysfs(tmp_path / "odd", {3: "1025K"})) == 3     # rounded up, never under 2x
    assert cold_mib(64, tmp_path / "none") == 64          # unknown cache: as asked


def test_the_gemv_matrix_on_the_cpu_is_twice_the_cache_it_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "CPU_CACHES", sysfs(tmp_path, {2: "2048K", 3: "3M"}))
    for dtype in (torch.float32, torch.bfloat16):
        w = gemv_matrix("cpu", dtype, 1)
        assert w.dtype == dtype and w.numel() * dtype.itemsize == 6 << 20
        assert bool(w.abs().max() > 0) and bool(torch.isfinite(w).all())   # values written, not an untouched buffer
    assert gemv_matrix("cpu", torch.float32, 8).numel() * 4 == 8 << 20


def test_a_warm_probe_reads_the_size_it_asks(tmp_path, monkeypatch):
    # dtype_speed's few-millisecond probe at a run's start compares dtypes on one 8 MiB matrix
    monkeypatch.setattr(calibrate, "CPU_CACHES", sysfs(tmp_path, {3: "64M"}))
    assert gemv_matrix("cpu", torch.float32, 8, cold=False).numel() * 4 == 8 << 20
    assert gemv_matrix("cpu", torch.float32, 8).numel() * 4 == 128 << 20
