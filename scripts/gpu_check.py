"""CUDA checks of the engine, one tidy CSV row at a time (check, case, metric, value, ok, error).

Each check is isolated: an exception becomes one failed row carrying its error and the
next check runs; every row is appended and flushed the moment it exists, so a crash, a
kill or a `timeout` loses nothing written before it. Run by `scripts/gpu_check.sh 1`
(about 2-3 minutes on an H200); exits non-zero if any row failed.

    python scripts/gpu_check.py --out results/gpu/<date>/gpu_check.csv [--only copy_stream,link]

Checks: invariant (every placement, both fetch copy schedules, vs resident; bytes by purpose
add up), pinned (exact-size registered host store for fetch/stream, none for cpu, pinned KV
offload), allocator_cap (a transient over the budget fails like a smaller card), copy_stream
(profiler: expert copies ran on the copy stream, not the compute stream), race (a spin
queued on the copy stream before every copy: results still exact; with the compute-stream
wait removed they must go wrong, which proves the amplifier bites), link (event-timed expert
copies in the timeline vs a raw pinned torch -- and CuPy -- copy of the same size),
overlap (fetch decode with the cache below the working set: issue_ahead off/on, prefetch
none/next_layer_gate; overlap_frac and time per token), memory (planned transient vs the
CUDA allocator's measured peak; PhaseProbe's allocated and reserved peaks), grouped
(resident_grouped in bf16: resident's tokens, and no host sync in a decode step under
torch.cuda.set_sync_debug_mode("error")), cuda_graph (resident_grouped decode replayed as CUDA graphs:
the eager tokens, no sync in a replay, tok/s with and without), kv_dtype (q8/q4/fp8 KV stored and
read on the device).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine  # noqa: E402

FIELDS = ("check", "case", "metric", "value", "ok", "error")
TINY = "tiny-mixtral"
PROMPT = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(0)).tolist()
# experts of 3 * 2048 * 1408 * 2 B = 16.5 MiB in bf16: above LINK_TRUSTED_MIN_BYTES, so their rate means something
BIG = {"hidden_size": 2048, "moe_intermediate_size": 1408, "intermediate_size": 1408, "num_heads": 16,
       "num_kv_heads": 4, "head_dim": 128, "num_layers": 4, "n_experts": 16, "top_k": 2}


class Table:
    """Rows appended to a CSV and flushed one by one; `isolated` turns an exception into a row."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._f = open(self.path, "a", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=FIELDS)
        if new:
            self._w.writeheader()
            self._flush()
        self.failed = 0
        self.rows = 0

    def _flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def add(self, check: str, case: str, metric: str, value: Any, ok: bool | None = None, error: str = "") -> None:
        self._w.writerow({"check": check, "case": case, "metric": metric, "value": value,
                          "ok": "" if ok is None else bool(ok), "error": error})
        self._flush()
        self.rows += 1
        self.failed += ok is False
        if ok is False:
            print(f"FAILED {check} {case} {metric}={value} {error}", flush=True)

    def isolated(self, check: str, fn: Callable[["Table"], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn(self)
        except BaseException as exc:   # noqa: BLE001 -- one failed check must never lose the table
            if isinstance(exc, KeyboardInterrupt):
                raise
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self.add(check, "-", "exception", type(exc).__name__, False, last[:500])
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_per_process_memory_fraction(1.0)   # no cap leaks into the next check
                torch.cuda.empty_cache()
        self.add(check, "-", "check_wall_s", round(time.perf_counter() - t0, 3))

    def close(self) -> None:
        self._f.close()


# --- helpers -----------------------------------------------------------------------------------
def run(eng: Engine, prompts: list[list[int]] = PROMPT, gen: int = 12) -> tuple[list, list[torch.Tensor]]:
    """A fresh turn, then offload + restore, then a continued turn; tokens and fp32 CPU logits."""
    sess = eng.new_session(len(prompts))
    a = eng.generate(prompts, gen, session=sess)
    sess.offload()
    sess.restore()
    b = eng.generate([p[:8] for p in prompts], gen // 2, session=sess)
    sess.close()
    torch.cuda.synchronize()
    return a.tokens + b.tokens, [t.float().cpu() for t in a.logits + b.logits]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of greedy tokens two runs share, position by position. In bf16 two kernels'
    rounding can flip a near-tie (tiny-mixtral's top-2 logits come within one bf16 step), so
    it is reported beside the logit check, not passed or failed."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


_REF: dict[str, tuple] = {}


def reference() -> tuple[list, list[torch.Tensor]]:
    if "tiny" not in _REF:
        eng = Engine.from_pretrained(TINY, device="cuda", ubatch=32)
        _REF["tiny"] = run(eng)
        eng.close()
    return _REF["tiny"]


# --- checks ------------------------------------------------------------------------------------
CASES = [("fetch", {"cache_capacity": 2}), ("fetch", {"cache_capacity": 2, "issue_ahead": False}),
         ("fetch", {"cache_capacity": 4, "cache_policy": "lfu", "prefetch": "next_layer_gate"}),
         ("cpu", {}), ("hybrid", {"n_cpu_layers": 2}), ("stream", {"cache_capacity": 2, "stream_threshold": 16}),
         ("stream", {"stream_fallback": "cpu", "stream_threshold": 16})]


def check_invariant(t: Table) -> None:
    ref = reference()
    for placement, opts in CASES:
        case = placement + "".join(f",{k}={v}" for k, v in opts.items())
        eng = Engine.from_pretrained(TINY, device="cuda", placement=placement, ubatch=32, **opts)
        toks, logits = run(eng)
        d = max_diff(logits, ref[1])
        t.add("invariant", case, "max_abs_logit_diff", d, d <= 1e-5)
        t.add("invariant", case, "tokens_equal", toks == ref[0], toks == ref[0])
        c = eng.counters
        for direction in ("h2d", "d2h"):
            parts = sum(c[f"{direction}_{p}_bytes"] for p in ("expert", "activation", "kv"))
            t.add("invariant", case, f"{direction}_bytes_by_purpose_sum", parts, parts == c[f"{direction}_bytes"])
        eng.close()


def check_pinned(t: Table) -> None:
    from engine.hostmem import host_alloc_bytes, registered_bytes

    for placement, opts, pinned in (("fetch", {"cache_capacity": 2}, True), ("stream", {"cache_capacity": 2}, True),
                                    ("cpu", {}, False), ("hybrid", {"n_cpu_layers": 4}, False)):
        before = registered_bytes()
        eng = Engine.from_pretrained(TINY, device="cuda", placement=placement, **opts)
        store = eng.model.store
        host = [l for l, on in store.on_device.items() if not on]
        got = all(store.rows[l].is_pinned() for l in host)
        t.add("pinned", placement, "host_store_pinned", got, got == pinned)
        want = len(host) * host_alloc_bytes(store.rows[host[0]].numel() * store.rows[host[0]].element_size(),
                                            "register") if pinned else 0
        t.add("pinned", placement, "registered_bytes", registered_bytes() - before, registered_bytes() - before == want)
        if placement == "fetch":
            sess = eng.new_session(2)
            eng.generate(PROMPT, 2, session=sess)
            sess.offload()
            t.add("pinned", placement, "kv_offload_pinned", sess.k[0].is_pinned(), sess.k[0].is_pinned())
            sess.restore()
            sess.close()
        eng.close()
        del eng, store
        import gc
        gc.collect()
        t.add("pinned", placement, "registered_after_close", registered_bytes() - before, registered_bytes() == before)


def check_allocator_cap(t: Table) -> None:
    budget = 96 << 20
    # planned for what run() needs (2 x 122 tokens): at the defaults (4096 tokens, 512-token micro-batches)
    # the CUDA plan is 110 MiB, refused before the cap is set
    eng = Engine.from_pretrained(TINY, device="cuda", placement="fetch", cache_capacity=2, device_memory=budget,
                                 max_context=256, batch=2, ubatch=32)
    t.add("allocator_cap", "96MiB", "allocator_cap", eng.device.allocator_cap, eng.device.allocator_cap == budget)
    try:
        torch.empty(2 * budget, dtype=torch.uint8, device="cuda")
        refused = False
    except torch.OutOfMemoryError:
        refused = True
    t.add("allocator_cap", "96MiB", "over_budget_transient_refused", refused, refused)
    toks, logits = run(eng)
    d = max_diff(logits, reference()[1])
    t.add("allocator_cap", "96MiB", "max_abs_logit_diff_within_cap", d, d <= 1e-5)
    eng.close()
    x = torch.empty(2 * budget, dtype=torch.uint8, device="cuda")     # the cap is lifted by close()
    t.add("allocator_cap", "96MiB", "cap_lifted_after_close", True, x.numel() == 2 * budget)


def check_copy_stream(t: Table) -> None:
    """torch.profiler's memcpy events carry CUPTI stream ids, not torch's: a marker copy on the
    engine's copy stream names that stream (harness.profiling.torchprof.copy_streams)."""
    from harness.profiling.torchprof import copy_streams

    eng = Engine.from_pretrained(TINY, device="cuda", placement="fetch", cache_capacity=2)
    got = copy_streams(lambda: eng.generate(PROMPT, 4), eng.device.copy_stream, eng.model.store.expert_bytes)
    marker, experts = got["marker"], got["copies"]
    t.add("copy_stream", "fetch,cap=2", "expert_memcpy_events", len(experts), len(experts) == eng.counters["expert_misses"])
    ok = len(marker) == 1 and experts and all(s == marker[0] for s in experts)
    t.add("copy_stream", "fetch,cap=2", "expert_copies_on_copy_stream", f"{set(experts)} vs {marker}", ok)
    t.add("copy_stream", "fetch,cap=2", "copy_stream_runs_no_kernels", f"kernels on {sorted(got['kernels'])}",
          bool(marker) and marker[0] not in got["kernels"])
    eng.close()


def check_race(t: Table) -> None:
    """Delay every copy behind a spin on the copy stream (Device.copy_delay_cycles): the compute
    stream's event waits must still make results exact; removing them must make results wrong
    (the amplifier works)."""
    from engine.devices import Device

    ref = reference()
    real_wait = Device.wait
    for schedule in (True, False):
        case = f"fetch,cap=2,issue_ahead={schedule}"
        try:
            eng = Engine.from_pretrained(TINY, device="cuda", placement="fetch", cache_capacity=2, ubatch=32,
                                         issue_ahead=schedule)
            eng.device.copy_delay_cycles = 2_000_000             # ~1 ms at 2 GHz before every copy
            toks, logits = run(eng)
            d = max_diff(logits, ref[1])
            t.add("race", case, "max_abs_logit_diff_with_slow_copies", d, d <= 1e-5 and toks == ref[0])
            Device.wait = lambda self, handle: None        # the bug the amplifier must expose
            eng.reset()
            toks, logits = run(eng)
            d = max_diff(logits, ref[1])
            t.add("race", case, "max_abs_logit_diff_without_waits", d, not d <= 1e-5 or toks != ref[0])   # NaN: wrong too
            eng.close()
        finally:
            Device.wait = real_wait
            torch.cuda.synchronize()


def raw_h2d_gbps(nbytes: int, repeats: int = 20) -> dict[str, float]:
    """Median rate of one pinned host->device copy of `nbytes`: torch (pin_memory) and CuPy."""
    out = {}
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    out["torch_pinned_h2d_gbps"] = nbytes / statistics.median(times) / 1e9
    try:
        import cupy as cp
        import numpy as np
    except ImportError:
        return out
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
    out["cupy_pinned_h2d_gbps"] = nbytes / statistics.median(ts) / 1e9
    return out


def timeline_decode(eng: Engine, prompts: list[list[int]], gen: int) -> tuple[dict[str, Any], float]:
    """One timed decode (instrument off: s/token after a synchronise) and one instrumented
    decode (timeline: overlap metrics, copy intervals of expert copies)."""
    from engine.timeline import Timeline
    from harness.profiling.overlap import overlap_metrics

    eng.generate(prompts, 4)                                    # warm-up
    eng.reset()
    sess = eng.new_session(len(prompts))
    first = eng.prefill(sess, prompts).argmax(-1).tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tok = first
    for _ in range(gen):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    torch.cuda.synchronize()
    per_token = (time.perf_counter() - t0) / gen
    sess.close()
    eng.reset()
    tl = Timeline("cuda")
    eng.set_instrument(tl)
    sess = eng.new_session(len(prompts))
    tok = eng.prefill(sess, prompts).argmax(-1).tolist()
    torch.cuda.synchronize()
    w0 = time.perf_counter()
    before = eng.counters["h2d_bytes"]
    for _ in range(gen):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    torch.cuda.synchronize()
    w1 = time.perf_counter()
    eng.set_instrument(None)
    tl.collect()
    sess.close()
    m = overlap_metrics(tl.intervals("copy", w0, w1), tl.compute_intervals(w0, w1), eng.counters["h2d_bytes"] - before)
    copies = [s for s in tl.spans if s.kind == "copy" and not s.attrs.get("sync") and w0 <= s.t0 <= w1]
    return {**m, "copies": copies}, per_token


def check_link(t: Table) -> None:
    from engine.devices import LINK_TRUSTED_MIN_BYTES

    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2, dtype="bfloat16",
                                 model_overrides=BIG)
    eb = eng.model.store.expert_bytes
    t.add("link", "expert", "expert_bytes", eb, eb >= LINK_TRUSTED_MIN_BYTES)
    m, _ = timeline_decode(eng, [PROMPT[0][:16]], 16)
    rates = [s.attrs["bytes"] / (s.t1 - s.t0) / 1e9 for s in m["copies"] if s.t1 > s.t0]
    engine_gbps = statistics.median(rates) if rates else None
    t.add("link", "expert", "engine_copy_gbps_median", engine_gbps, engine_gbps is not None)
    t.add("link", "expert", "engine_link_gbps_busy", m["link_gbps"])
    for name, gbps in raw_h2d_gbps(eb).items():
        t.add("link", "expert", name, gbps)
        if engine_gbps is not None:
            t.add("link", "expert", f"engine_over_{name}", engine_gbps / gbps, engine_gbps / gbps > 0.7)
    eng.close()


def check_overlap(t: Table) -> None:
    for ahead in (False, True):
        for prefetch in ("none", "next_layer_gate"):
            case = f"fetch,cap=4,issue_ahead={ahead},prefetch={prefetch}"
            eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=4,
                                         dtype="bfloat16", model_overrides=BIG, issue_ahead=ahead, prefetch=prefetch)
            m, per_token = timeline_decode(eng, [PROMPT[0][:16], PROMPT[1][:16]], 24)
            for k in ("overlap_frac", "copy_busy_s", "exposed_copy_s", "link_gbps"):
                t.add("overlap", case, k, m[k])
            t.add("overlap", case, "decode_s_per_token", per_token)
            for k in ("expert_misses", "prefetch_issued", "prefetch_used", "h2d_expert_bytes"):
                t.add("overlap", case, k, eng.counters[k])
            eng.close()


def check_memory(t: Table) -> None:
    from harness.measure import PhaseProbe, transient_peak

    for dtype, T in (("float32", 256), ("bfloat16", 512)):
        case = f"{dtype},T={T}"
        eng = Engine.from_pretrained(TINY, device="cuda", dtype=dtype, ubatch=T, max_context=T + 1, batch=2)
        sess = eng.new_session(2)
        eng.prefill(sess, [[1], [2]])                                  # the planned KV, allocated once
        rows = torch.randint(0, 512, (2, T)).tolist()
        measured = transient_peak("cuda", lambda: eng.prefill(sess, rows))
        t.add("memory", case, "measured_transient_bytes", measured)
        t.add("memory", case, "planned_transient_bytes", eng.plan.transient, 0 < measured <= eng.plan.transient)
        with PhaseProbe("cuda", None) as probe:
            eng.prefill(sess, [[3], [4]])
        t.add("memory", case, "peak_device_reserved_bytes", probe.peak_device_reserved_bytes,
              probe.peak_device_reserved_bytes is not None
              and probe.peak_device_reserved_bytes >= probe.peak_device_bytes > 0)
        sess.close()
        eng.close()


def check_grouped(t: Table) -> None:
    """resident_grouped (routing grouped on the device, F.grouped_mm per layer) in bf16: logits within
    bf16 rounding of resident bf16 (greedy token agreement reported), and no host sync in a decode step
    (torch.cuda.set_sync_debug_mode("error") raises on one)."""
    prompts = [list(range(1, 17)), list(range(5, 21))]
    out = {}
    for placement in ("resident", "resident_grouped"):
        eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement=placement, dtype="bfloat16", ubatch=32)
        res = eng.generate(prompts, 8)
        out[placement] = (res.tokens, [x.float().cpu() for x in res.logits])
        if placement == "resident_grouped":
            sess = eng.new_session(len(prompts))
            eng.prefill(sess, prompts)
            ids = torch.ones(len(prompts), 1, dtype=torch.long, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.inference_mode():     # as Engine.decode_step: the KV buffers are inference tensors
                    eng.model.forward(ids, sess)
                synced = None
            except RuntimeError as exc:          # the sync debug mode's error names the op
                synced = str(exc).splitlines()[0][:120]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            t.add("grouped", "resident_grouped,bf16", "decode_step_host_syncs", synced or 0, synced is None, synced or "")
            sess.close()
        eng.close()
    (ta, la), (tb, lb) = out["resident"], out["resident_grouped"]
    d = max_diff(la, lb)
    t.add("grouped", "resident_grouped,bf16", "token_agreement_vs_resident", round(agreement(ta, tb), 3))
    t.add("grouped", "resident_grouped,bf16", "max_abs_logit_diff_vs_resident", d, d <= 5e-2)


def check_cuda_graph(t: Table) -> None:
    """resident_grouped with cuda_graph=True (engine.static_decode) in bf16, at tiny-mixtral's and
    BIG's shapes: logits within bf16 rounding of the eager step's (greedy token agreement
    reported), no host sync inside a replay, the key buckets captured, and decode tok/s with and
    without graphs (interleaved, 3 rounds, medians; both buckets captured before the timing)."""
    prompts = [list(range(1, 250)), list(range(7, 256))]           # 249 tokens: crosses the 256-key bucket
    for case, overrides in (("tiny-mixtral", None), ("big", BIG)):
        engines = {g: Engine.from_pretrained(TINY, device="cuda", placement="resident_grouped", dtype="bfloat16",
                                             max_context=600, model_overrides=overrides, cuda_graph=g)
                   for g in (False, True)}
        out = {g: engines[g].generate(prompts, 16) for g in (False, True)}
        eager, graph = ([x.float().cpu() for x in out[g].logits] for g in (False, True))
        t.add("cuda_graph", case, "token_agreement_vs_eager", round(agreement(out[False].tokens, out[True].tokens), 3))
        # the first decode step alone (later steps attend K/V that already differ by bf16 rounding, and drift)
        d1, scale = max_diff(eager[1:2], graph[1:2]), float(eager[1].abs().max())
        t.add("cuda_graph", case, "first_step_max_abs_logit_diff", d1, d1 <= 1e-2 * scale, f"max |logit| {scale:.3g}")
        t.add("cuda_graph", case, "max_abs_logit_diff_16_steps", max_diff(eager, graph))
        eng = engines[True]
        sess = eng.new_session(len(prompts))
        tok = eng.prefill(sess, prompts).argmax(-1).tolist()
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()          # captures the first bucket
        ids = torch.tensor([[x] for x in tok], device="cuda")          # a host copy: before the sync check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sess.static_decoder.step(ids)
            synced = None
        except RuntimeError as exc:
            synced = str(exc).splitlines()[0][:120]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        t.add("cuda_graph", case, "replay_host_syncs", synced or 0, synced is None, synced or "")
        t.add("cuda_graph", case, "graphs_captured", ",".join(map(str, sorted(sess.static_decoder.graphs))), True)
        sess.close()
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):
            for g in (False, True):
                e = engines[g]
                s = e.new_session(1)
                tk = e.prefill(s, prompts[:1]).argmax(-1).tolist()
                for _ in range(8):      # 249 + 8 = 257 tokens: both key buckets (256, 512) captured before timing
                    tk = e.decode_step(s, tk).argmax(-1).tolist()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(64):
                    tk = e.decode_step(s, tk).argmax(-1).tolist()
                rates[g].append(64 / (time.perf_counter() - t0))
                s.close()
        for g in (False, True):
            t.add("cuda_graph", case, f"decode_tok_per_s_{'graph' if g else 'eager'}", round(statistics.median(rates[g]), 1))
        t.add("cuda_graph", case, "graph_speedup", round(statistics.median(rates[True]) / statistics.median(rates[False]), 2))
        for e in engines.values():
            e.close()


def check_kv_dtype(t: Table) -> None:
    """kv.dtype on CUDA: q8 and fp8 store and read back on the device; the stored bytes counted."""
    for kv in ("q8", "q4", "fp8"):
        try:
            eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=4, kv_dtype=kv)
            res = eng.generate([list(range(1, 33))], 8)
            t.add("kv_dtype", kv, "generated_tokens", len(res.tokens[0]), len(res.tokens[0]) == 8)
            eng.close()
        except Exception as exc:                 # a refusal (fp8 without device support) is a finding
            t.add("kv_dtype", kv, "error", type(exc).__name__, False, str(exc).splitlines()[0][:160])


CHECKS: dict[str, Callable[[Table], None]] = {
    "invariant": check_invariant, "pinned": check_pinned, "allocator_cap": check_allocator_cap,
    "copy_stream": check_copy_stream, "race": check_race, "link": check_link, "overlap": check_overlap,
    "memory": check_memory, "grouped": check_grouped, "cuda_graph": check_cuda_graph, "kv_dtype": check_kv_dtype}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="CSV to append rows to")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(CHECKS)}")
    args = ap.parse_args(argv)
    names = list(CHECKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; known: {list(CHECKS)}")
    table = Table(args.out)
    if not torch.cuda.is_available():
        table.add("setup", "-", "cuda_available", False, False, "torch.cuda.is_available() is False")
        return 1
    table.add("setup", "-", "device", torch.cuda.get_device_name())
    table.add("setup", "-", "torch", torch.__version__)
    for name in names:
        print(f"== {name}", flush=True)
        table.isolated(name, CHECKS[name])
    table.close()
    print(f"{table.rows} rows, {table.failed} failed -> {args.out}", flush=True)
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
