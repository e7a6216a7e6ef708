"""The prediction pass: beside every measured phase, the cost model's trace-free prediction for
the job's own configuration on the machine's profile, and the residual; null with the reason
where there is no profile; shown by `moebench table` and the job's report."""
from __future__ import annotations

import pytest

from harness.config import validate
from harness.costmodel import Routing, predict
from harness.costmodel.profiles import PROFILE_DIR
from harness.predict_inputs import shape_of
from harness.report import Reporter
from harness.roofline import machine_profile
from harness.table import display_rows, sweep_table
from tests.harness.test_roofline import RATES, SMALL, cfg_with, rows

TIMED = ("prefill_fresh", "decode", "prefill_continuation", "prefill_restored")     # what this scenario measures
FETCH = ["placement=fetch", "cache.capacity=4", "hardware.device_mem_gbps=10", "hardware.cpu_mem_gbps=10"]


@pytest.fixture(scope="module")
def fetch_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pred")
    return rows(tmp, *SMALL, *RATES, *FETCH, "run.passes=[speed,prediction]")


def test_each_measured_phase_has_its_prediction_and_residual(fetch_rows):
    df = fetch_rows
    pred = df[df.profiler == "prediction"]
    assert set(pred.source) == {"model"} and set(pred.status) == {"ok"}
    values = pred.pivot_table(index="phase", columns="metric", values="value")
    measured = df[(df.source == "client") & (df.metric == "tok_per_s") & (df.profiler == "none")
                  & df.repeat.notna()].groupby("phase").value.median()
    assert set(values.dropna(how="all").index) == set(TIMED) and set(TIMED) < set(measured.index)
    unpredicted = pred[~pred.phase.isin(TIMED)]            # kv_offload: measured, not modelled
    assert unpredicted.value.isna().all() and unpredicted.prediction_reason.str.contains("does not predict").all()
    for phase in TIMED:
        assert values.loc[phase, "predicted_tok_per_s"] > 0
        assert values.loc[phase, "prediction_residual"] == pytest.approx(
            measured[phase] / values.loc[phase, "predicted_tok_per_s"] - 1)
    timed = pred[pred.phase.isin(TIMED)]
    assert set(pred.prediction_profile) == {"local"} and timed.prediction_reason.isna().all()
    assert set(pred.prediction_routing) == {Routing.synthetic().label}
    assert timed.prediction_bound.notna().all()
    assert set(pred.unit) == {"tok/s", "ratio"}


def test_the_prediction_is_the_cost_models_for_the_jobs_config_with_nothing_measured(fetch_rows):
    """The same figure `harness.costmodel.predict` gives the job's spec at its resolved capacity,
    uniform synthetic routing: the run's measured hits and misses do not go in."""
    spec = validate(cfg_with(*SMALL, *RATES, *FETCH))
    capacity = int(fetch_rows.resolved_capacity.dropna().iloc[0])
    hw, given = machine_profile(spec)                          # the job's own measured figures
    assert given
    p = predict(spec.planned_config, "fetch", shape_of(spec), hw, capacity=capacity, policy=spec.policy,
                placement_options=spec.placement_options, dtype=spec.dtype, routing=Routing.synthetic())
    got = fetch_rows[(fetch_rows.profiler == "prediction") & (fetch_rows.metric == "predicted_tok_per_s")]
    for _, r in got.iterrows():
        assert r.value == pytest.approx(p.phases[r.phase].tok_per_s, rel=1e-9)


def test_the_table_and_the_report_show_prediction_and_residual(fetch_rows, capsys):
    header, cells = display_rows(sweep_table(fetch_rows))
    for label in ("pred pp tok/s", "pp resid.", "pred tg tok/s", "tg resid."):
        assert label in header
    residual = cells[0][header.index("tg resid.")]
    assert residual.startswith(("+", "-")) and float(residual) == pytest.approx(
        fetch_rows[(fetch_rows.metric == "prediction_residual") & (fetch_rows.phase == "decode")].value.iloc[0], abs=0.01)
    Reporter().summary(fetch_rows, "run")
    err = capsys.readouterr().err
    assert "predicted by the cost model (profile local" in err and "measured/pred. - 1" in err


def test_without_a_profile_the_rows_are_null_with_the_reason(tmp_path):
    if (PROFILE_DIR / "measured.yaml").is_file():
        pytest.skip("this machine is calibrated (conf/hardware/measured.yaml): its profile predicts")
    df = rows(tmp_path, *SMALL, "run.passes=[speed,prediction]")
    pred = df[df.profiler == "prediction"]
    assert set(TIMED) <= set(pred.phase) and pred.value.isna().all()
    assert pred.prediction_reason.str.contains("moebench calibrate").all()
    header, _ = display_rows(sweep_table(df))
    assert "pred tg tok/s" not in header                  # no figure, no column: never a 0


def test_the_default_pass_list_runs_it_after_speed():
    from harness.passes import DEFAULT_PASSES, PASSES, check_passes
    assert "prediction" in DEFAULT_PASSES and PASSES.get("prediction").needs == ("speed",)
    with pytest.raises(ValueError, match="prediction needs speed"):
        check_passes(["prediction"])


def test_an_engine_outside_the_cost_model_skips_it():
    from harness.passes.prediction import PredictionPass

    class Ctx:
        spec = validate(cfg_with(*SMALL))
        adapter = type("A", (), {"cost_model": False})()
    assert "cost model" in PredictionPass().skip_reason(Ctx())

