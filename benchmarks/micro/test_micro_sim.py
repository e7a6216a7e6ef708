"""Micro-benchmarks of the replay simulator: policy replay, the one-pass LRU curve, Belady.

A synthetic trace of 2048 decode tokens x 16 layers x top-8 of 64 experts (Zipf skew and
temporal reuse), i.e. 262k lookups: small enough for a CI box, large enough that the
per-lookup cost dominates the fixed cost. The full-size run is benchmarks/bench_sim.py.
"""
from __future__ import annotations

import pytest

from harness.sim.replay import lru_curve, replay
from harness.sim.synthetic import generate


@pytest.fixture(scope="module")
def trace():
    return generate(layers=16, n_experts=64, top_k=8, tokens=2048, zipf=0.8, reuse=0.4, seed=0, expert_bytes=1)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_replay_policy(benchmark, trace, policy: str) -> None:
    df = benchmark.pedantic(replay, args=(trace, [policy], [16]), rounds=3, iterations=1)
    assert len(df)


def test_lru_curve(benchmark, trace) -> None:
    df = benchmark(lru_curve, trace)
    assert set(df["capacity"]) == set(range(8, 65))            # top_k..n_experts: what the engine runs


def test_belady(benchmark, trace) -> None:
    df = benchmark.pedantic(replay, args=(trace, ["belady"], [8, 16, 32]), rounds=3, iterations=1)
    assert len(df)
