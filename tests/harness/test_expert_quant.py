"""The `experts` group and `cache.capacity_bytes` end to end in the harness: validation refuses bad
values naming the key and what is allowed, the resolved treatment reaches the planner and the
cost model, rows say which treatment ran (`expert_quant`, `lossy`), and files written before the
column existed read it as null."""
from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
from engine.blocks.quant_experts import ExpertQuant
from harness import results as R
from harness.cli import CONF_DIR
from harness.config import ConfigError, validate
from harness.costmodel.passcost import expert_bytes
from harness.plan import plan_of
from harness.report import Reporter
from harness.factors import factors_of
from harness.runner import JobContext, run_job

INT4 = 3 * 64 * 128 // 2 + 5 * (2 * 128 * 2 + 64 * 4)      # tiny-mixtral, group 32: nibbles + fp32 scale, u8 zero
INT4_G16 = 3 * 64 * 128 // 2 + 5 * (2 * 128 * 4 + 64 * 8)


def cfg_with(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_default_is_exact_and_labelled_so():
    cfg = cfg_with()
    spec = validate(cfg)
    assert spec.expert_quant is None and spec.model_config.expert_quant is None
    assert spec.capacity == 4 and spec.capacity_bytes is None
    f = factors_of(cfg)
    assert (f["expert_quant"], f["lossy"], f["cache_capacity"], f["cache_capacity_bytes"]) == ("none", False, "4", None)


def test_int4_reaches_the_planner_and_the_cost_model():
    cfg = cfg_with("experts.quant=int4", "experts.group_size=16")
    spec = validate(cfg)
    assert spec.expert_quant == ExpertQuant("int4", 16)
    assert plan_of(spec).expert_bytes == INT4_G16
    assert expert_bytes(spec.model_config, 4) == INT4_G16
    assert expert_bytes(validate(cfg_with()).model_config, 4) == 3 * 64 * 128 * 4
    assert factors_of(cfg)["expert_quant"] == "int4" and factors_of(cfg)["lossy"] is True


@pytest.mark.parametrize("overrides,match", [
    (("experts.quant=int3",), r"experts.quant must be one of \['none', 'int8', 'int4', 'mixed'\], got 'int3'"),
    (("experts.quant=int4", "experts.group_size=24"), "experts.group_size=24"),
    (("experts.quant=mixed",), "needs experts.popularity=FILE"),
    (("experts.quant=int8", "experts.mixed_count=2"), "applies to experts.quant=mixed only"),
    (("cache.capacity=4", "cache.capacity_bytes=1MiB"), "not both"),
    (("cache.capacity_bytes=lots",), r"cache.capacity_bytes: allowed a positive size"),
    (("engine=hf", "experts.quant=int4"), "allowed with engine=hf: experts.quant=none"),
])
def test_bad_values_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(cfg_with(*overrides))


def test_mixed_from_a_popularity_table(tmp_path):
    table = tmp_path / "pop.json"
    table.write_text(json.dumps([[float(e) for e in range(8)]] * 4))
    spec = validate(cfg_with("experts.quant=mixed", f"experts.popularity={table}", "experts.mixed_count=2"))
    assert spec.expert_quant.high_of(0) == {6, 7}
    assert plan_of(spec).expert_bytes == 3 * 64 * 128 + 4 * (2 * 128 + 64)            # a slot holds int8
    assert expert_bytes(spec.model_config, 4) == round((2 * plan_of(spec).expert_bytes + 6 * INT4) / 8)


def test_capacity_in_bytes_gives_more_slots_with_int4():
    spec = validate(cfg_with("cache.capacity_bytes=256KiB", "experts.quant=int4"))
    assert spec.capacity is None and spec.capacity_bytes == 256 << 10
    assert plan_of(spec).capacity == (256 << 10) // (4 * INT4) == 4
    assert "experts [fetch, int4] (4 slots/layer)" in str(plan_of(spec))
    with pytest.raises(ValueError, match="fewer than top_k=2"):      # exact experts: 96 KiB a slot, 0 slots
        plan_of(validate(cfg_with("cache.capacity_bytes=256KiB")))
    f = factors_of(cfg_with("cache.capacity_bytes=256KiB"))
    assert (f["cache_capacity"], f["cache_capacity_bytes"]) == ("bytes", "256KiB")


@pytest.mark.parametrize("engine,before", [("moebench", "none"), ("llamacpp", None)])
def test_a_file_written_before_the_column_reads_what_its_engine_did(tmp_path, engine, before):
    """moebench ran exact experts only before experts.quant (so old baselines compare with new runs);
    another engine's weights are its own knobs: null."""
    factors = {"engine": engine, "model": "tiny-mixtral", "placement": "resident", "cache_capacity": None,
               "cache_policy": None, "prefetch": "none", "workload": "chat", "context_tokens": 8, "gen_tokens": 2,
               "batch": 1, "dtype": "float32", "expert_quant": "int4"}
    device = {"device_kind": "cpu", "device_name": "emulated-cpu", "emulated": True}
    rows = R.make_rows(factors, device, "s", "0", 0, "decode", {"time_s": 1.0}, "engine")
    R.write_job(tmp_path / "job", rows, {"schema_version": R.SCHEMA_VERSION})
    path = tmp_path / "job" / R.ROWS_FILE
    old = pq.read_table(path)
    pq.write_table(old.drop(["expert_quant"]).replace_schema_metadata(old.schema.metadata), path)
    done = tmp_path / "job" / R.DONE_FILE                 # and its DONE as such a file's was: no file hashes
    done.write_text(json.dumps({k: v for k, v in json.loads(done.read_text()).items() if k != "files"}))
    df = R.load(tmp_path / "job")
    assert len(df) == 1
    assert (df["expert_quant"].isna() if before is None else df["expert_quant"] == before).all()


def test_an_int4_run_counts_stored_bytes_and_says_it_is_lossy(tmp_path):
    cfg = cfg_with("placement=fetch", "cache.capacity=2", "experts.quant=int4", "workload=chat", "workload.tokens=random",
                   "workload.context_tokens=48", "workload.gen_tokens=3", "workload.turn_tokens=6", "run.repeats=1",
                   "run.warmup=0", "run.timeline=false", "run.ablation=false", "hardware.device=cpu", "run.quiet=true")
    out = run_job(cfg, JobContext(tmp_path, "s", "j"), Reporter(quiet=True))
    assert out.error is None
    df = pd.DataFrame(out.rows)
    assert set(df["expert_quant"]) == {"int4"} and df["lossy"].all()
    ok = df[df["phase"] == "prefill_fresh"].set_index("metric")["value"]
    assert ok["expert_misses"] > 0
    assert ok["expert_miss_bytes"] == ok["h2d_expert_bytes"] == ok["expert_misses"] * INT4
    assert 0 < ok["max_abs_logit_diff"]                  # against the exact reference: the lossy error


def test_the_roofline_reads_the_stored_expert_bytes():
    rates = ["hardware.source=measured", "hardware.link=emulated", "hardware.h2d_gbps=5", "hardware.d2h_gbps=5",
             "hardware.device_tflops=100", "hardware.cpu_gflops=100000", "hardware.dtype=float32",
             "hardware.device_mem_gbps=10", "hardware.cpu_mem_gbps=10", "placement=resident", "workload=chat",
             "workload.context_tokens=256", "workload.gen_tokens=8"]
    from harness.roofline import roofline
    bound = {q: roofline(validate(cfg_with(*rates, f"experts.quant={q}")), {}, None).phases["decode"]
             for q in ("none", "int8", "int4")}
    assert bound["none"] < bound["int8"] < bound["int4"]       # decode is bound by the expert bytes it reads
