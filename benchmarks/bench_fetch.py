"""Fetch with copies issued ahead vs one at a time, on the emulated device: decode with the
expert cache smaller than a step's working set, no prefetch, `issue_ahead` off and on
interleaved in one run.

Per round and setting: one speed pass (instrument off; seconds per decode token) and one
timeline pass (overlap_frac of expert copies with compute, harness.profiling.overlap).
Prints medians with min-max over rounds, the torch thread count and the load average
before and after. Not a test:
`OMP_NUM_THREADS=1 python benchmarks/bench_fetch.py [--rounds 7] [--steps 32]`.

On the emulated device a copy is a memcpy on the copy worker thread while the main thread
computes, so copies can only overlap compute when a second core is free; hits, misses and
bytes are identical in both settings (tests/engine/test_invariant.py), only the schedule
differs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine  # noqa: E402
from engine.timeline import Timeline  # noqa: E402
from harness.profiling.overlap import overlap_metrics  # noqa: E402

# 16 experts of 3 * 512 * 1024 * 4 B = 6 MiB each (fp32), top-2: a decode step of batch 2 needs
# up to 4 experts per layer, the cache holds 2
SHAPE = {"hidden_size": 512, "moe_intermediate_size": 1024, "intermediate_size": 1024, "num_heads": 8,
         "num_kv_heads": 2, "head_dim": 64, "num_layers": 4, "n_experts": 16, "top_k": 2}


def decode(eng: Engine, prompts: list[list[int]], steps: int, timeline: Timeline | None) -> tuple[float, float | None]:
    """(seconds per decode token, overlap_frac or None) of one cold-cache pass."""
    eng.reset()
    eng.set_instrument(timeline)
    sess = eng.new_session(len(prompts))
    tok = eng.prefill(sess, prompts).argmax(-1).tolist()
    eng.device.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    eng.device.synchronize()
    t1 = time.perf_counter()
    eng.set_instrument(None)
    sess.close()
    frac = None
    if timeline is not None:
        timeline.collect()
        m = overlap_metrics(timeline.intervals("copy", t0, t1), timeline.compute_intervals(t0, t1), emulated=True)
        frac = m["overlap_frac"]
    return (t1 - t0) / steps, frac


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4g} ({min(xs):.4g}-{max(xs):.4g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=2)
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"cpus {os.cpu_count()}, load average before {os.getloadavg()}")
    engines = {ahead: Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch",
                                             cache_capacity=args.capacity, issue_ahead=ahead, model_overrides=SHAPE,
                                             max_context=64 + args.steps)
               for ahead in (False, True)}
    prompts = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()
    per_token: dict[bool, list[float]] = {False: [], True: []}
    overlap: dict[bool, list[float]] = {False: [], True: []}
    for eng in engines.values():
        decode(eng, prompts, 4, None)                                  # warm-up
    for _ in range(args.rounds):
        for ahead, eng in engines.items():                             # interleaved: drift hits both alike
            per_token[ahead].append(decode(eng, prompts, args.steps, None)[0])
            overlap[ahead].append(decode(eng, prompts, args.steps, Timeline("cpu"))[1])
    c = {ahead: eng.counters for ahead, eng in engines.items()}
    eb = engines[True].model.store.expert_bytes
    print(f"decode, batch 2, {args.steps} steps x {args.rounds} rounds, capacity {args.capacity} of 16 experts "
          f"({eb / 2**20:.1f} MiB each), emulated device; misses per pass equal in both: "
          f"{c[False]['expert_misses'] == c[True]['expert_misses']} ({c[True]['expert_misses']} in the last pass)")
    print(f"{'issue_ahead':<12} {'s/token median (min-max)':<30} {'overlap_frac median (min-max)':<30}")
    for ahead in (False, True):
        print(f"{str(ahead):<12} {spread(per_token[ahead]):<30} {spread(overlap[ahead]):<30}")
    ratio = statistics.median(per_token[False]) / statistics.median(per_token[True])
    print(f"time per token, off / on: {ratio:.3f}x")
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
