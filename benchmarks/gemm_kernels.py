"""Which CPU GEMM the experts could run, at the rows a prefill or a decode step gives one expert:
`F.linear(x, W)` (what the engine and transformers both run: the same MKL sgemm on the same
shapes), `torch.mm(x, Wt)` with the weight stored transposed, and MKL's packed sgemm
(`torch.ops.mkl._mkl_linear` on a weight reordered once by `_mkl_reorder_linear_weight`, what
inductor's CPU freezing uses). Per case: the median of interleaved rounds, each kernel's ratio to
F.linear, and whether its output is bitwise F.linear's. Dated runs of it, and what they
said about the prefill target, are in docs/history/2026-12-02-engine-speed.md.

The packed weight is an opaque MKL-DNN tensor: it cannot be a view into the engine's packed
expert buffers, be copied into a cache slot or sliced, so a placement that copies experts (fetch,
stream) could not run it, and outputs would then depend on the placement.
Not a test: `python benchmarks/gemm_kernels.py [--threads 1,2] [--rounds 7]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_backends import ms  # noqa: E402 -- warmed once, then the mean of n calls

D, I = 1024, 1024             # the engine-speed benchmarks' model: hidden 1024, expert intermediate 1024
WEIGHTS = ((2 * I, D, "gate|up [2I, D]"), (D, I, "down [D, I]"))
ROWS = (1, 16, 64, 128, 512)  # a decode step; a 512-token prefill's experts (64 on average) and dense layers


def kernels(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    wt = w.t().contiguous()
    out = {"F.linear": lambda: F.linear(x, w), "mm(x, Wt)": lambda: torch.mm(x, wt)}
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0])
        out["mkl packed"] = lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}, median of {args.rounds} "
          "interleaved rounds, microseconds per call (ratio: F.linear's time / the kernel's)")
    gen = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for n_out, n_in, name in WEIGHTS:
            w = torch.randn(n_out, n_in, generator=gen)
            for rows in ROWS:
                x = torch.randn(rows, n_in, generator=gen)
                ks = kernels(x, w)
                calls = max(5, 20000 // (rows * 8))
                times: dict[str, list[float]] = {k: [] for k in ks}
                for r in range(args.rounds):
                    for k in (list(ks) if r % 2 == 0 else list(ks)[::-1]):
                        times[k].append(ms(ks[k], calls) * 1e3)
                ref = ks["F.linear"]()
                base = statistics.median(times["F.linear"])
                cells = [f"{k} {statistics.median(v):8.1f} ({base / statistics.median(v):.2f}x"
                         f"{', bitwise' if k == 'F.linear' or torch.equal(ks[k](), ref) else ''})"
                         for k, v in times.items()]
                print(f"{threads} thread(s) {name:<15} rows {rows:>4}: " + "  ".join(cells))
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
