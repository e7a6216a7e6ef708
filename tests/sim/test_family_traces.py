"""Routing traces of DeepSeek-V3 (MLA) and GLM-4.5 models: only the routed experts of the MoE
layers are recorded (the shared experts and the dense first layer never appear), and replaying
the trace gives exactly the engine's per-layer hits, misses and bytes for every policy."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import Engine
from engine.config import preset
from engine.trace import expert_counts, load_trace, lookup_sequences, save_trace
from engine.trace_recorder import TraceRecorder
from harness.sim.replay import replay

PROMPTS = np.random.default_rng(3).integers(0, 512, size=(2, 20)).tolist()
POLICIES = ("lru", "lfu", "fifo", "static", "belady")


def build(model: str, capacity: int, policy: str = "lru", options: dict | None = None) -> Engine:
    return Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=capacity, cache_policy=policy,
                                  policy_options=options, record_lookups=True, ubatch=8, batch=2)


@pytest.mark.parametrize("model", ["tiny-deepseek", "tiny-glm"])
def test_trace_holds_routed_experts_and_replays_to_the_engine(model: str, tmp_path: Path) -> None:
    cfg = preset(model)
    eng = build(model, cfg.top_k)
    with TraceRecorder(eng) as rec:
        eng.generate(PROMPTS, 5)
    tr = load_trace(save_trace(tmp_path / "t.npz", rec.trace()))
    assert tr.moe_layers == [1, 2, 3] and tr.experts.shape == (2 * (20 + 4), 3, cfg.top_k)
    assert tr.n_experts == cfg.n_experts and tr.experts.max() < cfg.n_experts and tr.meta["family"] == cfg.family
    assert tr.expert_bytes == 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4    # a routed expert, fp32
    assert (np.diff(tr.weights, axis=2) <= 0).all()                                 # slots in descending weight
    future = lookup_sequences(tr, model_layers=True)
    sim = replay(tr, list(POLICIES), [2, 5, 8])
    for policy in POLICIES:
        options = {"belady": {"future": future},
                   "static": {"popularity": dict(zip(tr.moe_layers, expert_counts(tr)))}}.get(policy)
        for c in (2, 5, 8):
            again = build(model, c, policy, options)
            again.generate(PROMPTS, 5)
            assert again.lookup_log == future
            rows = sim[(sim.policy == policy) & (sim.capacity == c) & (sim.layer != "all")].set_index("layer")
            for layer in tr.moe_layers:
                got, want = rows.loc[layer], again.counters_by_layer[layer]
                assert (got.hits, got.misses, got.hit_bytes, got.miss_bytes) == (
                    want["expert_hits"], want["expert_misses"], want["expert_hit_bytes"], want["expert_miss_bytes"])
            assert again.counters_by_layer[0]["expert_misses"] == 0
