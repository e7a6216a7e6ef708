"""LFRU eviction: textbook reference strings worked by hand, its two limits (LFU and LRU),
the protection rule and its options (the engine's cache agrees with its replay: tests/sim/test_engine_agreement)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.policies import make_policy
from engine.policies.lfru import LFRU
from engine.policies.simulate import count_faults, simulate
from engine.registry import POLICIES

# Silberschatz, Operating System Concepts, the page-replacement chapter's reference string
SILBERSCHATZ = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
H, M = True, False


def flags(text: str) -> list[bool]:
    return [c == "H" for c in text]


def victims(policy: LFRU, refs: list[int]) -> tuple[list[bool], list[tuple[int, int]]]:
    """Hit flags and (time, victim) of every eviction."""
    seen: list[tuple[int, int]] = []
    original = policy.victim

    def spy(t: int, protected=frozenset()) -> int:
        v = original(t, protected)
        seen.append((t, v))
        return v

    policy.victim = spy   # type: ignore[method-assign]
    return simulate(policy, refs), seen


def test_registered_with_its_option() -> None:
    assert POLICIES.get("lfru") is LFRU and LFRU.name == "lfru"
    assert make_policy("lfru", 4, 8).privileged == 2                       # default capacity // 2
    assert make_policy("lfru", 4, 8, privileged=3).privileged == 3


@pytest.mark.parametrize("privileged", [-1, 3, 1.5, True])
def test_privileged_out_of_range_is_refused(privileged) -> None:
    with pytest.raises(ValueError, match=r"privileged must be an integer in \[0, capacity-1\] = \[0, 2\].*got "
                                         rf"privileged={privileged!r}"):
        LFRU(3, 8, privileged=privileged)


def test_silberschatz_three_frames_hand_worked() -> None:
    # capacity 3, privileged 1 (the most recent resident); (count, last use) of the unprivileged
    # residents at each miss once the cache is full, counts perfect (kept across evictions):
    # t3  2 M  priv {1}; 7:(1,t0) 0:(1,t1)  -> evict 7 (tie, less recent)
    # t5  3 M  priv {0}; 1:(1,t2) 2:(1,t3)  -> evict 1
    # t7  4 M  priv {0}; 2:(1,t3) 3:(1,t5)  -> evict 2
    # t8  2 M  priv {4}; 3:(1,t5) 0:(3,t6)  -> evict 3   (LRU would evict 0 here)
    # t9  3 M  priv {2}; 0:(3,t6) 4:(1,t7)  -> evict 4
    # t13 1 M  priv {2}; 0:(4,t10) 3:(3,t11) -> evict 3
    # t17 7 M  priv {1}; 2:(4,t14) 0:(5,t15) -> evict 2
    # 10 faults: between OPT's 9 and LRU's 12 / LFU's 11 / FIFO's 15 on this string.
    hits, seen = victims(LFRU(3, 8, privileged=1), SILBERSCHATZ)
    assert seen == [(3, 7), (5, 1), (7, 2), (8, 3), (9, 4), (13, 3), (17, 2)]
    assert hits == flags("MMMMHMHMMMHHHMHHHMHH")
    assert count_faults("lfru", SILBERSCHATZ, 3, privileged=1) == 10
    assert (count_faults("belady", SILBERSCHATZ, 3, future=SILBERSCHATZ), count_faults("lfu", SILBERSCHATZ, 3),
            count_faults("lru", SILBERSCHATZ, 3)) == (9, 11, 12)


def test_a_scan_does_not_flush_a_hot_expert() -> None:
    # 0 is referenced three times, then five one-off experts stream past: LRU(3) has evicted 0
    # by the time it returns; LFRU keeps it, the one-offs leaving from the unprivileged side.
    refs = [0, 0, 0, 1, 2, 3, 4, 5, 0]
    hits, seen = victims(LFRU(3, 8, privileged=1), refs)
    assert seen == [(5, 1), (6, 2), (7, 3)] and hits[-1] is H
    assert simulate(make_policy("lru", 3, 8), refs)[-1] is M


def test_a_new_expert_in_use_is_not_evicted_for_being_rare() -> None:
    # 0 and 1 are hot (three references each); then 2 alternates with one-off experts 5, 6, 7.
    # LFU evicts 2 whenever a one-off arrives (2's count is the lowest); LFRU keeps 2, the most
    # recent resident, privileged, and evicts the rare one-offs after their single use.
    refs = [0, 0, 0, 1, 1, 1, 2, 5, 2, 6, 2, 7, 2]
    hits, seen = victims(LFRU(3, 8, privileged=1), refs)
    assert seen == [(7, 0), (9, 5), (11, 6)]              # 0 and 1 tie at 3: the less recent, 0, goes once
    assert hits == flags("MHHMHHMMHMHMH")
    assert simulate(make_policy("lfu", 3, 8), refs) == flags("MHHMHHMMMMMMH")


refs_st = st.lists(st.integers(0, 7), min_size=0, max_size=80)


@settings(max_examples=100, deadline=None)
@given(refs=refs_st, capacity=st.integers(1, 6))
def test_its_limits_are_lfu_and_lru(refs: list[int], capacity: int) -> None:
    """privileged=0: every resident is a candidate, by frequency -- LFU; privileged=capacity-1: the one
    unprivileged resident is the least recent -- LRU. Hit for hit, not just in total."""
    lfru = simulate(make_policy("lfru", capacity, 8, privileged=0), refs)
    assert lfru == simulate(make_policy("lfu", capacity, 8), refs)
    lfru = simulate(make_policy("lfru", capacity, 8, privileged=capacity - 1), refs)
    assert lfru == simulate(make_policy("lru", capacity, 8), refs)


@settings(max_examples=100, deadline=None)
@given(refs=refs_st, capacity=st.integers(1, 6), data=st.data())
def test_belady_is_a_lower_bound(refs: list[int], capacity: int, data) -> None:
    privileged = data.draw(st.integers(0, capacity - 1))
    assert (count_faults("belady", refs, capacity, n_experts=8, future=refs)
            <= count_faults("lfru", refs, capacity, n_experts=8, privileged=privileged))


def test_protected_experts_are_never_victims_and_the_fallback_is_privileged() -> None:
    policy = LFRU(3, 8, privileged=1)
    for t, e in enumerate([0, 0, 1, 2]):                  # 0:(2,t1) 1:(1,t2) unprivileged, 2 privileged
        (policy.on_hit if e in policy.resident else policy.on_insert)(e, t)
    assert policy.privileged_set() == {2}
    assert policy.victim(4) == 1                          # the least frequent unprivileged
    assert policy.victim(4, frozenset({1})) == 0
    assert policy.victim(4, frozenset({0, 1})) == 2       # every unprivileged one still needed: privileged
    with pytest.raises(RuntimeError, match="no evictable expert"):
        policy.victim(4, frozenset({0, 1, 2}))
