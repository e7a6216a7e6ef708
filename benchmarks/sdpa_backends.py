"""Which scaled_dot_product_attention kernel this torch build runs on the CPU for the calls the
engine makes (engine.layers.attention: enable_gqa, a boolean mask for prefill, none for decode),
per dtype and shape, read from torch.profiler op names, with its time; and the math kernel
forced for comparison. (An fp32 decode step on the CPU does not call SDPA: engine.layers.
decode_attention; its measurement is in docs/cpu_experts.md.) A dated run is in
docs/history/2026-12-01-cpu-kernels-and-rates.md.
Not a test: `python benchmarks/sdpa_backends.py [--threads 1]`.
"""
from __future__ import annotations

import argparse
import os
import time

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

H, K, HD = 16, 4, 64           # the benchmark model's heads, kv heads, head dim (Mixtral-shaped, hidden 1024)
CASES = ((1, 512, "decode (T=1, no mask)"), (512, 512, "prefill (T=S=512, bool mask)"),
         (256, 768, "chunk after 512 (T=256, S=768, bool mask)"))


def kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")
                   or e.key in ("aten::bmm", "aten::_softmax", "aten::repeat_interleave")})


def ms(fn, n: int = 5) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for T, S, what in CASES:
            q = torch.randn(1, H, T, HD, dtype=dt)
            k, v = torch.randn(1, K, S, HD, dtype=dt), torch.randn(1, K, S, HD, dtype=dt)
            mask = None if T == 1 else torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]

            def run():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            def run_math():
                with sdpa_kernel(SDPBackend.MATH):
                    return run()

            print(f"{str(dt).split('.')[1]:<9} {what:<42} {ms(run):7.2f} ms {kernels(run)}; "
                  f"math forced {ms(run_math):7.2f} ms, max |diff| {(run() - run_math()).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
