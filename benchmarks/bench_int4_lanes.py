"""The int4 kernel's two block widths on one decode row: 8 lanes (AVX2) against 16 (AVX-512).

One row of x through a set of int4 (group 32) matrices larger than the last-level cache -- by
default 24 of 4096 x 2048, 130 MB packed -- at each thread count, the widths interleaved round by
round; prints the median ms per pass and the packed bytes read per second (values, scales and
zero points). On a CPU without AVX-512 only the 8-lane blocks run; a checkout whose kernel has one
width (no `lanes` argument) times that one. docs/cpu_experts.md has a run.

Not a test: `python benchmarks/bench_int4_lanes.py [--threads 1,2] [--rounds 15] [--mats 24]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch  # noqa: E402

from engine.blocks.intquant import quantize_int4  # noqa: E402
from engine.kernels import cpu  # noqa: E402

O, K, GROUP = 4096, 2048, 32


def packed_matrix(seed: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A random [O, K] matrix quantised to int4 in one buffer [scales | zero points | values] and the
    kernel's arguments after (x, packed)."""
    q, scale, zero = quantize_int4(torch.randn(O, K, generator=torch.Generator().manual_seed(seed)) * 0.02, GROUP)
    parts = [scale.reshape(-1).view(torch.uint8), zero.reshape(-1), q.reshape(-1)]
    zero_at, q_at = parts[0].numel(), parts[0].numel() + parts[1].numel()
    return torch.cat(parts), (q_at, 0, zero_at, O, K, GROUP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--mats", type=int, default=24)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu.reason()}")
    mats = [packed_matrix(i) for i in range(args.mats)]
    nbytes = sum(p.numel() for p, _ in mats)
    widths: list[int | None] = [8]
    try:
        cpu.int4_linear(torch.zeros(1, K), mats[0][0], *mats[0][1], lanes=16)
        widths.append(16)
    except RuntimeError:                        # no AVX-512 here: the 8-lane blocks alone
        pass
    except TypeError:                           # a kernel of one width (before the two): its own
        widths = [None]
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(99))
    print(f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}; {args.mats} int4 matrices "
          f"{O}x{K}, group {GROUP}, {nbytes / 1e6:.0f} MB packed; one row; median of {args.rounds} rounds")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        times: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(args.rounds + 1):                           # the first round warms up
            for w in widths:
                t = time.perf_counter()
                for packed, kargs in mats:
                    cpu.int4_linear(x, packed, *kargs, **({} if w is None else {"lanes": w}))
                times[w].append(time.perf_counter() - t)
        for w in widths:
            ms = statistics.median(times[w][1:]) * 1e3
            print(f"{threads} thread(s)  {'its' if w is None else w:>3} lanes  {ms:6.2f} ms  {nbytes / ms / 1e6:5.1f} GB/s")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
