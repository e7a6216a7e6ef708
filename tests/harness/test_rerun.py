"""`moebench rerun JOB_DIR` reproduces the job's context: through the real CLI in subprocesses, a
job run under one thread setting is rerun from an environment with another, and the rerun's own
manifest must record the original threads and environment; a version the manifest records that
differs from this installation's (edited into the real manifest file) is named on stderr."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import results
from harness.machine import physical_cores_available
from harness.manifest import env_recorded
from tests.harness.test_trust import REPO, SMALL, cli
from tests.cli_runner import run_cli

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips


def manifest(job: Path) -> dict:
    return json.loads((job / results.MANIFEST_FILE).read_text())


def edit_manifest(job: Path, **changes) -> None:
    m = manifest(job)
    m.update(changes)
    (job / results.MANIFEST_FILE).write_text(json.dumps(m))


def exact_env(**recorded: str) -> dict[str, str]:
    """This environment without any variable a manifest records, plus `recorded`."""
    return {**{k: v for k, v in os.environ.items() if not env_recorded(k)}, "PYTHONPATH": str(REPO), **recorded}


def rerun(job: Path, out: Path, cwd: Path, env: dict[str, str]):
    """`moebench rerun` in exactly `env` (a recorded variable absent from it is unset)."""
    proc = run_cli(["rerun", str(job), "--out", str(out)], cwd, env, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc, manifest(out)


def notes(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("moebench rerun: ")]


def test_a_rerun_runs_in_the_recorded_threads_and_environment(tmp_path):
    job = tmp_path / "first"
    first = cli([*SMALL, "run.threads=1", f"hydra.run.dir={job}"], tmp_path, env={"MKL_NUM_THREADS": "1"})
    assert first.returncode == 0, first.stderr
    old = manifest(job)
    assert old["threads"] == 1 and old["env"]["OMP_NUM_THREADS"] == "1" and old["env"]["MKL_NUM_THREADS"] == "1"
    assert all(env_recorded(k) for k in old["env"])

    # another OMP setting, MKL's unset, and a variable of the OpenMP runtime the job did not have
    proc, new = rerun(job, tmp_path / "again", tmp_path, exact_env(OMP_NUM_THREADS="2", KMP_BLOCKTIME="0"))
    assert new["threads"] == 1 and new["env"] == old["env"]          # set again, before torch loaded
    assert new["config_hash"] == old["config_hash"]
    said = [n for n in notes(proc) if "environment is set again" in n]
    assert len(said) == 1 and "OMP_NUM_THREADS=1 (here 2)" in said[0] and "KMP_BLOCKTIME unset (here 0)" in said[0]
    assert "MKL_NUM_THREADS=1 (unset here)" in said[0]
    assert results.load(tmp_path / "again").status.eq("ok").all()


def test_a_job_without_run_threads_gets_its_recorded_thread_count(tmp_path):
    job = tmp_path / "first"
    assert cli([*SMALL, f"hydra.run.dir={job}"], tmp_path, env={"OMP_NUM_THREADS": "1"}).returncode == 0
    old = manifest(job)
    assert old["threads"] == 1 and old["config"]["run"]["threads"] is None
    # the recorded OMP_NUM_THREADS gives the recorded count: no run.threads needed, the same config
    proc, new = rerun(job, tmp_path / "again", tmp_path, exact_env(OMP_NUM_THREADS="2"))
    assert new["threads"] == 1 and new["config_hash"] == old["config_hash"]
    assert not [n for n in notes(proc) if "run.threads" in n]

    # a job that ran on a machine with more cores and no OMP_NUM_THREADS: its count is set explicitly
    more = physical_cores_available() + 1
    edit_manifest(job, threads=more, env={})
    proc, new = rerun(job, tmp_path / "again2", tmp_path, exact_env(OMP_NUM_THREADS="1"))
    assert new["threads"] == more and new["config"]["run"]["threads"] == more and "OMP_NUM_THREADS" not in new["env"]
    assert [n for n in notes(proc) if f"the job ran with {more} intra-op thread(s)" in n
            and f"run.threads={more} is set" in n]


def test_a_rerun_names_each_version_that_differs(tmp_path):
    job = tmp_path / "first"
    assert cli([*SMALL, f"hydra.run.dir={job}"], tmp_path).returncode == 0
    proc, _ = rerun(job, tmp_path / "same", tmp_path, exact_env(OMP_NUM_THREADS="1"))
    said = notes(proc)
    assert not [n for n in said if " is " in n and "here, the job ran with" in n]     # nothing differs yet

    m = manifest(job)
    edit_manifest(job, packages={**m["packages"], "torch": "1.0.0", "numpy": None},
                  git={**m["git"], "commit": "0" * 40, "dirty": False},
                  python={**m["python"], "version": "3.0.1"})
    proc, _ = rerun(job, tmp_path / "again", tmp_path, exact_env(OMP_NUM_THREADS="1"))
    said = notes(proc)
    torch_now, numpy_now = m["packages"]["torch"], m["packages"]["numpy"]
    assert f"moebench rerun: torch is {torch_now} here, the job ran with 1.0.0" in said
    assert f"moebench rerun: numpy is {numpy_now} here, the job ran with it not installed" in said
    assert [n for n in said if n.startswith("moebench rerun: the checkout is at commit ") and
            n.endswith(f"the job ran at {'0' * 40}")]
    assert [n for n in said if n.startswith("moebench rerun: Python is ") and n.endswith("the job ran with 3.0.1")]
    assert results.load(tmp_path / "again").status.eq("ok").all()     # a note, not a refusal
