"""The `timeline` pass: one more repeat with the in-process Timeline (and NVTX ranges with
`run.nvtx`) attached, after the speed repeats, so no speed row comes from an instrumented run
(DESIGN.md §7.5).

Owns: the instrumented repeat (`timeline_repeat`: from the expert-cache state the measured
repeats start from), its rows `profiler=timeline` -- per phase copy_busy_s / overlap_s /
exposed_copy_s / overlap_frac / link_gbps, labelled with how copies were timed -- and the
Chrome/Perfetto trace JSON (`run.trace=true`: <job dir>/trace.json). Does not own: the interval
arithmetic (harness.profiling.overlap), the phases (harness.scenario).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.nvtx_ranges import NvtxRanges
from harness.passes.base import Pass, RunContext, Skip, emit_instrumented

if TYPE_CHECKING:
    from harness.engines.base import EngineAdapter
    from harness.scenario import RepeatResult
    from workloads.base import WorkloadSample


def timeline_repeat(eng: EngineAdapter, sample: WorkloadSample, gen_tokens: int, nvtx_on: bool,
                    trace_path: Path | None, warm_with: WorkloadSample | None = None) -> RepeatResult | None:
    """One instrumented repeat, from the expert-cache state the measured repeats start from
    (`warm_with`: run_repeat's); None when the engine has no instrumentation hook."""
    # measuring code (torch, pandas) loads when a job runs the pass: its declaration loads for --help and checks
    from engine.timeline import Instruments, Timeline
    from harness.scenario import run_repeat
    tl = Timeline(eng.device_kind)
    inst = Instruments(tl, NvtxRanges()) if nvtx_on else tl
    if not eng.set_instrument(inst):
        return None
    try:
        res = run_repeat(eng, sample, gen_tokens, keep_logits=False, timeline=tl, warm_with=warm_with)
    finally:
        eng.set_instrument(None)
    if trace_path is not None:
        tl.collect()
        trace_path.write_text(json.dumps(tl.chrome_trace(markers=res.windows)))
    return res


class TimelinePass(Pass):
    name = "timeline"
    summary = "one instrumented repeat: copy/compute overlap per phase (run.trace: a Perfetto trace too)"

    flag = ("trace", True)                        # the Perfetto trace; run.timeline (default true) runs it too

    def skip_reason(self, ctx: RunContext) -> str | None:
        run = ctx.spec.run
        return None if run.timeline or run.trace else "run.timeline=false"

    def run(self, ctx: RunContext) -> None:
        run, eng = ctx.spec.run, ctx.adapter
        with ctx.reporter.step("timeline pass"):
            res = timeline_repeat(eng, ctx.sample, ctx.spec.workload.gen_tokens, run.nvtx,
                                  ctx.job_dir / "trace.json" if run.trace else None, warm_with=ctx.warm)
        if res is None:
            raise Skip(f"engine={ctx.spec.engine} has no instrumentation hook")
        emit_instrumented(ctx, res, "timeline", copy_timing="emulated" if eng.emulated else "cuda_events")
