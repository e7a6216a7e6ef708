"""Fixtures of the analysis tests: real sweeps, each produced once per test session by the real CLI."""
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


@pytest.fixture(scope="session")
def serve_sweep(tmp_path_factory) -> Path:
    """A sweep of serving runs written by `moebench` (sweep `serving`): placements resident and fetch,
    each at two offered loads, a few requests of a few tokens each under an SLO -- the serve pass
    only, so the sweep holds serve rows and no speed rows. Returns the run.out root."""
    root = tmp_path_factory.mktemp("serve_sweep")
    args = ["-m", "placement=resident,fetch", "load.rate=5,10", "run.sweep_id=serving", "run.passes=[serve]",
            "run.warmup=0", "load=poisson", "load.requests=6", "load.warmup_requests=1", "load.max_concurrency=2",
            "load.input_len=32", "load.output_len=3", "load.slo=mixtral-8x7b", *SMALL, f"run.out={root}"]
    proc = cli(args, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root
