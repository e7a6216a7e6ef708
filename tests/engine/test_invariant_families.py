"""The invariant (DESIGN.md §3) for DeepSeek-V3 (MLA: the latent state) and GLM-4.5 (sigmoid
group routing, shared experts, a dense first layer): every placement, every capacity from
top_k to all experts, every eviction policy, with and without issue-ahead and prefetch, gives
bitwise the tokens and logits of `resident`, batch 1 and 3, through a fresh, a continued and a
restored session; a continued session equals prefilling the whole history. Counters: exact
bytes, lookups only for routed experts (the shared experts and the dense layer never touch the
cache)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine import Engine
from engine.config import preset
from tests.engine.test_invariant import OTHER_PLACEMENTS, POLICIES, assert_continuation_equals_fresh, scenario

MODELS = ("tiny-deepseek", "tiny-glm")          # 4 layers (the first dense), 8 experts in 4 groups, top-2
_REF: dict = {}


def reference(model: str, batch: int):
    """(resident's tokens and logits, the lookups of fetch at top_k) for the scenario."""
    if (model, batch) not in _REF:
        fetch = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=preset(model).top_k,
                                       record_lookups=True)
        scenario(fetch, batch)
        _REF[model, batch] = scenario(Engine.from_pretrained(model, device="cpu"), batch), fetch.lookup_log
    return _REF[model, batch]


def assert_bitwise(got, ref) -> None:
    (toks, logits), (rtoks, rlogits) = got, ref
    assert toks == rtoks and all(torch.equal(a, b) for a, b in zip(logits, rlogits))


def policy_options(model: str, policy: str, log: dict[int, list[int]]) -> dict:
    if policy == "belady":
        return {"future": log}
    if policy == "static":
        cfg = preset(model)
        pop = np.zeros((cfg.num_layers, cfg.n_experts))
        for layer, seq in log.items():
            for e, n in Counter(seq).items():
                pop[layer, e] = n
        return {"popularity": pop}
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", MODELS)
def test_fetch_every_capacity_and_policy(model, policy, batch):
    ref, log = reference(model, batch)
    cfg = preset(model)
    lookups = sum(len(s) for s in log.values())
    assert set(log) == set(cfg.moe_layers) and 0 not in log            # the dense layer looks nothing up
    for capacity in range(cfg.top_k, cfg.n_experts + 1):
        eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=capacity,
                                     cache_policy=policy, policy_options=policy_options(model, policy, log))
        assert_bitwise(scenario(eng, batch), ref)
        c, expert_bytes = eng.counters, eng.plan.expert_bytes
        assert c["expert_hits"] + c["expert_misses"] == lookups           # routed experts only
        assert c["expert_hit_bytes"] == c["expert_hits"] * expert_bytes
        assert c["expert_miss_bytes"] == c["expert_misses"] * expert_bytes == c["h2d_expert_bytes"] > 0
        assert c["h2d_bytes"] == c["h2d_expert_bytes"] + c["h2d_kv_bytes"]
        assert eng.counters_by_layer[0]["expert_hits"] + eng.counters_by_layer[0]["expert_misses"] == 0


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("placement,options", OTHER_PLACEMENTS)
@pytest.mark.parametrize("model", MODELS)
def test_other_placements(model, placement, options, batch):
    ref, _ = reference(model, batch)
    assert_bitwise(scenario(Engine.from_pretrained(model, device="cpu", placement=placement, **options), batch), ref)


@pytest.mark.parametrize("options", [{"issue_ahead": False}, {"issue_ahead": True, "prefetch": "next_layer_gate"},
                                     {"issue_ahead": False, "prefetch": "next_layer_gate"}])
@pytest.mark.parametrize("model", MODELS)
def test_copy_schedule_and_prefetch(model, options):
    ref, _ = reference(model, 3)
    eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=3, **options)
    assert_bitwise(scenario(eng, 3), ref)


@pytest.mark.parametrize("model", (*MODELS, "tiny-moonlight"))
def test_continuation_equals_fresh_prefill_of_whole_history(model):
    assert_continuation_equals_fresh(Engine.from_pretrained(model, device="cpu"))


def test_restored_session_moves_exactly_the_latent():
    """offload/restore move 4 layers x (16 latent + 8 rope) x 4 bytes per token and row -- the latent,
    not the 4 x 4 heads x (16 + 8 + 16) x 4 bytes of the keys and values it stands for."""
    eng = Engine.from_pretrained("tiny-deepseek", device="cpu")
    sess = eng.new_session(2)
    eng.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]] * 2, 3, session=sess)      # 12 tokens held
    eng.reset_counters()
    sess.offload()
    sess.restore()
    assert eng.counters["d2h_kv_bytes"] == eng.counters["h2d_kv_bytes"] == 2 * 12 * 4 * (16 + 8) * 4 == 9216
    assert eng.counters["h2d_bytes"] == 9216 and eng.counters["expert_hits"] + eng.counters["expert_misses"] == 0
