"""CUDA checks of the engine, written as one tidy table (check, placement, metric, value, ok).

For each placement on CUDA: tokens/logits equal `resident` (the invariant), the host expert
store is pinned where the placement reads it, fetch/stream copies ran on the dedicated copy
stream (counters > 0 and the stream saw work), and peak device memory per placement.
Run by scripts/gpu_check.sh; exits non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine  # noqa: E402

CASES = [("resident", {}), ("fetch", {"cache_capacity": 2}), ("fetch", {"cache_capacity": 4, "cache_policy": "lfu"}),
         ("cpu", {}), ("hybrid", {"n_cpu_layers": 2}),
         ("stream", {"cache_capacity": 2, "stream_threshold": 16}),
         ("stream", {"stream_fallback": "cpu", "stream_threshold": 16})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    rows: list[dict] = []

    def add(check: str, placement: str, metric: str, value, ok: bool | None = None) -> None:
        rows.append({"check": check, "placement": placement, "metric": metric, "value": value,
                     "ok": "" if ok is None else ok})

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 512, (2, 96), generator=g).tolist()
    ref = None
    for placement, opts in CASES:
        label = placement + "".join(f",{k}={v}" for k, v in opts.items())
        torch.cuda.reset_peak_memory_stats()
        eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement=placement, ubatch=32, **opts)
        sess = eng.new_session(2)
        t0 = time.perf_counter()
        res = eng.generate(prompts, 16, session=sess)
        sess.offload()
        sess.restore()
        res2 = eng.generate([p[:8] for p in prompts], 8, session=sess)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        logits = [t.float().cpu() for t in res.logits + res2.logits]
        toks = res.tokens + res2.tokens
        if ref is None:
            ref = (toks, logits)
        diff = max((a - b).abs().max().item() for a, b in zip(logits, ref[1]))
        add("invariant", label, "max_abs_logit_diff", diff, diff <= 1e-5)
        add("invariant", label, "tokens_equal", toks == ref[0], toks == ref[0])
        store = eng.model.store
        host_layers = [l for l, on_dev in store.on_device.items() if not on_dev]
        if host_layers:
            pinned = all(store.rows[l].is_pinned() for l in host_layers)
            add("pinned_host_store", label, "all_pinned", pinned, pinned)
        c = eng.counters
        for k, v in c.items():
            add("counters", label, k, v)
        if placement in ("fetch", "stream"):
            add("copy_stream", label, "h2d_bytes>0", c["h2d_bytes"] > 0, c["h2d_bytes"] > 0)
            add("copy_stream", label, "dedicated_stream", eng.device.copy_stream is not None,
                eng.device.copy_stream is not None)
        add("memory", label, "peak_device_bytes", torch.cuda.max_memory_allocated())
        add("timing", label, "generate_wall_s", wall)
        sess.close()
        eng.close()
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["check", "placement", "metric", "value", "ok"])
        w.writeheader()
        w.writerows(rows)
    bad = [r for r in rows if r["ok"] is False]
    print(f"{len(rows)} rows, {len(bad)} failed checks -> {args.out}")
    for r in bad:
        print("FAILED", r)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
