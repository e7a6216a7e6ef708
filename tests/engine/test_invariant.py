"""The invariant (DESIGN.md §3): placement changes where and when, never what.

Every placement, every capacity from top_k to all experts, every eviction policy and
every prefill micro-batch size gives the same tokens and logits (max |Δ| <= 1e-5) as
`resident`, for batch 1 and batch > 1, through a continued and a restored session."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine import Engine

TOL = 1e-5
MODEL = "tiny-mixtral"          # 4 layers, 8 experts, top-2
N_EXPERTS, TOP_K = 8, 2
POLICIES = ("lru", "lfu", "fifo", "static", "belady")


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return g.integers(0, 512, size=(batch, length)).tolist()


def scenario(eng: Engine, batch: int) -> tuple[list, list[torch.Tensor]]:
    """Fresh turn, continued turn (KV kept on device), then a turn after offload+restore."""
    sess = eng.new_session(batch)
    toks, logits = [], []
    for turn, seed in enumerate((1, 2, 3)):
        if turn == 2:
            sess.offload()
            sess.restore()
        r = eng.generate(prompts(batch, 24 if turn == 0 else 7, seed + 10 * batch), 5, session=sess)
        toks += r.tokens
        logits += r.logits
    sess.close()
    return toks, logits


_REF: dict = {}


def reference(batch: int, model: str = MODEL):
    """(resident's scenario, the lookup log of fetch at top_k slots) for `model`."""
    if (model, batch) not in _REF:
        eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=TOP_K,
                                     record_lookups=True)
        out = scenario(eng, batch)
        resident = Engine.from_pretrained(model, device="cpu")
        _REF[model, batch] = (scenario(resident, batch), eng.lookup_log)
        assert out[0] == _REF[model, batch][0][0]
    return _REF[model, batch]


def policy_options(policy: str, log: dict[int, list[int]]) -> dict:
    """What `policy` needs from a recorded lookup log (tiny presets: 4 layers, N_EXPERTS experts)."""
    if policy == "belady":
        return {"future": log}
    if policy == "static":
        pop = np.zeros((4, N_EXPERTS))
        for layer, seq in log.items():
            for e, n in Counter(seq).items():
                pop[layer, e] = n
        return {"popularity": pop}
    return {}


def assert_same(got, ref) -> None:
    (toks, logits), (rtoks, rlogits) = got, ref
    assert toks == rtoks
    assert max((a - b).abs().max().item() for a, b in zip(logits, rlogits)) <= TOL


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_fetch_every_capacity_and_policy(policy, batch):
    ref, log = reference(batch)
    for capacity in range(TOP_K, N_EXPERTS + 1):
        eng = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=capacity,
                                     cache_policy=policy, policy_options=policy_options(policy, log))
        assert_same(scenario(eng, batch), ref)
        c = eng.counters
        assert c["expert_hits"] + c["expert_misses"] == sum(len(s) for s in log.values())
        assert c["h2d_bytes"] >= c["expert_miss_bytes"] > 0


OTHER_PLACEMENTS = [     # every placement but fetch, with the options that change what it does
    ("cpu", {}),
    ("hybrid", {"n_cpu_layers": 0}), ("hybrid", {"n_cpu_layers": 2}), ("hybrid", {"n_cpu_layers": 4}),
    ("stream", {"cache_capacity": 3, "stream_threshold": 8}),
    ("stream", {"cache_capacity": 2, "stream_threshold": 0, "stream_buffers": 1}),
    ("stream", {"stream_fallback": "cpu", "stream_threshold": 8, "stream_buffers": 3}),
]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("placement,options", OTHER_PLACEMENTS)
def test_other_placements(placement, options, batch):
    ref, _ = reference(batch)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement=placement, **options)
    assert_same(scenario(eng, batch), ref)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("model", [MODEL, "tiny-qwen3-next", "tiny-gemma4"])
def test_resident_grouped(model, batch):
    """Routing kept on the device and grouped GEMMs: bitwise resident through a fresh, a continued
    and a restored turn (GPT-OSS's MXFP4 experts have no grouped kernel: refused, test_dispatch)."""
    ref, _ = reference(batch, model)
    assert_same(scenario(Engine.from_pretrained(model, device="cpu", placement="resident_grouped"), batch), ref)


# the second wave: sliding windows with sinks and MXFP4 experts (GPT-OSS), recurrent state (Qwen3-Next),
# per-layer head shapes, a dense MLP beside the experts and per-layer inputs (Gemma 4)
SECOND_WAVE = ("tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("model", SECOND_WAVE)
def test_second_wave_every_placement(model, batch):
    """Every placement bitwise resident through a fresh, a continued and a restored turn (the
    recurrent state displaced and restored like KV); fetch at the smallest cache counts every
    lookup and moves the stored expert bytes (MXFP4: the packed uint8 buffer)."""
    ref, log = reference(batch, model)
    for placement, options in [("fetch", {"cache_capacity": TOP_K}),
                               ("fetch", {"cache_capacity": 3, "prefetch": "next_layer_gate"}), *OTHER_PLACEMENTS]:
        eng = Engine.from_pretrained(model, device="cpu", placement=placement, **options)
        assert_same(scenario(eng, batch), ref)
    eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=TOP_K)
    scenario(eng, batch)
    c, expert = eng.counters, eng.model.store.expert_bytes
    assert c["expert_hits"] + c["expert_misses"] == sum(len(s) for s in log.values())
    assert c["expert_miss_bytes"] == c["expert_misses"] * expert == c["h2d_expert_bytes"]
    assert expert == eng.model.arch.experts.nbytes(4) == eng.plan.expert_bytes


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("model", SECOND_WAVE)
@pytest.mark.parametrize("policy", POLICIES)
def test_second_wave_every_capacity_and_policy(policy, model, batch):
    ref, log = reference(batch, model)
    for capacity in (TOP_K + 1, N_EXPERTS - 1, N_EXPERTS):
        eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=capacity,
                                     cache_policy=policy, policy_options=policy_options(policy, log))
        assert_same(scenario(eng, batch), ref)


@pytest.mark.parametrize("model", SECOND_WAVE)
def test_second_wave_continuation_equals_fresh_prefill(model):
    """A continued session (bounded windows, recurrent state) gives what prefilling the whole history
    gives; the recurrent layers' chunked and step forms may round differently, hence the tolerance."""
    eng = Engine.from_pretrained(model, device="cpu", ubatch=7)
    assert_continuation_equals_fresh(eng, tol=1e-4 if model == "tiny-qwen3-next" else TOL)


@pytest.mark.parametrize("ubatch", [1, 3, 5, 16, 512])
@pytest.mark.parametrize("placement,options", [("resident", {}), ("fetch", {"cache_capacity": 3}),
                                               ("stream", {"cache_capacity": 2, "stream_threshold": 4})])
def test_every_ubatch(ubatch, placement, options):
    ref, _ = reference(3)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement=placement, ubatch=ubatch, **options)
    assert_same(scenario(eng, 3), ref)


def test_continuation_equals_fresh_prefill_of_whole_history():
    """KV reuse is real: a continued turn gives the logits of prefilling the whole history."""
    assert_continuation_equals_fresh(Engine.from_pretrained(MODEL, device="cpu"))


def assert_continuation_equals_fresh(eng: Engine, tol: float = TOL) -> None:
    sess = eng.new_session(2)
    p1, p2 = prompts(2, 20, 5), prompts(2, 6, 6)
    r1 = eng.generate(p1, 4, session=sess)
    r2 = eng.generate(p2, 3, session=sess)
    history = [a + b + c for a, b, c in zip(p1, r1.tokens, p2)]
    fresh = eng.generate(history, 3)
    assert fresh.tokens == r2.tokens
    assert max((a - b).abs().max().item() for a, b in zip(fresh.logits, r2.logits)) <= tol


def test_restore_counts_kv_bytes():
    eng = Engine.from_pretrained(MODEL, device="cpu")
    sess = eng.new_session(1)
    eng.generate(prompts(1, 30, 0), 3, session=sess)
    eng.reset_counters()
    kv = sess.used_bytes()
    sess.offload()
    assert eng.counters["d2h_bytes"] == kv
    sess.restore()
    assert eng.counters["h2d_bytes"] == kv and sess.length == 32


def test_hf_family_with_dense_layer_and_shared_expert(hf_checkpoints):
    """Qwen2-MoE (shared expert, a dense layer) through fetch at every capacity equals resident."""
    _, path = hf_checkpoints["qwen2_moe"]
    ref_ids = [[t % 128 for t in row] for row in prompts(2, 16, 1)]
    ref = Engine.from_pretrained(path, device="cpu").generate(ref_ids, 6)
    for capacity in range(2, 9):
        got = Engine.from_pretrained(path, device="cpu", placement="fetch", cache_capacity=capacity).generate(ref_ids, 6)
        assert got.tokens == ref.tokens
        assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= TOL


@pytest.mark.parametrize("options", [{"issue_ahead": True}, {"issue_ahead": False},
                                     {"issue_ahead": True, "prefetch": "next_layer_gate"},
                                     {"issue_ahead": False, "prefetch": "next_layer_gate"}])
@pytest.mark.parametrize("capacity", [2, 3, 8])
def test_copy_schedule_is_bitwise_invisible(options, capacity):
    """Issuing copies ahead or one at a time, with or without prefetch, gives bitwise the
    logits of resident, and the same lookups, hits, misses and bytes in both schedules."""
    ref = scenario(Engine.from_pretrained(MODEL, device="cpu"), 3)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=capacity, **options)
    toks, logits = scenario(eng, 3)
    assert toks == ref[0] and all(torch.equal(a, b) for a, b in zip(logits, ref[1]))
    other = dict(options, issue_ahead=not options["issue_ahead"])
    twin = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=capacity, **other)
    scenario(twin, 3)
    assert twin.counters == eng.counters


@pytest.mark.parametrize("placement,options", [("fetch", {"cache_capacity": 2}), ("cpu", {}),
                                               ("stream", {"cache_capacity": 2, "stream_threshold": 4})])
def test_bounded_sliding_window_state(placement, options):
    """A window shorter than the turns (the state keeps 5 tokens): every placement, through a
    continued and a restored session, bitwise resident; and continuing equals prefilling the
    whole history (the bounded state forgets nothing a query may see)."""
    window = {"sliding_window": 6}
    ref_eng = Engine.from_pretrained(MODEL, device="cpu", model_overrides=window, ubatch=5)
    ref = scenario(ref_eng, 3)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement=placement, model_overrides=window, ubatch=5, **options)
    toks, logits = scenario(eng, 3)
    assert toks == ref[0] and all(torch.equal(a, b) for a, b in zip(logits, ref[1]))
    assert_continuation_equals_fresh(ref_eng)
