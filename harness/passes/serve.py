"""The `serve` pass: requests arriving over time (`load=...`), served by the engine -- our continuous
batcher in process, llama-server's slots over HTTP (the adapter's `serve`) -- and measured from the
client side.

Owns: turning the load spec into requests (the schedule of harness.serving.load; each prompt the
job's workload rendered at the request's input length, a seed of its own, so requests differ in
content but share what the workload shares -- the coding agent's system prompt and tool schemas),
running them (harness.serving.drive) with warm-up requests first, and the rows: per request and
metric (`request_id` column), the window's summary (throughput, latency percentiles, goodput
under `load.slo`), and the engine side of the run -- steps, sequences and tokens per step,
distinct experts per MoE layer per step (what an expert cache sees under concurrency), bytes
moved and hits over the measured requests' steps, for an engine that batches in process -- and
the harness's own time per request (harness.serving.drive says how each engine's is counted).
Does not own: the schedule, the metrics (harness.serving), the batching (engine.batcher).

Rows: phase `serve`, profiler `serve`; the metric names and units are harness.serving.metrics'
data dictionary (docs/serving.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from harness.contract import SERVE_PHASE
from harness.passes.base import Pass, RunContext

if TYPE_CHECKING:
    from engine.batcher import StepReport

STEP_UNITS = {"steps": "count", "sequences_per_step": "count", "tokens_per_step": "count",
              "distinct_experts_per_layer_step": "count", "serve_h2d_bytes": "B", "serve_expert_hits": "count",
              "serve_expert_misses": "count", "serve_hit_rate": "ratio", "harness_overhead_s_per_request": "s"}


class ServePass(Pass):
    name = "serve"
    summary = "requests arriving over time (load=...): per-request and summary serving metrics, batch counters"

    def skip_reason(self, ctx: RunContext) -> str | None:
        if ctx.spec.load is None:
            return "load=none"
        if not ctx.adapter.serves:
            return f"engine={ctx.spec.engine}: its adapter serves no requests over time"
        return None

    def run(self, ctx: RunContext) -> None:
        from harness.job import prompts_of
        from harness.serving.drive import Request
        from harness.serving.load import schedule, steady_window
        from harness.serving.metrics import METRICS, REQUEST_METRICS, request_rows, summarize, summary_rows
        load = ctx.spec.load
        plans = schedule(load)
        P = load.shared_prefix
        with ctx.reporter.step(f"building {len(plans)} prompts"):
            prompts = prompts_of(ctx.spec, [p.input_len for p in plans], load.seed, [p.shares_prefix for p in plans], P)
        requests = [Request(f"r{p.index}", p.arrival_s, prompt, p.output_len, p.warmup, P if p.shares_prefix else 0)
                    for p, prompt in zip(plans, prompts)]
        shared = next((r.prompt[:P] for r in requests if r.prefix_len), None)
        with ctx.reporter.step(f"serving {len(requests)} requests ({load.name})"):
            out = ctx.adapter.serve(requests, load.max_concurrency, load.prefix_cache if P else "isolated", shared)
        lo, hi = steady_window(plans, load)
        chosen = {r.request_id for r in requests if not r.warmup and lo <= r.arrival_s <= hi}
        mine = [t for t in out.timelines if t.request_id in chosen]
        units = {m: u for m, (u, _, _) in {**METRICS, **REQUEST_METRICS}.items()}
        by_request: dict[str, dict] = {}
        for row in request_rows(out.timelines):
            by_request.setdefault(row["request_id"], {})[row["metric"]] = row["value"]
        for rid, metrics in by_request.items():
            ctx.emit(None, SERVE_PHASE, metrics, "client", self.name, units=units, request_id=rid)
        summary = summarize(mine, measured_span(mine), load.slo)
        client = {r["metric"]: r["value"] for r in summary_rows(summary)}
        client["harness_overhead_s_per_request"] = out.overhead_s / len(requests)
        ctx.emit(None, SERVE_PHASE, client, "client", self.name, units={**units, **STEP_UNITS},
                 slo=summary.slo.name if summary.slo is not None else None)
        if out.steps:                                  # an in-process batcher's own steps (a server keeps its own)
            ctx.emit(None, SERVE_PHASE, step_metrics(out.steps, chosen), "engine", self.name, units=STEP_UNITS)


def measured_span(timelines: list) -> tuple[float, float]:
    """The measured requests' span on the client's clock: from the first one sent to the last token
    of any of them (the window throughputs divide by; every one of them arrives inside it)."""
    if not timelines:
        raise ValueError("the steady-state window holds no request: lower load.ramp_s / load.drain_s or "
                         "raise load.requests")
    ends = [t.token_times_s[-1] for t in timelines if t.token_times_s]
    start = min(t.arrival_s for t in timelines)
    return start, max([*ends, start]) + 1e-9


def step_metrics(steps: list[StepReport], measured: set[str]) -> dict:
    """The engine side of the run over the steps that served a measured request (warm-up-only steps
    left out): means per step, and the counters' totals over them."""
    import statistics
    mine = [s for s in steps if measured & ({e.request_id for e in s.emitted} | set(s.joined))] or steps
    hits = sum(s.counters.get("expert_hits", 0) for s in mine)
    misses = sum(s.counters.get("expert_misses", 0) for s in mine)
    per_layer = [n for s in mine for n in s.experts.values()]
    return {"steps": len(mine), "sequences_per_step": statistics.fmean(s.sequences for s in mine),
            "tokens_per_step": statistics.fmean(s.tokens for s in mine),
            "distinct_experts_per_layer_step": statistics.fmean(per_layer) if per_layer else None,
            "serve_h2d_bytes": sum(s.counters.get("h2d_bytes", 0) for s in mine),
            "serve_expert_hits": hits, "serve_expert_misses": misses,
            "serve_hit_rate": hits / (hits + misses) if hits + misses else None}
