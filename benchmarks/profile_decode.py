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
  line of Python) with its matrices shrunk to nothing (bench_vs_transformers.skeleton_of), timed the same
  way -- the step's cost that is not reading weights;
- the weight reads: F.linear on one row against each of the model's matrix shapes, cycling
  through copies that together exceed twice the last-level cache the CPU reports (cold, as in a
  step: the model's weights are several times the L3), and the step's GEMVs at those rates (each
  shape's bytes times how many a token reads).
What is left of the wall time is the two parts' interaction (and attention's own reads). Then,
in the same interleaved rounds (`--rounds`), the step, the skeleton's step and the step's own
GEMVs replayed back to back (the engine's weight tensors, in the step's order, nothing in
between): step - GEMVs is the engine's own cost as it runs inside a real step, with the weights
streaming past, beside the skeleton's. The profiler's self time of the same ops in the step and
in the skeleton shows the difference: the view-only ops (t, transpose, slice, ...) do the same
work in both, so their ratio is how much slower the engine's own code runs amid a real step's
weight reads.
`--llamacpp` puts llama.cpp's decode (its own timings, exact configuration) on the benchmark's
GGUF and on the skeleton's into the same rounds, so its step splits the same way, without its
internals: skeleton + the rest (its time reading the same weights, and all that scales with them).
`--gaps` instead times every call into the engine's CPU kernels inside unprofiled steps: the calls
that read weights (the projections, the experts, the head) against everything between them --
the gaps, where the step's other ops and Python run while no weights stream -- with the gap before
each weight read of the step, by position (the first layer's and the last one's).
`--shape small|wide`: bench_vs_llamacpp's shapes.
Not a test: `python benchmarks/profile_decode.py [--shape wide] [--threads 1,2] [--steps 16]
[--split [--llamacpp] | --gaps]`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_llamacpp import SHAPE, SHAPES, checkpoint  # noqa: E402
from bench_vs_transformers import GEMV_OPS, category, skeleton_of  # noqa: E402
from engine import Engine  # noqa: E402
from harness.costmodel.calibrate import best_time, cold_mib  # noqa: E402
from harness.llamacpp.build import Binaries, find_binaries  # noqa: E402
from harness.llamacpp.convert import convert  # noqa: E402
from harness.llamacpp.flags import EXACT  # noqa: E402
from harness.llamacpp.server import LlamaServer  # noqa: E402


def planned_context(context: int, steps: int) -> int:
    """The context an engine or llama-server is planned for: the prompt, the warm and measured
    steps of one `decode`, and a margin."""
    return context + steps + 8


def decode(eng: Engine, prompt: list[int], steps: int, prof: bool):
    sess = eng.new_session(1)
    tok = eng.prefill(sess, [prompt]).argmax(-1).tolist()
    for _ in range(2):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) if prof else contextlib.nullcontext() as p:
        for _ in range(steps):
            tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    wall = (time.perf_counter() - t0) / steps
    sess.close()
    return wall, p


# ops that only make a new view of a tensor: their cost is dispatch, whatever the tensor's size
VIEW_OPS = frozenset(f"aten::{n}" for n in ("t", "transpose", "as_strided", "slice", "view", "narrow", "unsqueeze",
                                             "reshape", "select", "unbind", "chunk", "split", "expand", "detach"))


def op_ms(p, steps: int) -> dict[str, float]:
    """Each op's self time in ms per token from a profile of `steps` decode steps."""
    ops: dict[str, float] = defaultdict(float)
    for e in p.key_averages():
        ops[e.key] += e.self_cpu_time_total / steps / 1e3
    return ops


def one_step_ops(eng: Engine, prompt: list[int], on_op: Callable[[object, tuple], None]) -> None:
    """Call `on_op(func, args)` for each aten op one batch-1 decode step dispatches (after a
    prefill and one warm step), under a TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            on_op(func, args)
            return func(*args, **(kwargs or {}))

    sess = eng.new_session(1)
    tok = eng.prefill(sess, [prompt]).argmax(-1).tolist()
    tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    with Watch():
        eng.decode_step(sess, tok)
    sess.close()


def aten_calls(eng: Engine, prompt: list[int]) -> Counter:
    """The aten ops one batch-1 decode step dispatches, counted."""
    calls: Counter = Counter()
    one_step_ops(eng, prompt, lambda func, args: calls.update([str(func)]))
    return calls


SKELETON = skeleton_of(SHAPE)


def skeleton_ms(skel: Engine, prompt: list[int], threads: list[int], steps: int) -> dict[int, float]:
    """ms per decode token of the skeleton engine (best of 3), at each thread count."""
    out = {}
    for th in threads:
        torch.set_num_threads(th)
        out[th] = min(decode(skel, prompt, steps, prof=False)[0] for _ in range(3)) * 1e3
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


def cold_gemv(shape: tuple[int, int], threads: list[int], exceed_mib: int = 320) -> dict[int, float]:
    """Seconds per F.linear of one row against a `shape` fp32 matrix, read cold: cycling through
    copies that together exceed `exceed_mib` MiB and twice this CPU's last-level cache (`cold_mib`)."""
    exceed = cold_mib(exceed_mib) << 20
    ws = [torch.randn(shape) for _ in range(max(2, -(-exceed // (shape[0] * shape[1] * 4))))]
    x = torch.randn(1, shape[1])
    out = {}
    for th in threads:
        torch.set_num_threads(th)
        out[th] = best_time(lambda: [torch.nn.functional.linear(x, w) for w in ws], 3) / len(ws)
    return out


def step_gemvs(eng: Engine, prompt: list[int]) -> list[torch.Tensor]:
    """The weight matrices one batch-1 decode step reads with `aten.linear`, in its order: the
    engine's own tensors (the experts it routed to included)."""
    weights: list[torch.Tensor] = []
    one_step_ops(eng, prompt, lambda func, args: weights.append(args[1])
                 if func is torch.ops.aten.linear.default else None)
    return weights


def gemv_replay(eng: Engine, prompt: list[int]) -> tuple[Callable[[], float], int, int]:
    """A callable that replays one decode step's GEMVs back to back -- one row against each of
    the step's weight tensors, in order, nothing in between -- and returns its seconds; with the
    GEMVs' count and bytes."""
    weights = step_gemvs(eng, prompt)
    xs = {n: torch.randn(1, n) for n in {w.shape[1] for w in weights}}

    def run() -> float:
        t0 = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        return time.perf_counter() - t0

    return run, len(weights), sum(w.numel() * w.element_size() for w in weights)


def split(eng: Engine, prompt: list[int], threads: list[int], steps: int, context: int, placement: str,
          wall_ms: dict[int, float], per_op: dict[int, dict[str, float]], rounds: int, bins: Binaries | None) -> None:
    skel = Engine.from_pretrained(str(checkpoint(SKELETON)), placement=placement, device="cpu",
                                  max_context=planned_context(context, steps))
    skel_prompt = torch.randint(0, SKELETON["vocab_size"], (context,)).tolist()
    skel_ms = skeleton_ms(skel, skel_prompt, threads, steps)
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
    nbytes = sum(s[0] * s[1] * 4 * n for s, n in mats.items())
    for th in threads:
        rest = wall_ms[th] - skel_ms[th] - reads[th]
        print(f"   {th} thread(s): wall {wall_ms[th]:.1f} ms/token = skeleton {skel_ms[th]:.1f} + the "
              f"{nbytes / 2**20:.0f} MiB of GEMVs at those rates {reads[th]:.1f} + the rest {rest:.1f}")
    print("-- the same ops' profiled self time, in the step and in the skeleton (ms/token):")
    for th in threads:
        torch.set_num_threads(th)
        skel_ops = op_ms(decode(skel, skel_prompt, steps, prof=True)[1], steps)
        cells = []
        for what, keep in (("every op but aten::mm", lambda k: k not in GEMV_OPS),
                           ("view-only ops", lambda k: k in VIEW_OPS)):
            a, b = (sum(ms for k, ms in o.items() if keep(k)) for o in (per_op[th], skel_ops))
            cells.append(f"{what} {a:.2f} vs {b:.2f} ({a / b:.1f}x)")
        print(f"   {th} thread(s): " + "; ".join(cells))
    interleaved(eng, skel, {"step": prompt, "skeleton": skel_prompt}, threads, steps, context, rounds, bins)


def interleaved(eng: Engine, skel: Engine, prompts: dict[str, list[int]], threads: list[int], steps: int,
                context: int, rounds: int, bins: Binaries | None) -> None:
    """Ours three ways in the same interleaved rounds -- the step, the skeleton's step, the step's
    GEMVs replayed back to back -- so step - GEMVs is the engine's own cost as it runs inside a
    real step (the weights streaming past), beside the skeleton's. With llama.cpp (the exact
    configuration, its own timings), its step and its skeleton's in the same rounds: its step -
    skeleton is its time reading the same weights and everything that scales with them (`bins`:
    the llama.cpp build; None: ours alone)."""
    gemvs, n, nbytes = gemv_replay(eng, prompts["step"])
    ours = {"step": eng, "skeleton": skel}
    shapes = {"step": SHAPE, "skeleton": SKELETON}
    ggufs = {k: convert(checkpoint(shape), "f32") for k, shape in shapes.items()} if bins else {}
    print(f"-- ms per decode token, median of {rounds} interleaved rounds; GEMVs: the step's {n} "
          f"({nbytes / 2**20:.0f} MiB of the engine's own weights) replayed back to back"
          + (f"; llama.cpp {bins.info.llama_cpp_commit if bins.info else bins.origin} "
             f"({' '.join(EXACT.server_argv())}), its own timings" if bins else ""))
    for th in threads:
        torch.set_num_threads(th)
        flags = EXACT.replace(threads=th, ctx=planned_context(context, steps), cache_ram=0)
        with contextlib.ExitStack() as stack:
            servers = {k: stack.enter_context(LlamaServer(
                g.path, flags, log_path=Path(tempfile.gettempdir()) / f"profile_decode-{k}-t{th}.log", binaries=bins))
                for k, g in ggufs.items()}

            def llama(kind: str) -> float:
                t = servers[kind].complete(prompts[kind], steps + 1, cache_prompt=False).timings
                assert t.cache_n == 0 and t.decode_steps == steps, t.raw
                return t.predicted_ms / t.decode_steps

            runs = {("ours", k): (lambda k=k: decode(ours[k], prompts[k], steps, prof=False)[0] * 1e3) for k in ours}
            runs["ours", "GEMVs"] = lambda: gemvs() * 1e3
            runs.update({("llama.cpp", k): (lambda k=k: llama(k)) for k in servers})
            for k in servers:                                              # warm-up, excluded
                llama(k)
            ms: dict[tuple[str, str], list[float]] = defaultdict(list)
            for r in range(rounds):
                for key in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                    ms[key].append(runs[key]())
        med = {k: statistics.median(v) for k, v in ms.items()}
        step, own = med["ours", "step"], med["ours", "step"] - med["ours", "GEMVs"]
        line = (f"   {th} thread(s), load average {os.getloadavg()[0]:.2f}: ours step {step:.1f} = GEMVs "
                f"{med['ours', 'GEMVs']:.1f} ({nbytes / med['ours', 'GEMVs'] / 1e6:.1f} GB/s) + own cost {own:.1f} "
                f"(skeleton alone {med['ours', 'skeleton']:.1f})")
        if servers:
            ll, ll_skel = med["llama.cpp", "step"], med["llama.cpp", "skeleton"]
            line += (f"; llama.cpp step {ll:.1f} = skeleton {ll_skel:.1f} + the rest {ll - ll_skel:.1f} "
                     f"({nbytes / (ll - ll_skel) / 1e6:.1f} GB/s); ours/llama.cpp in tok/s {ll / step:.2f}x")
        print(line)


WEIGHT_OPS = ("linear", "linears", "small_linear", "grouped_small_linear", "swiglu", "swiglu_add_", "int8_linear",
              "int4_linear", "int8_q8_linear", "int4_q8_linear")     # the kernel calls that read weight matrices


def gaps(eng: Engine, prompt: list[int], threads: list[int], steps: int) -> None:
    """Each weight-reading kernel call of `steps` decode steps timed, and the time between them."""
    from engine.kernels import cpu
    if not cpu.available():
        raise SystemExit(f"--gaps times the CPU kernels' calls, and they cannot run here: {cpu.reason()}")
    log: list[tuple[str, int, int]] = []

    def timed(name: str, op: Callable) -> Callable:
        if name not in WEIGHT_OPS:
            return op

        def call(*args):
            t0 = time.perf_counter_ns()
            out = op(*args)
            log.append((name, t0, time.perf_counter_ns()))
            return out
        return call

    for th in threads:
        torch.set_num_threads(th)
        sess = eng.new_session(1)
        tok = eng.prefill(sess, [prompt]).argmax(-1).tolist()
        for _ in range(2):
            tok = eng.decode_step(sess, tok).argmax(-1).tolist()
        walls, reads, before = [], [], defaultdict(list)
        with cpu.wrapped(timed):
            for _ in range(steps):
                log.clear()
                t0 = time.perf_counter_ns()
                tok = eng.decode_step(sess, tok).argmax(-1).tolist()
                walls.append(time.perf_counter_ns() - t0)
                reads.append(sum(b - a for _, a, b in log))
                ends = [t0] + [b for _, _, b in log]
                for i, (name, a, _) in enumerate(log):
                    before[i, name].append(a - ends[i])
        sess.close()
        wall, read = statistics.median(walls) / 1e6, statistics.median(reads) / 1e6
        print(f"-- {th} thread(s), load average {os.getloadavg()[0]:.2f}, medians of {steps} steps: {wall:.2f} "
              f"ms/token = weight-reading kernel calls {read:.2f} + the rest {wall - read:.2f}; microseconds "
              "before each weight read (its position in the step, the op):")
        calls = sorted(before)
        per_layer = (len(calls) - 1) // eng.cfg.num_layers if eng.cfg.num_layers else 0
        shown = calls[:per_layer + 1] + [None] + calls[-per_layer - 1:] if per_layer else calls   # first, last layer
        for call in shown:
            us = None if call is None else statistics.median(before[call]) / 1e3
            print("   ..." if call is None else f"   {call[0]:4d} {call[1]:<14} {us:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the benchmark's model shape")
    ap.add_argument("--gaps", action="store_true", help="time the kernel calls that read weights and the gaps between")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the measured steps")
    ap.add_argument("--placement", default="resident")
    ap.add_argument("--split", action="store_true", help="also time the step's skeleton and its weight reads apart")
    ap.add_argument("--rounds", type=int, default=7, help="with --split: interleaved rounds of the step's parts")
    ap.add_argument("--llamacpp", action="store_true",
                    help="with --split: llama.cpp's step and skeleton in the same rounds (needs `make llamacpp`)")
    args = ap.parse_args()
    if args.split and args.shape != "small":
        ap.error("--split takes the small shape apart (its skeleton and weight reads); --gaps times any shape")
    if args.llamacpp and not args.split:
        ap.error("--llamacpp takes llama.cpp's step apart beside ours: it needs --split")
    bins = find_binaries() if args.llamacpp else None    # a missing build fails now, not after minutes of profiling
    eng = Engine.from_pretrained(str(checkpoint(SHAPES[args.shape])), placement=args.placement, device="cpu",
                                 max_context=planned_context(args.context, args.steps))
    torch.manual_seed(0)
    prompt = torch.randint(0, eng.cfg.vocab_size, (args.context,)).tolist()
    if args.gaps:
        return gaps(eng, prompt, [int(t) for t in args.threads.split(",")], args.steps)
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
        ops = per_op[th] = op_ms(p, args.steps)
        cats: dict[str, float] = defaultdict(float)
        for k, ms in ops.items():
            cats[category(k)] += ms
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
        split(eng, prompt, threads, args.steps, args.context, args.placement, walls, per_op, args.rounds, bins)


if __name__ == "__main__":
    main()
