"""Multi-head latent attention and DeepSeek-V3's router as blocks: the sigmoid group-limited
router and the interleaved rotary bitwise against transformers; the latent state (what a
session keeps: rank + rope per token, never expanded K/V) through append, offload and restore;
the planner's per-token bytes for the real DeepSeek-V3 shape by hand; `auto` capacity against
the context; the planned transient bound against what a forward really allocates."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.blocks.mla import LatentKV, rotate
from engine.blocks.routers import SigmoidGroupTopK
from engine.config import preset
from engine.counters import Counters
from engine.devices import Device
from engine.kv import Session
from engine.planner import plan_memory
from tests.engine.test_planner_memory import measured_and_planned

ROUTERS = ["deepseek_v3.modeling_deepseek_v3:DeepseekV3TopkRouter", "glm4_moe.modeling_glm4_moe:Glm4MoeTopkRouter"]


def transformers_router(path: str, **config):
    import importlib

    import transformers as tf
    module, cls = path.split(":")
    conf = (tf.DeepseekV3Config if module.startswith("deepseek") else tf.Glm4MoeConfig)(**config)
    return getattr(importlib.import_module(f"transformers.models.{module}"), cls)(conf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 1, False), (8, 8, True)])
@pytest.mark.parametrize("path", ROUTERS)
def test_sigmoid_group_router_equals_transformers(path, n_group, topk_group, norm, dtype):
    """Ids and fp32 weights bitwise (ours put in descending weight), the correction bias kept fp32
    whatever the activations, as transformers' _keep_in_fp32_modules keeps it."""
    E, D, k = 16, 32, 3
    ref = transformers_router(path, hidden_size=D, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    w, bias = torch.randn(E, D, generator=g) * 0.4, torch.randn(E, generator=g) * 0.3
    ref.weight.data, ref.e_score_correction_bias.data = w.to(dtype), bias.clone()
    ours = SigmoidGroupTopK("g", D, E, k, n_group, topk_group, norm, 2.5)
    ours.w = {"weight": w.to(dtype), "bias": bias}
    assert ours.tensors()["bias"].dtype == "float32"
    h = torch.randn(40, D, generator=g).to(dtype)
    with torch.no_grad():
        _, ref_w, ref_i = ref(h)
    ids, weights = ours.route(h)
    order = ref_w.sort(dim=-1, descending=True, stable=True)[1]             # ours: in descending weight
    assert torch.equal(ids, ref_i.gather(1, order)) and torch.equal(weights, ref_w.gather(1, order))
    assert weights.dtype == torch.float32 and (weights[:, :-1] >= weights[:, 1:]).all()


def test_the_correction_bias_chooses_but_never_weighs():
    E, D = 8, 16
    r = SigmoidGroupTopK("g", D, E, 2, 1, 1, False, 1.0)
    g = torch.Generator().manual_seed(0)
    r.w = {"weight": torch.randn(E, D, generator=g), "bias": torch.zeros(E)}
    h = torch.randn(5, D, generator=g)
    scores = torch.sigmoid(h @ r.w["weight"].T)
    r.w["bias"][3] = 10.0                                  # expert 3 always chosen ...
    ids, weights = r.route(h)
    assert (ids == 3).any(dim=1).all()
    assert torch.equal(weights, scores.gather(1, ids))     # ... at its unbiased score


def test_groups_limit_the_choice():
    """Experts of a group outside the top `topk_group` are never chosen, however good alone."""
    r = SigmoidGroupTopK("g", 4, 8, 2, 4, 1, True, 1.0)                 # 4 groups of 2, one kept
    r.w = {"weight": torch.zeros(8, 4), "bias": torch.tensor([0.9, -0.5, 0.3, 0.3, 0, 0, 0, 0])}
    ids, _ = r.route(torch.zeros(3, 4))          # scores 0.5; choice 1.4, 0.0 | 0.8, 0.8 | 0.5 x 4: groups 1.4, 1.6, 1, 1
    assert [sorted(row) for row in ids.tolist()] == [[2, 3]] * 3         # expert 0, best alone, is in a dropped group


@pytest.mark.parametrize("interleave", [True, False])
def test_rotary_equals_transformers(interleave):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                      apply_rotary_pos_emb_interleave)
    from engine.layers import rope_cos_sin

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 7, 8, generator=g), torch.randn(2, 1, 7, 8, generator=g)
    cos, sin = rope_cos_sin(torch.arange(3, 10), 8, 10000.0, 1.0, torch.float32)
    ref_q, ref_k = (apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb)(q, k, cos[None], sin[None])
    assert torch.equal(rotate(q, cos, sin, interleave), ref_q) and torch.equal(rotate(k, cos, sin, interleave), ref_k)


def test_latent_state_round_trip_and_bytes():
    dev, counters = Device.create("cpu"), Counters(2)
    label = Session.new_label()
    states = [LatentKV(dev, label, 2, 16, 8, torch.float32, 40) for _ in range(2)]
    sess = Session(dev, counters, 2, states, 40)
    g = torch.Generator().manual_seed(0)
    for T in (10, 3):
        for st in states:
            held = st.append(torch.randn(2, T, 24, generator=g), sess.length)
        sess.advance(T)
    assert held.shape == (2, 13, 24) and all(s.capacity == 40 for s in states)
    assert sess.nbytes == 2 * LatentKV.term(16, 8, 4).bytes(40, 2) == 2 * 2 * 40 * 24 * 4   # one buffer per layer
    kept = [s.latent[:, :13].clone() for s in states]
    sess.offload()
    assert counters.totals()["d2h_kv_bytes"] == 2 * 2 * 13 * 24 * 4 and sess.nbytes == 0
    sess.restore()
    assert counters.totals()["h2d_kv_bytes"] == 2 * 2 * 13 * 24 * 4
    assert all(torch.equal(s.latent[:, :13], k) for s, k in zip(states, kept))
    with pytest.raises(ValueError, match="planned for max_context=40"):
        states[0].append(torch.zeros(2, 28, 24), 13)
    unplanned = LatentKV(dev, label, 1, 4, 2, torch.float32, None)
    unplanned.append(torch.ones(1, 300, 6), 0)
    assert unplanned.capacity == 512 and torch.equal(unplanned.latent[:, :300], torch.ones(1, 300, 6))


def test_deepseek_v3_plans_the_latent_per_token():
    """61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes (bf16) = 70,272 B per token --
    not the 61 x 128 heads x (128 + 64 + 128) x 2 = 4,997,120 B of the keys and values it stands for."""
    cfg = preset("deepseek-v3")
    per_token = 61 * (512 + 64) * 2
    assert per_token == 70_272
    assert cfg.kv_bytes_per_token(2) == per_token
    assert cfg.kv_bytes_per_token(2) * 71 < 61 * 128 * (128 + 64 + 128) * 2
    plan = plan_memory(cfg, "fetch", 8, None, 4096, 1, 512, 2)
    assert plan.kv == per_token * 4096 == 287_834_112
    assert plan.states == (("MLA latent (512 + 64 rope) (61 layers, 1 x 4096 tokens)", 287_834_112),)
    assert preset("kimi-k2").kv_bytes_per_token(2) == 70_272                       # the same MLA dims
    assert preset("moonlight-16b-a3b").kv_bytes_per_token(2) == 27 * (512 + 64) * 2 == 31_104
    assert plan_memory(cfg, "fetch", 8, None, 4096, 3, 512, 2).kv == 3 * 287_834_112


def test_auto_capacity_shrinks_as_the_latent_grows():
    """cache_capacity='auto' gives what the budget leaves after everything else, the latent growing
    by 5 layers x (16 + 8) x 4 bytes per token; by hand at each context."""
    cfg, budget = preset("tiny-moonlight"), 8 << 20
    slot = cfg.n_moe_layers * cfg.expert_params * 4
    caps, prev = [], None
    for ctx in (256, 1024, 2048, 4096):
        plan = plan_memory(cfg, "fetch", "auto", budget, ctx, 1, 64, 4, device_kind="cpu")
        assert plan.kv == ctx * 5 * (16 + 8) * 4
        fixed = plan.total - plan.experts
        assert plan.capacity == min(cfg.n_experts, (budget - fixed) // slot)
        if prev is not None:
            assert plan.kv - prev.kv == (ctx - prev.context) * 480
        caps.append(plan.capacity)
        prev = plan
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1] >= cfg.top_k, caps


@pytest.mark.parametrize("batch,context", [(1, 64), (3, 200)])
@pytest.mark.parametrize("model", ["tiny-deepseek", "tiny-glm"])
def test_planned_state_terms_equal_the_allocated_tensors(model, batch, context):
    eng = Engine.from_pretrained(model, device="cpu", batch=batch, max_context=context)
    sess = eng.new_session(batch)
    eng.prefill(sess, [[1, 2, 3]] * batch)
    assert [s.nbytes for s in sess.states] == [t.bytes(context, batch) for t in eng.model.arch.state_terms(4)]
    assert sess.nbytes == eng.plan.kv
    if model == "tiny-deepseek":
        assert all(isinstance(s, LatentKV) for s in sess.states)
        assert sess.nbytes == 4 * batch * context * (16 + 8) * 4
    eng.reset_counters()
    used = sess.used_bytes()
    sess.offload()
    sess.restore()
    assert eng.counters["d2h_kv_bytes"] == eng.counters["h2d_kv_bytes"] == used
    if model == "tiny-deepseek":
        assert used == 4 * batch * 3 * (16 + 8) * 4


@pytest.mark.parametrize("model,tokens,batch,dtype,options,overrides", [
    ("tiny-deepseek", 1, 2, "float32", {}, None),                                       # a decode step
    ("tiny-deepseek", 64, 2, "float32", {"placement": "fetch", "cache_capacity": 2}, None),
    ("tiny-deepseek", 256, 1, "bfloat16", {}, None),
    ("tiny-deepseek", 512, 2, "float32", {}, None),
    ("tiny-deepseek", 200, 1, "float32", {}, {"mla_kernel": "expanded"}),
    ("tiny-moonlight", 256, 2, "float32", {}, None),
    ("tiny-glm", 200, 2, "float32", {}, None),
])
def test_planned_transient_bounds_the_measured_peak(model, tokens, batch, dtype, options, overrides):
    peak, planned = measured_and_planned("cpu", tokens, batch, dtype, options, overrides, model=model)
    assert 0 < peak <= planned <= 3 * peak, (peak, planned)
