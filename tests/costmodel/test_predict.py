"""The time model: what-if orderings across profiles, the link term only where bytes move,
bytes that equal the engine's own counters, cache traffic that equals the engine's cache on
the same routing, and predicted rows in the tidy schema with source="model"."""
from __future__ import annotations

import numpy as np
import pytest

from engine import Engine
from engine.trace import TraceRecorder
from harness import results
from harness.costmodel import PlacementSpec, ProfileError, Routing, WorkloadShape, predict
from harness.costmodel.profiles import profile_from_dict
from harness.costmodel.work import PHASES, phase_passes, scenario_work
from engine.config import preset

MIXTRAL = WorkloadShape(context_tokens=1024, gen_tokens=16, turn_tokens=32)



def _fetch_decode(profile: str, **kw):
    return predict("mixtral-8x7b", "fetch", MIXTRAL, profile, capacity=4, dtype="bfloat16", **kw).phases["decode"]


def test_faster_link_predicts_faster_fetch_decode_at_the_same_hit_rate():
    slow, fast = _fetch_decode("rtx3090-pcie3-x8", hit_rate=0.6), _fetch_decode("rtx5090-pcie5-x16", hit_rate=0.6)
    lookups = 15 * 32 * 2                                   # decode steps x MoE layers x top-k
    for p in (slow, fast):
        assert (p.expert_hits, p.expert_misses) == pytest.approx((0.6 * lookups, 0.4 * lookups))
    assert fast.time_s < slow.time_s and fast.tok_per_s > slow.tok_per_s
    # measured counts instead of a rate: the same ordering
    counts = {"decode": {"expert_hits": 500.0, "expert_misses": 460.0}}
    assert _fetch_decode("rtx5090-pcie5-x16", counts=counts).time_s < _fetch_decode("rtx3090-pcie3-x8", counts=counts).time_s
    # the same card on a wider, newer link: only the copies change, by the bandwidth ratio
    x8, x16 = _fetch_decode("rtx3090-pcie3-x8", counts=counts), _fetch_decode("rtx3090-pcie4-x16", counts=counts)
    assert x8.compute_s == pytest.approx(x16.compute_s)
    assert x8.copy_busy_s / x16.copy_busy_s == pytest.approx(25.0 / 6.3)
    # decode is link-bound on any PCIe link for Mixtral: the copies dominate
    assert slow.exposed_copy_s > 0.9 * slow.time_s


def test_resident_has_no_link_term():
    a = predict("mixtral-8x7b", "resident", MIXTRAL, "rtx4090-pcie4-x16", dtype="bfloat16")
    b = predict("mixtral-8x7b", "resident", MIXTRAL, "rtx4090-pcie4-x8", dtype="bfloat16")
    for phase in ("prefill_fresh", "decode", "prefill_continuation"):
        pa, pb = a.phases[phase], b.phases[phase]
        assert pa.copy_busy_s == 0 and pa.h2d_bytes == 0 and pa.d2h_bytes == 0
        assert pa.time_s == pytest.approx(pb.time_s)
    # only the restored turn crosses the link (the KV comes back), and its time says so
    ra, rb = a.phases["prefill_restored"], b.phases["prefill_restored"]
    kv = preset("mixtral-8x7b").kv_bytes_per_token(2) * (1024 + 15 + 33)
    assert ra.h2d_bytes == kv and rb.time_s > ra.time_s


def test_overlap_modes_are_ordered():
    t = {o: _fetch_decode_overlap(o) for o in ("none", "auto", "full", 0.0, 0.5, 1.0)}
    assert t["full"] <= t["auto"] == pytest.approx(t["none"]) == pytest.approx(t[0.0])
    assert t[1.0] <= t["full"] and t[1.0] <= t[0.5] < t[0.0]   # full hides copies only under compute
    with pytest.raises(ValueError, match="overlap"):
        _fetch_decode_overlap("sometimes")


def _fetch_decode_overlap(overlap):
    return predict("olmoe-1b-7b", "fetch", MIXTRAL, "h100-sxm-80gb", capacity=16, dtype="bfloat16",
                   overlap=overlap).phases["decode"].time_s


def test_stream_pipelines_its_copies():
    shape = WorkloadShape(context_tokens=2048, gen_tokens=4)
    auto = predict("qwen3-30b-a3b", "stream", shape, "h100-pcie-80gb", capacity=16, dtype="bfloat16")
    none = predict("qwen3-30b-a3b", "stream", shape, "h100-pcie-80gb", capacity=16, dtype="bfloat16", overlap="none")
    fa, fn = auto.phases["prefill_fresh"], none.phases["prefill_fresh"]
    assert fa.copy_busy_s == pytest.approx(fn.copy_busy_s) and fa.copy_busy_s > 0
    assert fa.exposed_copy_s < fn.exposed_copy_s
    assert fa.expert_misses == 0     # streamed experts bypass the cache, as in the engine


def test_uniform_routing_gives_lru_hit_rate_capacity_over_experts():
    shape = WorkloadShape(context_tokens=64, gen_tokens=801)
    d = predict("tiny-mixtral", "fetch", shape, "rtx4090-pcie4-x16", capacity=4).phases["decode"]
    assert d.expert_hits / (d.expert_hits + d.expert_misses) == pytest.approx(0.5, abs=0.05)


def test_missing_figure_and_bad_options_fail_clearly():
    hw = profile_from_dict({"name": "bare", "source": "datasheet", "device_tflops": 100.0, "device_mem_gbps": 1000.0})
    with pytest.raises(ProfileError, match="has no h2d_gbps"):
        predict("tiny-mixtral", "fetch", MIXTRAL, hw, capacity=4)
    with pytest.raises(ValueError, match="unknown placement 'teleport'; known: cpu, fetch"):
        predict("tiny-mixtral", "teleport", MIXTRAL, "h200-sxm-141gb")
    with pytest.raises(ValueError, match="needs a cache capacity"):
        predict("tiny-mixtral", "fetch", MIXTRAL, "h200-sxm-141gb")
    with pytest.raises(ValueError, match=r"capacity must be in \[1, n_experts=8\]"):
        predict("tiny-mixtral", "fetch", MIXTRAL, "h200-sxm-141gb", capacity=9)


def test_predicted_rows_are_tidy_model_rows():
    p = predict("tiny-mixtral", "hybrid", MIXTRAL, "a100-pcie-40gb", placement_options={"n_cpu_layers": 2})
    rows = p.rows(workload="chat")
    table = results.rows_to_table(rows)                  # the store's schema check
    assert table.num_rows == len(rows)
    assert {r["source"] for r in rows} == {"model"} and {r["phase"] for r in rows} == set(PHASES)
    assert all(r["unit"] for r in rows)
    again = results.make_rows(p.factors("chat"), {"device_kind": "cuda"}, "s", "j", None, "decode",
                              p.phases["decode"].metrics(), "model", units={"compute_s": "s", "overhead_s": "s"})
    assert {r["metric"] for r in again} >= {"time_s", "tok_per_s", "h2d_bytes", "d2h_bytes", "tpot_s_p50"}
    decode = {r["metric"]: r["value"] for r in rows if r["phase"] == "decode"}
    assert decode["tok_per_s"] == pytest.approx(decode["tokens"] / decode["time_s"])
    assert rows[0]["fits_device_memory"] is True and rows[0]["cache_capacity"] is None


# --- agreement with the engine: bytes and cache traffic -----------------------------------------
SHAPE = WorkloadShape(context_tokens=40, gen_tokens=6, turn_tokens=5, ubatch=16)


def _run_scenario(eng: Engine) -> dict[str, dict[str, int]]:
    """harness.scenario's phases, by hand: per-phase counter deltas."""
    rng = np.random.default_rng(3)
    ctx = rng.integers(0, 512, SHAPE.context_tokens).tolist()
    turns = [rng.integers(0, 512, SHAPE.turn_tokens).tolist() for _ in range(2)]
    out, sess = {}, eng.new_session(1)

    def phase(name, fn):
        before = eng.counters
        fn()
        out[name] = {k: eng.counters[k] - before[k] for k in before}
    state = {}
    phase("prefill_fresh", lambda: state.update(tok=eng.prefill(sess, [ctx]).argmax(-1).tolist()))

    def decode():
        for _ in range(SHAPE.gen_tokens - 1):
            state["tok"] = eng.decode_step(sess, state["tok"]).argmax(-1).tolist()
    phase("decode", decode)
    phase("prefill_continuation", lambda: state.update(tok=eng.prefill(sess, [[state["tok"][0], *turns[0]]]).argmax(-1).tolist()))
    sess.offload()

    def restored():
        sess.restore()
        eng.prefill(sess, [[state["tok"][0], *turns[1]]])
    phase("prefill_restored", restored)
    return out


def test_phase_layout_matches_the_scenario():
    layout = phase_passes(SHAPE)
    assert [T for T, _ in layout["prefill_fresh"]] == [16, 16, 8]
    assert layout["decode"] == [(1, 40 + i) for i in range(5)]
    assert layout["prefill_continuation"] == [(6, 45)] and layout["prefill_restored"] == [(6, 51)]


def test_activation_and_kv_bytes_equal_the_engines_counters():
    eng = Engine.from_pretrained("tiny-mixtral", placement="cpu", device="cpu", ubatch=SHAPE.ubatch, max_context=256)
    measured = _run_scenario(eng)
    p = predict("tiny-mixtral", "cpu", SHAPE, "rtx4090-pcie4-x16")
    for phase in PHASES:
        assert p.phases[phase].d2h_bytes == measured[phase]["d2h_bytes"], phase
        assert p.phases[phase].h2d_bytes == measured[phase]["h2d_bytes"], phase


@pytest.mark.parametrize("policy, capacity", [("lru", 2), ("lru", 5), ("fifo", 3), ("belady", 3)])
def test_cache_replay_equals_the_engine_on_the_same_routing(policy, capacity):
    ref = Engine.from_pretrained("tiny-mixtral", device="cpu", ubatch=SHAPE.ubatch, max_context=256)
    with TraceRecorder(ref) as rec:
        _run_scenario(ref)
    trace = rec.trace()
    routing = Routing.from_trace(trace)
    spec = PlacementSpec("fetch", capacity=capacity, policy=policy)
    work = scenario_work(preset("tiny-mixtral"), spec, SHAPE, routing)
    options = {}
    if policy == "belady":   # the offline optimum needs the engine's own future lookups
        from engine.trace import lookup_sequences
        options = {"future": lookup_sequences(trace, model_layers=True)}
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=capacity, cache_policy=policy,
                                 policy_options=options, device="cpu", ubatch=SHAPE.ubatch, max_context=256)
    measured = _run_scenario(eng)
    for phase in PHASES:
        assert work[phase].total("hits") == measured[phase]["expert_hits"], phase
        assert work[phase].total("misses") == measured[phase]["expert_misses"], phase
    eb = preset("tiny-mixtral").expert_params * 4
    p = predict("tiny-mixtral", spec, SHAPE, "rtx4090-pcie4-x16", routing=routing)
    assert p.phases["decode"].h2d_bytes == measured["decode"]["h2d_bytes"] == measured["decode"]["expert_misses"] * eb
