"""CUDA-only checks (skipped without a GPU): pinned host store, copies on the dedicated copy
stream, and the invariant on the real device."""
from __future__ import annotations

import pytest
import torch

from engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]


def test_fetch_on_cuda_matches_resident_and_uses_pinned_store():
    ref = Engine.from_pretrained("tiny-mixtral", device="cuda").generate(PROMPT, 8)
    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2)
    assert all(rows.is_pinned() for rows in eng.model.store.rows.values())
    assert eng.device.copy_stream is not None
    got = eng.generate(PROMPT, 8)
    assert got.tokens == ref.tokens
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= 1e-5
    assert eng.counters["h2d_bytes"] == eng.counters["expert_miss_bytes"] > 0


@pytest.mark.parametrize("placement,opts", [("cpu", {}), ("hybrid", {"n_cpu_layers": 2}),
                                            ("stream", {"cache_capacity": 2, "stream_threshold": 4})])
def test_other_placements_on_cuda(placement, opts):
    ref = Engine.from_pretrained("tiny-mixtral", device="cuda").generate(PROMPT, 8)
    got = Engine.from_pretrained("tiny-mixtral", device="cuda", placement=placement, **opts).generate(PROMPT, 8)
    assert got.tokens == ref.tokens
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= 1e-5
