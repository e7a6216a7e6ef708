"""The invariant (DESIGN.md §3) for DeepSeek-V3 (MLA: the latent state) and GLM-4.5 (sigmoid
group routing, shared experts, a dense first layer): every registered placement in every
configuration it asks to be checked (`Placement.invariant_cases`: fetch at every capacity from
top_k to all experts under every eviction policy, with and without issue-ahead and each
prefetcher, ...) gives bitwise the tokens and logits of `resident`, batch 1 and 3, through a
fresh, a continued and a restored session; a continued session equals prefilling the whole
history. Counters: exact bytes, lookups only for routed experts (the shared experts and the
dense layer never touch the cache)."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.config import preset
from tests.engine.test_invariant import (assert_cache_counts, assert_continuation_equals_fresh, build,
                                         invariant_params, reference, scenario, through_cache_only)

MODELS = ("tiny-deepseek", "tiny-glm")          # 4 layers (the first dense), 8 experts in 4 groups, top-2


def assert_bitwise(got, ref) -> None:
    (toks, logits), (rtoks, rlogits) = got, ref
    assert toks == rtoks and all(torch.equal(a, b) for a, b in zip(logits, rlogits))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("model, placement, case", invariant_params(MODELS, slow_grid=True))
def test_every_registered_placement(model, placement, case, batch):
    ref = reference(batch, model)
    assert set(ref.log) == set(preset(model).moe_layers) and 0 not in ref.log     # the dense layer looks nothing up
    eng = build(model, placement, case, ref)
    assert_bitwise(scenario(eng, batch), ref.out)
    if through_cache_only(model, placement, case):
        assert_cache_counts(eng, ref)


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
