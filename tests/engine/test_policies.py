"""Eviction policies: textbook fault counts, hand-worked traces, protocol errors and
properties (OPT is a lower bound; stack algorithms never fault more with more frames)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.policies import EvictionPolicy, make_policy
from engine.policies.belady import Belady
from engine.policies.fifo import FIFO
from engine.policies.lfu import LFU
from engine.policies.lru import LRU
from engine.policies.simulate import count_faults, simulate
from engine.policies.static import Static
from engine.registry import POLICIES, UnknownPluginError

# Silberschatz, Operating System Concepts, the page-replacement chapter's reference string
SILBERSCHATZ = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
ANOMALY = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
H, M = True, False


# --- textbook values -------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [("fifo", 15), ("lru", 12), ("belady", 9)])
def test_silberschatz_three_frames(name: str, expected: int) -> None:
    opts = {"future": SILBERSCHATZ} if name == "belady" else {}
    assert count_faults(name, SILBERSCHATZ, 3, **opts) == expected


def test_fifo_belady_anomaly() -> None:
    assert count_faults("fifo", ANOMALY, 3) == 9
    assert count_faults("fifo", ANOMALY, 4) == 10


def test_registry_builds_each_class() -> None:
    for name, cls in [("lru", LRU), ("lfu", LFU), ("fifo", FIFO), ("static", Static), ("belady", Belady)]:
        assert POLICIES.get(name) is cls and cls.name == name


# --- hand-worked traces -------------------------------------------------------------------
def test_lfu_hand_trace_perfect_counts_and_lru_ties() -> None:
    refs = [1, 1, 2, 3, 2, 1, 3, 3, 2, 1]
    # capacity 2; (count, last use) of residents at each miss:
    # t0 1 M  c1=1
    # t1 1 H  c1=2
    # t2 2 M  c2=1
    # t3 3 M  1:(2,t1) 2:(1,t2) -> evict 2; c3=1
    # t4 2 M  1:(2,t1) 3:(1,t3) -> evict 3; c2=2 (count survived its eviction)
    # t5 1 H  c1=3
    # t6 3 M  1:(3,t5) 2:(2,t4) -> evict 2; c3=2
    # t7 3 H  c3=3
    # t8 2 M  1:(3,t5) 3:(3,t7) -> equal counts, 1 used less recently -> evict 1; c2=3.
    #         (An LFU that reset counts on eviction would see 3 at count 2 and evict it.)
    # t9 1 M  3:(3,t7) 2:(3,t8) -> evict 3; c1=4
    policy = LFU(2, 4)
    assert simulate(policy, refs) == [M, H, M, M, M, H, M, H, M, M]
    assert policy.resident == {1, 2}
    assert [policy.count(e) for e in range(4)] == [0, 4, 3, 3]


def test_static_hand_trace() -> None:
    refs = [1, 2, 3, 0, 4, 2, 0, 1, 3]
    # capacity 3, default pinned = 2 -> experts 2 (count 9) and 0 (count 5).
    # Pinned experts enter lazily on their first miss; victims are unpinned residents FIFO.
    # t0 1 M  unpinned order [1]
    # t1 2 M  (pinned)
    # t2 3 M  order [1, 3]
    # t3 0 M  full -> evict 1 (oldest unpinned); 0 pinned
    # t4 4 M  full -> evict 3; order [4]
    # t5 2 H, t6 0 H
    # t7 1 M  evict 4; order [1]
    # t8 3 M  evict 1; order [3]
    policy = Static(3, 5, popularity=[5, 1, 9, 1, 0])
    assert policy.pinned == {0, 2}
    assert simulate(policy, refs) == [M, M, M, M, M, H, H, M, M]
    assert policy.resident == {0, 2, 3}
    # plain FIFO evicts the popular 2 at t4 and misses it at t5
    assert simulate(FIFO(3, 5), refs)[5] is M


def test_static_ties_by_lower_id_and_2d_popularity() -> None:
    table = np.array([[0, 0, 0, 0], [1, 3, 3, 0]])           # [layers, n_experts]
    assert Static(2, 4, layer=1, popularity=table).pinned == {1}
    assert Static(3, 4, layer=1, popularity=table, pinned=2).pinned == {1, 2}
    assert Static(3, 4, layer=1, popularity=table, pinned=0).pinned == frozenset()


def test_lru_hits_refresh_fifo_hits_do_not() -> None:
    refs = [0, 1, 0, 2, 0]   # capacity 2: at t3 LRU evicts 1, FIFO evicts 0
    assert simulate(LRU(2, 3), refs) == [M, M, H, M, H]
    assert simulate(FIFO(2, 3), refs) == [M, M, H, M, M]


def test_belady_accepts_per_layer_future() -> None:
    per_layer = {0: [9, 9], 3: SILBERSCHATZ}
    assert simulate(Belady(3, 8, layer=3, future=per_layer), SILBERSCHATZ).count(M) == 9
    as_list = [[9, 9], [9], [9], SILBERSCHATZ]
    assert simulate(Belady(3, 8, layer=3, future=as_list), SILBERSCHATZ).count(M) == 9
    arr = np.array(SILBERSCHATZ)
    assert simulate(Belady(3, 8, future=arr), SILBERSCHATZ).count(M) == 9


# --- protocol errors --------------------------------------------------------------------
def test_belady_rejects_mismatched_future() -> None:
    wrong = list(SILBERSCHATZ)
    wrong[5] = 4
    with pytest.raises(ValueError, match=r"does not match.*position 5.*expected expert 4, got 3"):
        simulate(Belady(3, 8, future=wrong), SILBERSCHATZ)
    with pytest.raises(ValueError, match="does not match.*only 3 entries"):
        simulate(Belady(3, 8, future=SILBERSCHATZ[:3]), SILBERSCHATZ)


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo", "static", "belady"])
def test_victim_never_protected(name: str) -> None:
    refs = [0, 1, 2, 3, 0, 4, 1, 5, 2, 0, 3, 5, 4, 1] * 3
    opts = {"future": refs} if name == "belady" else {}
    if name == "static":
        opts = {"popularity": [3, 2, 1, 0, 0, 0], "pinned": 1}

    def protected(t: int) -> set[int]:
        return {refs[t - 1], refs[t - 2]}          # the previous two lookups are "in use"

    seen: list[tuple[int, int]] = []
    policy = make_policy(name, 4, 6, **opts)
    original = policy.victim

    def spy(t: int, prot=frozenset()) -> int:
        v = original(t, prot)
        assert v not in prot and v in policy.resident
        seen.append((t, v))
        return v

    policy.victim = spy   # type: ignore[method-assign]
    simulate(policy, refs, protected)
    assert seen


def test_victim_errors_when_everything_protected() -> None:
    policy = make_policy("lru", 2, 4)
    with pytest.raises(RuntimeError, match="no evictable expert"):
        simulate(policy, [0, 1, 2], lambda t: {0, 1})


def test_static_rejects_too_many_pinned() -> None:
    with pytest.raises(ValueError, match=r"pinned.*\[0, 2\].*pinned=3"):
        Static(3, 5, popularity=[1] * 5, pinned=3)
    with pytest.raises(ValueError, match="one count per expert"):
        Static(3, 5, popularity=[1] * 4)


def test_make_policy_rejects_unknown_name_and_options() -> None:
    with pytest.raises(UnknownPluginError, match="known: .*belady.*fifo.*lfu.*lru.*static"):
        make_policy("mru", 2, 4)
    with pytest.raises(TypeError, match=r"'lru'.*unknown option.*'pinned'.*accepted options: none"):
        make_policy("lru", 2, 4, pinned=1)
    with pytest.raises(TypeError, match=r"'static'.*'pined'.*accepted options: popularity, pinned"):
        make_policy("static", 2, 4, popularity=[1, 2, 3, 4], pined=1)
    with pytest.raises(TypeError, match=r"'belady' requires option.*'future'"):
        make_policy("belady", 2, 4)
    assert isinstance(make_policy("static", 2, 4, popularity=[1, 2, 3, 4]), EvictionPolicy)


# --- properties -------------------------------------------------------------------------
refs_st = st.lists(st.integers(0, 7), min_size=0, max_size=60)


@settings(max_examples=100, deadline=None)
@given(refs=refs_st, capacity=st.integers(1, 6))
def test_belady_is_a_lower_bound(refs: list[int], capacity: int) -> None:
    opt = count_faults("belady", refs, capacity, n_experts=8, future=refs)
    for name in ("lru", "lfu", "fifo"):
        assert opt <= count_faults(name, refs, capacity, n_experts=8)
    pop = np.bincount(np.array(refs, dtype=int), minlength=8)    # offline popularity
    assert opt <= count_faults("static", refs, capacity, n_experts=8, popularity=pop)


@settings(max_examples=100, deadline=None)
@given(refs=refs_st, capacity=st.integers(1, 6))
def test_more_frames_never_more_faults(refs: list[int], capacity: int) -> None:
    assert count_faults("lru", refs, capacity + 1) <= count_faults("lru", refs, capacity)
    assert (count_faults("belady", refs, capacity + 1, future=refs)
            <= count_faults("belady", refs, capacity, future=refs))
