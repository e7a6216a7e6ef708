"""The per-run routing statistics beyond popularity and reuse: adjacent-token Jaccard, distinct
experts per decode step and per prefill pass, and the route digest that tells whether two runs
routed the same tokens identically. Hand-made traces whose answers are known."""
from __future__ import annotations

from math import isnan

import numpy as np
import pytest

from engine.trace import RoutingTrace
from harness.sim.stats import route_digest, trace_stats
from harness.sim.synthetic import generate


def trace(experts: list, step: list | None = None, sequence: list | None = None) -> RoutingTrace:
    arr = np.asarray(experts, dtype=np.int32)                          # [N, L, k]
    return RoutingTrace(experts=arr, meta={"n_experts": 8, "expert_bytes": 1},
                        step=None if step is None else np.asarray(step, np.int32),
                        sequence=None if sequence is None else np.asarray(sequence, np.int32)).validate()


def test_distinct_experts_per_decode_step_and_per_prefill_pass():
    # one layer, top-2: a 3-token prefill pass (experts 0, 1, 2), then two decode steps
    t = trace([[[0, 1]], [[1, 2]], [[0, 2]], [[0, 1]], [[3, 4]]], step=[0, 0, 0, 1, 2])
    row = trace_stats(t).iloc[0]
    assert row.distinct_prefill == 3 and row.distinct_decode == 2
    # two sequences stepped together: a decode step holds one token of each -> the union of both
    b = trace([[[0, 1]], [[2, 3]], [[0, 1]], [[0, 5]]], step=[0, 0, 1, 1], sequence=[0, 1, 0, 1])
    row = trace_stats(b).iloc[0]
    assert row.distinct_decode == pytest.approx((4 + 3) / 2) and isnan(row.distinct_prefill)


def test_jaccard_of_adjacent_tokens_and_its_random_baseline():
    t = trace([[[0, 1]], [[1, 2]], [[1, 2]]])                           # 1/3, then 1
    row = trace_stats(t).iloc[0]
    assert row.jaccard == pytest.approx((1 / 3 + 1) / 2)
    assert row.jaccard_random == pytest.approx(5 / 28)                 # E=8, k=2: (12/28)(1/3) + (1/28)(1)
    uniform = trace_stats(generate(1, 8, 2, 20000, seed=3)).iloc[0]
    assert uniform.jaccard == pytest.approx(uniform.jaccard_random, abs=0.01)


def test_route_digest_is_the_routing_not_its_layout():
    a = trace([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]], step=[0, 0, 1, 1], sequence=[0, 1, 0, 1])
    slots_swapped = trace([[[1, 0]], [[3, 2]], [[5, 4]], [[7, 6]]], step=[0, 0, 1, 1], sequence=[0, 1, 0, 1])
    # the same two sequences run one after the other instead of stepped together
    rows_regrouped = trace([[[0, 1]], [[4, 5]], [[2, 3]], [[6, 7]]], step=[0, 1, 2, 3], sequence=[0, 0, 1, 1])
    other = trace([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 0]]], step=[0, 0, 1, 1], sequence=[0, 1, 0, 1])
    assert route_digest(a) == route_digest(slots_swapped) == route_digest(rows_regrouped)
    assert route_digest(a) != route_digest(other) and len(route_digest(a)) == 16
