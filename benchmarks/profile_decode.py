"""Where a decode step's time goes: torch.profiler over batch-1 decode of the benchmark's
Mixtral-shaped checkpoint (the one bench_vs_llamacpp loads), at each thread count, split into
the weight-streaming GEMVs (aten::mm: attention projections, experts, router, head), the
attention kernel, and every other op, beside the unprofiled wall time per token (the
difference is Python and dispatch, plus the profiler's own cost). Also each op's self time at
the highest thread count over the lowest -- an op far above 1 while doing little work enters
an OpenMP region it cannot use (how `index_add_` on one row was found: ~100x at 2 threads).
Also the aten calls one decode step makes (each a few µs of dispatch on this CPU, whatever it
computes), counted under a TorchDispatchMode, with the most frequent.

`--split` also takes the step apart without the profiler, each part measured by itself:
- the skeleton: the same architecture (layers, heads, experts, top-k, the engine's every op and
  line of Python) with its matrices shrunk to nothing (hidden 64, vocab 512), timed the same
  way -- the step's cost that is not reading weights;
- the weight reads: F.linear on one row against each of the model's matrix shapes, cycling
  through copies that together exceed the last-level cache (cold, as in a step: the model's
  weights are several times the L3), and the step's GEMVs at those rates (each shape's bytes
  times how many a token reads).
What is left of the wall time is the two parts' interaction (and attention's own reads).
Not a test: `python benchmarks/profile_decode.py [--threads 1,2] [--steps 16] [--split]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_llamacpp import SHAPE, checkpoint  # noqa: E402
from engine import Engine  # noqa: E402
from harness.costmodel.calibrate import best_time  # noqa: E402


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


def skeleton_ms(threads: list[int], steps: int, context: int, placement: str) -> dict[int, float]:
    """ms per decode token of the benchmark's architecture with every matrix shrunk to nothing."""
    import transformers as tf

    shape = SHAPE | {"hidden_size": 64, "intermediate_size": 64, "vocab_size": 512}
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        tf.MixtralForCausalLM(tf.MixtralConfig(**shape)).save_pretrained(d)
        eng = Engine.from_pretrained(d, placement=placement, device="cpu", max_context=context + steps + 8)
        prompt = torch.randint(0, shape["vocab_size"], (context,)).tolist()
        out = {}
        for th in threads:
            torch.set_num_threads(th)
            out[th] = min(decode(eng, prompt, steps, prof=False)[0] for _ in range(3)) * 1e3
        return out


def step_matrices(eng: Engine) -> dict[tuple[int, int], int]:
    """(rows, cols) of each weight matrix a batch-1 decode token reads -> how many times it reads it."""
    c = eng.cfg
    D, q, kv, I = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.moe_intermediate_size
    total: Counter = Counter()
    for shape, n in (((q, D), 1), ((kv, D), 2), ((D, q), 1), ((c.n_experts, D), 1),      # q, k and v, o, router
                     ((2 * I, D), c.top_k), ((D, I), c.top_k)):                         # each chosen expert
        total[shape] += n * c.num_layers                                                # (shapes may coincide)
    total[(c.vocab_size, D)] += 1                                                       # the head
    return dict(total)


def cold_gemv(shape: tuple[int, int], threads: list[int], exceed: int = 320 << 20) -> dict[int, float]:
    """Seconds per F.linear of one row against a `shape` fp32 matrix, read cold: cycling through
    copies that together exceed `exceed` bytes (several times this CPU's L3)."""
    ws = [torch.randn(shape) for _ in range(max(2, -(-exceed // (shape[0] * shape[1] * 4))))]
    x = torch.randn(1, shape[1])
    out = {}
    for th in threads:
        torch.set_num_threads(th)
        out[th] = best_time(lambda: [torch.nn.functional.linear(x, w) for w in ws], 3) / len(ws)
    return out


def split(eng: Engine, threads: list[int], steps: int, context: int, placement: str,
          wall_ms: dict[int, float]) -> None:
    skel = skeleton_ms(threads, steps, context, placement)
    mats = step_matrices(eng)
    reads = {th: 0.0 for th in threads}
    print("-- the step taken apart (--split): weight reads, cold, per matrix shape:")
    for shape, n in sorted(mats.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1]):
        t = cold_gemv(shape, threads)
        nbytes = shape[0] * shape[1] * 4
        for th in threads:
            reads[th] += n * t[th] * 1e3
        print(f"   {shape[0]:>6}x{shape[1]:<5} x{n:<3} " + "  ".join(
            f"{th} thr {t[th] * 1e6:7.0f} us {nbytes / t[th] / 1e9:5.1f} GB/s" for th in threads))
    mib = sum(s[0] * s[1] * 4 * n for s, n in mats.items()) / 2**20
    for th in threads:
        rest = wall_ms[th] - skel[th] - reads[th]
        print(f"   {th} thread(s): wall {wall_ms[th]:.1f} ms/token = skeleton {skel[th]:.1f} + the {mib:.0f} MiB "
              f"of GEMVs at those rates {reads[th]:.1f} + the rest {rest:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the measured steps")
    ap.add_argument("--placement", default="resident")
    ap.add_argument("--split", action="store_true", help="also time the step's skeleton and its weight reads apart")
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
    threads = [int(t) for t in args.threads.split(",")]
    walls: dict[int, float] = {}
    for th in threads:
        torch.set_num_threads(th)
        wall, _ = decode(eng, prompt, args.steps, prof=False)
        walls[th] = wall * 1e3
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
    if args.split:
        split(eng, threads, args.steps, args.context, args.placement, walls)


if __name__ == "__main__":
    main()
