"""Fixtures of the analysis tests: a real sweep, produced once per test session by the real CLI."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.test_trust import SMALL, cli

# small and fast (one context, one repeat, 4 generated tokens), with the instrumented passes the
# figures read: the timeline (overlap) and the routing trace (hit rates)
FIGURE_RUN = [*(a for a in SMALL if not a.startswith("run.timeline")), "run.timeline=true", "run.record_trace=true"]


@pytest.fixture(scope="session")
def figure_sweep(tmp_path_factory) -> Path:
    """A results tree written by `moebench`: placements resident, fetch, cpu and hybrid at two
    cache sizes (sweep `placements`), and one lossy treatment, fetch with its KV in q8 (sweep
    `lossy`). Returns the run.out root (`results.load` reads both sweeps from it)."""
    root = tmp_path_factory.mktemp("figure_sweep")
    for args in (["-m", "placement=resident,fetch,cpu,hybrid", "cache.capacity=2,4", "run.sweep_id=placements"],
                 ["-m", "placement=fetch", "cache.capacity=4", "kv.dtype=q8", "run.sweep_id=lossy"]):
        proc = cli([*args, *FIGURE_RUN, f"run.out={root}"], root)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root
