"""Cluster-style sweeps: `hydra/launcher=submitit_local` runs every job in its own process and
the SweepTable callback still merges them into one table -- the same table, row for row, as
the default (basic, in-process) launcher gives -- and every row keeps its device, every job
its host (in the manifest)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import results
from harness.compare import read_manifests
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
SWEEP = ["placement=resident,fetch", "workload.seed=0,1", "cache.capacity=4", "workload=chat", "workload.context_tokens=128",
         "workload.gen_tokens=8", "run.repeats=2", "run.quiet=true", "run.sweep_id=s"]
KEY = ["job_id", "repeat", "phase", "metric", "source", "profiler"]


def sweep(out: Path, *extra: str) -> Path:
    # one intra-op thread per process: submitit_local starts every job at once, and several
    # multi-threaded torch processes on a 2-core box slow each other down 10-100x
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run_cli(["-m", *SWEEP, *extra, f"run.out={out}"], REPO, env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return out / "sweeps" / "s"


@pytest.mark.slow
def test_submitit_local_gives_the_basic_launchers_table(tmp_path: Path) -> None:
    basic = sweep(tmp_path / "basic")
    sub = sweep(tmp_path / "submitit", "hydra/launcher=submitit_local")

    a, b = results.load(basic / "results.parquet"), results.load(sub / "results.parquet")
    assert list(a.columns) == list(b.columns)
    assert len(a) == len(b) and a["job_id"].nunique() == b["job_id"].nunique() == 4
    keys = lambda df: sorted(map(tuple, df[KEY].astype(object).where(df[KEY].notna(), "-").astype(str).to_numpy()))  # noqa: E731
    assert keys(a) == keys(b)                                   # same jobs, repeats, phases, metrics
    assert (b["status"] == "ok").all() and b["device_kind"].notna().all() and b["device_name"].notna().all()

    # each submitit job ran in its own process: its own submitit folder, and a cold model load
    assert len([p for p in (sub / ".submitit").iterdir() if p.name != "%j"]) == 4
    loads = lambda df: set(df.loc[df["phase"] == "load", "model_load"])  # noqa: E731
    assert loads(b) == {"cold"}                     # the second seed's job loads again: a fresh process ...
    assert loads(a) == {"cold", "reused"}           # ... where the basic launcher reuses the model in-process

    man = read_manifests(sub)
    assert len(man) == 4 and man["host"].notna().all() and man["cpu_model"].notna().all()
    assert set(zip(man["sweep_id"], man["job_id"])) == set(zip(b["sweep_id"], b["job_id"]))
