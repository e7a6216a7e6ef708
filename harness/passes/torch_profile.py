"""The `torch_profile` pass (`run.profiler=torch`): one repeat under torch.profiler, from the
measured repeats' expert-cache state; its Chrome trace (<job dir>/torch_trace.json) and the
memcpy bytes and time summed from it.

Owns: the profiled repeat, its rows (`profiler=torch`) and the summary row (source=torch).
Does not own: reading the trace (harness.profiling.torchprof), the phases (harness.scenario).
"""
from __future__ import annotations

import json

from harness.passes.base import Pass, RunContext, emit_instrumented


class TorchProfilePass(Pass):
    name = "torch_profile"
    summary = "run.profiler=torch: one repeat under torch.profiler; its trace, memcpy bytes and time"
    profiler = "torch"

    flag = ("profiler", "torch")

    def run(self, ctx: RunContext) -> None:
        # measuring code (torch, pandas) loads when a job runs the pass: its declaration loads for --help and checks
        from torch.profiler import ProfilerActivity, profile

        from harness.profiling.torchprof import PROFILER_UNITS, memcpy_summary
        from harness.scenario import run_repeat
        eng, path = ctx.adapter, ctx.job_dir / "torch_trace.json"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device_kind == "cuda" else [])
        with ctx.reporter.step("torch.profiler pass"):
            with profile(activities=activities, record_shapes=True) as prof:
                res = run_repeat(eng, ctx.sample, ctx.spec.workload.gen_tokens, keep_logits=False, warm_with=ctx.warm)
            prof.export_chrome_trace(str(path))
        emit_instrumented(ctx, res, "torch")
        ctx.emit(0, "all", memcpy_summary(json.loads(path.read_text())), "torch", "torch", units=PROFILER_UNITS)
