"""Where a decode step's time goes: torch.profiler over batch-1 decode of the benchmark's
Mixtral-shaped checkpoint (the one bench_vs_llamacpp loads), at each thread count, split into
the weight-streaming GEMVs (aten::mm: attention projections, experts, router, head), the
attention kernel, and every other op, beside the unprofiled wall time per token (the
difference is Python and dispatch, plus the profiler's own cost). Also each op's self time at
the highest thread count over the lowest -- an op far above 1 while doing little work enters
an OpenMP region it cannot use (how `index_add_` on one row was found: ~100x at 2 threads).
Also the aten calls one decode step makes (each a few µs of dispatch on this CPU, whatever it
computes), counted under a TorchDispatchMode, with the most frequent.
Not a test: `python benchmarks/profile_decode.py [--threads 1,2] [--steps 16]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_llamacpp import checkpoint  # noqa: E402
from engine import Engine  # noqa: E402


def category(name: str) -> str:
    if name in ("aten::mm", "aten::addmm"):
        return "GEMV (aten::mm)"
    if "scaled_dot_product" in name:
        return "attention kernel"
    return "other ops"


def decode(eng: Engine, prompt: list[int], steps: int, prof: bool):
    sess = eng.new_session(1)
    tok = eng.prefill(sess, [prompt]).argmax(-1).tolist()
    for _ in range(2):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    t0 = time.perf_counter()
    if prof:
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(steps):
                tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    else:
        p = None
        for _ in range(steps):
            tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    wall = (time.perf_counter() - t0) / steps
    sess.close()
    return wall, p


def aten_calls(eng: Engine, prompt: list[int]) -> Counter:
    """The aten ops one batch-1 decode step dispatches (after a prefill and one warm step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    sess = eng.new_session(1)
    tok = eng.prefill(sess, [prompt]).argmax(-1).tolist()
    tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    with Count():
        eng.decode_step(sess, tok)
    sess.close()
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the measured steps")
    ap.add_argument("--placement", default="resident")
    args = ap.parse_args()
    eng = Engine.from_pretrained(str(checkpoint()), placement=args.placement, device="cpu",
                                 max_context=args.context + args.steps + 8)
    torch.manual_seed(0)
    prompt = torch.randint(0, eng.cfg.vocab_size, (args.context,)).tolist()
    calls = aten_calls(eng, prompt)
    print(f"aten calls per decode step: {sum(calls.values())} ("
          + ", ".join(f"{k} {v}" for k, v in calls.most_common(6)) + ", ...)")
    per_op: dict[int, dict[str, float]] = {}
    print(f"torch {torch.__version__}, nproc {os.cpu_count()}, placement {args.placement}, "
          f"{args.steps} steps after {args.context} tokens")
    for th in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(th)
        wall, _ = decode(eng, prompt, args.steps, prof=False)
        _, p = decode(eng, prompt, args.steps, prof=True)
        cats: dict[str, float] = defaultdict(float)
        ops: dict[str, float] = defaultdict(float)
        for e in p.key_averages():
            cats[category(e.key)] += e.self_cpu_time_total / args.steps / 1e3        # ms per token
            ops[e.key] += e.self_cpu_time_total / args.steps / 1e3
        per_op[th] = ops
        total = sum(cats.values())
        print(f"-- {th} thread(s), load average {os.getloadavg()[0]:.2f}: {wall * 1e3:.1f} ms/token unprofiled "
              f"({1 / wall:.1f} tok/s); profiled op self time {total:.1f} ms/token:")
        for c, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
            print(f"   {c:<18} {ms:7.2f} ms/token  {ms / total:6.1%}")
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
        print("   top ops: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    if len(per_op) > 1:
        lo, hi = min(per_op), max(per_op)
        ratios = sorted(((per_op[hi][k] / v, k) for k, v in per_op[lo].items() if k in per_op[hi] and v > 0.02),
                        reverse=True)[:8]
        print(f"self time at {hi} threads / at {lo}: " + ", ".join(f"{k} {r:.1f}x" for r, k in ratios))


if __name__ == "__main__":
    main()
