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
    transfer_checks(add)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["check", "placement", "metric", "value", "ok"])
        w.writeheader()
        w.writerows(rows)
    bad = [r for r in rows if r["ok"] is False]
    print(f"{len(rows)} rows, {len(bad)} failed checks -> {args.out}")
    for r in bad:
        print("FAILED", r)
    sys.exit(1 if bad else 0)


def raw_h2d_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """Pinned host->device bandwidth with torch and, independently, CuPy."""
    out = {}
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    out["torch_pinned_h2d_gbps"] = nbytes / min(times) / 1e9
    try:
        import cupy as cp
        import numpy as np
        host = cp.cuda.alloc_pinned_memory(nbytes)
        harr = np.frombuffer(host, dtype=np.uint8, count=nbytes)
        darr = cp.empty(nbytes, dtype=cp.uint8)
        ts = []
        for _ in range(repeats):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            darr.set(harr)
            end.record()
            end.synchronize()
            ts.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        out["cupy_pinned_h2d_gbps"] = nbytes / min(ts) / 1e9
    except ImportError:
        pass
    return out


def transfer_checks(add) -> None:
    """fetch with and without prefetch on CUDA: link_gbps and overlap_frac from the timeline
    against a raw pinned copy benchmark; torch.profiler memcpy bytes against the counters."""
    from engine.timeline import Timeline
    from harness.profiling.overlap import overlap_metrics
    from harness.profiling.passes import memcpy_summary

    for name, gbps in raw_h2d_gbps().items():
        add("raw_copy", "-", name, gbps)
    # a model whose experts are big enough for the link to matter: 1 MiB+ per expert
    overrides = {"hidden_size": 1024, "moe_intermediate_size": 1024, "num_heads": 16, "num_kv_heads": 4,
                 "head_dim": 64, "num_layers": 8}
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 512, (1, 256), generator=g).tolist()
    for prefetch in ("none", "next_layer_gate"):
        label = f"fetch,capacity=2,prefetch={prefetch},hidden=1024"
        eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2,
                                     prefetch=prefetch, model_overrides=overrides)
        eng.generate(prompts, 4)                     # warm-up
        eng.reset()
        tl = Timeline("cuda")
        eng.set_instrument(tl)
        eng.generate(prompts, 32)
        eng.set_instrument(None)
        tl.collect()
        m = overlap_metrics(tl.intervals("copy"), tl.compute_intervals(), eng.counters["h2d_bytes"])
        for k, v in m.items():
            add("overlap", label, k, v)
        for k in ("h2d_bytes", "prefetch_issued", "prefetch_used", "prefetch_wasted_bytes"):
            add("overlap", label, k, eng.counters[k])
        if prefetch == "none":
            from torch.profiler import ProfilerActivity, profile
            import json, tempfile
            eng.reset()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                eng.generate(prompts, 8)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                summary = memcpy_summary(json.load(open(f.name)))
            counted = eng.counters["h2d_bytes"]
            got = summary.get("memcpy_h2d_bytes")
            add("torch_profiler", label, "memcpy_h2d_bytes", got, got is not None and got >= counted)
            add("torch_profiler", label, "engine_h2d_bytes", counted)
        eng.close()


if __name__ == "__main__":
    main()
