"""A roofline beside every speed: the bound from bytes and FLOPs at measured rates (source=model),
and the measurement's fraction of it; null with the reason when the machine has no measured rates."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
from harness import results
from harness.cli import CONF_DIR
from harness.config import validate
from harness.costmodel.profiles import PROFILE_DIR
from harness.report import Reporter
from harness.roofline import roofline
from harness.runner import JobContext, run_job

RATES = ["hardware.source=measured", "hardware.link=emulated", "hardware.h2d_gbps=5", "hardware.d2h_gbps=5",
         "hardware.device_tflops=0.1", "hardware.cpu_gflops=100", "hardware.dtype=float32"]
SMALL = ["placement=resident", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=8",
         "run.repeats=2", "run.timeline=false", "run.ablation=false"]


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def rows(tmp_path, *overrides):
    out = run_job(cfg_with(*overrides, f"run.out={tmp_path}"), JobContext(tmp_path / "j", "s", "j"), Reporter(quiet=True))
    assert out.error is None, out.error
    return results.rows_to_table(out.rows).to_pandas()


@pytest.mark.slow
def test_roofline_rows_bound_the_measurement_and_scale_with_the_rates(tmp_path):
    df = rows(tmp_path, *SMALL, *RATES, "hardware.device_mem_gbps=10", "hardware.cpu_mem_gbps=10")
    model = df[df.source == "model"].pivot_table(index="phase", columns="metric", values="value")
    measured = df[(df.source == "client") & (df.metric == "tok_per_s") & df.repeat.notna()].groupby("phase").value.median()
    for phase in ("prefill_fresh", "decode", "prefill_continuation", "prefill_restored"):
        bound = model.loc[phase, "roofline_tok_per_s"]
        assert bound > 0 and model.loc[phase, "frac_of_roofline"] == pytest.approx(measured[phase] / bound)
        assert measured[phase] <= bound          # nothing runs faster than its bytes and FLOPs allow
    assert set(df[df.source == "model"].roofline_profile) == {"local"}
    spec = validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=20", "hardware.cpu_mem_gbps=20"))
    faster = roofline(spec, {}, None).phases["decode"]
    assert faster > 1.5 * model.loc["decode", "roofline_tok_per_s"]  # decode is bound by the bytes it reads


def test_without_measured_rates_the_rows_say_why():
    spec = validate(cfg_with(*SMALL))
    bound = roofline(spec, {}, None)
    if (PROFILE_DIR / "measured.yaml").is_file():        # this machine was calibrated: its figures are used
        assert bound.profile == "measured" and bound.phases["decode"] > 0
    else:
        assert bound.profile is None and not bound.phases and "moebench calibrate" in bound.reason


def test_the_basis_says_what_the_bound_takes_from_a_model_rather_than_the_run(tmp_path):
    """A batched decode where no lookups are counted (resident) takes its distinct experts from
    simulated routing; mixed expert formats are at their mean bytes; a counted fetch run at batch
    1 with exact experts assumes neither."""
    plain = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10")), {}, None)
    assert plain.basis.startswith("bytes and FLOPs") and "simulated" not in plain.basis and "mean" not in plain.basis
    batched = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10", "workload.batch=2")), {}, None)
    assert "distinct experts per batched step from simulated uniform routing" in batched.basis
    counted = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10", "workload.batch=2",
                                         "placement=fetch", "cache.capacity=4")),
                       {"decode": {"expert_hits": 10, "expert_misses": 2}}, 4)
    assert "simulated" not in counted.basis
    table = tmp_path / "pop.json"                                     # tiny-mixtral: 4 MoE layers of 8 experts
    table.write_text(json.dumps([[float(e) for e in range(8)]] * 4))
    mixed = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10", "experts.quant=mixed",
                                       f"experts.popularity={table}", "experts.mixed_count=2")), {}, None)
    assert "mixed expert formats at their mean bytes" in mixed.basis
