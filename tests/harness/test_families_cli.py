"""The harness runs the new families end to end: the real `moebench` CLI on a tiny DeepSeek-V3
checkpoint (MLA, sigmoid group routing, a dense layer, a shared expert) written by
transformers -- every phase checked against the exact reference, engine=hf agreeing with it,
a fetch cache that moves exactly the bytes it counts, the restored turn moving the latent -- and
`moebench plan` sizing the real presets without reading a weight."""
from __future__ import annotations

import re

import pandas as pd
import pytest

from engine.devices import fmt_bytes
from harness import results
from tests.harness.test_cli import moebench, sweep_dir

SMALL = ["workload=chat", "workload.tokens=random", "workload.context_tokens=256", "workload.gen_tokens=8",
         "run.repeats=1", "run.quiet=true"]
CHECKED = {"prefill_fresh", "decode", "prefill_continuation", "prefill_restored"}


def checks(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    return df[(df.metric == metric) & (df.profiler == "none")]


@pytest.mark.slow
def test_a_tiny_deepseek_checkpoint_through_the_cli(tmp_path, hf_checkpoints):
    _, ckpt = hf_checkpoints["deepseek_v3"]                 # vocab 128: random tokens, not the byte tokenizer
    (tmp_path / "engines").mkdir()
    (tmp_path / "fetch").mkdir()
    moebench(["-m", "model=hf", f"model.path={ckpt}", "engine=moebench,hf", "placement=resident", *SMALL],
             tmp_path / "engines")
    df = results.load(sweep_dir(tmp_path / "engines") / "results.parquet")
    assert set(df.engine) == {"moebench", "hf"} and (df.status == "ok").all()
    for engine in ("moebench", "hf"):
        agree, diff = (checks(df[df.engine == engine], m) for m in ("token_agreement", "max_abs_logit_diff"))
        assert set(agree.phase) == CHECKED and (agree["value"] == 1.0).all(), engine
        assert (diff["value"] <= (1e-5 if engine == "moebench" else 1e-4)).all(), engine

    moebench(["-m", "model=hf", f"model.path={ckpt}", "placement=fetch", "cache.capacity=2", *SMALL],
             tmp_path / "fetch")
    df = results.load(sweep_dir(tmp_path / "fetch") / "results.parquet")
    assert (df.status == "ok").all() and (checks(df, "token_agreement")["value"] == 1.0).all()
    assert (checks(df, "max_abs_logit_diff")["value"] <= 1e-5).all()
    row = {m: checks(df[df.phase == "decode"], m)["value"].iloc[0]
           for m in ("expert_misses", "expert_miss_bytes", "h2d_expert_bytes")}
    assert row["expert_miss_bytes"] == row["expert_misses"] * 3 * 64 * 32 * 4 == row["h2d_expert_bytes"]
    restored = checks(df[df.phase == "prefill_restored"], "h2d_kv_bytes")["value"].iloc[0]
    assert restored > 0 and restored % (3 * (16 + 8) * 4) == 0              # whole tokens of the 3 layers' latent


@pytest.mark.slow
def test_moebench_plan_sizes_the_real_presets_without_weights(tmp_path):
    proc = moebench(["plan", "model=deepseek-v3", "placement=fetch", "cache.capacity=8", "model.dtype=bfloat16",
                     "workload.context_tokens=4096"], tmp_path)
    line = next(x for x in proc.stdout.splitlines() if "MLA latent" in x)
    tokens = int(re.search(r"\(61 layers, 1 x (\d+) tokens\)", line).group(1))   # the context the session needs
    assert tokens >= 4096 and fmt_bytes(70_272 * tokens) in line                  # 61 x (512 + 64) x 2 B per token


def test_the_mla_context_pressure_budget_leaves_the_mixtral_experiment_s_room():
    """conf/experiment/context_pressure_mla.yaml's budget: after each model's own context-independent
    costs (non-expert weights, one micro-batch's activations, the 5% reserve), both experiments have
    the same room (to 1 KiB) for state, attention workspace and expert slots -- so the slots differ
    by the state alone; and at 3072 tokens MLA keeps more slots than GQA."""
    from harness.plan import plan_of, spec_of

    def room(experiment: str, context: int):
        plan = plan_of(spec_of([f"experiment={experiment}", f"workload.context_tokens={context}"]))
        return plan.budget - plan.reserve - plan.non_expert - plan.activations, plan

    (gqa, gqa_plan), (mla, mla_plan) = room("context_pressure", 3072), room("context_pressure_mla", 3072)
    assert abs(gqa - mla) < 1024
    assert mla_plan.kv * 2 < gqa_plan.kv and mla_plan.capacity > gqa_plan.capacity


def test_truncating_below_the_first_moe_layer_is_refused():
    """model.num_layers keeps a prefix of the layers: DeepSeek-V3's first 3 are dense, so 3 would
    leave no MoE layer (refused, naming the smallest allowed), 4 keeps one."""
    from harness.config import ConfigError
    from harness.plan import spec_of

    with pytest.raises(ConfigError, match=r"model.num_layers: allowed 4\.\.61 \(the first MoE layer of deepseek-v3 "
                                          r"is layer 3\), got 3"):
        spec_of(["model=deepseek-v3", "model.num_layers=3", "cache.capacity=auto"])
    assert spec_of(["model=deepseek-v3", "model.num_layers=4", "cache.capacity=auto"]).model_config.moe_layers == (3,)
