"""Lossy KV treatments and their quality: the placement invariant does not hold for them, so
instead the quality metrics move the right way on a fixed tiny model (q4 worse than q8 worse
than exact), exact reads exactly 0 / 1, and a CLI run with kv.dtype=q8 carries the metrics and
the treatment columns."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine import Engine
from engine.config import preset
from harness import results
from harness.config import ConfigError
from harness.contract import METRIC_UNITS, QUALITY_METRICS, QUALITY_PHASE
from harness.costmodel.passcost import kv_bytes
from harness.quality import quality_metrics, quality_run

PROMPT = [[(37 * i + 11) % 512 for i in range(96)]]
GEN = 12


def _quality(kv_dtype: str, ref) -> dict:
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=3, device="cpu", max_context=256,
                                 ubatch=32, kv_dtype=kv_dtype)
    try:
        forced = quality_run(eng, PROMPT, GEN, forced=ref.continuation)
        return quality_metrics(forced, ref, quality_run(eng, PROMPT, GEN).continuation)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def reference():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=256, ubatch=32)
    try:
        return quality_run(eng, PROMPT, GEN)
    finally:
        eng.close()


@pytest.mark.slow
def test_quality_orders_the_treatments(reference):
    q = {kv: _quality(kv, reference) for kv in ("model", "q8", "q4")}
    exact = q["model"]
    assert exact["kl_div_mean"] == 0.0 and exact["kl_div_max"] == 0.0 and exact["max_abs_logit_diff"] == 0.0
    assert exact["top1_agreement"] == 1.0 and exact["token_agreement"] == 1.0 and exact["ppl_ratio"] == 1.0
    assert exact["quality_positions"] == 96 + GEN - 1
    for m in ("kl_div_mean", "kl_div_max", "max_abs_logit_diff"):
        assert 0.0 < q["q8"][m] < q["q4"][m], (m, q["q8"][m], q["q4"][m])
    assert abs(math.log(q["q8"]["ppl_ratio"])) < abs(math.log(q["q4"]["ppl_ratio"]))
    assert q["q4"]["top1_agreement"] <= q["q8"]["top1_agreement"] <= 1.0


def test_compare_refuses_different_positions(reference):
    short = quality_run(Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=256, ubatch=32),
                         PROMPT, GEN - 1)
    with pytest.raises(ValueError, match=r"different positions"):
        quality_metrics(short, reference, None)


def test_quality_metrics_have_units():
    assert all(m in METRIC_UNITS for m in QUALITY_METRICS)


def test_cost_model_kv_bytes_use_the_stored_format():
    cfg = preset("tiny-mixtral")
    # 4 layers x K and V x 2 heads x (16 int8 codes + one float16 scale), per token
    assert kv_bytes(cfg, 100, 2, 4, "q8") == 100 * 2 * 4 * 2 * 2 * 18
    assert kv_bytes(cfg, 100, 2, 4) == cfg.kv_bytes_per_token(4) * 200 == 100 * 2 * 4 * 2 * 2 * 16 * 4


def test_config_refuses_bad_kv_dtype():
    from hydra import compose, initialize_config_dir
    from harness.config import register_configs, validate

    register_configs()
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        ok = validate(compose("config", overrides=["kv=q8"]))
        assert ok.kv_dtype == "q8" and ok.lossy
        assert not validate(compose("config", overrides=["kv.dtype=model"])).lossy
        for overrides, match in ((["kv.dtype=q2"], r"kv.dtype: allowed \['model', 'f16', 'bf16', 'q8', 'q4', 'fp8'\], "
                                                   r"got 'q2'"),
                                 (["kv.dtype=q8", "model=tiny-deepseek"], r"kv.dtype: .*MLA latent"),
                                 (["kv.dtype=q4", "engine=hf"], r"engine=hf has no KV storage treatments")):
            with pytest.raises(ConfigError, match=match):
                validate(compose("config", overrides=overrides))


@pytest.mark.slow
def test_sweep_over_kv_dtype_keeps_exact_and_lossy_apart(tmp_path):
    """One process, two jobs: the q8 job gets its own engine (not the exact one reused), the
    exact job's quality reads exactly 0 / 1, the q8 job's does not, and the factor tells them apart."""
    from tests.harness.test_cli import SMALL, moebench, sweep_dir

    moebench(["-m", "kv.dtype=model,q8", "run.repeats=1", "run.warmup=0", "run.timeline=false", *SMALL], tmp_path)
    df = results.load(sweep_dir(tmp_path) / "results.parquet")
    assert (df.status == "ok").all() and set(df.kv_dtype) == {"model", "q8"}
    assert set(df[df.kv_dtype == "model"].lossy) == {False} and set(df[df.kv_dtype == "q8"].lossy) == {True}
    q = df[df.phase == QUALITY_PHASE].pivot_table(index="kv_dtype", columns="metric", values="value")
    assert (q.loc["model", ["kl_div_mean", "kl_div_max", "max_abs_logit_diff"]] == 0).all()
    assert (q.loc["model", ["top1_agreement", "token_agreement", "ppl_ratio"]] == 1).all()
    assert (q.loc["q8", ["kl_div_mean", "kl_div_max", "max_abs_logit_diff"]] > 0).all()
    loads = df[(df.phase == "load") & (df.metric == "time_s")]
    assert set(loads.model_load) == {"cold"} and loads.value.notna().all()     # two engines, one per treatment


@pytest.mark.slow
def test_cli_run_with_q8_carries_quality_and_treatment(tmp_path):
    from tests.harness.test_cli import SMALL, moebench

    moebench(["kv.dtype=q8", "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false", *SMALL],
             tmp_path)
    run = next((tmp_path / "results" / "runs").iterdir())
    df = results.load(run)
    assert (df.status == "ok").all()
    assert set(df.kv_dtype) == {"q8"} and set(df.expert_quant) == {"none"} and df.lossy.all()
    q = df[df.phase == QUALITY_PHASE].set_index("metric")["value"]
    assert set(QUALITY_METRICS) <= set(q.index) and q.notna().all(), q
    assert q["kl_div_mean"] > 0 and 0 < q["top1_agreement"] <= 1 and q["ppl_ratio"] > 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["lossy"] is True and manifest["treatment"] == {"kv_dtype": "q8", "expert_quant": "none"}
    checks = df[(df.metric == "max_abs_logit_diff") & (df.phase == "decode")]["value"]
    assert (checks > 0).all()                        # vs the exact reference, not the treatment itself


@pytest.mark.slow
def test_a_budgeted_job_plans_its_quality_pass(tmp_path):
    """The quality pass keeps a micro-batch's logits at every position on the device: the job's
    engine, held to the budget, is planned for them (a budgeted engine refuses the pass otherwise,
    and its quality row would be a failed one), and `moebench plan` shows the same plan."""
    from harness.plan import plan_of, spec_of
    from tests.harness.test_cli import SMALL, moebench

    job = ["hardware.device_memory=7MiB", "placement=fetch", "cache.capacity=auto", *SMALL]
    moebench([*job, "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false"], tmp_path)
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    assert (df.status == "ok").all(), df[df.status != "ok"].error.unique()
    q = df[df.phase == QUALITY_PHASE].set_index("metric")["value"]
    assert set(QUALITY_METRICS) <= set(q.index) and q.notna().all(), q
    assert q["kl_div_max"] == 0.0 and q["token_agreement"] == 1.0       # exact on the CPU: placement changes nothing
    planned = plan_of(spec_of(job))
    assert planned.all_logits and "all logits" in str(planned)
    assert set(df.resolved_capacity.dropna()) == {planned.capacity}                 # the job ran that plan
    assert not plan_of(spec_of([*job, "run.check_reference=false"])).all_logits     # no pass, no room for it
