"""The `roofline` pass: beside every speed, the physical limit of its phase on this machine.

Owns: per measured phase, the median of speed's measured repeats (tok/s and the expert-cache
counts) handed to harness.roofline with this machine's read bandwidth at the job's threads, and
the rows (`roofline_tok_per_s`, `frac_of_roofline`, source=model, labelled with the profile, what
the bound assumes and where its read bandwidth came from: `roofline_read_gbps`,
`roofline_read_gbps_all_cores`, `roofline_read_method`; null with the reason when there are no
measured rates). A measurement more than harness.roofline.ROOFLINE_SLACK above its bound is
flagged `roofline_wrong` with the reason and a warning, its fraction null: a number above 1 would
read as a result. A bound is a diagnostic: its own errors become that reason, never a failed job.
Does not own: the bound (harness.roofline, harness.costmodel), the read (harness.read_bandwidth).
"""
from __future__ import annotations

from harness.contract import MEASURED_PHASES
from harness.passes.base import ModelPass, RunContext
from harness.roofline import Roofline, frac, roofline, wrong

COUNTS = ("expert_hits", "expert_misses")


class RooflinePass(ModelPass):
    name = "roofline"
    summary = "the bound bytes and FLOPs put on each phase at this machine's rates; the fraction reached"

    def run(self, ctx: RunContext) -> None:
        counts = self.measured(ctx, "engine", COUNTS)
        speeds = self.measured(ctx, "client", ("tok_per_s",))
        med = {ph: {**counts[ph], **speeds[ph]} for ph in counts}          # the same phases, both sides
        import torch                                  # loaded by the job that ran; not for --help or checks
        try:                                          # the job's threads: the runner set them
            bound = roofline(ctx.spec, {ph: c for ph, c in counts.items() if c}, ctx.adapter.resolved_capacity,
                             torch.get_num_threads())
        except Exception as exc:  # noqa: BLE001 -- a bound is a diagnostic; it never fails the job
            bound = Roofline(None, reason=f"{type(exc).__name__}: {exc}")
        for phase in MEASURED_PHASES:
            if phase not in med:
                continue
            b, measured = bound.phases.get(phase), med[phase].get("tok_per_s")
            why = wrong(measured, b)
            if why:
                ctx.reporter.warn(f"{phase}: {why} ({bound.read_method})")
            ctx.emit(None, phase, {"roofline_tok_per_s": b, "frac_of_roofline": None if why else frac(measured, b)},
                     "model", roofline_reason=why or bound.reason, roofline_wrong=bool(why), **bound.columns())
