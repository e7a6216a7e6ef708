"""Quantised experts (the lossy `expert_quant` treatments): the quantisers against slow per-element
references, the packed layouts' sizes by hand, byte-exact cache accounting when experts differ in
size, the planner's stored bytes per treatment, and the invariant *within* a treatment: every
placement and capacity gives resident int4's (and mixed's) tokens and logits."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import Engine
from engine.blocks.clamped_experts import ClampedSwiGLUExperts
from engine.blocks.experts import ExpertLayout, SwiGLUExperts
from engine.blocks.intquant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, unpack_int4
from engine.blocks.quant_experts import ExpertQuant, MixedExperts, QuantExperts, resolve_expert_quant
from engine.cache import ExpertCache, ExpertStore
from engine.config import preset
from engine.counters import Counters
from engine.devices import Device
from engine.planner import plan_memory
from engine.policies import make_policy
from harness.measure import rates
from tests.engine.test_invariant import scenario

TOL = 1e-5
MODEL = "tiny-mixtral"            # 4 MoE layers, 8 experts of D=64, I=128, top-2
D, I = 64, 128


# --- the quantisers against slow references ----------------------------------------------------------
def slow_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per element, in float32: (q, scale, dequantised)."""
    R, C = w.shape
    q, scale, deq = np.zeros((R, C), np.int8), np.zeros(R, np.float32), np.zeros((R, C), np.float32)
    for r in range(R):
        amax = max(abs(np.float32(v)) for v in w[r])
        s = np.float32(amax) / np.float32(127) if amax > 0 else np.float32(1)
        scale[r] = s
        for c in range(C):
            v = np.round(np.float32(w[r, c]) / s)
            q[r, c] = int(min(max(v, -127), 127))
            deq[r, c] = np.float32(q[r, c]) * s
    return q, scale, deq


def slow_int4(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per group and element, in float32: (q unpacked [R, C], scale [R, G], zero [R, G], dequantised)."""
    R, C = w.shape
    q = np.zeros((R, C), np.uint8)
    scale, zero = np.zeros((R, C // g), np.float32), np.zeros((R, C // g), np.uint8)
    deq = np.zeros((R, C), np.float32)
    for r in range(R):
        for j in range(C // g):
            vals = [np.float32(v) for v in w[r, j * g:(j + 1) * g]]
            lo, hi = min(min(vals), np.float32(0)), max(max(vals), np.float32(0))
            s = (np.float32(hi) - np.float32(lo)) / np.float32(15)
            s = s if s > 0 else np.float32(1)
            z = int(min(max(np.round(-np.float32(lo) / s), 0), 15))
            scale[r, j], zero[r, j] = s, z
            for i, v in enumerate(vals):
                qi = int(min(max(np.round(v / s) + z, 0), 15))
                q[r, j * g + i] = qi
                deq[r, j * g + i] = (np.float32(qi) - np.float32(z)) * s
    return q, scale, zero, deq


def weights(R: int, C: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(R, C, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[1] = 0.0                                     # an all-zero row: scale 1, exact zeros back
    w[2, :8] = 0.05                                # a constant group, all positive
    return w


def test_int8_matches_the_slow_reference():
    w = weights(6, 40)
    q, scale = quantize_int8(w)
    sq, ss, sdeq = slow_int8(w.numpy())
    assert q.dtype == torch.int8 and np.array_equal(q.numpy(), sq)
    assert np.array_equal(scale.numpy(), ss)
    deq = dequantize_int8(q, scale)
    assert np.array_equal(deq.numpy(), sdeq)
    assert torch.all((deq - w).abs() <= scale[:, None] / 2 + 1e-9)    # round to nearest
    assert torch.equal(deq[1], torch.zeros(40))


@pytest.mark.parametrize("group", [8, 16])
def test_int4_matches_the_slow_reference(group):
    w = weights(5, 32)
    q, scale, zero = quantize_int4(w, group)
    sq, ss, sz, sdeq = slow_int4(w.numpy(), group)
    assert q.shape == (5, 16) and q.dtype == torch.uint8
    assert np.array_equal(unpack_int4(q).numpy(), sq)
    assert np.array_equal((q & 0x0F).numpy(), sq[:, 0::2]), "the first value of a pair is the low nibble"
    assert np.array_equal(scale.numpy(), ss) and np.array_equal(zero.numpy(), sz)
    deq = dequantize_int4(q, scale, zero, group)
    assert np.array_equal(deq.numpy(), sdeq)
    # 0 inside every group's range; the integer zero point can move the ends by up to one step
    step = scale.repeat_interleave(group, dim=1)
    assert torch.all((deq - w).abs() <= step * 1.0001)
    assert torch.equal(deq[1], torch.zeros(32))


def test_int4_groups_must_divide_the_input_dim():
    with pytest.raises(ValueError, match="experts.group_size=24"):
        quantize_int4(torch.zeros(2, 32), 24)
    with pytest.raises(ValueError, match="even number"):
        quantize_int4(torch.zeros(2, 33), 3)


# --- layouts: sizes by hand, pack / unpack ------------------------------------------------------------------
def test_stored_bytes_by_hand():
    base = SwiGLUExperts(D, I, "silu", "model.layers.{layer}.block_sparse_moe")
    assert base.nbytes(4) == 3 * D * I * 4 == 98304
    int8 = QuantExperts(base, "int8")
    assert int8.nbytes(4) == int8.nbytes(2) == 3 * D * I + 4 * (2 * I + D) == 25856      # values + a scale per row
    int4 = QuantExperts(base, "int4", 32)
    scales = 2 * I * (D // 32) + D * (I // 32)                                             # 768 groups
    assert int4.nbytes(4) == 3 * D * I // 2 + 4 * scales + scales == 16128                # nibbles, fp32 scales, u8 zeros
    assert QuantExperts(base, "int4", 16).nbytes(2) == 12288 + 5 * 2 * 768
    assert int8.params == int4.params == base.params == 3 * D * I                        # FLOPs stay the model's


def test_pack_keeps_biases_and_dequantises_within_a_step():
    base = ClampedSwiGLUExperts(32, 16)
    dense = torch.randn(base.numel, generator=torch.Generator().manual_seed(1)) * 0.02
    for layout in (QuantExperts(base, "int8"), QuantExperts(base, "int4", 16)):
        out = torch.empty(layout.numel, dtype=torch.uint8)
        layout.pack(dense, out)
        back = layout.unpack(out, torch.float32)
        w = 3 * 32 * 16
        assert torch.equal(back[w:], dense[w:]), "biases are kept exactly (fp32)"
        assert 0 < float((back[:w] - dense[:w]).abs().max()) < 0.01
        assert layout.numel % 16 == 0


def test_mxfp4_experts_refuse_a_second_quantisation():
    cfg = preset("tiny-gpt-oss")
    assert cfg.expert_format == "mxfp4"
    with pytest.raises(ValueError, match="quantised already.*allowed with mxfp4: experts.quant=none"):
        Engine.from_pretrained("tiny-gpt-oss", device="cpu", expert_quant="int4")


def test_bad_treatments_name_the_allowed_values(tmp_path):
    cfg = preset(MODEL)
    with pytest.raises(ValueError, match=r"experts.quant must be one of \['none', 'int8', 'int4', 'mixed'\], got 'int3'"):
        resolve_expert_quant(cfg, "int3")
    with pytest.raises(ValueError, match="needs experts.popularity=FILE"):
        resolve_expert_quant(cfg, "mixed")
    with pytest.raises(ValueError, match="applies to experts.quant=mixed only"):
        resolve_expert_quant(cfg, "int4", mixed_count=2)
    table = tmp_path / "pop.json"
    table.write_text(json.dumps([[1] * 8] * 4))
    with pytest.raises(ValueError, match=r"mixed_count must be an int in \[0, n_experts=8\], got 9"):
        resolve_expert_quant(cfg, "mixed", popularity=str(table), mixed_count=9)
    with pytest.raises(ValueError, match="not both"):
        resolve_expert_quant(cfg, "mixed", popularity=str(table), mixed_count=2, mixed_fraction=0.5)


def popularity_file(tmp_path) -> str:
    """Layer i's counts rise with the expert id, except layer 0 where expert 0 is the most popular."""
    rows = [[8, 1, 2, 3, 4, 5, 6, 7]] + [[float(e) for e in range(8)]] * 3
    path = tmp_path / "pop.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_mixed_keeps_the_most_popular_experts_in_int8(tmp_path):
    cfg = preset(MODEL)
    spec = resolve_expert_quant(cfg, "mixed", popularity=popularity_file(tmp_path), mixed_count=3)
    assert spec.high_of(0) == {0, 6, 7} and spec.high_of(1) == {5, 6, 7}
    assert resolve_expert_quant(cfg, "mixed", popularity=popularity_file(tmp_path), mixed_fraction=0.25).high_of(2) \
        == {6, 7}                                                                         # round(0.25 * 8) = 2
    layout = cfg.replace(expert_quant=spec).architecture().experts
    assert isinstance(layout, MixedExperts)
    assert layout.expert_numel(0, 0) == 25856 and layout.expert_numel(0, 1) == 16128
    assert layout.nbytes(4) == 25856                                                      # a slot holds the larger
    assert layout.mean_nbytes(4, 8, cfg.moe_layers) == (3 * 25856 + 5 * 16128) / 8


# --- cache accounting with experts of different sizes ---------------------------------------------------------
class SizedExperts(ExpertLayout):
    """Three uint8 experts of 16, 32 and 48 bytes (the cache only asks sizes)."""
    sizes = (16, 32, 48)
    numel = 48

    def storage_dtype(self, dtype):
        return torch.uint8

    def expert_numel(self, layer, e):
        return self.sizes[e]

    read_into = hub_tensors = run = activation_bytes = None


def test_byte_hit_rate_by_hand_with_mixed_expert_sizes():
    store = ExpertStore(3, 48, torch.uint8, SizedExperts())
    dev = Device("cpu")
    rows = store.allocate(0, dev, on_device=False)
    rows.copy_(torch.arange(3, dtype=torch.uint8)[:, None] + 1)
    counters = Counters(1)
    cache = ExpertCache(store, dev, counters, 2, [0], lambda layer: make_policy("lru", 2, 3, layer))
    # LRU, 2 slots: 0 miss, 1 miss, 0 hit, 2 miss (evicts 1), 1 miss (evicts 0), 0 miss (evicts 2)
    for e in [0, 1, 0, 2, 1, 0]:
        w = cache.acquire(0, e)
        assert w.numel() == SizedExperts.sizes[e] and torch.all(w == e + 1)
        cache.release(0, e)
    t = counters.totals()
    assert (t["expert_hits"], t["expert_misses"]) == (1, 5)
    assert t["expert_hit_bytes"] == 16
    assert t["expert_miss_bytes"] == t["h2d_expert_bytes"] == t["h2d_bytes"] == 16 + 32 + 48 + 32 + 16
    r = rates(t)
    assert r["hit_rate"] == pytest.approx(1 / 6)
    assert r["byte_hit_rate"] == pytest.approx(16 / 160)


def test_engine_counts_stored_bytes_of_a_quantised_expert():
    eng = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=2, expert_quant="int4")
    eng.generate([[1, 2, 3, 4, 5, 6]], 4)
    c = eng.counters
    assert c["expert_misses"] > 0
    assert c["expert_miss_bytes"] == c["h2d_expert_bytes"] == c["expert_misses"] * 16128
    assert c["expert_hit_bytes"] == c["expert_hits"] * 16128
    assert eng.options["expert_quant"] == "int4"


# --- the planner: stored bytes for every treatment ------------------------------------------------------------
def test_planner_bytes_per_treatment_by_hand(tmp_path):
    cfg = preset(MODEL)
    mixed = resolve_expert_quant(cfg, "mixed", popularity=popularity_file(tmp_path), mixed_count=2)
    want = {None: 98304, ExpertQuant("int8"): 25856, ExpertQuant("int4", 32): 16128, mixed: 25856}
    for spec, per_expert in want.items():
        plan = plan_memory(cfg.replace(expert_quant=spec), "resident", None, None, 64, 1, 64, 4, device_kind="cpu")
        assert plan.expert_bytes == per_expert
        assert plan.experts == 4 * 8 * per_expert                     # 4 MoE layers x 8 experts resident
        fetch = plan_memory(cfg.replace(expert_quant=spec), "fetch", 3, None, 64, 1, 64, 4, device_kind="cpu")
        assert fetch.experts == 4 * 3 * per_expert


def test_auto_capacity_is_larger_with_int4():
    cfg = preset(MODEL)
    exact = plan_memory(cfg, "fetch", "auto", None, 64, 1, 64, 4, device_kind="cpu")
    fixed = exact.total - exact.experts
    budget = int((fixed + 4 * 3 * 98304) / 0.95) + 1                  # room for 3 exact slots per layer
    caps = {q: plan_memory(cfg.replace(expert_quant=q), "fetch", "auto", budget, 64, 1, 64, 4, device_kind="cpu").capacity
            for q in (None, ExpertQuant("int8"), ExpertQuant("int4", 32))}
    assert caps[None] == 3
    assert caps[None] < caps[ExpertQuant("int8")] <= caps[ExpertQuant("int4", 32)]
    assert caps[ExpertQuant("int4", 32)] == 8


def test_capacity_in_bytes():
    cfg = preset(MODEL)
    int4 = cfg.replace(expert_quant=ExpertQuant("int4", 32))
    plan = plan_memory(int4, "fetch", None, None, 64, 1, 64, 4, device_kind="cpu", capacity_bytes=4 * 5 * 16128 + 100)
    assert plan.capacity == 5
    three_exact = 4 * 3 * 98304 + 100
    assert plan_memory(cfg, "fetch", None, None, 64, 1, 64, 4, device_kind="cpu", capacity_bytes=three_exact).capacity == 3
    assert plan_memory(int4, "fetch", None, None, 64, 1, 64, 4, device_kind="cpu",
                       capacity_bytes=three_exact).capacity == 8                  # 18 int4 slots fit, 8 experts exist
    with pytest.raises(ValueError, match="not both"):
        plan_memory(cfg, "fetch", 4, None, 64, 1, 64, 4, device_kind="cpu", capacity_bytes=1 << 20)
    with pytest.raises(ValueError, match="fewer than top_k=2"):
        plan_memory(cfg, "fetch", None, None, 64, 1, 64, 4, device_kind="cpu", capacity_bytes=4 * 98304)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity_bytes="256KiB",
                                 expert_quant="int4")
    assert eng.plan.capacity == (256 << 10) // (4 * 16128) == 4


# --- the invariant within a treatment ---------------------------------------------------------------------------
PLACEMENTS = [
    ("fetch", {"cache_capacity": 2}),
    ("fetch", {"cache_capacity": 5, "cache_policy": "lfu"}),
    ("fetch", {"cache_capacity": 8, "issue_ahead": False}),
    ("cpu", {}),
    ("hybrid", {"n_cpu_layers": 2}),
    ("stream", {"stream_threshold": 8, "cache_capacity": 2}),
]
_RESIDENT: dict = {}


def resident(quant: str, options: dict) -> tuple:
    key = (quant, json.dumps(options, sort_keys=True))
    if key not in _RESIDENT:
        _RESIDENT[key] = scenario(Engine.from_pretrained(MODEL, device="cpu", expert_quant=quant,
                                                         quant_options=options), 1)
    return _RESIDENT[key]


@pytest.mark.parametrize("placement,options", PLACEMENTS, ids=lambda v: v if isinstance(v, str) else repr(v))
def test_int4_every_placement_gives_resident_int4(placement, options):
    toks, logits = resident("int4", {})
    eng = Engine.from_pretrained(MODEL, device="cpu", placement=placement, expert_quant="int4", **options)
    t, l = scenario(eng, 1)
    assert t == toks
    assert max(float((a - b).abs().max()) for a, b in zip(l, logits)) <= TOL


def test_int4_is_a_different_treatment_from_exact():
    """So the invariant above is not exact-vs-exact: int4's logits move, int8's less."""
    exact = scenario(Engine.from_pretrained(MODEL, device="cpu"), 1)[1]
    diff = {q: max(float((a - b).abs().max()) for a, b in zip(resident(q, {})[1], exact)) for q in ("int8", "int4")}
    assert 0 < diff["int8"] < diff["int4"]


@pytest.mark.parametrize("placement,options", PLACEMENTS[:2] + PLACEMENTS[3:4] + PLACEMENTS[5:],
                         ids=lambda v: v if isinstance(v, str) else repr(v))
def test_mixed_every_placement_gives_resident_mixed(tmp_path, placement, options):
    q = {"popularity": popularity_file(tmp_path), "mixed_count": 3}
    toks, logits = resident("mixed", q)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement=placement, expert_quant="mixed", quant_options=q,
                                 **options)
    t, l = scenario(eng, 1)
    assert t == toks
    assert max(float((a - b).abs().max()) for a, b in zip(l, logits)) <= TOL
    if eng.placement.cache is not None:
        c = eng.counters
        n8 = c["expert_miss_bytes"] - c["expert_misses"] * 16128        # misses beyond int4 size are int8 experts
        assert n8 > 0 and n8 % (25856 - 16128) == 0


def test_mixed_from_a_recorded_routing_trace(tmp_path):
    from engine.trace import expert_counts, save_trace
    from engine.trace_recorder import TraceRecorder
    eng = Engine.from_pretrained(MODEL, device="cpu")
    rec = TraceRecorder(eng)
    eng.generate([[3, 1, 4, 1, 5, 9, 2, 6]], 6)
    path = save_trace(tmp_path / "routing.npz", rec.trace())
    counts = expert_counts(rec.trace())                                        # [layers, experts]
    spec = resolve_expert_quant(preset(MODEL), "mixed", trace=str(path), mixed_count=2)
    for i, layer in enumerate(preset(MODEL).moe_layers):
        top = sorted(range(8), key=lambda e: (-counts[i][e], e))[:2]
        assert spec.high_of(layer) == set(top)


def test_an_engine_with_quantised_experts_says_it_is_lossy():
    from engine import Engine
    assert not Engine.from_pretrained("tiny-mixtral", device="cpu").lossy
    for mode in ("int8", "int4"):
        assert Engine.from_pretrained("tiny-mixtral", device="cpu", expert_quant=mode).lossy, mode
