"""`moebench-compare`'s verdict tells the truth, on result sets the real `moebench` CLI wrote:
runs of different models are never paired (a checkpoint is its content, not its path or its
label), and the headline is PASS only when everything in the base was compared and no check
went beyond its threshold -- INCOMPLETE (exit 3), INCONCLUSIVE (exit 4) and FAIL (exit 1)
otherwise -- while a 0.1% change is never listed as significant."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from harness import results
from tests.cli_runner import run_module
from tests.conftest import hf_model, save
from tests.harness.test_trust import REPO, cli

pytestmark = pytest.mark.slow     # CLI runs in subprocesses
RUN = ["model=tiny-mixtral", "workload=chat", "workload.tokens=random", "workload.context_tokens=256", "workload.gen_tokens=4",
       "run.timeline=false", "run.ablation=false", "run.check_reference=false", "run.quiet=true"]
CHECK = ["--check", "decode.tok_per_s:-10%", "--check", "prefill_fresh.ttft_s:+15%"]


def sweep(root: Path, name: str, *overrides: str, env: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    proc = cli(["-m", f"run.sweep_id={name}", *RUN, *overrides], root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "results" / "sweeps" / name


def compare(base: Path, new: Path, *args: str, tmp: Path) -> tuple[int, str, str, pd.DataFrame]:
    """The CLI in a subprocess: (exit code, stdout + stderr, the markdown report, the table)."""
    report, table = tmp / "report.md", tmp / "table.csv"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run_module("harness.analysis_cli", ["compare", str(base), str(new), *args, "--report", str(report),
                                               "--table", str(table)], os.getcwd(), env, timeout=300)
    df = pd.read_csv(table, keep_default_na=False, na_values=[""]) if table.exists() else pd.DataFrame()
    return proc.returncode, proc.stdout + proc.stderr, report.read_text() if report.exists() else "", df


def rewritten(src: Path, dst: Path, factor: Callable[[pd.DataFrame], pd.Series], jobs: set[str] | None = None) -> Path:
    """A copy of sweep `src` whose speed rows' values are multiplied by `factor(rows)`, each job
    written back with its own manifest (`jobs`: only those job dirs)."""
    for job in sorted(p for p in src.iterdir() if (p / results.ROWS_FILE).is_file()):
        if jobs is not None and job.name not in jobs:
            continue
        df = results.load(job)
        df["value"] = df["value"] * factor(df).where(df["profiler"].fillna("none") == "none", 1.0)
        rows = df.astype(object).where(df.notna(), None).to_dict("records")
        results.write_job(dst / job.name, rows, json.loads((job / results.MANIFEST_FILE).read_text()))
    return dst


def slower(by: float) -> Callable[[pd.DataFrame], pd.Series]:
    """Times `by` times longer, rates `by` times lower."""
    return lambda df: df["unit"].map({"s": by, "tok/s": 1 / by}).fillna(1.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    ckpt = save(hf_model("mixtral"), root / "ckpt")
    other = save(hf_model("mixtral", seed=1), root / "other")     # the same architecture, other weights
    copy = shutil.copytree(ckpt, root / "elsewhere" / "ckpt-copy")
    env = {"MOEBENCH_CACHE": str(root / "cache")}
    return {
        "preset": sweep(root / "p", "preset", "placement=resident,fetch", "cache.capacity=2", "run.repeats=2"),
        # a checkpoint under the preset's label: the `model` column alone cannot tell them apart
        "ckpt": sweep(root / "c", "ckpt", f"model.path={ckpt}", "placement=resident,fetch", "cache.capacity=2",
                      "run.repeats=2", env=env),
        "copy": sweep(root / "cc", "copy", f"model.path={copy}", "placement=resident,fetch", "cache.capacity=2",
                      "run.repeats=2", env=env),
        "other": sweep(root / "o", "other", f"model.path={other}", "placement=resident,fetch", "cache.capacity=2",
                       "run.repeats=2", env=env),
        "one": sweep(root / "1", "one", "placement=resident", "run.repeats=1"),
        "five": sweep(root / "5", "five", "placement=fetch", "cache.capacity=2", "run.repeats=5"),
    }


def test_runs_of_different_models_are_never_paired(runs, tmp_path) -> None:
    code, out, report, t = compare(runs["preset"], runs["ckpt"], *CHECK, tmp=tmp_path)
    assert code == 3 and "**INCOMPLETE**" in report and "**PASS**" not in report, out
    assert len(t) and set(t["verdict"]) == {"not comparable"}
    notes = set(t["note"])
    assert all(n.startswith("model differs: base ['tiny-mixtral: preset tiny-mixtral seed=0'] vs new "
                            "['tiny-mixtral: checkpoint sha256:") for n in notes), notes
    assert all(f"at {runs['ckpt'].parents[3] / 'ckpt'}" in n for n in notes)
    # two checkpoints of one architecture, other weights: not comparable either
    code, out, _, t = compare(runs["ckpt"], runs["other"], *CHECK, tmp=tmp_path)
    assert code == 3 and set(t["verdict"]) == {"not comparable"}, out
    assert t["note"].str.startswith("model differs").all()
    # the same bytes elsewhere are the same model: compared, with the checks applied
    code, out, report, t = compare(runs["ckpt"], runs["copy"], "--check", "*.h2d_bytes:+1%", tmp=tmp_path)
    assert "not comparable" not in set(t["verdict"]) and len(t) > 50, out
    assert code == 0 and "**PASS**" in report, out                   # exact byte counts, identical


def test_configs_missing_on_the_new_side_are_incomplete(runs, tmp_path) -> None:
    jobs = {p.name for p in runs["preset"].iterdir() if "placement=resident" in p.name}
    assert len(jobs) == 1
    new = rewritten(runs["preset"], tmp_path / "new" / "sweeps" / "preset", lambda df: pd.Series(1.0, index=df.index), jobs)
    code, out, report, t = compare(runs["preset"], new, *CHECK, tmp=tmp_path)
    assert code == 3 and "**INCOMPLETE**" in report, out
    why = ("only in base: placement differs: base fetch vs new resident; cache_capacity differs: base 2 vs new "
           "(not recorded); cache_policy differs: base lru vs new (not recorded); placement_options differs: "
           "base {'issue_ahead': True} vs new {}")
    assert f"has no comparable counterpart: {why}" in report and "placement=fetch" in report
    assert set(t[t["placement"] == "fetch"]["note"]) == {why}
    assert "not comparable" not in set(t[t["placement"] == "resident"]["verdict"])
    assert "INCOMPLETE (exit 3): base config" in out


def test_a_2x_slowdown_with_one_repeat_is_inconclusive(runs, tmp_path) -> None:
    new = rewritten(runs["one"], tmp_path / "new" / "sweeps" / "one", slower(2.0))
    code, out, report, t = compare(runs["one"], new, *CHECK, tmp=tmp_path)
    assert code == 4 and "**INCONCLUSIVE**" in report and "**PASS**" not in report, out
    dec = t[(t["phase"] == "decode") & (t["metric"] == "tok_per_s")].iloc[0]
    assert dec["verdict"] == "inconclusive" and dec["test"] == "too few" and dec["ratio"] == pytest.approx(0.5)
    assert "beyond the threshold but not significant (too few, 1 + 1 samples)" in report
    # no change at all, but one repeat a side: nothing could have been significant -- not a PASS
    code, out, report, _ = compare(runs["one"], runs["one"], *CHECK, tmp=tmp_path)
    assert code == 4 and "fewer than 2 samples on a side: nothing could be significant" in report, out


def test_one_repeat_a_side_and_no_checks_is_inconclusive(runs, tmp_path) -> None:
    """No checks, one repeat a side, even a 2x slowdown: no pair could be tested, so the verdict is
    INCONCLUSIVE with the reason, never PASS; with 2 repeats a side and no checks it is a PASS."""
    new = rewritten(runs["one"], tmp_path / "new" / "sweeps" / "one", slower(2.0))
    for other in (runs["one"], new):
        code, out, report, t = compare(runs["one"], other, tmp=tmp_path)
        assert code == 4 and "**INCONCLUSIVE**" in report and "**PASS**" not in report, out
        assert len(t) and set(t["test"]) == {"too few"}
        why = f"every compared pair ({len(t)}) has fewer than 2 samples on a side: nothing could be significant"
        assert why in report and f"INCONCLUSIVE (exit 4): {why}" in out
    code, out, report, _ = compare(runs["ckpt"], runs["copy"], tmp=tmp_path)
    assert code == 0 and "**PASS**" in report, out


def test_a_real_regression_with_enough_repeats_fails(runs, tmp_path) -> None:
    # the new side is the old samples slowed down: by more than the old run's own spread, so every
    # new sample is slower than every old one and the 5 + 5 Mann-Whitney test reaches its least p
    # (2/252) however noisy the machine that measured them was
    old = results.load(runs["five"])
    times = old[(old["profiler"].fillna("none") == "none") & (old["unit"] == "s")].groupby(
        ["phase", "metric", "source"])["value"]
    spread = float((times.max() / times.min()).replace([float("inf")], float("nan")).max())
    new = rewritten(runs["five"], tmp_path / "new" / "sweeps" / "five", slower(max(2.0, 1.5 * spread)))
    code, out, report, t = compare(runs["five"], new, *CHECK, tmp=tmp_path)
    assert code == 1 and "**FAIL**" in report and "## Regressions" in report, out
    dec = t[(t["phase"] == "decode") & (t["metric"] == "tok_per_s") & (t["source"] == "client")].iloc[0]
    assert dec["verdict"] == "regression" and dec["test"] == "mwu" and dec["p_value"] < 0.01
    assert "REGRESSION" in out and "decode.tok_per_s" in out
    code, out, report, _ = compare(runs["five"], runs["five"], *CHECK, tmp=tmp_path)
    assert code == 0 and "**PASS**" in report, out                   # itself: nothing changed


def test_a_tenth_of_a_percent_is_not_a_significant_change(runs, tmp_path) -> None:
    shifted = {"h2d_bytes", "peak_host_rss_bytes"}
    new = rewritten(runs["five"], tmp_path / "new" / "sweeps" / "five",
                    lambda df: df["metric"].isin(shifted).map({True: 1.001, False: 1.0}))
    code, out, report, t = compare(runs["five"], new, *CHECK, tmp=tmp_path)
    assert code == 0 and "**PASS**" in report, out
    h2d = t[(t["metric"] == "h2d_bytes") & (t["phase"] == "decode")].iloc[0]
    assert h2d["ratio"] == pytest.approx(1.001) and h2d["test"] == "constant"
    assert h2d["stat_significant"] and not h2d["significant"]        # certain, and too small to matter
    assert not t[t["metric"].isin(shifted)]["significant"].any()
    assert "h2d_bytes" not in report and "peak_host_rss_bytes" not in report      # listed nowhere
    # the floor is one option: at 0.05% the same change is listed
    code, out, report, t = compare(runs["five"], new, *CHECK, "--min-change", "0.05", tmp=tmp_path)
    assert t[(t["metric"] == "h2d_bytes") & (t["phase"] == "decode")]["significant"].all()
    assert "Other significant changes" in report and "h2d_bytes" in report.split("Other significant changes")[1]


def test_a_pair_not_comparable_names_the_column_that_differs(tmp_path) -> None:
    """Sweeps the CLI wrote with another placement option, or another cache size: each unpaired config
    says which config column's value the other side lacks, with both values, in the table and the
    report."""
    base = sweep(tmp_path / "b", "b", "placement=hybrid", "placement.n_cpu_layers=1,2", "run.repeats=1")
    new = sweep(tmp_path / "n", "n", "placement=hybrid", "placement.n_cpu_layers=2,3", "run.repeats=1")
    code, out, report, t = compare(base, new, *CHECK, tmp=tmp_path)
    assert code == 3, out
    options = t["placement_options"].astype(str)
    one, three = t[options.str.contains("'n_cpu_layers': 1")], t[options.str.contains("'n_cpu_layers': 3")]
    assert len(one) and set(one["note"]) == {"only in base: placement_options differs: base {'n_cpu_layers': 1} "
                                              "vs new {'n_cpu_layers': 2} or {'n_cpu_layers': 3}"}
    assert len(three) and set(three["note"]) == {"only in new: placement_options differs: base {'n_cpu_layers': 1} "
                                                  "or {'n_cpu_layers': 2} vs new {'n_cpu_layers': 3}"}
    assert "not comparable" not in set(t[options.str.contains("'n_cpu_layers': 2")]["verdict"])
    assert "has no comparable counterpart: only in base: placement_options differs" in report
    # a cache size the new set did not run
    other = sweep(tmp_path / "c", "c", "placement=fetch", "cache.capacity=4", "run.repeats=1")
    fetch2 = sweep(tmp_path / "d", "d", "placement=fetch", "cache.capacity=2", "run.repeats=1")
    code, out, report, t = compare(other, fetch2, *CHECK, tmp=tmp_path)
    assert code == 3 and set(t["note"]) == {"only in base: cache_capacity differs: base 4 vs new 2",
                                            "only in new: cache_capacity differs: base 4 vs new 2"}, out
