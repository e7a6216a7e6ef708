"""run.profiler=nsys through the real CLI. Nsight Systems is not installed here, so `nsys` is a
stand-in script: it runs the profiled child command exactly as `nsys profile` would (a real
subprocess of the harness) and leaves the checked-in export (the real Nsight SQLite schema) where
nsys writes its own."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import results
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nsys_small.sqlite"
BASE = ["workload=chat", "workload.context_tokens=160", "workload.gen_tokens=3", "workload.turn_tokens=4",
        "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false", "run.check_reference=false",
        "run.quiet=true"]
STANDIN = """#!/bin/sh
# `nsys profile FLAGS -o OUT CMD...` -> run CMD, then the export nsys would write to OUT.sqlite
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; shift 2; break; fi; shift; done
"$@" || exit $?
cp "{fixture}" "$out.sqlite"
"""


@pytest.mark.slow
def test_a_sweep_under_nsys_profiles_every_job_and_keeps_only_its_own_rows(tmp_path: Path) -> None:
    """Each job of a sweep relaunches itself under nsys (its dir name holds '=' and ',', which the
    child's hydra.run.dir override once failed to parse), and the child's own results never join
    the store: one job per sweep job, no instrumented child rows read as speed rows."""
    exe = tmp_path / "nsys"
    exe.write_text(STANDIN.format(fixture=FIXTURE))
    exe.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NSYS": str(exe)}
    proc = run_cli(["-m", *BASE, "cache.capacity=2,4", "run.profiler=nsys", f"run.out={tmp_path / 'out'}",
                    "run.sweep_id=n"], tmp_path, env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = tmp_path / "out" / "sweeps" / "n"
    df = results.load(sweep)
    assert set(df["sweep_id"]) == {"n"} and df["job_id"].nunique() == 2 and (df["status"] == "ok").all()
    nsys_rows = df[df["source"] == "nsys"]
    assert nsys_rows["job_id"].nunique() == 2 and nsys_rows["value"].notna().any()
    assert len(list(sweep.rglob(results.ROWS_FILE))) == 2           # the children's rows were not kept
    for job in {p.parent for p in sweep.rglob(results.ROWS_FILE)}:
        assert (job / "trace.sqlite").is_file()
