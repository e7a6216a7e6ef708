"""The serve pass through the CLI, in real processes: a load run writes one row per request and
metric, the steady window's summary and the engine's batch counters, with the load's columns on
every row; `load=none` skips it, saying so; a bad load spec is one line; a length dataset sets each
request's prompt and output; a sweep over loads killed mid-load (a real SIGTERM) resumes into
exactly one set of request rows per job, the completed jobs not run again; `moebench serve-sweep`
steps a rate or a closed loop's concurrency up to the SLO."""
from __future__ import annotations

import json
import signal

import pandas as pd
import pytest

from harness import results
from harness.compare import compare_paths
from harness.plots.serving import load_curve
from harness.serving.load import LoadConf, schedule
from tests.harness.test_trust import cli, done_times, popen, table, wait_until

LOAD = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1", "run.warmup=0",
        "run.quiet=true", "run.passes=[speed,serve]", "load=poisson", "load.rate=50", "load.requests=10",
        "load.warmup_requests=2", "load.max_concurrency=3", "load.input_len=48", "load.output_len=5",
        "load.slo=mixtral-8x7b"]


def serve_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df.phase == "serve") & (df.profiler == "serve")]


def test_a_load_run_writes_requests_a_summary_and_the_batch_it_made(tmp_path):
    proc = cli(LOAD, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (job_dir,) = (tmp_path / "results" / "runs").iterdir()
    df = results.load(job_dir)
    rows = serve_rows(df)
    per_request = rows[rows.request_id.notna()]
    assert sorted(per_request.request_id.unique()) == sorted(f"r{i}" for i in range(10))   # warm-up ones too
    by = per_request.pivot_table(index="request_id", columns="metric", values="value")
    assert (by["output_tokens"] == 5).all() and (by["prompt_tokens"] == 48).all() and (by["output_mismatch"] == 0).all()
    assert by.loc[["r0", "r1"], "warmup"].eq(1).all() and by.drop(["r0", "r1"])["warmup"].eq(0).all()
    assert (by["ttft_s"] > 0).all() and (by["e2el_s"] >= by["ttft_s"]).all()
    summary = rows[rows.request_id.isna() & (rows.source == "client")].set_index("metric")["value"]
    assert summary["requests"] == summary["completed"] == 8 and summary["failed"] == 0   # warm-up excluded
    assert summary["output_tokens"] == 8 * 5 and summary["prompt_tokens"] == 8 * 48
    assert 0 < summary["request_goodput"] <= summary["request_throughput"]
    assert summary["ttft_s_p50"] <= summary["ttft_s_p99"] and summary["cached_prompt_fraction"] == 0
    engine = rows[rows.source == "engine"].set_index("metric")["value"]
    assert 1 <= engine["sequences_per_step"] <= 3 and engine["steps"] >= 5     # at most max_concurrency at once
    assert 2 <= engine["distinct_experts_per_layer_step"] <= 8                # top-2 of 8 experts, unioned
    assert 0 <= engine["serve_hit_rate"] <= 1 and summary["harness_overhead_s_per_request"] > 0
    assert set(df.load.dropna()) == {"poisson"} and set(df.load_rate.dropna()) == {50.0}
    assert set(df.load_max_concurrency.dropna()) == {3}
    manifest = json.loads((job_dir / "manifest.json").read_text())
    assert {"name": "serve", "status": "ran", "reason": None} in manifest["passes"]
    cmp = compare_paths(job_dir, job_dir, ["serve.ttft_s:+20%", "serve.tpot_s:+20%"])   # a regression gate
    gated = cmp.table[cmp.table.phase == "serve"].set_index("metric")
    assert gated.loc["ttft_s", "n_base"] == gated.loc["ttft_s", "n_new"] == 8      # one sample a measured request
    assert gated.loc["ttft_s", "verdict"] == gated.loc["tpot_s", "verdict"] == "ok" and cmp.verdict == "PASS"
    assert "warmup" not in gated.index and gated.loc["e2el_s", "unit"] == "s"
    fig = load_curve(df)                                  # goodput and p99 TPOT against the offered load
    goodput, tpot = fig.axes
    (line,) = goodput.get_lines()
    assert list(line.get_xdata()) == [50.0] and list(line.get_ydata()) == [summary["request_goodput"]]
    assert list(tpot.get_lines()[0].get_ydata()) == [summary["tpot_s_p99"] * 1e3]


def test_plan_and_predict_hold_kv_for_every_concurrent_sequence(tmp_path):
    """KV for max_concurrency sequences, each as long as the longest request or the workload's session."""
    one = cli(["plan", "load=poisson", "load.max_concurrency=1"], tmp_path).stdout
    six = cli(["plan", "load=poisson", "load.max_concurrency=6"], tmp_path).stdout
    assert "KV cache (4 layers, 1 x 4258 tokens)" in one and "KV cache (4 layers, 6 x 4258 tokens)" in six
    assert "x batch 6," in six
    pred = cli(["predict", "load=poisson", "load.max_concurrency=6", "hardware=h100-pcie-80gb"], tmp_path).stdout
    assert "x batch 6," in pred


def test_no_load_skips_the_pass_and_says_why(tmp_path):
    proc = cli([a for a in LOAD if not a.startswith("load")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (job_dir,) = (tmp_path / "results" / "runs").iterdir()
    assert serve_rows(results.load(job_dir)).empty
    passes = json.loads((job_dir / "manifest.json").read_text())["passes"]
    assert {"name": "serve", "status": "skipped", "reason": "load=none"} in passes


@pytest.mark.parametrize("bad, line", [
    ("load.rate=-1", "ConfigError: load.rate: allowed a positive number or null, got -1.0"),
    ("load.slo=fast", "ConfigError: load.slo: unknown SLO 'fast': give a preset (mixtral-8x7b, deepseek-r1, "
                      "deepseek-r1-interactive) or 'ttft=SECONDS,tpot=SECONDS[,percentile=P]'; the keys are ttft and "
                      "tpot, and optionally percentile, each once"),
    ("load.dataset_file=lengths.jsonl", "ConfigError: load.dataset_file: allowed null unless load.input_dist or "
                                        "load.output_dist is dataset, got 'lengths.jsonl'"),
])
def test_a_bad_load_is_a_failed_job_saying_why(tmp_path, bad, line):
    """As any bad setting of a job: its failed row saying why in one line, before the engine is built."""
    proc = cli([*LOAD, bad], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (job_dir,) = (tmp_path / "results" / "runs").iterdir()
    df = results.load(job_dir)
    assert (df.status == "failed").all() and df.error.iloc[0] == line


DATASET = [a for a in LOAD if not a.startswith(("load.rate", "load.input_len", "load.output_len"))] + [
    "load.rate=null", "load.input_dist=dataset", "load.output_dist=dataset", "load.dataset_file=lengths.csv"]


def test_a_length_dataset_sets_each_requests_prompt_and_output_in_a_closed_loop(tmp_path):
    """Each request is served with the lengths of the row the schedule gave it (a relative path is
    the working directory's); a row beyond the model's context fails the job when it is checked."""
    (tmp_path / "lengths.csv").write_text("input_length,output_length\n40,3\n64,6\n20,1\n")
    proc = cli(DATASET, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (job_dir,) = (tmp_path / "results" / "runs").iterdir()
    df = results.load(job_dir)
    per_request = serve_rows(df)[serve_rows(df).request_id.notna()]
    by = per_request.pivot_table(index="request_id", columns="metric", values="value")
    plans = schedule(LoadConf(name="poisson", rate=None, requests=10, warmup_requests=2, max_concurrency=3,
                              input_dist="dataset", output_dist="dataset", dataset_file=str(tmp_path / "lengths.csv")))
    served = [(by.loc[f"r{p.index}", "prompt_tokens"], by.loc[f"r{p.index}", "output_tokens"]) for p in plans]
    assert served == [(p.input_len, p.output_len) for p in plans]
    assert set(served) == {(40, 3), (64, 6), (20, 1)} and (by["output_mismatch"] == 0).all()
    assert df.load_rate.isna().all() and set(df.load_max_concurrency.dropna()) == {3}
    (tmp_path / "lengths.csv").write_text("input_length,output_length\n9000,3\n")
    too_long = cli([*DATASET, "hydra.run.dir=results/runs/long"], tmp_path)
    assert too_long.returncode == 1 and "Traceback" not in too_long.stderr, too_long.stderr
    error = results.load(tmp_path / "results" / "runs" / "long").error.iloc[0]
    assert "ConfigError: load: its longest request, 9003 tokens (prompt and output), is longer than the model " \
           "allows" in error


@pytest.mark.slow
def test_a_sweep_killed_mid_load_resumes_without_mixing(tmp_path):
    args = ["-m", "load.rate=20,30,40", "load.requests=40", "run.sweep_id=S",
            *[a for a in LOAD if not a.startswith(("load.rate", "load.requests"))]]
    proc = popen(args, tmp_path)
    sweep = tmp_path / "results" / "sweeps" / "S"
    wait_until(lambda: len(list(sweep.glob("*/DONE"))) >= 1, proc)
    proc.send_signal(signal.SIGTERM)                  # the next job is serving: its rows are lost, never half-kept
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    completed = done_times(sweep)
    assert 1 <= len(completed) < 3
    again = cli(args, tmp_path)
    assert again.returncode == 0, again.stderr
    df = table(sweep)
    rows = serve_rows(df)
    per_request = rows[rows.request_id.notna()]
    counts = per_request.groupby(["job_id", "request_id", "metric"]).size()
    assert (counts == 1).all() and per_request.job_id.nunique() == 3             # one set of rows per job
    assert all(per_request.groupby("job_id").request_id.nunique() == 40)
    assert all(done_times(sweep)[j] == t for j, t in completed.items())          # the completed jobs not re-run


@pytest.mark.slow
def test_serve_sweep_steps_each_configuration_up_to_its_slo(tmp_path):
    """A bound no run can miss: every step meets it, up to the last; one no run can meet: the
    first step is beyond it. Each step a real run in a dir of its own; the figure beside them."""
    base = ["serve-sweep", "workload=chat", "workload.context_tokens=256", "load=poisson", "load.requests=4",
            "load.max_concurrency=2", "load.input_len=32", "load.output_len=3", "--start", "5", "--factor", "2",
            "--steps", "2"]
    easy = cli([*base, "placement=resident,fetch", "load.slo='ttft=100,tpot=100'"], tmp_path)
    assert easy.returncode == 0, easy.stderr
    assert easy.stdout.splitlines()[:2] == [
        "placement=resident: highest rate within the SLO 10 req/s; first beyond it not reached",
        "placement=fetch: highest rate within the SLO 10 req/s; first beyond it not reached"]
    out = tmp_path / "results" / "serve-sweep"
    assert (out / "serve_frontier.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "job0").iterdir()) == ["rate10", "rate5"]
    hard = cli([*base, "load.slo='ttft=1e-9,tpot=1e-9'", "--out", str(tmp_path / "hard")], tmp_path)
    assert hard.returncode == 0 and hard.stdout.splitlines()[0] == (
        "job: highest rate within the SLO none; first beyond it 5 req/s"), hard.stderr
    refused = cli(["serve-sweep", "load=poisson", "load.rate=3", "load.slo=mixtral-8x7b"], tmp_path)
    assert refused.returncode == 2 and "load.rate is what serve-sweep steps" in refused.stderr


@pytest.mark.slow
def test_serve_sweep_steps_a_closed_loops_concurrency_up_to_its_slo(tmp_path):
    """--step load.max_concurrency: each step a closed loop (load.rate null) with twice the requests
    in flight of the last -- at 1, every engine step holds one sequence; it stops where the SLO
    fails as the rate sweep above does (the same loop)."""
    base = ["serve-sweep", "workload=chat", "workload.context_tokens=256", "load=poisson", "load.requests=4",
            "load.input_len=32", "load.output_len=3", "--step", "load.max_concurrency", "--start", "1",
            "--factor", "2", "--steps", "2"]
    easy = cli([*base, "load.slo='ttft=100,tpot=100'"], tmp_path)
    assert easy.returncode == 0, easy.stderr
    assert easy.stdout.splitlines()[0] == "job: highest concurrency within the SLO 2; first beyond it not reached"
    out = tmp_path / "results" / "serve-sweep"
    assert sorted(p.name for p in (out / "job0").iterdir()) == ["concurrency1", "concurrency2"]
    assert (out / "serve_frontier.png").stat().st_size > 0
    df = pd.concat([results.load(d) for d in sorted((out / "job0").glob("*/runs/*"))], ignore_index=True)
    rows = serve_rows(df)
    assert rows.load_rate.isna().all() and sorted(set(rows.load_max_concurrency)) == [1, 2]
    per_step = rows[rows.metric == "sequences_per_step"].set_index("load_max_concurrency")["value"]
    assert per_step[1] == 1 and 1 <= per_step[2] <= 2
    for given, says in ((["load.rate=3"], "load.rate: serve-sweep --step load.max_concurrency sets load.rate=null"),
                        (["load.max_concurrency=2"], "load.max_concurrency is what serve-sweep steps"),
                        (["--start", "1.5"], "--start and --factor: whole numbers with --step load.max_concurrency")):
        refused = cli([*base, "load.slo=mixtral-8x7b", *given], tmp_path)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr


@pytest.mark.parametrize("mode", ["primed", "cold", "isolated"])
def test_a_shared_prefix_is_counted_token_weighted_from_the_prefix_cache(tmp_path, mode):
    """Every prompt begins with the same 32 of its 48 tokens: primed, every request's 32 come from
    the prefix cache; isolated, none; cold, only what an earlier request had computed by then.
    The window's fraction is the tokens' sum over the prompts' sum, from the per-request counts."""
    proc = cli([*LOAD, "load.shared_prefix=32", f"load.prefix_cache={mode}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (job_dir,) = (tmp_path / "results" / "runs").iterdir()
    rows = serve_rows(results.load(job_dir))
    by = rows[rows.request_id.notna()].pivot_table(index="request_id", columns="metric", values="value")
    summary = rows[rows.request_id.isna() & (rows.source == "client")].set_index("metric")["value"]
    measured = by[by["warmup"] == 0]
    assert summary["cached_prompt_fraction"] == pytest.approx(
        measured["cached_prompt_tokens"].sum() / measured["prompt_tokens"].sum())
    assert set(by["cached_prompt_tokens"]) <= {0, 32}
    if mode == "primed":
        assert (by["cached_prompt_tokens"] == 32).all() and summary["cached_prompt_fraction"] == pytest.approx(32 / 48)
    if mode == "isolated":
        assert (by["cached_prompt_tokens"] == 0).all()
    if mode == "cold":
        assert by.loc["r0", "cached_prompt_tokens"] == 0 and (by["cached_prompt_tokens"] == 32).any()
