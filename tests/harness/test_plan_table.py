"""What practitioners reach for: `moebench plan` and `fit` against hand-computed plans, the
end-of-sweep table and `moebench table` formats (golden files), progress output, threads."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness import results as R
from harness.plan import fit_context, fit_cpu_layers, fit_capacity, fit_main, plan_main, plan_of, spec_of, verdict
from harness.table import FORMATS, render, sweep_table
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MOEBENCH_UPDATE_GOLDEN") == "1"
CHAT = ["workload=chat", "workload.context_tokens=1024"]

# tiny-mixtral by hand: vocab 512, hidden 64, 4 layers, 4 heads / 2 kv heads of 16, 8 experts of 128, fp32
NON_EXPERT = (2 * 512 * 64 + 64 + 4 * ((64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 64 + 8 * 64)) * 4   # 469,248 B
KV_PER_TOKEN = 2 * 4 * 2 * 16 * 4                                                                  # 1,024 B
EXPERT = 3 * 64 * 128 * 4                                                                          # 98,304 B
SESSION = 1024 + 32 + 2 * (64 + 1)                                                                 # 1,186 tokens


def test_plan_matches_the_hand_computation(capsys):
    spec = spec_of(["placement=fetch", "cache.capacity=2", *CHAT])
    p = plan_of(spec)
    assert (p.non_expert, p.kv, p.experts) == (NON_EXPERT, KV_PER_TOKEN * SESSION, 4 * 2 * EXPERT)
    assert p.total > NON_EXPERT + p.kv + p.experts                     # plus activations and attention workspace
    assert plan_main(["placement=fetch", "cache.capacity=2", *CHAT]) == 0
    out = capsys.readouterr().out
    assert "458.25 KiB" in out and "1.16 MiB" in out and "768.00 KiB" in out          # the three terms above
    for name in ("resident", "fetch", "cpu", "hybrid", "stream", "resident_grouped"):
        assert re.search(rf"^  {name} +fits", out, re.M), name


def test_auto_capacity_and_placements_that_do_not_fit(capsys):
    args = ["placement=fetch", "cache.capacity=auto", "hardware.device_memory=5MiB", "workload.ubatch=64", *CHAT]
    p = plan_of(spec_of(args))
    fixed = p.total - p.experts                                       # everything but the slots, reserve included
    assert 2 <= p.capacity == min(8, (5 * 2**20 - fixed) // (4 * EXPERT)) < 8   # what `auto` leaves per layer
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert f"cache.capacity=auto -> {p.capacity} expert slots" in out and re.search(r"^  resident +does not fit", out, re.M)
    assert plan_main([*args[:2], "placement=resident", *args[2:]]) == 1                # the job's own plan refused


def test_a_cpu_plan_is_for_the_jobs_threads_not_the_callers(capsys):
    """CPU attention keeps a buffer per torch thread: the plan of a job with run.threads=n is the
    one the runner, which sets n threads, will make, whatever threads the planning process has."""
    import torch
    args = ["placement=fetch", "cache.capacity=auto", "hardware.device_memory=7MiB", "workload.ubatch=64", *CHAT]
    before = torch.get_num_threads()
    one, two = (plan_of(spec_of([*args, f"run.threads={n}"])) for n in (1, 2))
    assert two.attention > one.attention and torch.get_num_threads() == before       # and the caller's kept
    torch.set_num_threads(2 if before == 1 else 1)
    try:
        assert plan_of(spec_of([*args, "run.threads=1"])) == one
    finally:
        torch.set_num_threads(before)
    assert plan_main(["-m", *args, "run.threads=1,2"]) == 0
    assert "planned for 1 or 2 torch thread(s) (run.threads" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["cache.capcity=4"], "Key 'capcity' not in"), (["model=nonexistent"], "Could not find 'model/nonexistent'"),
    (["workload.context_tokens=abc"], "workload.context_tokens: allowed an integer, got 'abc'"), (["-m", "cache.capcity=4,6"], "capcity"),
    (["cache.capacity=1"], "cache.capacity: allowed")])
def test_bad_input_is_exit_2_with_one_line_not_a_traceback(capsys, args, says):
    """Exit 1 means "does not fit"; a typo or a bad value is 2 with one line, however it fails
    (Hydra's composition, OmegaConf's types, our checks)."""
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if "-m" not in args:
        assert fit_main(["--search", "context", *args]) == 2
        assert says in capsys.readouterr().err


def test_fit_searches_find_the_boundary():
    spec = spec_of(["placement=fetch", "cache.capacity=2", "hardware.device_memory=7MiB", "workload.ubatch=64", *CHAT])
    best, text = fit_context(spec)
    from dataclasses import replace
    at = lambda n: verdict(replace(spec, workload=replace(spec.workload, context_tokens=n))).fits  # noqa: E731
    assert best and at(best) and not at(best + 1) and f"largest context_tokens that fits: {best}" in text
    cap, text = fit_capacity(spec_of(["placement=fetch", "hardware.device_memory=7MiB", "workload.ubatch=64", *CHAT]))
    assert cap is not None and f"largest cache.capacity that fits: {cap} of 8" in text
    n, text = fit_cpu_layers(spec_of(["placement=hybrid", "hardware.device_memory=10MiB", "workload.ubatch=64", *CHAT]))
    assert n is not None and f"--n-cpu-moe {n}" in text
    if n > 0:
        fewer = spec_of(["placement=hybrid", f"placement.n_cpu_layers={n - 1}", "hardware.device_memory=10MiB",
                         "workload.ubatch=64", *CHAT])
        assert not verdict(fewer).fits


def test_when_nothing_fits_the_message_says_what_would():
    spec = spec_of(["placement=resident", "hardware.device_memory=3MiB", *CHAT])
    best, text = fit_context(spec)
    assert best is None and "nothing fits" in text and "what would fit: nothing at any context" in text
    best, text = fit_cpu_layers(spec_of(["placement=hybrid", "hardware.device_memory=7MiB", *CHAT]))
    assert best is None and "what would fit: the same setting with workload.context_tokens=" in text


def _tree(root: Path) -> Path:
    factors = {"engine": "moebench", "model": "tiny-mixtral", "cache_policy": "lru", "prefetch": "none",
               "workload": "chat", "context_tokens": 512, "gen_tokens": 8, "batch": 1, "dtype": "float32"}
    dev = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}
    sweep = root / "s"
    for i, (placement, cap, rate) in enumerate((("fetch", "2", 100.0), ("fetch", "4", 150.0), ("resident", None, 300.0))):
        f = {**factors, "placement": placement, "cache_capacity": cap}
        rows = []
        for r in range(3):
            rows += R.make_rows(f, dev, "s", str(i), r, "decode", {"tok_per_s": rate + 10 * r}, "client",
                                extra={"profiler": "none"})
            rows += R.make_rows(f, dev, "s", str(i), r, "decode", {"tok_per_s": 1.0, "hit_rate": 0.5}, "engine",
                                extra={"profiler": "none"})          # an engine's own rate: never the client column
            rows += R.make_rows(f, dev, "s", str(i), r, "prefill_fresh", {"tok_per_s": 10 * rate, "ttft_s": 0.05},
                                "client", extra={"profiler": "none"})
        R.write_job(sweep / str(i), rows, {"t": 1})
    R.write_job(sweep / "3", [R.failed_row({**factors, "placement": "cpu", "cache_capacity": None}, dev, "s", "3",
                                           "PlanError: does not fit\narithmetic follows")], {"t": 1})
    return sweep


@pytest.mark.parametrize("fmt", FORMATS)
def test_table_formats_match_golden_files(tmp_path, fmt):
    text = render(sweep_table(R.load(_tree(tmp_path))), fmt)
    path = GOLDEN / f"table.{fmt}"
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (MOEBENCH_UPDATE_GOLDEN=1 to regenerate, then review)"


@pytest.mark.slow
def test_table_rows_columns_and_failed_jobs(tmp_path):
    t = sweep_table(R.load(_tree(tmp_path)))
    assert list(t["placement"]) == ["fetch", "fetch", "resident", "cpu"] and "cache_capacity" in t
    assert "workload" not in t                                         # only the factors that vary
    assert t.loc[0, "tg tok/s"] == 110.0 and t.loc[0, "tg tok/s ±"] == 10.0 and t.loc[0, "tg tok/s n"] == 3
    assert t.loc[3, "status"] == "failed" and t.loc[3, "error"] == "PlanError: does not fit"
    proc = run_cli(["table", str(tmp_path / "s"), "--format", "md"], Path.cwd(), {**os.environ, "PYTHONPATH": str(REPO)},
                   timeout=120)
    assert proc.returncode == 0 and proc.stdout == render(t, "md")


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.slow
def test_sweep_progress_is_shown_unless_quiet(tmp_path, quiet):
    args = ["-m", "placement=resident,cpu", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=2",
            "run.repeats=1", "run.timeline=false", "run.ablation=false", f"run.quiet={str(quiet).lower()}"]
    proc = run_cli(args, tmp_path, {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("job ")]
    if quiet:
        assert not lines and "repeat 1/1" not in proc.stderr
    else:
        assert [l.split(" (")[0] for l in lines] == ["job 1/2", "job 2/2"]
        assert "elapsed, ~? left): " in lines[0] and "left): placement=cpu" in lines[0] + lines[1]
        assert "  repeat 1/1" in proc.stderr and "sweep " in proc.stderr and "tg tok/s" in proc.stderr
        assert "loading the model: load 4/4" in proc.stderr          # long work inside a step shows progress too


def test_default_threads_are_the_physical_cores_unless_the_environment_says(monkeypatch):
    from harness.machine import default_threads, physical_cores_available
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == physical_cores_available() >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1


def test_table_lists_numeric_factors_in_numeric_order(tmp_path):
    """Jobs read 1024 before 512 (as their files sort as text) still list 512 first; text
    factors keep the sweep's order."""
    factors = {"engine": "moebench", "model": "tiny-mixtral", "cache_policy": "lru", "prefetch": "none",
               "workload": "chat", "gen_tokens": 8, "batch": 1, "dtype": "float32", "cache_capacity": "2"}
    dev = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}
    for i, (placement, ctx) in enumerate((("resident", 1024), ("resident", 512), ("fetch", 1024), ("fetch", 512))):
        f = {**factors, "placement": placement, "context_tokens": ctx}
        R.write_job(tmp_path / "s" / str(i), R.make_rows(f, dev, "s", str(i), 0, "decode", {"tok_per_s": float(ctx)},
                                                         "client", extra={"profiler": "none"}), {"t": 1})
    t = sweep_table(R.load(tmp_path / "s"))
    assert list(zip(t["placement"], t["context_tokens"])) == [("resident", 512), ("resident", 1024),
                                                              ("fetch", 512), ("fetch", 1024)]


def test_jobs_of_different_sweeps_are_never_one_row(tmp_path):
    """Every single run's job id is "run": two runs in one results dir are two rows, told apart
    by their sweep ids, with their own repeats -- even when their configs are the same."""
    factors = {"engine": "moebench", "model": "tiny-mixtral", "cache_policy": None, "prefetch": "none",
               "workload": "chat", "context_tokens": 128, "gen_tokens": 8, "batch": 1, "dtype": "float32",
               "cache_capacity": None}
    dev = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}
    for sweep, placement, rate in (("run-a", "resident", 300.0), ("run-b", "fetch", 100.0), ("run-c", "fetch", 120.0)):
        rows = [row for r in range(2) for row in R.make_rows({**factors, "placement": placement}, dev, sweep, "run", r,
                                                              "decode", {"tok_per_s": rate + r}, "client",
                                                              extra={"profiler": "none"})]
        R.write_job(tmp_path / "runs" / sweep, rows, {"t": 1})
    t = sweep_table(R.load(tmp_path / "runs"))
    assert list(zip(t["sweep_id"], t["placement"], t["tg tok/s"], t["tg tok/s n"])) == [
        ("run-a", "resident", 300.5, 2), ("run-b", "fetch", 100.5, 2), ("run-c", "fetch", 120.5, 2)]
