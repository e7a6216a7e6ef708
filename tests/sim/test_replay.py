"""Replay simulator: textbook fault counts through replay(), the fast kernels against the
engine's policy classes, and the properties that make the optimum a bound."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.policies.simulate import count_faults
from engine.registry import UnknownPluginError
from engine.trace import RoutingTrace, lookup_arrays
from harness.sim.kernels import COLD, stack_distances
from harness.sim.replay import ROW_COLUMNS, lru_curve, oracle_hidden, profile_transfer, replay
from harness.sim.synthetic import generate

SILBERSCHATZ = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
ANOMALY = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
POLICIES = ["lru", "lfu", "fifo", "static", "belady"]
FAST = settings(max_examples=60, deadline=None)


def total(df: pd.DataFrame, policy: str, capacity: int, col: str = "misses") -> int:
    row = df[(df.policy == policy) & (df.capacity == capacity) & (df.layer == "all")]
    assert len(row) == 1
    return int(row[col].iloc[0])


def random_trace(seed: int, n_experts: int, layers: int, top_k: int, tokens: int, stepped: bool,
                 skew: float = 1.0) -> RoutingTrace:
    """Skewed random routing (so caches matter) with optional multi-token steps."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n_experts, skew))
    ex = np.array([[rng.choice(n_experts, top_k, replace=False, p=p) for _ in range(layers)]
                   for _ in range(tokens)], dtype=np.int32).reshape(tokens, layers, top_k)   # [N, L, k]
    step = np.sort(rng.integers(0, max(tokens // 2, 1), tokens)).astype(np.int32) if stepped else None
    return RoutingTrace(experts=ex.astype(np.int32), meta={"n_experts": n_experts, "expert_bytes": 3},
                        step=step).validate()


traces = st.builds(random_trace, st.integers(0, 2**32 - 1), st.integers(2, 8), st.integers(1, 3),
                   st.integers(1, 2), st.integers(0, 40), st.booleans())


# --- textbook values through replay() --------------------------------------------------------
@pytest.mark.parametrize("policy, faults", [("fifo", 15), ("lru", 12), ("belady", 9)])
@pytest.mark.parametrize("fast", [True, False])
def test_silberschatz_three_frames(policy: str, faults: int, fast: bool) -> None:
    df = replay(RoutingTrace.from_reference_string(SILBERSCHATZ), [policy], [3], fast=fast)
    assert total(df, policy, 3) == faults
    assert total(df, policy, 3, "hits") == len(SILBERSCHATZ) - faults


def test_belady_anomaly_fifo() -> None:
    df = replay(RoutingTrace.from_reference_string(ANOMALY), ["fifo"], [3, 4])
    assert total(df, "fifo", 3) == 9 and total(df, "fifo", 4) == 10


def test_rows_are_tidy_with_bytes() -> None:
    tr = RoutingTrace.from_reference_string(SILBERSCHATZ, expert_bytes=100)
    df = replay(tr, ["lru", "belady"], [3, 4])
    assert list(df.columns) == list(ROW_COLUMNS)
    assert len(df) == 2 * 2 * 2                            # policies x capacities x (layer 0 + "all")
    lru3 = df[(df.policy == "lru") & (df.capacity == 3) & (df.layer == 0)].iloc[0]
    assert (lru3.hits, lru3.misses, lru3.hit_bytes, lru3.miss_bytes) == (8, 12, 800, 1200)
    assert lru3.hit_rate == pytest.approx(0.4)


# --- fast paths == the engine's classes --------------------------------------------------------
@FAST
@given(traces)
@pytest.mark.slow
def test_fast_belady_equals_engine_class(tr: RoutingTrace) -> None:
    caps = list(range(tr.top_k, tr.n_experts + 1))
    fast = replay(tr, ["belady"], caps, fast=True)
    ref = replay(tr, ["belady"], caps, fast=False)
    pd.testing.assert_frame_equal(fast, ref)


@FAST
@given(traces)
@pytest.mark.slow
def test_stack_distance_curve_equals_per_capacity_lru(tr: RoutingTrace) -> None:
    curve = lru_curve(tr)
    sim = replay(tr, ["lru"], list(range(tr.top_k, tr.n_experts + 1)))
    pd.testing.assert_frame_equal(curve, sim)


def test_stack_distances_by_hand() -> None:
    d = stack_distances(np.array([0, 1, 2, 0, 0, 2, 1]), 3)
    assert d.tolist() == [COLD, COLD, COLD, 3, 1, 2, 3]


# --- properties --------------------------------------------------------------------------------
@FAST
@given(traces)
@pytest.mark.slow
def test_belady_never_misses_more_than_any_policy(tr: RoutingTrace) -> None:
    caps = list(range(tr.top_k, tr.n_experts + 1))
    df = replay(tr, POLICIES, caps)
    per_layer = df[df.layer != "all"].pivot_table(index=["capacity", "layer"], columns="policy", values="misses")
    assert (per_layer["belady"].to_numpy()[:, None] <= per_layer.drop(columns="belady").to_numpy()).all()


@FAST
@given(traces)
@pytest.mark.slow
def test_misses_non_increasing_with_capacity_for_stack_policies(tr: RoutingTrace) -> None:
    df = replay(tr, ["lru", "belady"], list(range(tr.top_k, tr.n_experts + 1)))
    for (_, _), g in df.groupby(["policy", "layer"]):
        assert (np.diff(g.sort_values("capacity").misses.to_numpy()) <= 0).all()


@FAST
@given(traces)
@pytest.mark.slow
def test_replay_matches_reference_loop(tr: RoutingTrace) -> None:
    """Per layer, replay's counts equal the engine's reference loop on the lookup sequence."""
    df = replay(tr, ["lru", "lfu", "fifo"], [2])
    for l, (ids, steps) in enumerate(lookup_arrays(tr)):
        for p in ("lru", "lfu", "fifo"):
            got = df[(df.policy == p) & (df.layer == l)].misses.iloc[0]
            assert got == count_faults(p, ids.tolist(), 2, n_experts=tr.n_experts, steps=steps.tolist())


# --- oracle prefetch ---------------------------------------------------------------------------
def slow_oracle_hidden(ids: list[int], steps: list[int], hit: list[bool], capacity: int) -> int:
    by_step: dict[int, list[tuple[int, bool]]] = {}
    for e, s, h in zip(ids, steps, hit):
        by_step.setdefault(s, []).append((e, h))
    hidden = 0
    for s in sorted(by_step)[1:]:
        prev_used = {e for e, _ in by_step.get(s - 1, [])}
        found = {e for e, h in by_step[s] if h}
        misses = sum(not h for _, h in by_step[s])
        hidden += min(misses, max(0, capacity - len(prev_used | found)))
    return hidden


@FAST
@given(traces, st.integers(1, 8), st.integers(0, 2**32 - 1))
@pytest.mark.slow
def test_oracle_hidden_matches_slow_definition(tr: RoutingTrace, capacity: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for ids, steps in lookup_arrays(tr):
        hit = rng.random(len(ids)) < 0.5
        assert oracle_hidden(ids, steps, hit, capacity) == slow_oracle_hidden(ids.tolist(), steps.tolist(),
                                                                               hit.tolist(), capacity)


def test_oracle_prefetch_by_hand() -> None:
    tr = RoutingTrace.from_reference_string([0, 1, 2, 0, 1, 2])
    df = replay(tr, ["lru"], [1, 3], prefetch="oracle")
    # capacity 3: misses at t=0,1,2; t=0 cannot be hidden, t=1 and t=2 find 2 and 1 free slots
    assert total(df, "lru", 3) == 3 and total(df, "lru", 3, "hidden_misses") == 2
    assert total(df, "lru", 3, "exposed_misses") == 1
    # capacity 1: the only slot is busy with the running step, nothing can be hidden
    assert total(df, "lru", 1, "hidden_misses") == 0
    none = replay(tr, ["lru"], [3])
    assert total(none, "lru", 3, "hidden_misses") == 0 and (none.prefetch == "none").all()


# --- errors ------------------------------------------------------------------------------------
def test_errors_name_what_was_wrong() -> None:
    tr = RoutingTrace.from_reference_string([0, 1, 2])
    with pytest.raises(ValueError, match=r"capacity must be in \[top_k=1, n_experts=3\].*got 4$"):
        replay(tr, ["lru"], [4])
    top2 = generate(layers=1, n_experts=4, top_k=2, tokens=8)
    with pytest.raises(ValueError, match=r"capacity must be in \[top_k=2, n_experts=4\].*got 1$"):
        replay(top2, ["lru"], [1, 2])          # the engine refuses a cache smaller than one step's experts
    with pytest.raises(ValueError, match="next_layer_gate.*router logits.*replayable: none, oracle"):
        replay(tr, ["lru"], [2], prefetch="next_layer_gate")
    with pytest.raises(ValueError, match="unknown prefetch 'sometimes'"):
        replay(tr, ["lru"], [2], prefetch="sometimes")
    with pytest.raises(UnknownPluginError, match="known: .*belady"):
        replay(tr, ["lrx"], [2])
    with pytest.raises(ValueError, match="options given for policies"):
        replay(tr, ["lru"], [2], options={"static": {"pinned": 1}})


def test_policy_options_pass_through() -> None:
    tr = RoutingTrace.from_reference_string(SILBERSCHATZ)
    pinned0 = replay(tr, ["static"], [3], options={"static": {"pinned": 0}})
    fifo = replay(tr, ["fifo"], [3])
    assert total(pinned0, "static", 3) == total(fifo, "fifo", 3)   # nothing pinned: plain FIFO


def test_step_protection_by_hand() -> None:
    """Recency stack [7, 5] when a step needs [1, 5, 7]: at capacity 2 every resident is a later
    expert of the step, so the miss of 1 protects none and evicts 5 (LRU); 7 still hits. At
    capacity 3 the miss of 1 has a free slot. The closed-form LRU curve and the class agree."""
    ex = np.array([5, 7, 1, 5, 7], dtype=np.int32).reshape(5, 1, 1)
    tr = RoutingTrace(experts=ex, meta={"n_experts": 8, "expert_bytes": 1},
                      step=np.array([0, 1, 2, 2, 2], dtype=np.int32)).validate()
    df = replay(tr, ["lru"], [1, 2, 3])
    assert [total(df, "lru", c, "hits") for c in (1, 2, 3)] == [0, 1, 2]
    pd.testing.assert_frame_equal(lru_curve(tr)[lambda d: d.capacity <= 3].reset_index(drop=True),
                                  df.reset_index(drop=True), check_like=True)


# --- a hot-expert profile from another workload ----------------------------------------------
def _one_layer(ids: list[int]) -> RoutingTrace:
    return RoutingTrace(experts=np.array(ids, dtype=np.int32).reshape(-1, 1, 1),
                        meta={"n_experts": 4, "expert_bytes": 1}).validate()


def test_a_profile_from_the_same_routing_transfers_fully_and_a_reversed_one_does_not() -> None:
    """Capacity 2 pins one expert. On 0 0 0 1 2 3 0 0 the own profile pins 0: hits at every later 0 (4);
    1, 2 and 3 take turns in the other slot. A profile whose most popular expert is 3 pins 3, which
    is never routed to again: 0 hits twice, is evicted by 2 (first in, first out among the unpinned),
    and misses once more before its last hit (3)."""
    trace = _one_layer([0, 0, 0, 1, 2, 3, 0, 0])
    same = profile_transfer(trace, trace, 2)
    assert same["transfer"].tolist() == [1.0, 1.0]
    reversed_ = profile_transfer(trace, _one_layer([3, 3, 3, 2, 1]), 2)
    row = reversed_[reversed_.layer == "all"].iloc[0]
    assert (row.own_hit_rate, row.profile_hit_rate, row.transfer) == (4 / 8, 3 / 8, 0.75)


def test_a_count_only_profile_serves_and_another_models_is_refused() -> None:
    trace = _one_layer([0, 0, 0, 1, 2, 3, 0, 0])
    counts = RoutingTrace(experts=np.zeros((0, 1, 1), dtype=np.int32), meta={"n_experts": 4, "expert_bytes": 1,
                          "count_only": True}, counts=np.array([[5, 1, 1, 1]])).validate()
    assert profile_transfer(trace, counts, 2)["transfer"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="same model"):
        profile_transfer(trace, random_trace(0, 8, 1, 1, 10, False), 2)
