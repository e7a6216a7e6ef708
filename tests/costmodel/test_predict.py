"""The time model: what-if orderings across profiles, the link term only where bytes move,
bytes that equal the engine's own counters, cache traffic that equals the engine's cache on
the same routing, attention bytes as engine.layers.attention moves them, rates at the run's
dtype, the issue-ahead pipeline, and predicted rows in the tidy schema with source="model"."""
from __future__ import annotations

import numpy as np
import pytest

from engine import Engine
from engine.placements.fetch import Fetch
from engine.registry import PLACEMENTS
from engine.trace_recorder import TraceRecorder
from harness import results
from harness.costmodel import PlacementSpec, ProfileError, Routing, WorkloadShape, predict
from harness.costmodel.profiles import profile_from_dict
from harness.costmodel.timemodel import pipelined_exposed
from harness.costmodel.passcost import pass_flops, routed_slot_bytes
from harness.costmodel.work import PHASES, PassWork, phase_passes, scenario_work
from engine.config import preset

MIXTRAL = WorkloadShape(context_tokens=1024, gen_tokens=16, turn_tokens=32)



def _fetch_decode(profile: str, **kw):
    return predict("mixtral-8x7b", "fetch", MIXTRAL, profile, capacity=4, dtype="bfloat16", **kw).phases["decode"]


@pytest.mark.slow
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


@pytest.mark.slow
def test_overlap_modes_are_ordered():
    t = {o: _fetch_decode_overlap(o) for o in ("none", "auto", "full", 0.0, 0.5, 1.0)}
    assert t["full"] <= t["auto"] < t["none"] == pytest.approx(t[0.0])   # auto: fetch issues its misses ahead
    assert _fetch_decode_overlap("auto", issue_ahead=False) == pytest.approx(t["none"])
    assert t[1.0] <= t["full"] and t[1.0] <= t[0.5] < t[0.0]   # full hides copies only under compute
    with pytest.raises(ValueError, match="overlap"):
        _fetch_decode_overlap("sometimes")


def _fetch_decode_overlap(overlap, issue_ahead=True):
    return predict("olmoe-1b-7b", "fetch", MIXTRAL, "h100-sxm-80gb", capacity=16, dtype="bfloat16", overlap=overlap,
                   placement_options={"issue_ahead": issue_ahead}).phases["decode"].time_s


def test_pipelined_copies_by_hand():
    # one layer, 3 misses of 1 s each under 3 experts of 0.5 s: copies end at 3, the last expert
    # computes after -> 3.5 s, of which 1.5 s compute: 2 s exposed (max(n*c + e, c + n*e) - n*e)
    assert pipelined_exposed(np.array([3.0]), np.array([1.5]), np.array([3.0]), np.array([3.0]), 2) == 2.0
    # 1 miss among 3 experts: on average 1 hit computes under the copy, 1 after it ->
    # max(1 + 0.5 * 2, 1.5 + max(0, 1 - 0.5)) - 1.5 = 0.5
    assert pipelined_exposed(np.array([1.0]), np.array([1.5]), np.array([1.0]), np.array([3.0]), 2) == 0.5
    # half a miss per pass on average (1 s each) among 2 experts of 0.5 s: half the one-copy case
    # max(1 + 0.5 * 1.5, 1 + max(0, 1 - 0.25)) - 1 = 0.75, times 0.5
    assert pipelined_exposed(np.array([0.5]), np.array([1.0]), np.array([0.5]), np.array([2.0]), 2) == 0.375
    # one slot: every copy waits for the previous expert's compute; layers sum, empty ones add 0
    assert pipelined_exposed(np.array([3.0, 0.0]), np.array([1.5, 1.0]), np.array([3.0, 0.0]),
                             np.array([3.0, 2.0]), 1) == 3.0


@pytest.mark.slow
def test_issue_ahead_is_asked_of_the_placement_traits():
    """The copy schedule comes from `traits.issue_ahead`: fetch's option, or a third-party
    placement's own answer -- never the placement's name."""
    shape = WorkloadShape(context_tokens=256, gen_tokens=9)
    kw = dict(capacity=8, dtype="bfloat16", hit_rate=0.5)
    ahead = predict("qwen3-30b-a3b", "fetch", shape, "h100-pcie-80gb", **kw).phases["decode"]
    waits = predict("qwen3-30b-a3b", "fetch", shape, "h100-pcie-80gb", placement_options={"issue_ahead": False},
                    **kw).phases["decode"]
    assert ahead.copy_busy_s == pytest.approx(waits.copy_busy_s) and waits.copy_busy_s > 0
    assert waits.exposed_copy_s == pytest.approx(waits.copy_busy_s)          # copy, wait, compute: nothing hides
    assert 0 < ahead.exposed_copy_s < waits.exposed_copy_s

    class SerialFetch(Fetch):                  # a plugin that never queues ahead, whatever its options
        name = "serial_fetch"

        @classmethod
        def traits(cls, cfg, options):
            from dataclasses import replace
            return replace(super().traits(cfg, options), issue_ahead=False)
    PLACEMENTS.register("serial_fetch", SerialFetch)
    try:
        serial = predict("qwen3-30b-a3b", "serial_fetch", shape, "h100-pcie-80gb", **kw).phases["decode"]
    finally:
        PLACEMENTS._targets.pop("serial_fetch", None)
        PLACEMENTS._loaded.pop("serial_fetch", None)
    assert serial.exposed_copy_s == pytest.approx(waits.exposed_copy_s)


# --- attention bytes and the run's dtype -------------------------------------------------------
def test_attention_bytes_read_kv_once_at_kv_heads():
    """engine.layers.attention hands SDPA the cache's K/V at K heads (enable_gqa): no repeated
    copy at H heads. Mixtral-8x7B decode at 32K context, one token: per layer K/V
    2 x 8 heads x 128 x 32768 positions, plus q and the output 2 x 32 x 128, in bf16."""
    cfg = preset("mixtral-8x7b")
    S = 32768
    p = PassWork("decode", 1, 1, S - 1, np.full(32, 2.0), np.zeros(32), np.zeros(32), np.zeros(32),
                 np.zeros(32, dtype=bool))
    f = pass_flops(cfg, p, 2)
    assert f.attn_bytes == 32 * (2 * 8 * 128 * S + 2 * 32 * 128) * 2 == 4_295_491_584


@pytest.mark.slow
def test_mixtral_32k_decode_on_h100_is_bound_by_weights_and_kv_read_once():
    """Resident Mixtral-8x7B, bf16, 32K context, on the H100 SXM profile (3350 GB/s, 989.4
    TFLOP/s): decode is bandwidth-bound, so time per token = bytes / 3350e9, by hand:
      experts   32 layers x 2 experts x 3 x 4096 x 14336 x 2 B        = 22,548,578,304 B
      dense     32 x (2 x 4096^2 + 2 x 4096 x 1024) x 2 B (q,k,v,o)   =  2,684,354,560
                + 32 x 8 x 4096 x 2 (router) + 32000 x 4096 x 2 (lm_head) =    264,241,152
                + (32 x 2 + 1) x 4096 x 2 (the layers' and the final norm) =        532,480
                + activations 32 x 6 x 4096 x 2                       =      1,572,864
      attention 32 x (2 x 8 x 128 x S + 2 x 32 x 128) x 2, S ~ 32.8K  ~  4,297,000,000
    ~ 29.8e9 B / 3350e9 B/s ~ 8.9 ms -> ~112 tok/s (the repeated-K/V arithmetic gave 52)."""
    shape = WorkloadShape(context_tokens=32768, gen_tokens=64)
    d = predict("mixtral-8x7b", "resident", shape, "h100-sxm-80gb", dtype="bfloat16").phases["decode"]
    experts = 32 * 2 * 3 * 4096 * 14336 * 2
    dense = 32 * (2 * 4096 ** 2 + 2 * 4096 * 1024) * 2 + 32 * 8 * 4096 * 2 + 32000 * 4096 * 2 + 32 * 6 * 4096 * 2 \
        + (32 * 2 + 1) * 4096 * 2
    kv = sum(32 * (2 * 8 * 128 * (32768 + i + 1) + 2 * 32 * 128) * 2 for i in range(63))
    by_hand = (63 * (experts + dense) + kv) / 3350e9
    assert d.time_s == pytest.approx(by_hand, rel=1e-9)
    assert d.tok_per_s == pytest.approx(112.4, abs=0.1)


def _rates_profile(**rates):
    return profile_from_dict({"name": "r", "source": "datasheet", "h2d_gbps": 10.0, "d2h_gbps": 10.0,
                              "device_mem_gbps": 1e9, "cpu_mem_gbps": 1e9, "dtype": "float32",
                              "device_tflops": 1.0, "cpu_gflops": 10.0, "dtype_rates": rates})


def test_compute_uses_the_rate_of_the_runs_dtype():
    hw = _rates_profile(bfloat16={"device_tflops": 4.0, "cpu_gflops": 40.0})
    shape = WorkloadShape(context_tokens=512, gen_tokens=2)
    for placement in ("resident", "cpu"):
        fp32 = predict("tiny-mixtral", placement, shape, hw, dtype="float32").phases["prefill_fresh"]
        bf16 = predict("tiny-mixtral", placement, shape, hw, dtype="bfloat16").phases["prefill_fresh"]
        assert fp32.compute_s == pytest.approx(4 * bf16.compute_s)        # bandwidth is ample: FLOP-bound
    # no figure for the dtype: refused, naming the figure, the dtype and what the profile has
    with pytest.raises(ProfileError, match=r"no device_tflops for float16 \(device_tflops is given for "
                                           r"bfloat16 \(4\), float32 \(1\)\)"):
        predict("tiny-mixtral", "resident", shape, hw, dtype="float16")
    gpu_only = _rates_profile(bfloat16={"device_tflops": 4.0})
    predict("tiny-mixtral", "fetch", shape, gpu_only, capacity=2, dtype="bfloat16")   # no CPU work: no CPU rate needed
    with pytest.raises(ProfileError, match="no cpu_gflops for bfloat16.*placement=hybrid needs it"):
        predict("tiny-mixtral", "hybrid", shape, gpu_only, dtype="bfloat16")
    # a profile whose dtype is not named: its plain figures are for no dtype in particular
    hw = profile_from_dict({"name": "x", "source": "datasheet", "h2d_gbps": 1.0, "device_mem_gbps": 1.0,
                            "device_tflops": 1.0})
    with pytest.raises(ProfileError, match=r"no device_tflops for float32 \(device_tflops is given for an unnamed dtype"):
        predict("tiny-mixtral", "resident", shape, hw)


def test_weight_reads_use_the_gemv_rate_of_the_dtype():
    """Expert weights on the CPU read at the CPU GEMV rate of the run's dtype where the profile
    has one (this machine: bf16 GEMV ~2.5x slower than fp32), else at the memory bandwidth."""
    shape = WorkloadShape(context_tokens=64, gen_tokens=9)
    raw = {"name": "g", "source": "measured", "h2d_gbps": 10.0, "d2h_gbps": 10.0, "device_mem_gbps": 100.0,
           "cpu_mem_gbps": 100.0, "dtype": "bfloat16", "device_tflops": 1e6, "cpu_gflops": 1e6}
    cfg = preset("tiny-mixtral")
    eb = cfg.expert_params * 2
    plain = predict(cfg, "cpu", shape, profile_from_dict(raw), dtype="bfloat16").phases["decode"]
    gemv = profile_from_dict({**raw, "dtype_rates": {"bfloat16": {"cpu_gemv_gbps": 2.0}, "float32": {"cpu_gemv_gbps": 50.0}}})
    slow = predict(cfg, "cpu", shape, gemv, dtype="bfloat16").phases["decode"]
    # 8 decode steps x 4 layers x 2 experts, each read once, at 2 GB/s instead of 100
    assert slow.compute_s - plain.compute_s == pytest.approx(8 * 4 * 2 * eb * (1 / 2e9 - 1 / 100e9), rel=1e-9)
    dev = profile_from_dict({**raw, "dtype_rates": {"bfloat16": {"device_gemv_gbps": 2.0}}})
    resident = predict(cfg, "resident", shape, dev, dtype="bfloat16").phases["decode"]
    assert resident.compute_s > 8 * 4 * 2 * eb / 2e9          # the device's weight reads too


def test_compute_scale_scales_the_flop_side_of_the_roof_only():
    """A fitted compute_scale is the engine's FLOP efficiency at small matmuls; a weight-read-
    bound matmul already runs at the achieved (GEMV) rate, so it is not scaled."""
    from harness.costmodel import Overheads
    hw = _rates_profile()                                   # 1 TFLOP/s, ample bandwidth: all FLOP-bound
    shape = WorkloadShape(context_tokens=512, gen_tokens=9)
    one = predict("tiny-mixtral", "resident", shape, hw).phases
    three = predict("tiny-mixtral", "resident", shape, hw, overheads=Overheads(compute_scale=3.0)).phases
    assert three["prefill_fresh"].compute_s == pytest.approx(3 * one["prefill_fresh"].compute_s)
    slow = hw.replace(dtype_rates={"float32": {"device_gemv_gbps": 1e-3}})     # every weight read bound by 1 MB/s
    a = predict("tiny-mixtral", "resident", shape, slow).phases["decode"]
    b = predict("tiny-mixtral", "resident", shape, slow, overheads=Overheads(compute_scale=3.0)).phases["decode"]
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-6)     # attention (KV, ample bandwidth) is ~1e-6 of it


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
    with pytest.raises(ValueError, match=r"capacity must be in \[top_k=2, n_experts=8\]"):
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


@pytest.mark.parametrize("model, dtype", [("tiny-mixtral", "float32"), ("tiny-mixtral", "bfloat16"),
                                          ("tiny-gpt-oss", "bfloat16"), ("tiny-deepseek", "bfloat16"),
                                          ("tiny-gemma4", "bfloat16"), ("tiny-qwen3-next", "bfloat16")])
def test_activation_and_kv_bytes_equal_the_engines_counters(model, dtype):
    """A CPU layer ships each row's activations and its routed slots: an int64 id and a weight that
    Mixtral's, DeepSeek's and Gemma 4's routers keep in fp32, GPT-OSS's and Qwen3-Next's return in
    the activation dtype."""
    eng = Engine.from_pretrained(model, placement="cpu", device="cpu", dtype=dtype, ubatch=SHAPE.ubatch,
                                 max_context=256)
    measured = _run_scenario(eng)
    p = predict(model, "cpu", SHAPE, "rtx4090-pcie4-x16", dtype=dtype)
    for phase in PHASES:
        assert p.phases[phase].d2h_bytes == measured[phase]["d2h_bytes"], phase
        assert p.phases[phase].h2d_bytes == measured[phase]["h2d_bytes"], phase


def test_a_routed_slot_costs_what_its_router_returns():
    """The bytes are the router's, not a family name's: at bf16 Mixtral's fp32 weights make a slot
    8 + 4 bytes, GPT-OSS's bf16 ones 8 + 2; in fp32 both are 8 + 4."""
    assert set(routed_slot_bytes(preset("tiny-mixtral"), 2)) == {12}
    assert set(routed_slot_bytes(preset("tiny-gpt-oss"), 2)) == {10}
    assert set(routed_slot_bytes(preset("tiny-gpt-oss"), 4)) == {12}


@pytest.mark.parametrize("policy, capacity", [("lru", 2), ("lru", 5), ("fifo", 3), ("belady", 3)])
@pytest.mark.slow
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


def test_first_n_against_last_n_follows_the_layers_working_sets():
    """A trace whose first MoE layer spreads a prefill over all 8 experts and whose last uses 2:
    the CPU reads each distinct expert once per pass, so putting the last layer on the CPU
    (last_n) predicts a faster prefill than the first (first_n); a decode token routes to top-k
    experts in either layer, so decode predicts the same."""
    from engine.trace import RoutingTrace
    cfg = preset("tiny-mixtral")
    N, L, k, E = 256, cfg.n_moe_layers, cfg.top_k, cfg.n_experts
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(N * L)]).reshape(N, L, k)
    experts[:, -1, :] = rng.permutation(2)[None, :].repeat(N, axis=0)     # the last layer: experts 0 and 1
    trace = RoutingTrace(experts.astype(np.int32), {"n_experts": E, "expert_bytes": cfg.expert_bytes(4)},
                         step=np.zeros(N, dtype=np.int32), sequence=np.zeros(N, dtype=np.int32))
    shape = WorkloadShape(context_tokens=128, gen_tokens=8, turn_tokens=16)
    got = {which: predict(cfg, "hybrid", shape, "rtx4090-pcie4-x16", placement_options={
        "n_cpu_layers": 1, "cpu_layers": which}, routing=Routing.from_trace(trace)) for which in ("first_n", "last_n")}
    first, last = (got[w].phases["prefill_fresh"] for w in ("first_n", "last_n"))
    cpu = lambda p: p.spent_s["host RAM bandwidth"] + p.spent_s["CPU compute"]     # noqa: E731
    assert cpu(last) < cpu(first) and first.spent_s["host RAM bandwidth"] > 0
    assert last.time_s < first.time_s
    assert got["last_n"].phases["decode"].time_s == pytest.approx(got["first_n"].phases["decode"].time_s, rel=0.05)
