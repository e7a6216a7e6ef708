"""The `quality` pass: the job's `quality` phase -- the measured engine against the exact
reference over every kept position's full distribution (exact runs too: 0 and 1 there).

Owns: making the measured engine's two quality runs (teacher-forced on the reference's
continuation, and free-running: harness.quality) and the phase's rows, `profiler=quality`, so
they stay out of the speed rows and the per-phase checks. Every metric is measured or null with
its reason in the row's `quality_reason`; a job without the pass still gets those null rows (its
absence would read as a metric missing by accident), the reason also in the manifest. NaN or inf
in a run is the pass's failed row. Does not own: the arithmetic (harness.quality), the reference's
own run (harness.reference).
"""
from __future__ import annotations

from harness.contract import QUALITY_METRICS, QUALITY_PHASE
from harness.passes.base import Pass, RunContext


class QualityPass(Pass):
    name = "quality"
    summary = "KL, top-1 agreement, perplexity ratio and greedy tokens vs the exact reference"

    def skip_reason(self, ctx: RunContext) -> str | None:
        spec = ctx.spec
        if not spec.run.check_reference:
            return "no exact reference (run.check_reference=false)"
        if ctx.reference is None or ctx.reference.quality is None:
            return "the exact reference holds no quality pass"
        if not ctx.adapter.per_position_logits:
            return f"engine={spec.engine} gives no full-vocabulary logits per position"
        return None

    def skipped(self, ctx: RunContext, reason: str) -> None:
        _emit(ctx, dict.fromkeys(QUALITY_METRICS), dict.fromkeys(QUALITY_METRICS, reason))

    def run(self, ctx: RunContext) -> None:
        # measuring code (torch, pandas) loads when a job runs the pass: its declaration loads for --help and checks
        from harness.quality import compare_explained, quality_run
        ref, engine, gen = ctx.reference.quality, ctx.adapter.engine, ctx.spec.workload.gen_tokens
        with ctx.reporter.step("quality pass (teacher-forced and greedy, vs the exact reference)"):
            forced = quality_run(engine, ctx.sample.contexts, gen, forced=ref.continuation)
            free = quality_run(engine, ctx.sample.contexts, gen)
        _emit(ctx, *compare_explained(forced, ref, free.continuation))


def _emit(ctx: RunContext, metrics: dict[str, float | None], reasons: dict[str, str]) -> None:
    """One row group per reason: a null metric's rows carry why, a measured one's none."""
    def reason_of(m: str) -> str | None:
        return reasons.get(m) if metrics[m] is None else None

    unexplained = [m for m, v in metrics.items() if v is None and not reasons.get(m)]
    if unexplained:
        raise RuntimeError(f"quality metrics {unexplained} are null with no reason")
    for reason in dict.fromkeys(map(reason_of, metrics)):
        ctx.emit(0, QUALITY_PHASE, {m: v for m, v in metrics.items() if reason_of(m) == reason}, "engine",
                 QUALITY_PHASE, quality_reason=reason)
