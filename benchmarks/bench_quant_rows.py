"""Where a quantised expert's rows should stop taking the CPU kernel: one expert of the wide benchmark
shape (hidden = expert intermediate = 2048) run on n rows by the kernel on its packed bytes and by
the dequantise-then-GEMM path (the kernels off), per format and input treatment, best of 4, in ms.
`engine.kernels.cpu.QUANT_MAX_ROWS` is set from this table, below the row count where the two meet
at any format and thread count measured (docs/cpu_experts.md has a run).

Not a test: `python benchmarks/bench_quant_rows.py [--threads 1,2] [--rows 8,32,128,256]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch  # noqa: E402

from engine.blocks.experts import SwiGLUExperts  # noqa: E402
from engine.blocks.quant_experts import QuantExperts  # noqa: E402
from engine.kernels import cpu  # noqa: E402

D = I = 2048


def best_ms(f, x: torch.Tensor, rounds: int = 4) -> float:
    f(x)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        f(x)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="8,32,128,256")
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu.reason()}")
    print(f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}; one expert D = I = {D}; "
          f"QUANT_MAX_ROWS = {cpu.QUANT_MAX_ROWS}")
    print("threads | format | inputs | rows | kernel ms | dequantise + GEMM ms | kernel faster")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for fmt in ("int8", "int4"):
            for acts in ("fp32", "int8"):
                layout = QuantExperts(SwiGLUExperts(D, I, "silu", "m.{layer}"), fmt, 32, acts)
                packed = torch.empty(layout.numel, dtype=torch.uint8)
                layout.pack(torch.randn(layout.base.numel, generator=torch.Generator().manual_seed(0)) * 0.02, packed)

                def kernel(x: torch.Tensor) -> torch.Tensor:
                    return layout.run_packed(x, packed)

                def dequantised(x: torch.Tensor) -> torch.Tensor:
                    with cpu.enabled(False):
                        return layout.run(x, packed)

                for n in map(int, args.rows.split(",")):
                    x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
                    k, d = best_ms(kernel, x), best_ms(dequantised, x)
                    print(f"{threads} | {fmt} | {acts} | {n} | {k:.1f} | {d:.1f} | {'yes' if k < d else 'no'}")


if __name__ == "__main__":
    main()
