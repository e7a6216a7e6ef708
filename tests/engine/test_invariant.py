"""The invariant (DESIGN.md §3): placement changes where and when, never what.

Every registered placement -- built in, or a third party's through the entry-point group -- in
every configuration it asks to be checked (`Placement.invariant_cases`: fetch at every capacity
from top_k to all experts under every registered eviction policy and each copy schedule with
every registered prefetcher, hybrid's layer counts, stream's thresholds and fallbacks, ...) gives
the same tokens and logits (max |Δ| <= 1e-5) as `resident`, for batch 1 and batch > 1, through a
fresh, a continued and a restored session; on tiny-mixtral and the second-wave families here,
DeepSeek-V3 and GLM-4.5 in test_invariant_families. Every prefill micro-batch size too."""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from engine import Engine
from engine.config import preset
from engine.registry import PLACEMENTS

TOL = 1e-5
MODEL = "tiny-mixtral"          # 4 layers, 8 experts, top-2
TOP_K = 2
# the second wave: sliding windows with sinks and MXFP4 experts (GPT-OSS), recurrent state (Qwen3-Next),
# per-layer head shapes, a dense MLP beside the experts and per-layer inputs (Gemma 4)
SECOND_WAVE = ("tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4")
ENGINE_KEYWORDS = ("cache_capacity", "cache_policy", "prefetch")    # the rest of a case is the placement's options


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


class Reference(NamedTuple):
    out: tuple[list, list[torch.Tensor]]        # resident's tokens and logits
    log: dict[int, list[int]]                   # fetch's lookups per layer, in order (belady's future)
    steps: dict[int, list[list[int]]]           # the experts each forward pass used (trace_oracle's steps)


_REF: dict[tuple[str, int], Reference] = {}


def reference(batch: int, model: str = MODEL) -> Reference:
    """resident's scenario and what fetch at top_k looked up in it, for `model`."""
    if (model, batch) not in _REF:
        eng = Engine.from_pretrained(model, device="cpu", placement="fetch", cache_capacity=preset(model).top_k,
                                     record_lookups=True)
        out = scenario(eng, batch)
        resident = Engine.from_pretrained(model, device="cpu")
        _REF[model, batch] = Reference(scenario(resident, batch), eng.lookup_log, eng.step_log)
        assert out[0] == _REF[model, batch].out[0]
    return _REF[model, batch]


def policy_options(model: str, policy: str, log: dict[int, list[int]]) -> dict:
    """What `policy` needs from a recorded lookup log: belady the future, static the popularity."""
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


def recorded_options(model: str, case: dict[str, Any], ref: Reference) -> dict[str, Any]:
    """The Engine keywords an oracle in `case` takes from the reference run: an offline policy's
    lookups, trace_oracle's steps."""
    out: dict[str, Any] = {}
    if case.get("cache_policy"):
        out["policy_options"] = policy_options(model, case["cache_policy"], ref.log)
    if case.get("prefetch") == "trace_oracle":
        out["prefetch_options"] = {"steps": ref.steps}
    return out


def registered_cases(model: str) -> list[tuple[str, dict[str, Any]]]:
    """(placement, Engine keywords) of every registered placement's `invariant_cases` on `model`."""
    cfg = preset(model)
    return [(name, case) for name in PLACEMENTS.names() for case in PLACEMENTS.get(name).invariant_cases(cfg)]


def case_id(name: str, case: dict[str, Any]) -> str:
    return name + "".join(f"-{k}={v}" for k, v in case.items())


def param_id(x: Any) -> str:
    """A parametrize id: a placement's name as is, its case as its keywords."""
    return x if isinstance(x, str) else case_id("", x).lstrip("-") or "defaults"


def invariant_params(models: tuple[str, ...], slow_grid: bool = False) -> list:
    """pytest params (model, placement, case) over the registry; `slow_grid` marks the cases that set
    a cache policy (fetch's capacity x policy grid) slow."""
    return [pytest.param(model, name, case, id=f"{model}-{case_id(name, case)}",
                         marks=[pytest.mark.slow] if slow_grid and "cache_policy" in case else [])
            for model in models for name, case in registered_cases(model)]


def build(model: str, name: str, case: dict[str, Any], ref: Reference, **kw: Any) -> Engine:
    return Engine.from_pretrained(model, device="cpu", placement=name, **case, **recorded_options(model, case, ref), **kw)


def through_cache_only(model: str, name: str, case: dict[str, Any]) -> bool:
    """Whether every routed expert of every pass goes through the placement's device cache (no CPU
    layer, no streamed pass) with no prefetcher: then lookups are the reference's, one per expert a
    pass uses."""
    cls = PLACEMENTS.get(name)
    options = {k: v for k, v in case.items() if k in {f.name for f in dataclasses.fields(cls.Options)}}
    tr = cls.traits(preset(model), options)
    return tr.uses_cache and not tr.uses_cpu and tr.stream_threshold is None and case.get("prefetch", "none") == "none"


def assert_cache_counts(eng: Engine, ref: Reference) -> None:
    """Exact counters of a placement whose experts all go through its cache: every routed expert a
    pass uses looked up once (the dense layers and shared experts never), each hit and miss counted
    at the stored expert bytes (MXFP4: the packed uint8 buffer), a miss's copy the only expert bytes
    that move."""
    c, expert = eng.counters, eng.plan.expert_bytes
    assert expert == eng.model.store.expert_bytes == eng.model.arch.experts.nbytes(4)
    assert c["expert_hits"] + c["expert_misses"] == sum(len(s) for s in ref.log.values())
    assert c["expert_hit_bytes"] == c["expert_hits"] * expert
    assert c["expert_miss_bytes"] == c["expert_misses"] * expert == c["h2d_expert_bytes"] > 0
    assert c["h2d_bytes"] == c["h2d_expert_bytes"] + c["h2d_kv_bytes"]
    dense = set(range(eng.cfg.num_layers)) - set(eng.cfg.moe_layers)
    assert all(eng.counters_by_layer[i]["expert_hits"] + eng.counters_by_layer[i]["expert_misses"] == 0 for i in dense)


def assert_same(got, ref) -> None:
    (toks, logits), (rtoks, rlogits) = got, ref
    assert toks == rtoks
    assert max((a - b).abs().max().item() for a, b in zip(logits, rlogits)) <= TOL


def test_every_placement_is_asked_for_its_cases():
    """The parametrisation is the registry's: each built-in placement contributes cases on the
    model, fetch its whole capacity x policy grid."""
    cases = registered_cases(MODEL)
    assert {name for name, _ in cases} == set(PLACEMENTS.names())
    from engine.registry import POLICIES
    grid = {(c["cache_capacity"], c["cache_policy"]) for name, c in cases if name == "fetch" and "cache_policy" in c}
    assert grid == {(cap, p) for cap in range(TOP_K, 9) for p in POLICIES.names()}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("model, placement, case", invariant_params((MODEL, *SECOND_WAVE)))
def test_every_registered_placement(model, placement, case, batch):
    ref = reference(batch, model)
    eng = build(model, placement, case, ref)
    assert_same(scenario(eng, batch), ref.out)
    if through_cache_only(model, placement, case):
        assert_cache_counts(eng, ref)


@pytest.mark.parametrize("model", SECOND_WAVE)
def test_second_wave_continuation_equals_fresh_prefill(model):
    """A continued session (bounded windows, recurrent state) gives what prefilling the whole history
    gives; the recurrent layers' chunked and step forms may round differently, hence the tolerance."""
    eng = Engine.from_pretrained(model, device="cpu", ubatch=7)
    assert_continuation_equals_fresh(eng, tol=1e-4 if model == "tiny-qwen3-next" else TOL)


def representative_cases(model: str, extra: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """`extra`, then every registered placement's representative (first) case not among them."""
    first = {}
    for name, case in registered_cases(model):
        first.setdefault(name, case)
    return extra + [(n, c) for n, c in first.items() if (n, c) not in extra]


@pytest.mark.parametrize("ubatch", [1, 3, 5, 16, 512])
@pytest.mark.parametrize("placement,case", representative_cases(MODEL, [
    ("fetch", {"cache_capacity": 3, "cache_policy": "lru"}), ("stream", {"cache_capacity": 2, "stream_threshold": 4})]),
    ids=param_id)
def test_every_ubatch(ubatch, placement, case):
    ref = reference(3)
    eng = build(MODEL, placement, case, ref, ubatch=ubatch)
    assert_same(scenario(eng, 3), ref.out)


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


@pytest.mark.parametrize("placement,options", representative_cases(MODEL, [
    ("fetch", {"cache_capacity": 2}), ("cpu", {}), ("stream", {"cache_capacity": 2, "stream_threshold": 4})]),
    ids=param_id)
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
