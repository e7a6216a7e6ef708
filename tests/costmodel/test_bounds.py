"""The cost model at long contexts: the routing a prediction draws and replays is bounded (the same
at 32k as at 128k, a long prompt's passes between its routed ones carrying their mean counts), and
each phase's time is split over the resources that bound it (RESOURCES), the largest named."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import preset
from engine.trace import RoutingTrace
from harness.costmodel import Overheads, PlacementSpec, Routing, WorkloadShape, predict
from harness.costmodel.timemodel import RESOURCES
from harness.costmodel.work import SAMPLE_LAYERS, SAMPLE_ROWS, routed_passes, scenario_work


def test_a_long_phase_routes_its_first_passes_and_its_last():
    assert routed_passes([512] * 256) == [0, 1, 2, 255]              # 2048 rows: cold, two steady, the last
    assert routed_passes([16, 16, 8]) == [0, 1, 2]                   # three passes: all of them
    assert routed_passes([1] * 800) == list(range(800))              # within SAMPLE_ROWS: all of them
    assert routed_passes([1] * 4096) == [*range(SAMPLE_ROWS - 1), 4095]
    assert routed_passes([4096] * 32) == [0, 1, 31]                  # a pass beyond the bound: still a steady one


def test_the_routing_replayed_does_not_grow_with_the_context():
    """Fetch on a 48-layer, 128-expert model: decode replays the same sample at 32k and at 128k, and
    the prompt's passes between the routed ones carry the routed steady passes' mean."""
    cfg = preset("qwen3-30b-a3b")
    spec = PlacementSpec("fetch", capacity=16)
    short, long = (scenario_work(cfg, spec, WorkloadShape(n, gen_tokens=32)) for n in (32768, 131072))
    for phase in ("decode", "prefill_continuation", "prefill_restored"):
        assert short[phase].total("hits") == long[phase].total("hits"), phase
        assert short[phase].total("misses") == long[phase].total("misses"), phase
    prefill = long["prefill_fresh"].passes
    assert len(prefill) == 256 and prefill[-1].past == 131072 - 512
    steady = (prefill[1].misses + prefill[2].misses) / 2
    assert all(p.misses == pytest.approx(steady) for p in prefill[3:-1])
    lookups = [p.hits + p.misses for p in prefill]
    assert all(lk == pytest.approx(p.unique) for lk, p in zip(lookups, prefill))     # a lookup per invoked expert


def test_synthetic_routing_draws_a_few_layers_and_a_trace_all_of_its():
    cfg = preset("mixtral-8x7b")
    M, k = cfg.n_moe_layers, cfg.top_k
    assert Routing.synthetic().routed_layers(cfg) == SAMPLE_LAYERS < M
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(8)[:k] for _ in range(10 * M)]).reshape(10, M, k).astype(np.int32)
    trace = Routing.from_trace(RoutingTrace(experts=experts, meta={"n_experts": 8, "expert_bytes": 1}))
    assert trace.routed_layers(cfg) == M
    # every layer's decode lookups are its k experts per token, whichever layer was routed
    work = scenario_work(cfg, PlacementSpec("fetch", capacity=4), WorkloadShape(64, gen_tokens=17))
    assert work["decode"].total("hits") + work["decode"].total("misses") == 16 * M * k
    # a prompt pass of 512 (and the last, of 312) tokens invokes all 8 experts of every layer
    resident = scenario_work(cfg, PlacementSpec("resident"), WorkloadShape(32768 - 200))
    assert len(resident["prefill_fresh"].passes) == 64
    assert resident["prefill_fresh"].total("unique") == 64 * M * 8


def _bound(model, placement, shape, profile, phase, **kw):
    est = predict(model, placement, shape, profile, dtype="bfloat16", **kw).phases[phase]
    assert set(est.spent_s) == set(RESOURCES)
    assert sum(est.spent_s.values()) == pytest.approx(est.time_s, rel=1e-9)
    return est.bound


@pytest.mark.parametrize("placement, phase, ubatch, kw, bound", [
    ("resident", "decode", 512, {}, "device memory bandwidth"),       # weights and KV read once per token
    # 512 rows give an expert ~128 (2 of 8 experts each): 128 FLOP per weight byte, below the H100's
    # 378 (756 TFLOP/s / 2 TB/s); 4096 rows give it ~1024
    ("resident", "prefill_fresh", 512, {}, "device memory bandwidth"),
    ("resident", "prefill_fresh", 4096, {}, "device compute"),
    ("cpu", "decode", 512, {}, "host RAM bandwidth"),                 # CPU experts read from RAM
    ("cpu", "prefill_fresh", 512, {}, "CPU compute"),
    ("fetch", "decode", 512, {"capacity": 2, "hit_rate": 0.0}, "link"),   # every expert crosses PCIe
    ("resident", "decode", 512, {"overheads": Overheads(pass_s=1.0)}, "software overhead"),
])
def test_each_phase_names_what_bounds_it(placement, phase, ubatch, kw, bound):
    shape = WorkloadShape(8192, gen_tokens=8, ubatch=ubatch)
    assert _bound("mixtral-8x7b", placement, shape, "h100-pcie-80gb", phase, **kw) == bound
