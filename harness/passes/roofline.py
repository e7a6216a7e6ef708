"""The `roofline` pass: beside every speed, the physical limit of its phase on this machine.

Owns: per measured phase, the median of speed's measured repeats (tok/s and the expert-cache
counts) handed to harness.roofline, and the rows (`roofline_tok_per_s`, `frac_of_roofline`,
source=model, labelled with the profile and what the bound assumes; null with the reason when
there are no measured rates). A bound is a diagnostic: its own errors become that reason, never
a failed job. Does not own: the bound (harness.roofline, harness.costmodel).
"""
from __future__ import annotations

import statistics

from harness.contract import MEASURED_PHASES
from harness.passes.base import Pass, RunContext
from harness.roofline import Roofline, frac, roofline

COUNTS = ("expert_hits", "expert_misses")


class RooflinePass(Pass):
    name = "roofline"
    summary = "the bound bytes and FLOPs put on each phase at this machine's rates; the fraction reached"
    needs = ("speed",)
    uses_engine = False                  # reads the measured repeats and the resolved capacity only

    def skip_reason(self, ctx: RunContext) -> str | None:
        if ctx.spec.engine != "moebench":
            return f"engine={ctx.spec.engine}: the bound models moebench's own engine (its placements and cache)"
        return None

    def run(self, ctx: RunContext) -> None:
        by_phase: dict[str, dict[str, list[float]]] = {}
        for res in ctx.measured:
            for ph in res.phases:
                d = by_phase.setdefault(ph.phase, {})
                for m in COUNTS:
                    if ph.engine.get(m) is not None:
                        d.setdefault(m, []).append(ph.engine[m])
                if ph.client.get("tok_per_s") is not None:
                    d.setdefault("tok_per_s", []).append(ph.client["tok_per_s"])
        med = {ph: {m: statistics.median(v) for m, v in d.items() if v} for ph, d in by_phase.items()}
        counts = {ph: {m: d[m] for m in COUNTS if m in d} for ph, d in med.items()}
        try:
            bound = roofline(ctx.spec, {ph: c for ph, c in counts.items() if c}, ctx.adapter.resolved_capacity)
        except Exception as exc:  # noqa: BLE001 -- a bound is a diagnostic; it never fails the job
            bound = Roofline(None, reason=f"{type(exc).__name__}: {exc}")
        for phase in MEASURED_PHASES:
            if phase not in med:
                continue
            b = bound.phases.get(phase)
            ctx.emit(None, phase, {"roofline_tok_per_s": b, "frac_of_roofline": frac(med[phase].get("tok_per_s"), b)},
                     "model", roofline_profile=bound.profile, roofline_basis=bound.basis, roofline_reason=bound.reason)
