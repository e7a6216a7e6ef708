"""The `speed` pass: what every speed table reads -- `run.warmup` unrecorded repeats, then
`run.repeats` measured ones of every phase, each phase checked against the exact reference, the
repeats that stand out flagged.

Owns: the warm-up and measured repeats (un-instrumented: `profiler=none`; under the nsys pass's
child, `profiler=nsys` inside the capture range, with NVTX ranges), their rows with each phase's
numerical check and verdict (`emit_repeat`: harness.checks), the per-step decode latencies, the
outlier flags (harness.outliers), and `ctx.measured` for the passes that need speed (roofline,
ablation). A failure here fails the job: its measured rows are the job. Does not own: the phases
(harness.scenario), the reference (harness.reference), the judgement (harness.checks).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.nvtx_ranges import NvtxRanges
from harness.checks import LOSSY_REASON, NO_REFERENCE_REASON, RepeatCheck
from harness.contract import CHECK_METRICS
from harness.passes.base import Pass, RunContext
from harness.passes.nsys import CudaProfilerRange, under_nsys

if TYPE_CHECKING:
    from harness.scenario import RepeatResult


class SpeedPass(Pass):
    name = "speed"
    summary = "warm-up, then run.repeats measured repeats of every phase, each checked; outliers flagged"
    fails_job = True

    def run(self, ctx: RunContext) -> None:
        # measuring code (torch, pandas) loads when a job runs the pass: its declaration loads for --help and checks
        from harness.outliers import flag_outliers
        from harness.scenario import run_repeat
        eng, sample, warm, run_cfg = ctx.adapter, ctx.sample, ctx.warm, ctx.spec.run
        gen = ctx.spec.workload.gen_tokens
        for i in range(run_cfg.warmup):                                 # excluded from every table
            with ctx.reporter.step(f"warm-up {i + 1}/{run_cfg.warmup}"):
                run_repeat(eng, sample, gen, keep_logits=False, warm_with=warm)
        measured = []
        nvtx_child = run_cfg.profiler == "nsys" and under_nsys()
        with CudaProfilerRange():
            if nvtx_child:
                eng.set_instrument(NvtxRanges())
            for r in range(run_cfg.repeats):
                with ctx.reporter.step(f"repeat {r + 1}/{run_cfg.repeats}"):
                    measured.append(run_repeat(eng, sample, gen, keep_logits=run_cfg.check_reference, warm_with=warm))
            eng.set_instrument(None)
        for r, res in enumerate(measured):
            emit_repeat(ctx, r, res, "nsys" if nvtx_child else "none", check=run_cfg.check_reference)
        flag_outliers(ctx.job.rows)                 # each repeat against its siblings (harness.outliers)
        ctx.measured = measured


def emit_repeat(ctx: RunContext, r: int, res: RepeatResult, profiler: str, check: bool) -> None:
    """Rows of one repeat; with `check`, every phase that produced tokens carries its own
    numerical check against the reference (null when there is no reference) and its verdict
    (harness.checks: `check_ok`, `check_tolerance`, `check_reason`)."""
    from harness.scenario import check_metrics, compare_phase
    job = ctx.job
    ref = ctx.reference.result if (check and ctx.reference is not None) else None
    skip = LOSSY_REASON if job.factors.get("lossy") else None if ref is not None else NO_REFERENCE_REASON
    judge = RepeatCheck(job.check_dtype, skip, ctx.adapter.suppressed_tokens)
    for ph in res.phases:
        state = {"expert_cache": ph.expert_cache, **ph.columns}     # ph.columns: starved, on every row of it
        ctx.emit(r, ph.phase, ph.client, "client", profiler, **state)
        engine_metrics, verdict = dict(ph.engine), {}
        if ph.tokens:                    # null when unchecked or nothing to compare with, never 0
            theirs = ref.phase(ph.phase) if ref else None
            cmp = compare_phase(ph, theirs) if theirs is not None and theirs.tokens else None
            engine_metrics.update(check_metrics(cmp) if cmp else dict.fromkeys(CHECK_METRICS))
            verdict = judge.phase(ph.phase, cmp).columns()
        ctx.emit(r, ph.phase, engine_metrics, "engine", profiler, **state, **verdict)
    job.steps.extend({"sweep_id": job.ctx.sweep_id, "job_id": job.ctx.job_id, "repeat": r, "profiler": profiler,
                      "phase": "decode", "step": i, "tpot_s": s} for i, s in enumerate(res.steps))
