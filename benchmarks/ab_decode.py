"""A/B of batch-1 decode speed between two checkouts of this repository (e.g. a commit before a
change, made with `git worktree add /tmp/old HEAD~1`, against the working tree), on the
benchmark's Mixtral-shaped checkpoint (`--shape small|wide`: bench_vs_llamacpp's shapes): each round runs one fresh process per checkout, in
alternating order (this machine's speed drifts, so the two must be interleaved), and each
process times the same decode steps at each thread count after the same prompt. Prints the
medians with every round's value, the ratio old/new, and whether the greedy tokens agree.
`--skeleton` times the shape's skeleton instead (the same engine and architecture with
its matrices shrunk to nothing): the engine's own per-token cost, which the weight reads' run-to-run
drift hides in the full step.
Not a test: `python benchmarks/ab_decode.py OLD_CHECKOUT [NEW_CHECKOUT] [--rounds 10] [--shape wide] [--skeleton]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import SHAPES  # noqa: E402
from bench_vs_transformers import skeleton_of  # noqa: E402

WORKER = r'''
import json, sys, time
import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch
root, placement, context, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
shape = json.loads(sys.argv[6])
sys.path[:0] = [root, root + "/benchmarks"]
from bench_vs_llamacpp import checkpoint
from engine import Engine
eng = Engine.from_pretrained(str(checkpoint(shape)), placement=placement, device="cpu", max_context=context + steps + 8)
torch.manual_seed(0)
prompt = torch.randint(0, eng.cfg.vocab_size, (context,)).tolist()
out = {}
for th in (int(t) for t in threads.split(",")):
    torch.set_num_threads(th)
    sess = eng.new_session(1)
    tok = eng.prefill(sess, [prompt]).argmax(-1).tolist()
    for _ in range(2):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    toks, t0 = [], time.perf_counter()
    for _ in range(steps):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
        toks += tok
    out[str(th)] = {"ms": (time.perf_counter() - t0) / steps * 1e3, "tokens": toks}
    sess.close()
print(json.dumps(out))
'''


def run(root: Path, args: argparse.Namespace) -> dict:
    shape = json.dumps(skeleton_of(SHAPES[args.shape]) if args.skeleton else SHAPES[args.shape])
    proc = subprocess.run([sys.executable, "-c", WORKER, str(root), args.placement, str(args.context),
                           str(args.steps), args.threads, shape], capture_output=True, text=True,
                          cwd=root)             # `python -c` imports from its working directory: the checkout's own engine
    if proc.returncode:
        raise SystemExit(f"the run in {root} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="checkout A (e.g. a worktree of the commit before a change)")
    ap.add_argument("new", type=Path, nargs="?", default=Path(__file__).resolve().parents[1],
                    help="checkout B (default: this one)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per process and thread count")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before them")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--placement", default="resident")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the benchmark's model shape")
    ap.add_argument("--skeleton", action="store_true",
                    help="time the shape's skeleton (the same architecture, matrices shrunk to "
                         "nothing) -- the engine's own per-token cost, without the weight reads' noise")
    args = ap.parse_args()
    for root in (args.old, args.new):
        if not (root / "engine" / "__init__.py").is_file():
            ap.error(f"{root} is not a checkout of this repository (no engine/__init__.py)")
    ms: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    tokens: dict[str, dict[str, list[int]]] = {"old": {}, "new": {}}
    pair = [("old", args.old), ("new", args.new)]
    print(f"{args.rounds} rounds, {args.steps} decode steps after {args.context} tokens, {args.shape} shape, placement "
          f"{args.placement}{', skeleton' if args.skeleton else ''}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for r in range(args.rounds):
        for name, root in pair if r % 2 == 0 else pair[::-1]:
            for th, res in run(root, args).items():
                ms[name].setdefault(th, []).append(res["ms"])
                tokens[name][th] = res["tokens"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for th in ms["old"]:
        o, n = (statistics.median(ms[v][th]) for v in ("old", "new"))
        spread = {v: ", ".join(f"{x:.1f}" for x in sorted(ms[v][th])) for v in ("old", "new")}
        print(f"{th} thread(s): old {o:.1f} ms/token ({spread['old']}); new {n:.1f} ({spread['new']}); "
              f"speed-up old/new {o / n:.3f}x; same tokens: {tokens['old'][th] == tokens['new'][th]}")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
