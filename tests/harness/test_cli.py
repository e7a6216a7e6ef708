"""The real `moebench` CLI in a subprocess: a single run, a Hydra multirun, a failing job,
a killed-and-resumed sweep, and both engines in one sweep."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness import results
from harness.contract import ALL_PHASES, MEASURED_PHASES, SERVE_PHASE
from tests.cli_runner import run_cli

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
REPO = Path(__file__).resolve().parents[2]
SMALL = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=8", "run.quiet=true"]
PHASES = set(ALL_PHASES) - {SERVE_PHASE}            # serve: only a job with a load has it


def moebench(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_cli(args, cwd, env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"moebench {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def sweep_dir(cwd: Path) -> Path:
    dirs = list((cwd / "results" / "sweeps").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def med(df: pd.DataFrame, phase: str, metric: str) -> pd.Series:
    sel = df[(df.phase == phase) & (df.metric == metric)]
    return sel.groupby("job_id")["value"].median()


def test_single_run_defaults(tmp_path):
    """A bare `moebench`: tiny model, coding-agent workload, a summary and the results path."""
    proc = moebench([], tmp_path)
    assert "results:" in proc.stdout and "prefill_fresh" in proc.stderr
    runs = list((tmp_path / "results" / "runs").iterdir())
    df = results.load(runs[0])
    assert set(df.phase) == PHASES and (df.status == "ok").all()
    assert set(df.workload) == {"coding_agent"} and (df.emulated == True).all()  # noqa: E712
    assert df[df.metric == "peak_device_bytes"]["value"].isna().all()          # null on CPU, never 0
    assert (tmp_path / runs[0] / "manifest.json").is_file()


def test_single_runs_in_dirs_of_one_name_are_two_jobs_of_a_tree(tmp_path):
    """Runs in R/fetch/latest and R/cpu/latest (one dir name) load as two jobs of R, and the
    default run dirs of two runs are distinct (to the microsecond) -- neither is lost to the other."""
    small = [*SMALL, "workload.gen_tokens=3", "run.repeats=1", "run.warmup=0", "run.timeline=false",
             "run.ablation=false"]
    for placement in ("fetch", "cpu"):
        moebench([f"placement={placement}", f"hydra.run.dir={tmp_path / 'R' / placement / 'latest'}", *small], tmp_path)
    df = results.load(tmp_path / "R")
    assert set(df.placement) == {"fetch", "cpu"} and df.groupby(["sweep_id", "job_id"]).ngroups == 2
    moebench(small, tmp_path)
    moebench(small, tmp_path)
    assert len(list((tmp_path / "results" / "runs").iterdir())) == 2


def test_multirun_table(tmp_path):
    moebench(["-m", "placement=resident,fetch,cpu", "cache.capacity=2,4", "run.repeats=3", *SMALL], tmp_path)
    sd = sweep_dir(tmp_path)
    everything = results.load(sd / "results.parquet")
    assert (sd / "summary.csv").is_file()
    # resident and cpu keep no cache: their cache.capacity=4 jobs are their =2 twins, skipped as such
    assert everything.job_id.nunique() == 4 and (everything.status == "ok").all()
    assert sorted(everything.groupby("job_id").placement.first()) == ["cpu", "fetch", "fetch", "resident"]
    twins = [d for d in sd.iterdir() if d.is_dir() and "cache.capacity=4" in d.name and "placement=fetch" not in d.name]
    assert len(twins) == 2 and not any((d / results.ROWS_FILE).exists() for d in twins)
    # passes beside the speed rows labelled
    assert set(everything.profiler) == {"none", "timeline", "ablation", "quality", "prediction"}
    df = everything[everything.profiler == "none"]               # the speed table
    # every job x phase x metric that applies
    per_job = df.groupby("job_id").apply(lambda j: set(zip(j.phase, j.metric)), include_groups=False)
    ablation = {(p, m) for p in MEASURED_PHASES for m in ("exposed_copy_ablation_s", "exposed_copy_ablation_ci_low_s",
                                                            "exposed_copy_ablation_ci_high_s",
                                                            "exposed_copy_ablation_p_value",
                                                            "exposed_copy_ablation_significant")}
    full = set().union(*per_job)
    for job, pairs in per_job.items():
        resident = df[df.job_id == job].placement.iloc[0] == "resident"
        assert pairs | (ablation if resident else set()) == full, job
    assert len(full) >= 80
    timeline = everything[(everything.profiler == "timeline") & (everything.metric == "copy_busy_s")]
    assert timeline.value.notna().all() and (timeline[timeline.placement == "fetch"].value > 0).any()
    assert {"ttft_s", "tpot_s_p99", "reused_tokens", "restore_s", "h2d_bytes", "hit_rate", "peak_host_rss_bytes",
            "max_abs_logit_diff", "token_agreement"} <= set(df.metric)
    h2d = df[(df.metric == "h2d_bytes") & (df.phase != "load")]
    assert (h2d[h2d.placement == "fetch"].groupby("job_id")["value"].sum() > 0).all()
    resident = h2d[(h2d.placement == "resident") & (h2d.phase != "prefill_restored")]
    assert (resident["value"] == 0).all()
    # every measured phase that produced tokens carries its own check against the CPU reference
    checked = df[df.metric == "max_abs_logit_diff"]
    assert set(checked.phase) == {"prefill_fresh", "decode", "prefill_continuation", "prefill_restored"}
    assert (checked["value"] <= 1e-5).all() and len(checked) == 4 * 3 * 4
    assert (df[df.metric == "token_agreement"]["value"] == 1.0).all()
    assert (df[df.metric == "reused_tokens"].groupby("phase")["value"].min()[["prefill_continuation",
                                                                              "prefill_restored"]] > 256).all()
    loads = df[(df.phase == "load") & (df.metric == "time_s")]
    assert set(loads.model_load) == {"cold"}                     # no two of these jobs share an engine


def test_jobs_of_one_engine_configuration_share_one_load(tmp_path):
    """One model load per engine configuration per process: a later job that differs only in
    what it feeds the engine (its workload sample) reuses the loaded engine."""
    moebench(["-m", "workload.seed=0,1", "run.repeats=1", "run.warmup=0", "run.timeline=false",
              "run.ablation=false", *SMALL], tmp_path)
    df = results.load(sweep_dir(tmp_path) / "results.parquet")
    loads = df[(df.phase == "load") & (df.metric == "time_s") & (df.source == "client")].sort_values("job_id")
    assert df.job_id.nunique() == 2 and sorted(loads.model_load) == ["cold", "reused"]
    assert loads[loads.model_load == "reused"].value.isna().all()  # a reused engine's load was not measured


def test_failed_job_leaves_complete_table(tmp_path):
    proc = moebench(["-m", "workload.context_tokens=256,9000", "workload=chat", "run.repeats=1",
                     "workload.gen_tokens=4", "run.quiet=true"], tmp_path, check=False)
    assert proc.returncode == 1
    df = results.load(sweep_dir(tmp_path) / "results.parquet")
    failed = df[df.status == "failed"]
    assert len(failed) == 1 and "longer than the model allows" in failed.iloc[0]["error"]
    assert set(df[df.status == "ok"].phase) == PHASES
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_killed_sweep_resumes_without_duplicates(tmp_path):
    args = ["-m", "placement=resident,fetch,cpu", "cache.capacity=2,3,4", "run.repeats=1", *SMALL]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        done = list(tmp_path.glob("results/sweeps/*/*/DONE"))
        if len(done) >= 2 or proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sd = sweep_dir(tmp_path)
    finished_before = {p.parent.name: p.stat().st_mtime_ns for p in sd.glob("*/DONE")}
    assert 0 < len(finished_before) < 5          # 5 jobs: resident and cpu once each, their twins skipped
    moebench(args, tmp_path)
    df = results.load(sd / "results.parquet")
    assert df.job_id.nunique() == 5 and (df.status == "ok").all()
    key = ["job_id", "repeat", "phase", "metric", "source", "profiler", "ablation_side"]
    assert not df.duplicated(key).any()
    for job, mtime in finished_before.items():   # completed jobs were skipped, not re-run
        assert (sd / job / "DONE").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_a_job_measured_again_for_a_changed_config_hides_its_old_results_until_done(tmp_path):
    """A job dir holding another config's results is re-measured; killed part-way, it is an
    incomplete job (never read), not the old config's rows passing as this run's."""
    job = tmp_path / "job"
    small = [*SMALL, "run.warmup=0", "run.timeline=false", "run.ablation=false", f"hydra.run.dir={job}"]
    moebench([*small, "workload.turn_tokens=4", "run.repeats=1"], tmp_path)
    assert results.job_complete(job)
    log = tmp_path / "second.err"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *[a for a in small if a != "run.quiet=true"],
                                 "workload.turn_tokens=16", "run.repeats=50"],
                                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and "repeat 2/" not in log.read_text():
            time.sleep(0.05)
        assert proc.poll() is None, log.read_text()[-2000:]          # killed while it measures
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not results.job_complete(job)
    with pytest.raises(results.ResultsError, match="no results"):
        results.load(job)


def test_engines_side_by_side(tmp_path):
    moebench(["-m", "engine=moebench,hf", "placement=resident", "run.repeats=1", *SMALL], tmp_path)
    df = results.load(sweep_dir(tmp_path) / "results.parquet")
    assert set(df.engine) == {"moebench", "hf"} and (df.status == "ok").all()
    hf = df[(df.engine == "hf") & (df.profiler == "none")]      # the per-phase checks (not the quality pass)
    assert hf[hf.metric == "h2d_bytes"]["value"].isna().all()   # transformers cannot count: null, not 0
    quality = df[(df.engine == "hf") & (df.phase == "quality")]
    assert quality["value"].isna().all() and quality["quality_reason"].str.contains("engine=hf").all()
    assert set(hf[hf.metric == "token_agreement"].phase) == {"prefill_fresh", "decode", "prefill_continuation",
                                                            "prefill_restored"}
    assert (hf[hf.metric == "token_agreement"]["value"] == 1.0).all()
    assert (hf[hf.metric == "max_abs_logit_diff"]["value"] <= 1e-4).all()
