"""The `trace` pass (`run.record_trace=true`): one cold repeat with the routing recorder attached,
saved as the DESIGN §3 routing trace file (<job dir>/routing.npz) the simulator replays.

Owns: the recorded repeat and its rows (`profiler=trace`). Does not own: recording and the file
format (engine.trace), the phases (harness.scenario).
"""
from __future__ import annotations

from harness.passes.base import Pass, RunContext, emit_instrumented


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
            save_trace(ctx.job_dir / "routing.npz", rec.trace())
        emit_instrumented(ctx, res, "trace")
