"""Replay-simulator speed on a synthetic trace of 100k tokens x 32 layers x top-8 of 64 experts
(25.6M lookups, decode-like: one token per step).

Reports: trace generation time; replay rate (lookups/s) of lru, lfu, fifo through the
engine's policy classes (on the first --class-layers layers, to keep the run short; the
rate does not depend on the layer count); the full LRU curve (every capacity 8..64, top_k..n_experts, stack
distances, all layers) against its 60 s target; Belady at 5 capacities (all layers, fast
kernel) against its 120 s target. Single process, one core of numpy work.
Not a test: run `python benchmarks/bench_sim.py [--tokens N] [--class-layers L]`.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.trace import RoutingTrace, lookup_arrays  # noqa: E402
from harness.sim.replay import lru_curve, replay  # noqa: E402
from harness.sim.synthetic import generate  # noqa: E402

LAYERS, EXPERTS, TOP_K = 32, 64, 8
BELADY_CAPACITIES = (8, 16, 24, 32, 48)
CURVE_TARGET_S, BELADY_TARGET_S = 60.0, 120.0


def subset(tr: RoutingTrace, layers: int) -> RoutingTrace:
    meta = dict(tr.meta, moe_layers=tr.moe_layers[:layers])
    return RoutingTrace(experts=tr.experts[:, :layers].copy(), meta=meta).validate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--class-layers", type=int, default=4, help="layers replayed through the policy classes")
    ap.add_argument("--capacity", type=int, default=16, help="capacity for the class replays")
    args = ap.parse_args()
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.processor() or platform.machine()}")

    t0 = time.perf_counter()
    tr = generate(LAYERS, EXPERTS, TOP_K, args.tokens, zipf=0.25, reuse=0.1, seed=0)
    lookups = sum(len(ids) for ids, _ in lookup_arrays(tr))
    print(f"generate: {args.tokens} tokens x {LAYERS} layers x top-{TOP_K} of {EXPERTS} -> {lookups:,} lookups "
          f"in {time.perf_counter() - t0:.1f} s")

    small = subset(tr, args.class_layers)
    n_small = sum(len(ids) for ids, _ in lookup_arrays(small))
    for policy in ("lru", "lfu", "fifo"):
        t0 = time.perf_counter()
        df = replay(small, [policy], [args.capacity])
        dt = time.perf_counter() - t0
        hr = df[df.layer == "all"].hit_rate.iloc[0]
        print(f"replay {policy:5s} capacity {args.capacity}: {n_small / dt / 1e6:.2f} M lookups/s "
              f"({n_small:,} lookups in {dt:.1f} s, hit rate {hr:.3f})")

    t0 = time.perf_counter()
    curve = lru_curve(tr)
    dt = time.perf_counter() - t0
    tot = curve[curve.layer == "all"].set_index("capacity").hit_rate
    print(f"lru curve, capacities {TOP_K}..{EXPERTS}, all layers: {dt:.1f} s (target < {CURVE_TARGET_S:.0f} s; "
          f"{lookups / dt / 1e6:.2f} M lookups/s); hit rate at 8/16/32: "
          f"{tot[8]:.3f}/{tot[16]:.3f}/{tot[32]:.3f}")

    t0 = time.perf_counter()
    bel = replay(tr, ["belady"], list(BELADY_CAPACITIES))
    dt = time.perf_counter() - t0
    rates = bel[bel.layer == "all"].set_index("capacity").hit_rate
    print(f"belady at capacities {list(BELADY_CAPACITIES)}, all layers: {dt:.1f} s (target < {BELADY_TARGET_S:.0f} s); "
          f"hit rates {', '.join(f'{c}: {rates[c]:.3f}' for c in BELADY_CAPACITIES)}")


if __name__ == "__main__":
    main()
