"""Results never mix or vanish: the real `moebench` CLI in subprocesses, with real signals, real
files and real locks, asserting on the loaded tables (rows per job, no duplicates, nothing stale)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import results
from harness.contract import ALL_PHASES, SERVE_PHASE
from harness.sweep import stale_jobs
from tests.cli_runner import run_cli

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
REPO = Path(__file__).resolve().parents[2]
SMALL = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1",
         "run.timeline=false", "run.ablation=false", "run.quiet=true"]
KEY = ["job_id", "repeat", "phase", "metric", "source", "profiler"]


def cli(args: list[str], cwd: Path, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m harness.cli *args` (forked warm: tests/cli_runner.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return run_cli(args, cwd, env, **{"timeout": 600, **kw})


def popen(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def done_times(sweep: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in sweep.glob("*/DONE")}


def table(sweep: Path):
    df = results.load(sweep / results.SWEEP_TABLE)
    assert not df.duplicated([*KEY, *(["request_id"] if "request_id" in df else [])]).any()   # a request's own rows
    return df


def wait_until(done: Callable[[], bool], proc: subprocess.Popen | None = None, timeout: float = 300,
               every: float = 0.05) -> None:
    """Poll `done` until it holds, `proc` (when given) has exited, or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done() and (proc is None or proc.poll() is None):
        time.sleep(every)


def a_done_rewritten(sweep: Path, before: dict[str, int]) -> Callable[[], bool]:
    """Whether some job of `sweep` has written its DONE since `before` (done_times)."""
    return lambda: any(t != before.get(j) for j, t in done_times(sweep).items())


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp")]


# ----------------------------------------------------------------------------- 1. resume by config

def test_a_different_sweep_in_the_same_dir_is_refused_unless_added_or_replaced(tmp_path):
    first = cli(["-m", "placement=resident", "run.sweep_id=X", *SMALL], tmp_path)
    assert first.returncode == 0, first.stderr
    sweep = tmp_path / "results" / "sweeps" / "X"
    before = done_times(sweep)

    other = cli(["-m", "placement=cpu", "run.sweep_id=X", *SMALL], tmp_path)
    assert other.returncode == 1
    msg = other.stderr.strip().splitlines()[-1]
    assert "sweep dir results/sweeps/X " in msg and "placement: resident (recorded) vs cpu (now)" in msg
    assert "run.resume=add" in msg and "run.resume=replace" in msg and "Traceback" not in other.stderr
    assert set(table(sweep).placement) == {"resident"} and done_times(sweep) == before   # nothing touched

    added = cli(["-m", "placement=cpu", "run.sweep_id=X", "run.resume=add", *SMALL], tmp_path)
    assert added.returncode == 0, added.stderr
    df = table(sweep)
    assert set(df.placement) == {"resident", "cpu"} and df.job_id.nunique() == 2
    assert done_times(sweep)[next(iter(before))] == next(iter(before.values()))          # resident not re-run

    replaced = cli(["-m", "placement=cpu", "run.sweep_id=X", "run.resume=replace", *SMALL], tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert set(table(sweep).placement) == {"cpu"}


def test_rerun_skips_only_when_the_config_hash_matches(tmp_path, tiny_mixtral_dir):
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_mixtral_dir, ckpt)
    args = ["-m", "model=hf", f"model.path={ckpt}", "workload.tokens=random", "placement=resident,cpu", *SMALL]
    assert cli(args, tmp_path).returncode == 0
    sweep = next((tmp_path / "results" / "sweeps").iterdir())
    first = done_times(sweep)
    assert len(first) == 2
    again = cli(args, tmp_path)
    assert again.returncode == 0 and done_times(sweep) == first                           # same hash: skipped
    # the checkpoint changed in place (same path): its identity, and so every job's hash, changed
    weights = next(ckpt.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cli(args, tmp_path).returncode == 0
    third = done_times(sweep)
    assert all(third[j] > first[j] for j in first)
    assert table(sweep).job_id.nunique() == 2


def test_a_resume_retires_an_older_configs_results_before_any_job_runs(tmp_path, tiny_mixtral_dir):
    """The checkpoint changed in place since the sweep ran, so all three jobs' results are an older
    config's. The resume is killed (SIGKILL: no clean-up of any kind) as soon as it has re-measured
    one job: the dir then holds that job's new results and nothing of the older config -- the two
    unreached jobs were retired when the resume started, not left beside the new one."""
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_mixtral_dir, ckpt)
    args = ["-m", "model=hf", f"model.path={ckpt}", "workload.tokens=random", "placement=fetch",
            "cache.capacity=2,3,4", *SMALL]
    assert cli(args, tmp_path).returncode == 0
    sweep = next((tmp_path / "results" / "sweeps").iterdir())
    first = done_times(sweep)
    assert len(first) == 3 and table(sweep).job_id.nunique() == 3
    weights = next(ckpt.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    proc = popen(args, tmp_path)
    wait_until(a_done_rewritten(sweep, first), proc, every=0.02)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert "3 finished job(s)" in err and "ran under another config than their overrides give now" in err, err
    remeasured = {j for j, t in done_times(sweep).items() if t > first[j]}
    assert 1 <= len(remeasured) < 3, remeasured                    # killed midway
    assert set(done_times(sweep)) == remeasured                     # no older DONE left beside it
    df = results.load(sweep)
    assert df.job_id.nunique() == len(remeasured)
    if (sweep / results.SWEEP_TABLE).is_file():                     # a table, if any, holds no older job either
        assert table(sweep).job_id.nunique() <= len(remeasured)


def test_job_dirs_do_not_depend_on_the_order_of_sweep_values(tmp_path):
    assert cli(["-m", "placement=resident,cpu", "run.sweep_id=S", *SMALL], tmp_path).returncode == 0
    sweep = tmp_path / "results" / "sweeps" / "S"
    first = done_times(sweep)
    # the same sweep written in another order (and with -m last): the same jobs, all skipped
    proc = cli(["placement=cpu,resident", "run.sweep_id=S", *SMALL, "-m"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert done_times(sweep) == first


def test_values_that_differ_only_by_a_path_separator_get_two_job_dirs(tmp_path, tiny_mixtral_dir):
    import shutil
    for rel in ("ck/a", "ck_a"):                   # one dir name once `/` becomes `_`
        shutil.copytree(tiny_mixtral_dir, tmp_path / rel)
    proc = cli(["-m", "model=hf", "model.path=ck/a,ck_a", "workload.tokens=random", "run.sweep_id=P", *SMALL],
               tmp_path)
    assert proc.returncode == 0, proc.stderr
    sweep = tmp_path / "results" / "sweeps" / "P"
    assert len(done_times(sweep)) == 2
    df = table(sweep)
    assert df.job_id.nunique() == 2 and all(any(v in j for j in df.job_id) for v in ("=ck/a", "=ck_a"))


# ----------------------------------------------------------------------------- 2. one writer

def test_a_second_writer_is_refused_while_the_first_runs(tmp_path):
    args = ["-m", "placement=resident,cpu,fetch", "run.sweep_id=L", *SMALL]
    first = popen(args, tmp_path)
    lock = tmp_path / "results" / "sweeps" / "L" / ".lock"
    wait_until(lambda: lock.is_file() and lock.read_text().startswith("pid"), timeout=120)
    second = cli(args, tmp_path)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert second.returncode == 1
    assert f"pid {first.pid}" in second.stderr and "being written by another moebench" in second.stderr
    df = table(tmp_path / "results" / "sweeps" / "L")
    assert df.job_id.nunique() == 3 and (df.status == "ok").all()


@pytest.mark.parametrize("given", ["run.out=${oc.env:OUT_ROOT}", "hydra.sweep.dir=${oc.env:OUT_ROOT}/s",
                                   "run.sweep_id=${now:%H%M%S}"])
def test_an_interpolated_sweep_dir_is_refused_before_anything_is_written(tmp_path, given):
    # the lock and sweep.json would land at the literal path while Hydra writes where it resolves
    proc = cli(["-m", "placement=resident", given, *SMALL], tmp_path, env={"OUT_ROOT": str(tmp_path / "out")})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{given}: a sweep's dir must be a plain path" in proc.stderr and "run.out=$HOME" in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 3. failed jobs retried

def test_failed_jobs_are_retried_unless_asked_not_to(tmp_path):
    args = ["-m", "workload.context_tokens=256,9000", *[a for a in SMALL if "context_tokens" not in a]]
    assert cli(args, tmp_path).returncode == 1
    sweep = next((tmp_path / "results" / "sweeps").iterdir())
    first = done_times(sweep)
    failed_job = next(j for j in first if "9000" in j)
    ok_job = next(j for j in first if "9000" not in j)
    kept = cli([*args, "run.retry_failed=false"], tmp_path)
    assert kept.returncode == 1 and done_times(sweep) == first          # skipped; the table still says failed
    retried = cli(args, tmp_path)
    assert retried.returncode == 1
    now = done_times(sweep)
    assert now[failed_job] > first[failed_job] and now[ok_job] == first[ok_job]
    df = table(sweep)
    assert df.job_id.nunique() == 2 and (df[df.status == "failed"].job_id == failed_job).all()


# ----------------------------------------------------------------------------- 4. failed writes

@pytest.mark.parametrize("blocked", [results.ROWS_FILE, results.MANIFEST_FILE])
def test_a_job_whose_files_cannot_be_written_becomes_a_failed_row(tmp_path, blocked):
    args = ["-m", "placement=resident,cpu", "run.sweep_id=W", *SMALL]
    assert cli(args, tmp_path).returncode == 0
    sweep = tmp_path / "results" / "sweeps" / "W"
    cpu_dir = next(p for p in sweep.iterdir() if p.name.startswith("placement=cpu"))
    # the cpu job left incomplete (as by a kill), and one of its files' place taken by a directory:
    # renaming the new file into place fails with a real OS error (the manifest: after the new
    # rows.parquet is in place, so the job's dir holds rows without a DONE)
    (cpu_dir / results.DONE_FILE).unlink()
    (cpu_dir / blocked).unlink()
    (cpu_dir / blocked).mkdir()
    proc = cli(args, tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    for df in (table(sweep), results.load(sweep)):      # the sweep table, and the dir as any load reads it
        assert df.job_id.nunique() == 2
        failed = df[df.status == "failed"]
        assert len(failed) == 1 and failed.iloc[0]["placement"] == "cpu"
        assert "cannot write the job's files" in failed.iloc[0]["error"] and "Is a directory" in failed.iloc[0]["error"]
        assert set(df[df.status == "ok"].placement) == {"resident"}
    assert not temp_files(sweep)


def test_a_sweep_table_that_cannot_be_written_fails_with_one_line(tmp_path):
    args = ["-m", "placement=resident", "run.sweep_id=T", *SMALL]
    assert cli(args, tmp_path).returncode == 0
    sweep = tmp_path / "results" / "sweeps" / "T"
    (sweep / results.SWEEP_TABLE).unlink()
    (sweep / results.SWEEP_TABLE).mkdir()
    proc = cli(args, tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("moebench: cannot write") and f"results/sweeps/T/{results.SWEEP_TABLE}" in last
    assert "Is a directory" in last and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- 5. signals

@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_sweep_writes_the_completed_jobs_and_resumes(tmp_path, sig, code):
    args = ["-m", "placement=resident,cpu,fetch,hybrid", "cache.capacity=2,4", "run.sweep_id=G", *SMALL]
    proc = popen(args, tmp_path)
    sweep = tmp_path / "results" / "sweeps" / "G"
    wait_until(lambda: len(list(sweep.glob("*/DONE"))) >= 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    lines = [l for l in err.strip().splitlines() if l.startswith("moebench:")]
    assert len(lines) == 1 and signal.Signals(sig).name in lines[0] and "Traceback" not in err
    completed = done_times(sweep)
    df = table(sweep)
    done_ids = {json.loads(p.read_text())["job_id"] for p in sweep.glob("*/DONE")}
    # 5 jobs: resident, cpu and hybrid keep no cache, so their cache.capacity=4 jobs are skipped as twins
    assert set(df.job_id) == done_ids and 2 <= len(completed) < 5             # exactly the completed jobs
    assert not temp_files(sweep)
    # a kill -9 during a later table write would leave a temp file; the next run removes it
    (sweep / ".results.parquet.killed.tmp").write_bytes(b"half a table")
    again = cli(args, tmp_path)
    assert again.returncode == 0, again.stderr
    df = table(sweep)
    assert df.job_id.nunique() == 5 and (df.status == "ok").all()
    assert all(done_times(sweep)[j] == t for j, t in completed.items())          # not re-run
    assert not temp_files(sweep)
    per_job = df.groupby("job_id").size()
    assert per_job.nunique() <= 2            # fetch/hybrid vs others differ only by what applies


@pytest.mark.slow
def test_an_interrupted_resume_of_a_changed_sweep_leaves_no_older_results(tmp_path):
    """The experiment file (on a search path given on the command line) changed since the sweep
    ran: the resume retires all three jobs before running any, and a signal after the first is
    re-measured leaves that job alone in the dir and the table -- with no traceback however the
    signal lands (in a job, or in Hydra composing the next job's config). Resumed unchanged, the
    same search path composes the same configs and nothing is retired."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    mine = conf / "mine.yaml"
    args = ["-m", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=mine", "cache.capacity=2,3,4",
            "run.sweep_id=C", *SMALL]
    mine.write_text("# @package _global_\nworkload:\n  turn_tokens: 4\n")
    assert cli(args, tmp_path).returncode == 0
    sweep = tmp_path / "results" / "sweeps" / "C"
    before = done_times(sweep)

    def cannot_compose(overrides):
        raise ValueError("an interpolation only Hydra's app resolves")
    assert stale_jobs(sweep, cannot_compose) == []                  # unchecked, never retired on a guess
    same = cli(args, tmp_path)
    assert same.returncode == 0 and "finished job(s)" not in same.stderr and done_times(sweep) == before, same.stderr
    mine.write_text("# @package _global_\nworkload:\n  turn_tokens: 16\n")
    proc = popen(args, tmp_path)
    wait_until(a_done_rewritten(sweep, before), proc, every=0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert "3 finished job(s)" in err and "config hash" in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("moebench: interrupted by SIGTERM") and "not reached by this run" not in last, last
    remeasured = set(done_times(sweep))
    assert remeasured and all(done_times(sweep)[j] != before[j] for j in remeasured)
    assert results.load(sweep).job_id.nunique() == len(remeasured)
    if (sweep / results.SWEEP_TABLE).is_file():
        assert table(sweep).job_id.nunique() <= len(remeasured)


def test_a_job_is_reached_before_its_done_is_written(tmp_path):
    """What an interrupt's line calls "not reached by this run" is read from the jobs this process
    reached (JobContext.reached), so a job must be reached before its DONE lands: a signal between
    the DONE and the end of the job (seen under load in CI) then finds the job this run's, not
    results "from before it". A job found current is reached too, its DONE untouched."""
    from hydra import compose, initialize_config_dir

    from harness.cli import CONF_DIR
    from harness.report import Reporter
    from harness.runner import JobContext, run

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[*SMALL, f"run.out={tmp_path}"])
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / results.DONE_FILE).write_text(json.dumps({"status": "ok", "config_hash": "an older config"}))
    seen: list[tuple[str, bool]] = []
    ctx = JobContext(job_dir, "s", "j", reached=lambda job_id: seen.append((job_id, (job_dir / results.DONE_FILE).exists())))
    out = run(cfg, ctx, Reporter(quiet=True))
    assert out.error is None and out.skipped is None
    assert seen == [("j", False)]                   # reached once, the older DONE already gone, the new not yet written
    written = json.loads((job_dir / results.DONE_FILE).read_text())
    assert written["config_hash"] != "an older config"
    again = run(cfg, ctx, Reporter(quiet=True))
    assert again.skipped and seen == [("j", False), ("j", True)]
    assert json.loads((job_dir / results.DONE_FILE).read_text()) == written


@pytest.mark.slow
def test_an_interrupted_replace_says_how_to_resume_without_starting_over(tmp_path):
    """`run.resume=replace` clears the dir on every run: repeating the command after an interrupt
    would delete the jobs it completed, so the message says to drop it."""
    args = ["-m", "placement=fetch", "cache.capacity=2,3,4", "run.sweep_id=R", "run.resume=replace", *SMALL]
    proc = popen(args, tmp_path)
    sweep = tmp_path / "results" / "sweeps" / "R"
    wait_until(lambda: bool(list(sweep.glob("*/DONE"))), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.endswith("run the command again without run.resume=replace to resume (with it, the sweep starts "
                         "over and the completed jobs are deleted)"), last
    kept = done_times(sweep)
    again = cli([a for a in args if a != "run.resume=replace"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert all(done_times(sweep)[j] == t for j, t in kept.items())              # resumed, not re-run


@pytest.mark.slow
def test_a_sweep_interrupted_before_any_job_finished_claims_no_table(tmp_path):
    """SIGINT in the first job of a sweep: its line says no job had finished and names no table,
    and the sweep dir holds none."""
    proc = popen(["-m", "placement=resident,fetch", "cache.capacity=2", "workload=chat", "workload.context_tokens=2048",
                  "workload.gen_tokens=64", "run.repeats=20", "run.sweep_id=Z", "run.quiet=true"], tmp_path)
    wait_until(lambda: bool(list(tmp_path.glob("results/.reference/*.pt"))), proc, timeout=120)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    sweep = tmp_path / "results" / "sweeps" / "Z"
    assert not list(sweep.glob("*/DONE")) and not (sweep / results.SWEEP_TABLE).exists()
    last = err.strip().splitlines()[-1]
    assert last.startswith("moebench: interrupted by SIGINT; no job in ") and "had finished, so it has no table" in last
    assert "the table of" not in err


def test_ctrl_c_in_a_single_run_prints_one_line(tmp_path):
    proc = popen(["workload=chat", "workload.context_tokens=2048", "workload.gen_tokens=64", "run.repeats=20",
                  "run.quiet=true"], tmp_path)
    wait_until(lambda: bool(list(tmp_path.glob("results/.reference/*.pt"))), timeout=120)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("moebench: interrupted by SIGINT")
    run_dir = next((tmp_path / "results" / "runs").iterdir())
    assert not results.job_complete(run_dir)
    # a single run keeps nothing to resume from, so the line promises no resume
    assert "a single run does not resume" in err and "again to resume" not in err


# ----------------------------------------------------------------------------- 13. rerun one job

def test_rerun_replays_one_job_from_its_manifest(tmp_path):
    assert cli(["-m", "placement=fetch", "cache.capacity=2", "run.sweep_id=R", *SMALL], tmp_path).returncode == 0
    job = next(p for p in (tmp_path / "results" / "sweeps" / "R").iterdir() if p.is_dir())
    proc = cli(["rerun", str(job), "--out", str(tmp_path / "again")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    old, new = (json.loads((d / results.MANIFEST_FILE).read_text()) for d in (job, tmp_path / "again"))
    assert old["config_hash"] == new["config_hash"] and old["config"] == new["config"]
    counters = ["h2d_bytes", "expert_hits", "expert_misses", "d2h_bytes"]
    a, b = (results.load(d) for d in (job, tmp_path / "again"))
    pick = lambda df: df[df.metric.isin(counters) & (df.profiler == "none")].set_index(  # noqa: E731
        ["phase", "metric"])["value"].sort_index()
    assert (pick(a) == pick(b)).all() and len(pick(a)) >= 16
    for key in ("command", "overrides", "machine_load", "threads", "device"):
        assert new[key] is not None, key
    assert new["machine_load"]["start"]["cores"] >= 1 and new["device"]["device_kind"] == "cpu"
    assert new["machine_load"]["measurement"]["other_busy_cores"] >= 0
    # an override that no longer composes (a key renamed since) is refused in one line, exit 2
    m = json.loads((job / results.MANIFEST_FILE).read_text())
    m["overrides"] = [*m["overrides"], "cache.old_key=4"]
    (job / results.MANIFEST_FILE).write_text(json.dumps(m))
    proc = cli(["rerun", str(job), "--out", str(tmp_path / "again2")], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "no longer compose" in proc.stderr and "cache.old_key" in proc.stderr


def test_rows_record_threads_load_and_phase_states(tmp_path):
    assert cli(["placement=fetch", "run.expert_cache=warm", "workload=chat", "workload.context_tokens=256",
                "workload.gen_tokens=4", "run.repeats=1", "run.quiet=true"], tmp_path).returncode == 0
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    assert set(df.phase) == set(ALL_PHASES) - {SERVE_PHASE}          # serve: only a job with a load has it
    assert (df.threads == 1).all() and df.load_avg_start.notna().all() and "machine_busy" in df
    measured = df[(df.profiler == "none") & df.repeat.notna()]            # not the ablation's aggregate rows
    assert set(measured[measured.phase == "prefill_fresh"].expert_cache) == {"warm"}
    assert set(measured[measured.phase == "decode"].expert_cache) == {"warm"}
    assert set(df[df.phase == "load"].expert_cache) == {"cold"}
    assert set(df[df.phase == "prefill_restored"].prefix_cache) == {"restored"}
