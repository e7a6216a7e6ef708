"""Counters are exact: the device cache's hits, misses and bytes equal hand-computed values
for known reference strings, and the engine's counters equal an independent replay of
the lookups it made."""
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
        hits = sum(simulate(make_policy(policy, capacity, 8, layer), refs))
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
    assert c["h2d_bytes"] == 4 * rows * 64 * 4
    assert c["d2h_bytes"] == 4 * rows * (64 * 4 + 2 * 8 + 2 * 4)
    assert c["expert_hits"] == c["expert_misses"] == 0
