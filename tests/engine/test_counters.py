"""Counters are exact: the device cache's hits, misses and bytes equal hand-computed values
for known reference strings, the engine's counters equal an independent replay of the
lookups it made (with the step-protection rule), and link bytes split by purpose add up
to the totals for every placement."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.cache import ExpertCache, ExpertStore
from engine.counters import Counters
from engine.devices import Device
from engine.policies import make_policy
from engine.policies.simulate import simulate

# Silberschatz, Operating System Concepts: 20 references, 3 frames.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
FAULTS_3_FRAMES = {"fifo": 15, "lru": 12, "belady": 9}


def drive_cache(policy: str, refs: list[int], capacity: int, **options) -> tuple[Counters, int]:
    """Run a reference string through the real ExpertCache (one layer, emulated device)."""
    n_experts, numel = 8, 10
    store = ExpertStore(n_experts, numel, torch.float32)
    dev = Device("cpu")
    rows = store.allocate(0, dev, on_device=False)
    rows.copy_(torch.arange(n_experts, dtype=torch.float32)[:, None].expand(n_experts, numel))
    counters = Counters(1)
    cache = ExpertCache(store, dev, counters, capacity, [0],
                        lambda layer: make_policy(policy, capacity, n_experts, layer, **options))
    for e in refs:
        w = cache.acquire(0, e)
        assert torch.equal(w, rows[e])           # the slot really holds expert e's bytes
        cache.release(0, e)
    return counters, store.expert_bytes


@pytest.mark.parametrize("policy,faults", sorted(FAULTS_3_FRAMES.items()))
def test_textbook_reference_string(policy, faults):
    options = {"future": TEXTBOOK} if policy == "belady" else {}
    c, eb = drive_cache(policy, TEXTBOOK, 3, **options)
    t = c.totals()
    assert eb == 40
    assert t["expert_misses"] == faults
    assert t["expert_hits"] == len(TEXTBOOK) - faults
    assert t["expert_miss_bytes"] == faults * 40 and t["expert_hit_bytes"] == (20 - faults) * 40
    assert t["h2d_bytes"] == faults * 40         # one copy per miss, nothing else
    assert t["d2h_bytes"] == 0


def test_lfu_by_hand():
    # refs 1 1 2 3 1 2 4 with 2 slots, perfect LFU (counts survive eviction, ties -> least recent):
    # 1 miss, 1 hit, 2 miss, 3 miss (evict 2: count 1 < 1's 2), 1 hit, 2 miss (evict 3), 4 miss (evict 2:
    # counts 1->3, 2->2... 2 has count 2, 4 is new; victim among {1:3, 2:2} is 2)
    c, _ = drive_cache("lfu", [1, 1, 2, 3, 1, 2, 4], 2)
    assert (c.totals()["expert_hits"], c.totals()["expert_misses"]) == (2, 5)


def test_static_by_hand():
    # popularity pins expert 5 (capacity 2 -> 1 pinned slot); the other slot rotates
    pop = [0, 1, 1, 1, 1, 9, 0, 0]
    c, _ = drive_cache("static", [5, 1, 5, 2, 5, 1, 5], 2, popularity=pop)
    # 5 miss, 1 miss, 5 hit, 2 miss (evicts 1, never 5), 5 hit, 1 miss, 5 hit
    assert (c.totals()["expert_hits"], c.totals()["expert_misses"]) == (3, 4)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("capacity", [2, 3, 5])
def test_engine_counters_equal_independent_replay(policy, capacity):
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=capacity,
                                 cache_policy=policy, record_lookups=True)
    eng.generate([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]] * 2, 12)
    per_layer = eng.counters_by_layer
    eb = eng.model.store.expert_bytes
    for layer, refs in eng.lookup_log.items():
        steps = [s for s, experts in enumerate(eng.step_log[layer]) for _ in experts]   # pass of each lookup
        hits = sum(simulate(make_policy(policy, capacity, 8, layer), refs, steps=steps))
        assert per_layer[layer]["expert_hits"] == hits
        assert per_layer[layer]["expert_misses"] == len(refs) - hits
        assert per_layer[layer]["h2d_bytes"] == (len(refs) - hits) * eb
    assert eng.counters["expert_hits"] == sum(r["expert_hits"] for r in per_layer.values())


def test_resident_moves_nothing_and_cpu_moves_activations():
    prompt = [[1, 2, 3, 4, 5, 6]]
    res = Engine.from_pretrained("tiny-mixtral", device="cpu")
    res.generate(prompt, 4)
    assert res.counters == dict.fromkeys(res.counters, 0)
    cpu = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="cpu")
    cpu.generate(prompt, 4)
    c = cpu.counters
    # per layer per forward: hidden [N, 64] fp32 + ids [N, 2] int64 + weights [N, 2] fp32 down; [N, 64] back
    rows = 6 + 3                                   # prefill rows + three decode steps
    assert c["h2d_bytes"] == c["h2d_activation_bytes"] == 4 * rows * 64 * 4
    assert c["d2h_bytes"] == c["d2h_activation_bytes"] == 4 * rows * (64 * 4 + 2 * 8 + 2 * 4)
    assert c["expert_hits"] == c["expert_misses"] == 0


def test_protection_keeps_an_expert_the_step_still_needs():
    """One pass needing [1, 5] with 5 the least recently used resident: the miss of 1 must not
    evict 5 (plain LRU would, and then miss 5 too)."""
    store = ExpertStore(8, 4, torch.float32)
    dev = Device("cpu")
    rows = store.allocate(0, dev, on_device=False)
    rows.copy_(torch.arange(8, dtype=torch.float32)[:, None].expand(8, 4))
    counters = Counters(1)
    cache = ExpertCache(store, dev, counters, 2, [0], lambda layer: make_policy("lru", 2, 8, layer))
    for e in (5, 2):                                   # residents, 5 least recent
        cache.acquire(0, e)
        cache.release(0, e)
    cache.lookup(0, [1, 5])
    assert cache.resident(0) == {1, 5}
    for e in (1, 5):
        assert torch.equal(cache.acquire(0, e), rows[e])
        cache.release(0, e)
    t = counters.totals()
    assert (t["expert_hits"], t["expert_misses"]) == (1, 3)
    refs, steps = [5, 2, 1, 5], [0, 1, 2, 2]
    assert simulate(make_policy("lru", 2, 8), refs, steps=steps) == [False, False, False, True]
    assert simulate(make_policy("lru", 2, 8), refs) == [False, False, False, False]   # unprotected


@pytest.mark.parametrize("capacity", [2, 3])
def test_a_pass_needing_more_experts_than_slots_pipelines(capacity):
    """8 experts through 2-3 slots in one pass: later copies reuse slots of experts already
    computed, every slot holds the right bytes when its expert runs, in both copy schedules."""
    store = ExpertStore(8, 16, torch.float32)
    dev = Device("cpu")
    rows = store.allocate(0, dev, on_device=False)
    rows.normal_()
    got = []
    for ahead in (True, False):
        counters = Counters(1)
        cache = ExpertCache(store, dev, counters, capacity, [0],
                            lambda layer: make_policy("fifo", capacity, 8, layer), issue_ahead=ahead)
        for _ in range(3):
            experts = list(range(8))
            cache.lookup(0, experts)
            for e in experts:
                assert torch.equal(cache.acquire(0, e), rows[e])
                cache.release(0, e)
        got.append(counters.totals())
    hits = simulate(make_policy("fifo", capacity, 8), list(range(8)) * 3, steps=[s for s in range(3) for _ in range(8)])
    assert got[0] == got[1] and got[0]["expert_hits"] == sum(hits) and got[0]["expert_misses"] == 24 - sum(hits)


@pytest.mark.parametrize("placement,options", [
    ("resident", {}), ("fetch", {"cache_capacity": 2}), ("fetch", {"cache_capacity": 3, "prefetch": "next_layer_gate"}),
    ("cpu", {}), ("hybrid", {"n_cpu_layers": 2}),
    ("stream", {"cache_capacity": 2, "stream_threshold": 4}),
    ("stream", {"stream_fallback": "cpu", "stream_threshold": 4})])
def test_bytes_by_purpose_sum_to_totals(placement, options):
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, **options)
    sess = eng.new_session(2)
    eng.generate([[3, 1, 4, 1, 5, 9, 2, 6]] * 2, 4, session=sess)
    sess.offload()
    sess.restore()
    eng.generate([[2, 7, 1]] * 2, 3, session=sess)
    sess.close()
    for row in [eng.counters, *eng.counters_by_layer.values()]:
        for d in ("h2d", "d2h"):
            assert row[f"{d}_bytes"] == sum(row[f"{d}_{p}_bytes"] for p in ("expert", "activation", "kv"))
    c = eng.counters
    assert c["h2d_kv_bytes"] == c["d2h_kv_bytes"] > 0
    assert c["d2h_expert_bytes"] == 0                   # experts are never written back
    copies = placement in ("fetch", "stream")
    assert (c["h2d_expert_bytes"] > 0) == copies
    assert (c["h2d_activation_bytes"] > 0) == (c["d2h_activation_bytes"] > 0) == (placement in ("cpu", "hybrid")
                                                                                  or "stream_fallback" in options)
    if placement == "fetch":
        assert c["h2d_expert_bytes"] == (c["expert_misses"] + c["prefetch_issued"]) * eng.model.store.expert_bytes


def test_link_bytes_cannot_be_added_directly():
    with pytest.raises(ValueError, match=r"Counters.transfer"):
        Counters(1).add("h2d_bytes", 1)
    with pytest.raises(ValueError, match="purpose one of"):
        Counters(1).transfer("h2d", "weights", 1)
