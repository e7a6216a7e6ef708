"""`moebench predict`: what a config will do on a machine, answered before any weight is read --
whether it fits (the plan `moebench plan` makes), the prefill rate and time to first token at its
context, the decode rate there, and the resource that bounds each.

Owns: turning a composed config (or each job of a sweep, `-m`) into prediction rows -- the job's
own placement when the overrides choose one (`placement=...`), else every registered placement
that applies to the model, as `moebench plan` lists them -- the hardware profile the config's
`hardware` group holds (figures overridden on the command line included), the expert-cache hit
rate a fetch-type placement is predicted at (`cache.hit_rate=`, else a synthetic routing trace
of a stated skew), the inputs of each row with where each came from (harness.predict_inputs),
and the human table and JSON. Does not own: the memory plan (harness.plan's verdicts, the one
memory rule), the time model (harness.costmodel), composing configs (Hydra).

    moebench predict model=mixtral-8x7b model.dtype=bfloat16 hardware=rtx4090-pcie4-x16 hardware.device_memory=24GiB
    moebench predict -m placement=fetch,hybrid placement.n_cpu_layers=16 cache.hit_rate=0.6,0.8 hardware=h100-pcie-80gb
    moebench predict model=qwen3-30b-a3b cache.capacity=auto hardware=rtx4090-pcie4-x16 --format json

A row that does not fit carries no figures (null) and the plan's reason; a row the profile cannot
predict (a figure it lacks at the run's dtype) likewise, with the profile's reason.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from engine.devices import fmt_bytes
from engine.dtypes import dtype_bytes
from engine.registry import PLACEMENTS
from harness.config import BAD_CONFIG, ConfigError, RunSpec, config_error_line, validate
from harness.predict_inputs import Job
from harness.plan import (Verdict, budget_of, composer, compose_once, engine_placements, expand, host_plan,
                          registered_verdicts, verdict)

if TYPE_CHECKING:
    from harness.costmodel import HardwareProfile, Routing

FORMATS = ("human", "json")
PHASES = {"prefill": "prefill_fresh", "decode": "decode"}     # a row's phases: the fresh prompt, then decode


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are one line (what was wrong, what is allowed, what was given), exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def job_of(overrides: list[str], compose: Any) -> Job:
    """Compose and check one job; raises a BAD_CONFIG error (one line through `error_line`)."""
    cfg = compose(overrides)
    hit_rate = cfg.cache.hit_rate
    if hit_rate is not None and not 0.0 <= hit_rate <= 1.0:
        raise ConfigError(f"cache.hit_rate: allowed a fraction in [0, 1] or null, got {hit_rate!r}")
    cfg.cache.hit_rate = None
    option = cfg.hydra.runtime.choices.get("hardware") or "local"
    return Job(list(overrides), validate(cfg), hit_rate, option, cfg.cache.policy)


def chooses_placement(overrides: Sequence[str]) -> bool:
    """Whether the overrides choose the placement (or set its options): then only it is predicted."""
    from harness.predict_inputs import given_keys
    return any(k == "placement" or k.startswith("placement.") for k in given_keys(overrides))


@dataclass(frozen=True)
class Candidate:
    """A placement to predict, with its options and the plan's verdict on it."""

    name: str
    options: dict[str, Any]
    verdict: Verdict
    capacity: int | str | None        # the cache capacity asked for (the plan resolves auto, or bytes, to slots)


def candidates(job: Job) -> tuple[list[Candidate], list[str]]:
    """The placements a job is predicted under, and the registered ones that do not apply to its
    model (each `name: why`): its own when the overrides choose one, else every registered one."""
    spec = job.spec
    if chooses_placement(job.overrides):
        asked = spec.capacity if spec.capacity is not None else spec.capacity_bytes and fmt_bytes(spec.capacity_bytes)
        return [Candidate(spec.placement, dict(spec.placement_options), verdict(spec), asked)], []
    out = []
    asked = spec.capacity if spec.capacity is not None else "auto"      # as harness.plan.registered_verdicts asks
    laid_out = engine_placements(spec)
    skipped = [f"{name}: engine={spec.engine} has no such layout (its knobs lay out {', '.join(laid_out)})"
               for name in PLACEMENTS.names() if name not in laid_out]
    for name, v in registered_verdicts(spec):
        try:
            PLACEMENTS.get(name).check_model(spec.model_config, {})
        except ValueError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        out.append(Candidate(name, {}, v, asked))
    return out, skipped


def row_of(job: Job, c: Candidate, hw: HardwareProfile, routing: Routing) -> dict[str, Any]:
    """One prediction row (the module docstring); figures null with a reason where there are none."""
    from harness.costmodel import ProfileError, predict
    from harness.predict_inputs import inputs_of, shape_of

    spec, plan = job.spec, c.verdict.plan
    uses_cache = PLACEMENTS.get(c.name).uses_cache(c.options)
    capacity = plan.capacity if plan is not None and uses_cache else None
    options = {**c.options, **({"capacity": capacity if capacity is not None else c.capacity,
                                "policy": job.cache_policy} if uses_cache else {})}
    row = blank_row(job.overrides, model=spec.model_label, placement=c.name, options=options, fits=c.verdict.fits,
                    plan_bytes=plan.total if plan is not None else None, budget_bytes=budget_of(spec),
                    context_tokens=spec.workload.context_tokens, dtype=spec.dtype,
                    inputs=inputs_of(job, hw, c.name, c.options, uses_cache, routing))
    hit = {"decode": job.hit_rate} if uses_cache and job.hit_rate is not None else None
    if not c.verdict.fits:
        row["reason"] = f"does not fit: {c.verdict.message.splitlines()[0]}"
        return row
    try:
        p = predict(spec.planned_config, c.name, shape_of(spec), hw, capacity=capacity, policy=job.cache_policy,
                    placement_options=c.options, dtype=spec.dtype, routing=routing, hit_rate=hit)
    except (ProfileError, ValueError) as exc:
        row["reason"] = f"cannot predict: {exc}"
        return row
    prefill, decode = (p.phases.get(PHASES[k]) for k in ("prefill", "decode"))
    row.update(prefill_tok_s=_num(prefill.tok_per_s), ttft_s=_num(prefill.time_s),
               decode_tok_s=_num(decode.tok_per_s) if decode else None)
    for k, est in (("prefill", prefill), ("decode", decode)):
        if est is not None:
            row["bound"][k] = est.bound
            row["spent_s"][k] = {r: _num(s) for r, s in est.spent_s.items()}
    _host_bound(row, job, c, hw, decode)
    if uses_cache and decode is not None and decode.expert_hits + decode.expert_misses > 0:
        row["hit_rate"] = _num(decode.expert_hits / (decode.expert_hits + decode.expert_misses))
        if job.hit_rate is None:                     # the synthetic trace's, as replayed
            row["inputs"]["hit_rate"]["value"] = row["hit_rate"]
    return row


def _host_bound(row: dict[str, Any], job: Job, c: Candidate, hw: HardwareProfile, decode: Any) -> None:
    """Host RAM as a budget (harness.plan.host_plan): when what stays on the host does not fit, the
    experts RAM cannot hold page in from disk as a decode step touches them, so decode is bounded
    by hardware.disk_read_gbps (bound `disk`); without that figure decode has no figure."""
    hp = host_plan(job.spec, c.name, c.options, c.verdict.plan)
    row.update(host_bytes=hp.total, host_budget_bytes=hp.budget, host_fits=hp.fits)
    if hp.fits is not False or decode is None or decode.tokens == 0:
        return
    cfg = job.spec.planned_config
    cpu = len(PLACEMENTS.get(c.name).traits(cfg, c.options).cpu_layers)
    per_token = (decode.h2d_bytes / decode.tokens                           # copies a device cache makes
                 + cfg.top_k * cpu * cfg.expert_bytes(dtype_bytes(job.spec.dtype)))   # CPU layers' reads
    paged = hp.paged_fraction * per_token
    if hw.disk_read_gbps is None:
        row.update(decode_tok_s=None, reason=f"host RAM does not hold what stays on the host ({hp.total / 2**30:.1f} "
                                             f"GiB > {hp.budget / 2**30:.1f} GiB): decode pages experts from disk; "
                                             "set hardware.disk_read_gbps to bound it")
        row["bound"]["decode"] = None
        return
    disk_s = paged / (hw.disk_read_gbps * 1e9)                                 # per token
    if disk_s * decode.tokens > decode.time_s:
        row["decode_tok_s"] = _num(1 / disk_s)
        row["bound"]["decode"] = "disk"
        row["spent_s"]["decode"] = {**(row["spent_s"]["decode"] or {}), "disk": _num(disk_s * decode.tokens)}


def blank_row(overrides: list[str], **known: Any) -> dict[str, Any]:
    """A row with no figures (null where not `known`): what a job's row holds before its prediction."""
    row: dict[str, Any] = {
        "model": None, "placement": None, "options": {}, "fits": False, "plan_bytes": None, "budget_bytes": None,
        "context_tokens": None, "dtype": None, "prefill_tok_s": None, "ttft_s": None, "decode_tok_s": None,
        "hit_rate": None, "bound": {"prefill": None, "decode": None}, "spent_s": {"prefill": None, "decode": None},
        "host_bytes": None, "host_budget_bytes": None, "host_fits": None, "reason": None, "overrides": overrides, "inputs": {}}
    return {**row, **known}


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def job_rows(job: Job, routing: Routing) -> tuple[list[dict[str, Any]], list[str]]:
    """The job's rows, and the registered placements that do not apply to its model. ConfigError
    when its `hardware` holds no figures (the default, `local`)."""
    from harness.costmodel import list_profiles
    from harness.predict_inputs import hardware_profile

    hw = hardware_profile(job)
    if hw is None:
        raise ConfigError(f"hardware={job.hardware_option}: holds no figures to predict with; allowed: "
                          f"hardware=<a profile: {', '.join(list_profiles())}> (or `moebench calibrate` for this "
                          "machine's)")
    cands, skipped = candidates(job)
    return [row_of(job, c, hw, routing) for c in cands], skipped


# --- output ------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def _options_text(row: dict[str, Any]) -> str:
    opts = {k: v for k, v in row["options"].items() if k not in ("capacity", "policy")}
    words = [PLACEMENTS.get(row["placement"]).describe(opts)] if opts else []
    if "capacity" in row["options"]:
        words.append(f"{row['options']['capacity']} slots {row['options']['policy']}")
    return ", ".join(w for w in words if w) or "-"


HEAD = ("placement", "options", "fits", "plan", "prefill tok/s", "TTFT s", "decode tok/s", "hit rate",
        "bound: prefill / decode")


def human(blocks: list[tuple[Job, list[dict[str, Any]], list[str]]]) -> str:
    """Per job: a line saying what is predicted on what, then one line per placement."""
    out = []
    common = set.intersection(*(set(job.overrides) for job, _, _ in blocks)) if len(blocks) > 1 else set()
    for job, rows, skipped in blocks:
        spec, w = job.spec, job.spec.workload
        if len(blocks) > 1:                          # a sweep: which job this is
            out.append(" ".join(o for o in job.overrides if o not in common) or "(the sweep's common overrides)")
        budget, gib = budget_of(spec), spec.hardware.device_memory_gib
        unset = "unlimited (hardware.device_memory unset" + (f"; the profile's card has {gib:g} GiB" if gib else "") + ")"
        out.append(f"{spec.model_label}, {spec.dtype}, context {w.context_tokens} (+{w.gen_tokens} generated) x batch "
                   f"{spec.planned_batch}, ubatch {w.ubatch}, hardware={job.hardware_option}, budget "
                   f"{fmt_bytes(budget) if budget is not None else unset}")
        table = [HEAD] + [(r["placement"], _options_text(r), "yes" if r["fits"] else "no",
                           fmt_bytes(r["plan_bytes"]) if r["plan_bytes"] is not None else "-",
                           _fmt(r["prefill_tok_s"]), _fmt(r["ttft_s"]), _fmt(r["decode_tok_s"]),
                           _fmt(r["hit_rate"], 2),
                           " / ".join(b or "-" for b in r["bound"].values())) for r in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(HEAD))]
        out += ["  " + "  ".join(cell.ljust(wd) for cell, wd in zip(line, widths)).rstrip() for line in table]
        for r in rows:
            if r["reason"]:
                out.append(f"  {r['placement']}: {r['reason']}")
            elif "hit_rate_source" in r["inputs"]:
                out.append(f"  {r['placement']}: decode hit rate from {r['inputs']['hit_rate_source']}")
            if r["host_fits"] is False and r["bound"]["decode"] == "disk":
                out.append(f"  {r['placement']}: host RAM holds {fmt_bytes(r['host_budget_bytes'])} of "
                           f"{fmt_bytes(r['host_bytes'])} it keeps there: decode pages experts from disk")
        out += [f"  not applicable: {s}" for s in skipped]
    return "\n".join(out)


# --- the command -------------------------------------------------------------------------
def predict_main(argv: Sequence[str]) -> int:
    """`moebench predict [-m] [overrides] [--format human|json]`: exit 0 when every job has a
    placement that fits and is predicted, 1 when some job has none, 2 on bad input."""
    p = OneLineParser(prog="moebench predict", description="Predicted prefill and decode rates of a config (or of "
                      "each job of a sweep, -m) on a hardware profile, with its memory plan: no weight is read, "
                      "nothing runs. Without placement=..., every registered placement. Exit 0: every job has a "
                      "placement that fits, 1: some job has none, 2: bad input.",
                      epilog="e.g. moebench predict model=mixtral-8x7b model.dtype=bfloat16 "
                             "hardware=rtx4090-pcie4-x16 hardware.device_memory=24GiB")
    p.add_argument("-m", "--multirun", action="store_true", help="predict each job of the sweep the overrides make")
    p.add_argument("--format", default="human", help=f"one of {', '.join(FORMATS)} (default human)")
    p.add_argument("--zipf", type=float, default=0.0, help="skew of the synthetic routing a cache's hit rate comes "
                   "from without cache.hit_rate (Zipf exponent of expert popularity; default 0: uniform)")
    p.add_argument("--reuse", type=float, default=0.0, help="the synthetic routing's chance that a token keeps the "
                   "previous token's expert in a slot (default 0)")
    p.add_argument("overrides", nargs="*", help="the run's overrides (key=value, group=option), as `moebench` takes")
    args = p.parse_intermixed_args(argv)
    if args.format not in FORMATS:
        p.error(f"--format: allowed {', '.join(FORMATS)}; got {args.format!r}")
    if not args.zipf >= 0:
        p.error(f"--zipf: allowed a number >= 0, got {args.zipf}")
    if not 0.0 <= args.reuse <= 1.0:
        p.error(f"--reuse: allowed a fraction in [0, 1], got {args.reuse}")
    from harness.costmodel import Routing
    routing = Routing.synthetic(zipf=args.zipf, reuse=args.reuse)
    blocks, ok = [], True
    try:
        from harness.plugin_keys import scope_options
        overrides = scope_options(args.overrides, args.multirun, compose_once)
        jobs = expand(overrides) if args.multirun else [list(overrides)]
        with composer(hydra=True) as compose:
            for overrides in jobs:
                try:
                    job = job_of(overrides, compose)
                except ConfigError as exc:          # one job of a sweep: its row says why, the sweep goes on
                    if not args.multirun:
                        raise
                    blocks.append((None, [blank_row(overrides, reason=config_error_line(exc))], []))
                    ok = False
                    continue
                rows, skipped = job_rows(job, routing)
                ok &= any(r["fits"] and r["reason"] is None for r in rows)
                blocks.append((job, rows, skipped))
    except BAD_CONFIG as exc:
        print(f"moebench predict: {error_line(exc, args.overrides)}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps([r for _, rows, _ in blocks for r in rows], indent=2))
    else:
        text = human([b for b in blocks if b[0] is not None])
        invalid = [f"{' '.join(r['overrides'])}: invalid: {r['reason']}" for job, rows, _ in blocks if job is None
                   for r in rows]
        print("\n".join(filter(None, [text, *invalid])))
    return 0 if ok else 1


def error_line(exc: BaseException, overrides: Sequence[str]) -> str:
    """One line for a config that does not compose or validate (a missing group option with the options there are)."""
    from harness.hydra_errors import one_line
    return one_line(exc, list(overrides)) or config_error_line(exc)
