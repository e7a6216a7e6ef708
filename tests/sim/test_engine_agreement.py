"""Engine <-> simulator agreement: a trace recorded from the engine, saved and loaded, replays
to exactly the engine's per-layer hit/miss counts and bytes, for every policy and several
capacities, with a batch of 2 and a prompt longer than the prefill micro-batch (so steps
hold many tokens and the per-step sorted-unique lookup order matters)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import Engine
from engine.hooks import RouteCallback
from engine.trace import RoutingTrace, expert_counts, load_trace, lookup_sequences, save_trace
from engine.trace_recorder import TraceRecorder
from harness.sim.replay import replay

MODEL = "tiny-mixtral"                   # 4 layers, 8 experts, top-2, vocab 512
UBATCH, BATCH, PROMPT, NEW = 8, 2, 20, 6
CAPACITIES = (2, 3, 5, 8)
POLICIES = ("lru", "lfu", "fifo", "static", "belady", "lfru")
PROMPTS = np.random.default_rng(7).integers(0, 512, size=(BATCH, PROMPT)).tolist()



def build(capacity: int, policy: str, policy_options: dict | None = None, **kw) -> Engine:
    return Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=capacity,
                                  cache_policy=policy, policy_options=policy_options, record_lookups=True,
                                  ubatch=UBATCH, batch=BATCH, **kw)


def record(eng: Engine) -> RoutingTrace:
    with TraceRecorder(eng) as rec:
        eng.generate(PROMPTS, NEW)
        return rec.trace()


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> RoutingTrace:
    tr = record(build(2, "lru"))
    return load_trace(save_trace(tmp_path_factory.mktemp("trace") / "tiny.npz", tr))


def test_recorded_trace_shape_and_steps(trace: RoutingTrace) -> None:
    prefill_passes = -(-PROMPT // UBATCH)                                 # 8 + 8 + 4 tokens per row
    assert trace.n_tokens == BATCH * (PROMPT + NEW - 1)
    assert trace.experts.shape[1:] == (4, 2) and trace.weights is not None
    assert int(trace.step[-1]) + 1 == prefill_passes + NEW - 1
    assert np.bincount(trace.step)[:prefill_passes].tolist() == [16, 16, 8]
    assert trace.sequence[:16].tolist() == [0] * 8 + [1] * 8              # row-major over [B, T]
    assert trace.meta["model"] == MODEL and trace.meta["moe_layers"] == [0, 1, 2, 3]
    assert trace.expert_bytes > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.slow
def test_replay_equals_engine_counters(trace: RoutingTrace, policy: str) -> None:
    options = {"belady": {"future": lookup_sequences(trace, model_layers=True)},
               "static": {"popularity": dict(zip(trace.moe_layers, expert_counts(trace)))}}.get(policy)
    sim = replay(trace, [policy], list(CAPACITIES))
    for c in CAPACITIES:
        eng = build(c, policy, options)
        again = record(eng)
        assert np.array_equal(again.experts, trace.experts)             # same routing every run
        assert eng.lookup_log == lookup_sequences(trace, model_layers=True)
        rows = sim[(sim.capacity == c) & (sim.layer != "all")].set_index("layer")
        for layer, counts in eng.counters_by_layer.items():
            if layer < 0:
                continue
            got = rows.loc[layer]
            assert (got.hits, got.misses, got.hit_bytes, got.miss_bytes) == (
                counts["expert_hits"], counts["expert_misses"], counts["expert_hit_bytes"],
                counts["expert_miss_bytes"]), (policy, c, layer)
        total = sim[(sim.capacity == c) & (sim.layer == "all")].iloc[0]
        assert total.miss_bytes == eng.counters["expert_miss_bytes"] == eng.counters["h2d_bytes"]


def test_dense_layers_are_skipped(tmp_path: Path) -> None:
    eng = build(3, "lru", model_overrides={"moe_layers": (1, 3)})
    tr = load_trace(save_trace(tmp_path / "dense.npz", record(eng)))
    assert tr.moe_layers == [1, 3] and tr.n_layers == 2
    sim = replay(tr, ["lru"], [3]).set_index("layer")
    by_layer = eng.counters_by_layer
    assert by_layer[0]["expert_misses"] == by_layer[2]["expert_misses"] == 0
    for layer in (1, 3):
        assert sim.loc[layer, "misses"] == by_layer[layer]["expert_misses"]
        assert sim.loc[layer, "hits"] == by_layer[layer]["expert_hits"]


def test_recorder_chains_and_detaches() -> None:
    eng = build(2, "lru")
    seen: list[int] = []
    other = RouteCallback(lambda layer, ids, w: seen.append(layer))
    eng.model.add_routing_hook(other)
    with TraceRecorder(eng) as rec:
        eng.generate([[1, 2, 3], [4, 5, 6]], 2)
    assert seen[:4] == [0, 1, 2, 3] and rec.trace().n_tokens == 2 * 3 + 2
    assert eng.model.routing_hooks == [other] and "forward" not in vars(eng.model)   # nothing monkeypatched
    eng.generate([[1, 2, 3], [4, 5, 6]], 1)                                # still works after detaching


@pytest.mark.parametrize("model", ["tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4"])
def test_second_wave_traces_replay_to_the_engine_counters(model: str, tmp_path: Path) -> None:
    """A trace holds only the routed experts (not Qwen3-Next's shared expert, not Gemma 4's dense
    MLP beside them) and the stored bytes of one expert (GPT-OSS: its packed MXFP4 buffer); replayed,
    it gives the engine's hits, misses and bytes."""
    eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=3, record_lookups=True,
                                 ubatch=UBATCH, batch=BATCH)
    tr = load_trace(save_trace(tmp_path / "t.npz", record(eng)))
    assert tr.experts.shape[1:] == (eng.cfg.n_moe_layers, eng.cfg.top_k)
    assert tr.expert_bytes == eng.model.store.expert_bytes == eng.model.arch.experts.nbytes(4)
    total = replay(tr, ["lru"], [3])
    total = total[total.layer == "all"].iloc[0]
    c = eng.counters
    assert (total.hits, total.misses, total.miss_bytes) == (c["expert_hits"], c["expert_misses"],
                                                           c["expert_miss_bytes"])


def test_a_mixed_treatment_replays_its_counts_and_leaves_bytes_null(tmp_path: Path) -> None:
    """Mixed int8/int4 experts store different bytes, which the trace's one expert_bytes (the
    slot) cannot say: the replay's counts still equal the engine's, its bytes are null rather
    than counts x the slot size (36% over the engine's here)."""
    import json
    pop = tmp_path / "pop.json"
    pop.write_text(json.dumps([[8, 7, 6, 5, 4, 3, 2, 1]] * 4))
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=2, cache_policy="lru",
                                 expert_quant="mixed", quant_options={"popularity": str(pop), "mixed_count": 2}, ubatch=8)
    with TraceRecorder(eng) as rec:
        eng.generate(np.random.default_rng(7).integers(0, 512, size=(1, 20)).tolist(), 6)
    tr = rec.trace()
    save_trace(tmp_path / "t.npz", tr)
    tr = load_trace(tmp_path / "t.npz")
    assert tr.meta.get("expert_bytes_vary") is True
    tot = replay(tr, ["lru"], [2])
    tot = tot[tot["layer"] == "all"].iloc[0]
    c = eng.counters
    assert (tot["hits"], tot["misses"]) == (c["expert_hits"], c["expert_misses"])
    assert tot["hit_bytes"] is None and tot["miss_bytes"] is None
