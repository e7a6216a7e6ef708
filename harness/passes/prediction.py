"""The `prediction` pass: beside every speed, what the cost model predicts for the job's own
configuration on this machine, and how far the measurement is from it.

Owns: per measured phase, the prediction `moebench predict` makes for this job -- its model,
placement and options, resolved cache capacity and policy, workload shape and dtype, on this
machine's calibrated profile (harness.roofline.machine_rates: `moebench calibrate`'s, with its
fitted overheads, its CPU read rate at the job's threads; or the job's own measured figures)
-- trace-free: the cache's hits and misses come from uniform synthetic routing replayed through
its policy, nothing measured about the run goes in. Its rows (source=model, profiler
`prediction`): `predicted_tok_per_s` and `prediction_residual` = measured median / predicted - 1
(+0.25: the run was 25% faster than predicted), labelled with `prediction_profile`, the phase's
bounding resource (`prediction_bound`) and the routing (`prediction_routing`); null with
`prediction_reason` where there is no profile or the profile cannot predict the job. A
prediction is a diagnostic: its errors become that reason, never a failed job. Does not own: the
model (harness.costmodel), the profile choice and read rate (harness.roofline), the offline
validation over a whole sweep (harness.costmodel.validate).
"""
from __future__ import annotations

from harness.contract import MEASURED_PHASES
from harness.passes.base import ModelPass, RunContext


class PredictionPass(ModelPass):
    name = "prediction"
    summary = "the cost model's trace-free prediction of each phase on this machine's profile; the residual"

    def run(self, ctx: RunContext) -> None:
        measured = self.measured(ctx, "client", ("tok_per_s",))
        import torch                                  # loaded by the job that ran; the runner set its threads
        phases, labels = predicted(ctx, torch.get_num_threads())
        for phase in MEASURED_PHASES:
            if "tok_per_s" not in measured.get(phase, {}):
                continue
            est = phases.get(phase)
            tok_s = est.tok_per_s if est is not None else None
            residual = measured[phase]["tok_per_s"] / tok_s - 1 if tok_s else None
            reason = (labels["prediction_reason"] if not phases else
                      f"the cost model does not predict the {phase} phase" if est is None else
                      None if tok_s else "predicted 0 tok/s")
            ctx.emit(None, phase, {"predicted_tok_per_s": tok_s, "prediction_residual": residual}, "model",
                     self.name, prediction_bound=est.bound if est is not None else None,
                     **{**labels, "prediction_reason": reason})


def predicted(ctx: RunContext, threads: int) -> tuple[dict, dict[str, str | None]]:
    """(phase -> the cost model's estimate, the rows' labels), or ({}, labels with the reason)."""
    from harness.costmodel import ProfileError, Routing, predict
    from harness.predict_inputs import shape_of
    from harness.roofline import machine_rates

    spec, routing = ctx.spec, Routing.synthetic()
    m = machine_rates(spec, threads)
    labels: dict[str, str | None] = {"prediction_profile": m.profile and m.profile.name,
                                     "prediction_routing": routing.label, "prediction_reason": m.reason}
    if m.profile is None:
        return {}, labels
    try:
        p = predict(spec.planned_config, spec.placement, shape_of(spec), m.profile,
                    capacity=ctx.adapter.resolved_capacity, policy=spec.policy or "lru",
                    placement_options=spec.placement_options, dtype=spec.dtype, routing=routing)
    except (ProfileError, ValueError, KeyError) as exc:
        return {}, {**labels, "prediction_reason": f"cannot predict this job on profile {m.profile.name!r}: {exc}"}
    return p.phases, labels
