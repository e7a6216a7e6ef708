"""A decode step's attention on the CPU: the engine's kernel (engine.kernels.cpu.decode_attention,
one op) against torch's three ops (engine.layers.decode_attention with the kernels off: grouped
matmul, softmax, matmul), over head layouts and context lengths, each at 1 and 2 threads. Warm
caches and no weights streaming in between, so this is each form's own arithmetic and reads; inside
a real step the torch form's five dispatched ops cost more (docs/cpu_experts.md). Prints the
median microseconds of each, their ratio, and the largest difference between the two.
Not a test: `python benchmarks/bench_decode_attention.py [--threads 1,2] [--keys 128,512,2048,16384]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch

from engine.kernels import cpu
from engine.layers import decode_attention

LAYOUTS = ((16, 4, 128), (32, 4, 128), (64, 8, 64), (16, 16, 64))     # (query heads, key heads, head dim)


def median_us(f, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        f()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--keys", default="128,512,2048,16384", help="context lengths (keys held)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit(f"the CPU kernels cannot run here: {cpu.reason()}")
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}; median of {args.repeats} calls, "
          "microseconds: kernel / torch's ops (ratio torch/kernel), max |difference|")
    for H, K, h in LAYOUTS:
        for S in (int(s) for s in args.keys.split(",")):
            g = torch.Generator().manual_seed(S)
            q = torch.randn(1, H, 1, h, generator=g)
            k, v = (torch.randn(1, K, S + 64, h, generator=g)[:, :, :S] for _ in range(2))   # views of a cache
            cells = []
            for th in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(th)
                ours = median_us(lambda: decode_attention(q, k, v, h ** -0.5), args.repeats)
                with cpu.enabled(False):
                    ref = median_us(lambda: decode_attention(q, k, v, h ** -0.5), args.repeats)
                    diff = (decode_attention(q, k, v, h ** -0.5) - cpu.decode_attention(q, k, v, h ** -0.5)).abs().max()
                cells.append(f"{th} thr {ours:8.1f} / {ref:8.1f} ({ref / ours:4.2f}x)")
            print(f"H {H:3d} K {K:2d} h {h:3d} keys {S:6d}: " + "  ".join(cells) + f"  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
