"""The `trace` pass (`run.record_trace=true`): one cold repeat with the routing recorder attached,
saved as the DESIGN §3 routing trace file (<job dir>/routing.npz) the simulator replays, and the
run's routing statistics as rows.

Owns: the recorded repeat and its rows (`profiler=trace`): the repeat's phases, and per MoE layer
(column `layer`; `all`: the mean over layers) phase `routing` with ROUTING_METRICS -- expert
frequency entropy, adjacent-token overlap (reuse, Jaccard), distinct experts per decode step and
per prefill pass (harness.sim.stats defines each) -- every row carrying `route_digest`, which is
equal for two runs exactly when they routed the same tokens the same way. Does not own: recording
and the file format (engine.trace, engine.trace_recorder), the statistics (harness.sim.stats),
the phases (harness.scenario).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from harness.passes.base import Pass, RunContext, emit_instrumented

if TYPE_CHECKING:
    from engine.trace import RoutingTrace

ROUTING_METRICS = {"entropy_bits": "bits", "entropy_ratio": "ratio", "reuse_rate": "ratio", "jaccard": "ratio",
                   "any_overlap": "ratio", "distinct_decode": "experts", "distinct_prefill": "experts"}


class TracePass(Pass):
    name = "trace"
    summary = "run.record_trace=true: one repeat's expert routing saved as routing.npz (for the simulator)"

    flag = ("record_trace", True)

    def skip_reason(self, ctx: RunContext) -> str | None:
        if reason := super().skip_reason(ctx):
            return reason
        if not ctx.adapter.routing_hooks:
            return f"engine={ctx.spec.engine} exposes no routing"
        return None

    def run(self, ctx: RunContext) -> None:
        # measuring code (torch, pandas) loads when a job runs the pass: its declaration loads for --help and checks
        from engine.trace import save_trace
        from engine.trace_recorder import TraceRecorder
        from harness.scenario import run_repeat
        with ctx.reporter.step("routing trace pass"):
            rec = TraceRecorder(ctx.adapter.engine)
            try:
                res = run_repeat(ctx.adapter, ctx.sample, ctx.spec.workload.gen_tokens, keep_logits=False)
            finally:
                rec.detach()
            trace = rec.trace()
            save_trace(ctx.job_dir / "routing.npz", trace)
        emit_instrumented(ctx, res, "trace")
        emit_routing_stats(ctx, trace)


def emit_routing_stats(ctx: RunContext, trace: RoutingTrace) -> None:
    """Per MoE layer and over all of them, the ROUTING_METRICS of the recorded trace, with its digest."""
    from harness.sim.stats import route_digest, trace_stats
    stats = trace_stats(trace)
    digest = route_digest(trace)
    per_layer = [(str(int(row["layer"])), row) for _, row in stats.iterrows()]
    for layer, row in [*per_layer, ("all", stats[list(ROUTING_METRICS)].mean())]:
        metrics = {m: None if row[m] != row[m] else float(row[m]) for m in ROUTING_METRICS}     # NaN: none of that kind
        ctx.emit(None, "routing", metrics, "engine", "trace", units=ROUTING_METRICS, layer=layer, route_digest=digest)
