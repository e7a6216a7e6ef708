"""Predicted vs measured: the join, the error arithmetic and the summary, on hand-made tables;
the two ways (simulated counts -- from the job's recorded trace when it has one -- and measured
counts); what a job dir says beyond its rows."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from engine.config import preset
from engine.trace import save_trace
from harness import results
from harness.costmodel import PlacementSpec, Routing, WorkloadShape, load_profile
from harness.costmodel.validate import (TRACE_FILE, job_inputs, predict_for, prediction_errors, summarize,
                                        summarize_two_ways, two_ways)
from harness.costmodel.work import scenario_work
from harness.sim.synthetic import generate

DEVICE = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}


def factors(placement: str, capacity: str | None = None, context: int = 64) -> dict:
    return {"engine": "moebench", "model": "tiny-mixtral", "placement": placement, "cache_capacity": capacity,
            "cache_policy": "lru" if capacity else None, "prefetch": "none", "workload": "chat",
            "context_tokens": context, "gen_tokens": 4, "batch": 1, "dtype": "float32"}


def measured_rows(f: dict, phase: str, times: list[float], source: str = "client", **extra) -> list[dict]:
    rows = []
    for r, t in enumerate(times):
        rows += results.make_rows(f, DEVICE, "sweep", f"job-{f['placement']}", r, phase,
                                  {"time_s": t, "tok_per_s": 100 / t}, source,
                                  extra={"profiler": "none", "ubatch": 512, **extra})
    return rows


def predicted_rows(f: dict, phase: str, t: float) -> list[dict]:
    return results.make_rows(f, {"device_kind": "cpu"}, "model", "p", None, phase,
                             {"time_s": t, "tok_per_s": 100 / t}, "model", extra={"ubatch": 512})


def test_error_columns_are_predicted_over_measured():
    f = factors("resident")
    meas = pd.DataFrame(measured_rows(f, "decode", [1.0, 2.0, 4.0]))
    pred = pd.DataFrame(predicted_rows(f, "decode", 1.5))
    t = prediction_errors(pred, meas).set_index("metric")
    assert t.loc["time_s", "measured"] == 2.0 and t.loc["time_s", "n_measured"] == 3
    assert t.loc["time_s", "pred_over_measured"] == pytest.approx(0.75)
    assert t.loc["time_s", "abs_err"] == pytest.approx(0.25)
    # tok/s: 100/1.5 predicted vs median(100, 50, 25) = 50 measured
    assert t.loc["tok_per_s", "pred_over_measured"] == pytest.approx((100 / 1.5) / 50)
    best = prediction_errors(pred, meas, stat="best").set_index("metric")
    assert best.loc["time_s", "measured"] == 1.0 and best.loc["time_s", "abs_err"] == pytest.approx(0.5)
    assert best.loc["tok_per_s", "measured"] == 100.0        # the fastest repeat: highest tok/s
    assert pd.isna(t.loc["time_s", "cache_capacity"])       # null factors join and stay null


def test_join_is_by_factors_and_phase_and_ignores_instrumented_rows():
    fa, fb = factors("fetch", "2"), factors("fetch", "4")
    meas = pd.DataFrame(measured_rows(fa, "decode", [2.0]) + measured_rows(fb, "decode", [4.0])
                        + measured_rows(fa, "prefill_fresh", [10.0])
                        + results.make_rows(fa, DEVICE, "sweep", "job-fetch", 0, "decode", {"time_s": 99.0}, "client",
                                            extra={"profiler": "timeline", "ubatch": 512}))
    pred = pd.DataFrame(predicted_rows(fa, "decode", 1.0) + predicted_rows(fb, "decode", 1.0)
                        + predicted_rows(fa, "prefill_restored", 1.0))
    t = prediction_errors(pred, meas, metrics=("time_s",))
    got = dict(zip(t["cache_capacity"], t["measured"]))
    assert got == {"2": 2.0, "4": 4.0}                       # timeline row excluded; unmatched phases dropped
    assert list(t["abs_err"]) == pytest.approx([0.5, 0.75])
    with pytest.raises(ValueError, match="no predicted row matches"):
        prediction_errors(pd.DataFrame(predicted_rows(factors("cpu"), "decode", 1.0)), meas)


def test_summary_is_the_error_distribution_per_placement():
    errs = {"fetch": [0.1, 0.2, 0.3, 0.4], "cpu": [0.05]}
    rows = [{"placement": p, "metric": "time_s", "abs_err": e, "pred_over_measured": 1 + e}
            for p, es in errs.items() for e in es]
    s = summarize(pd.DataFrame(rows)).set_index("placement")
    assert s.loc["fetch", "n"] == 4
    assert s.loc["fetch", "median_abs_err"] == pytest.approx(0.25)
    assert s.loc["fetch", "p90_abs_err"] == pytest.approx(np.quantile([0.1, 0.2, 0.3, 0.4], 0.9))
    assert s.loc["fetch", "max_abs_err"] == pytest.approx(0.4)
    assert s.loc["all", "n"] == 5 and s.loc["all", "median_abs_err"] == pytest.approx(0.2)
    assert s.loc["cpu", "median_pred_over_measured"] == pytest.approx(1.05)


def _fetch_job(context: int = 96, **extra_metrics) -> pd.DataFrame:
    f = factors("fetch", "4", context=context)
    rows = []
    extra = {"profiler": "none", "ubatch": 512, "resolved_capacity": 4, "placement_options": "{}"}
    for phase, tokens in (("prefill_fresh", context), ("decode", 3), ("prefill_continuation", 65),
                          ("prefill_restored", 65)):
        rows += measured_rows(f, phase, [0.01, 0.02], resolved_capacity=4, placement_options="{}")
        rows += results.make_rows(f, DEVICE, "sweep", "job-fetch", 0, phase, {"tokens": tokens}, "client", extra=extra)
        rows += results.make_rows(f, DEVICE, "sweep", "job-fetch", 0, phase,
                                  {"expert_hits": 5.0, "expert_misses": 7.0, **extra_metrics}, "engine", extra=extra)
    return pd.DataFrame(rows)


def test_predict_for_a_measured_table():
    meas = _fetch_job()
    hw = load_profile("rtx4090-pcie4-x16")
    pred = predict_for(meas, hw, counts="measured")
    assert set(pred["source"]) == {"model"} and set(pred["phase"]) == {"prefill_fresh", "decode",
                                                                         "prefill_continuation", "prefill_restored"}
    decode = pred[pred["phase"] == "decode"].set_index("metric")["value"]
    assert decode["expert_hits"] == 5.0 and decode["expert_misses"] == 7.0     # the measured counts
    assert decode["tokens"] == 3.0
    assert set(pred["routing"]) == {"measured"} and set(pred["counts"]) == {"measured"}
    t = prediction_errors(pred, meas)
    assert len(t) == 8 and t["abs_err"].notna().all() and set(t["counts"]) == {"measured"}
    # the default, the headline: counts simulated from uniform routing, not the measured ones
    sim = predict_for(meas, hw)
    d = sim[sim["phase"] == "decode"].set_index("metric")["value"]
    assert set(sim["routing"]) == {"synthetic-uniform"} and set(sim["counts"]) == {"simulated"}
    assert d["expert_hits"] + d["expert_misses"] == 3 * 4 * 2       # gen 4: 3 decode steps x 4 layers x top-2
    assert (d["expert_hits"], d["expert_misses"]) != (5.0, 7.0)


def test_two_ways_in_one_table_and_one_summary():
    table = two_ways(_fetch_job(), load_profile("rtx4090-pcie4-x16"))
    assert list(table["counts"].unique()) == ["simulated", "measured"]
    assert (table.groupby("counts").size() == 8).all()
    s = summarize_two_ways(table).set_index("placement")
    assert list(s.columns) == ["n", "simulated_median", "simulated_p90", "simulated_max", "measured_median",
                               "measured_p90", "measured_max"]
    assert s.loc["fetch", "n"] == 4                          # time_s of the four phases
    t = table[(table["metric"] == "time_s")]
    for c in ("simulated", "measured"):
        assert s.loc["all", f"{c}_max"] == pytest.approx(t[t["counts"] == c]["abs_err"].max())
    one = summarize_two_ways(table, ways=("measured",))           # any labels of `counts`, in the order given
    assert list(one.columns) == ["placement", "n", "measured_median", "measured_p90", "measured_max"]


def test_streamed_experts_are_read_from_the_expert_bytes_moved():
    f = factors("stream", "2", context=256)
    eb = preset("tiny-mixtral").expert_params * 4
    extra = {"profiler": "none", "ubatch": 512, "resolved_capacity": 2, "placement_options": "{}"}
    rows = measured_rows(f, "prefill_fresh", [0.05], resolved_capacity=2, placement_options="{}")
    rows += results.make_rows(f, DEVICE, "sweep", "job-stream", 0, "prefill_fresh", {"tokens": 256}, "client", extra=extra)
    # 30 experts streamed and 2 misses copied; the KV bytes of h2d_bytes are not experts
    rows += results.make_rows(f, DEVICE, "sweep", "job-stream", 0, "prefill_fresh",
                              {"expert_hits": 0.0, "expert_misses": 2.0, "h2d_expert_bytes": 32.0 * eb,
                               "h2d_bytes": 32.0 * eb + 12345.0}, "engine", extra=extra)
    pred = predict_for(pd.DataFrame(rows), load_profile("rtx4090-pcie4-x16"), counts="measured")
    fresh = pred[pred["phase"] == "prefill_fresh"].set_index("metric")["value"]
    assert fresh["h2d_bytes"] == pytest.approx(32.0 * eb)


def _write_job(job_dir, model: dict, rows: list[dict], trace=None) -> None:
    manifest = {"sweep_id": rows[0]["sweep_id"], "job_id": rows[0]["job_id"], "config": {"model": model}}
    results.write_job(job_dir, rows, manifest)
    if trace is not None:
        save_trace(job_dir / TRACE_FILE, trace)


def test_job_inputs_give_the_jobs_model_and_its_recorded_trace(tmp_path):
    """A truncated model comes from the manifest (its rows name only the preset), and the
    simulated counts replay the routing the job recorded."""
    meas = _fetch_job(context=40)
    model = {"name": "tiny-mixtral", "path": None, "dtype": "float32", "num_layers": 2, "seed": 0}
    cfg = preset("tiny-mixtral").replace(num_layers=2, moe_layers=(0, 1))
    trace = generate(2, 8, 2, 200, zipf=1.2, reuse=0.3, seed=4, expert_bytes=cfg.expert_params * 4,
                     meta={"model": "tiny-mixtral"})
    _write_job(tmp_path / "sweep" / "a", model, meas.to_dict("records"), trace)
    inputs = job_inputs(tmp_path)
    assert list(inputs) == [("sweep", "job-fetch")]
    got = inputs[("sweep", "job-fetch")]
    assert got.cfg.num_layers == 2 and got.cfg.moe_layers == (0, 1) and got.trace == tmp_path / "sweep" / "a" / TRACE_FILE
    pred = predict_for(meas, load_profile("rtx4090-pcie4-x16"), inputs=inputs)
    assert set(pred["routing"]) == {"trace:tiny-mixtral"}
    shape = WorkloadShape(40, 4, turn_tokens=64)
    work = scenario_work(cfg, PlacementSpec("fetch", capacity=4), shape, Routing.from_trace(trace))
    for phase, w in work.items():
        p = pred[(pred["phase"] == phase)].set_index("metric")["value"]
        assert (p["expert_hits"], p["expert_misses"]) == (w.total("hits"), w.total("misses")), phase
    # without the job's inputs a truncated run would be predicted for the whole preset
    whole = predict_for(meas, load_profile("rtx4090-pcie4-x16"))
    assert whole[whole["metric"] == "expert_hits"]["value"].sum() > pred[pred["metric"] == "expert_hits"]["value"].sum()


def test_job_inputs_carry_the_jobs_expert_treatment(tmp_path):
    """An int4 job is predicted at int4's stored bytes (its manifest's experts group), not the exact model's."""
    from engine.blocks.quant_experts import ExpertQuant
    from harness.costmodel.passcost import expert_bytes
    meas = _fetch_job(context=40)
    model = {"name": "tiny-mixtral", "path": None, "dtype": "float32", "num_layers": None, "seed": 0}
    manifest = {"sweep_id": "sweep", "job_id": "job-fetch",
                "config": {"model": model, "experts": {"quant": "int4", "group_size": 32}}}
    results.write_job(tmp_path / "sweep" / "a", meas.to_dict("records"), manifest)
    got = job_inputs(tmp_path)[("sweep", "job-fetch")]
    assert got.cfg.expert_quant == ExpertQuant("int4", 32)
    assert expert_bytes(got.cfg, 4) == 16128 < expert_bytes(preset("tiny-mixtral"), 4)


@pytest.mark.slow
@pytest.mark.parametrize("root, jobs", [
    ("results/samples/sweeps/fetch_capacity", None),
    ("results/samples-lossy/sweeps", ["experiment=kv_vs_residency,experts.quant=none,kv.dtype=q8,workload.context_tokens=2048",
                                      "experiment=kv_vs_residency,experts.quant=int4,kv.dtype=model,workload.context_tokens=2048"])])
def test_predictions_join_the_committed_results(root, jobs):
    """On real result files (the committed samples): every measured job gets predictions that join
    it -- exact jobs (kv_dtype model, expert_quant none), a q8 KV, int4 experts, cache.capacity=auto
    (requested 'auto', resolved to slots)."""
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[2] / root)
    meas = results.load(root)
    if jobs:
        meas = meas[meas["job_id"].isin(jobs)]
    t = prediction_errors(predict_for(meas, load_profile("rtx4090-pcie4-x16"), inputs=job_inputs(root)), meas)
    assert t["abs_err"].notna().all()
    config = ["placement", "cache_capacity", "context_tokens", "kv_dtype", "expert_quant"]
    ok = meas[meas["status"] == "ok"]
    assert len(t[config].astype(str).drop_duplicates()) == len(ok[config].astype(str).drop_duplicates())
    if jobs:
        assert set(zip(t["kv_dtype"], t["expert_quant"])) == {("q8", "none"), ("model", "int4")}
