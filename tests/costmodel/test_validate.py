"""Predicted vs measured: the join, the error arithmetic and the summary, on hand-made tables."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness import results
from harness.costmodel import load_profile
from harness.costmodel.validate import compare, predict_for, summarize

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
    t = compare(pred, meas).set_index("metric")
    assert t.loc["time_s", "measured"] == 2.0 and t.loc["time_s", "n_measured"] == 3
    assert t.loc["time_s", "pred_over_measured"] == pytest.approx(0.75)
    assert t.loc["time_s", "abs_err"] == pytest.approx(0.25)
    # tok/s: 100/1.5 predicted vs median(100, 50, 25) = 50 measured
    assert t.loc["tok_per_s", "pred_over_measured"] == pytest.approx((100 / 1.5) / 50)
    best = compare(pred, meas, stat="best").set_index("metric")
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
    t = compare(pred, meas, metrics=("time_s",))
    got = dict(zip(t["cache_capacity"], t["measured"]))
    assert got == {"2": 2.0, "4": 4.0}                       # timeline row excluded; unmatched phases dropped
    assert list(t["abs_err"]) == pytest.approx([0.5, 0.75])
    with pytest.raises(ValueError, match="no predicted row matches"):
        compare(pd.DataFrame(predicted_rows(factors("cpu"), "decode", 1.0)), meas)


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


def test_predict_for_a_measured_table():
    f = factors("fetch", "4", context=96)
    rows = []
    extra = {"profiler": "none", "ubatch": 512, "resolved_capacity": 4, "placement_options": "{}"}
    for phase, tokens in (("prefill_fresh", 96), ("decode", 3), ("prefill_continuation", 65), ("prefill_restored", 65)):
        rows += measured_rows(f, phase, [0.01, 0.02], resolved_capacity=4, placement_options="{}")
        rows += results.make_rows(f, DEVICE, "sweep", "job-fetch", 0, phase, {"tokens": tokens}, "client", extra=extra)
        rows += results.make_rows(f, DEVICE, "sweep", "job-fetch", 0, phase,
                                  {"expert_hits": 5.0, "expert_misses": 7.0}, "engine", extra=extra)
    meas = pd.DataFrame(rows)
    pred = predict_for(meas, load_profile("rtx4090-pcie4-x16"))
    assert set(pred["source"]) == {"model"} and set(pred["phase"]) == {"prefill_fresh", "decode",
                                                                         "prefill_continuation", "prefill_restored"}
    decode = pred[pred["phase"] == "decode"].set_index("metric")["value"]
    assert decode["expert_hits"] == 5.0 and decode["expert_misses"] == 7.0     # the measured counts
    assert decode["tokens"] == 3.0
    assert set(pred["routing"]) == {"measured"}
    t = compare(pred, meas)
    assert len(t) == 8 and t["abs_err"].notna().all()
