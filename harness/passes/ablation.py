"""The `ablation` pass: the same work with every expert resident, paired with this placement's
repeats, so a row says what the placement costs (harness.ablation has the statistics).

Owns: whether the resident side fits the device budget, alone and beside the measured engine
(`plan_ablation`: interleaved, sequential -- the measured engine freed first -- or skipped with the
reason), running the resident engine (warmed as the measured one was; the pairs' order
alternating), its own timeline repeat when the job's timeline pass ran, and the rows: per phase
the paired statistics checked against the timeline pass, and each side's raw samples
(`profiler=ablation`). `placement=resident` is ablated only as the A/A calibration
(`run.ablation_aa`). Does not own: the statistics (harness.ablation), the measured repeats
(harness.passes.speed).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.planner import PlanError, plan_memory
from harness.engines import EngineAdapter, session_tokens_of
from harness.passes.base import Pass, RunContext
from harness.passes.timeline import timeline_repeat

if TYPE_CHECKING:
    from harness.ablation import Ablation
    from harness.config import RunConf, RunSpec


class AblationPass(Pass):
    name = "ablation"
    summary = "this placement's phase times minus every expert resident's, paired (run.ablation)"
    needs = ("speed",)
    after = ("timeline",)

    flag = ("ablation", True)

    @classmethod
    def asked_by(cls, run: RunConf) -> str | None:
        """None: run.ablation is on by default, so a `run.passes` without the pass leaves it out."""
        return None

    def skip_reason(self, ctx: RunContext) -> str | None:
        spec = ctx.spec
        if reason := super().skip_reason(ctx):
            return reason
        if not ctx.adapter.resident_twin:
            return (f"engine={spec.engine}: it has no resident twin (the same engine, every expert resident) to "
                    "pair with")
        if spec.placement == "resident" and not spec.run.ablation_aa:
            return "placement=resident is the resident side itself (run.ablation_aa=true pairs it as the A/A check)"
        return None

    def run(self, ctx: RunContext) -> None:
        # measuring code (torch, pandas) loads when a job runs the pass: its declaration loads for --help and checks
        from harness.ablation import ablation_metrics, pair_order
        ab = plan_ablation(ctx.spec, ctx.adapter)
        if ab.mode != "skipped":
            ab = _pair(ctx, ab)
        for phase, res in ablation_metrics(ab, _timeline_exposed(ctx)).items():
            ctx.emit(None, phase, res["stats"], "client", ablation_mode=ab.mode, ablation_reason=ab.reason,
                     **{k: v for k, v in res.items() if k != "stats"})
        interleaved = ab.mode == "interleaved"
        sides = [("resident", ab.resident), *([("placement", ab.placement)] if interleaved else [])]
        for side, runs in sides:               # the raw samples (the placement side's: the measured repeats if sequential)
            for r, res in enumerate(runs):
                for ph in res.phases:
                    ctx.emit(r, ph.phase, {"time_s": ph.client["time_s"]}, "client", "ablation",
                             ablation_side=side, ablation_mode=ab.mode,
                             ablation_first=pair_order(r)[0] if interleaved else None)


def plan_ablation(spec: RunSpec, eng: EngineAdapter) -> Ablation:
    """Whether the resident side fits the device budget, alone and beside the measured engine."""
    from harness.ablation import Ablation
    engine = eng.engine
    budget = engine.device.ledger.budget
    w, mcfg = spec.workload, engine.cfg
    try:
        resident = plan_memory(mcfg, "resident", None, budget, session_tokens_of(spec), w.batch, w.ubatch,
                               engine.model.dtype.itemsize, device_kind=engine.device.kind, kv_dtype=engine.kv_dtype)
    except PlanError as exc:
        return Ablation("skipped", f"the resident plan does not fit the device budget: {str(exc).splitlines()[0]}")
    if budget is None or resident.total + engine.plan.total <= budget:
        return Ablation("interleaved")
    return Ablation("sequential", "both engines together exceed the device budget")


def _pair(ctx: RunContext, ab: Ablation) -> Ablation:
    """The resident side's repeats, paired with the placement's (`ab.mode`)."""
    from harness.ablation import pair_order
    from harness.scenario import run_repeat
    spec, eng, sample, warm = ctx.spec, ctx.adapter, ctx.sample, ctx.warm
    gen, n = spec.workload.gen_tokens, spec.run.repeats
    if ab.mode == "sequential":     # the measured engine leaves the device before the resident one arrives
        ctx.free_engine("for the ablation's resident side (both engines together exceed the device budget)")
        ab.placement = ctx.measured
    resident = eng.resident_adapter(spec)
    repeat_of = {"placement": lambda: run_repeat(eng, sample, gen, keep_logits=False, warm_with=warm),
                 "resident": lambda: run_repeat(resident, sample, gen, keep_logits=False)}
    try:
        with ctx.reporter.step(f"ablation ({ab.mode}): the same work with every expert resident"):
            for _ in range(spec.run.warmup):       # warmed as the measured engine was: a fair pair
                repeat_of["resident"]()
            for i in range(n):
                # which side goes first alternates: an order effect cancels over the pairs
                for side in (pair_order(i) if ab.mode == "interleaved" else ("resident",)):
                    getattr(ab, side).append(repeat_of[side]())
            if spec.run.timeline and ctx.status("timeline") == "ran":   # the copies a resident engine makes too
                ab.resident_timeline = timeline_repeat(resident, sample, gen, False, None)
    finally:
        resident.close()
    return ab


def _timeline_exposed(ctx: RunContext) -> dict[str, float | None] | None:
    """Per phase, the timeline pass's `exposed_copy_s` (None when no timeline pass ran)."""
    rows = [r for r in ctx.job.rows if r.get("profiler") == "timeline" and r.get("source") == "engine"
            and r.get("status") == "ok" and r.get("metric") == "exposed_copy_s"]
    return {r["phase"]: r["value"] for r in rows} if rows else None
