"""Predicted time per phase from bytes and FLOPs: a hardware profile applied to a scenario's work.

Owns: the time model -- a roofline per piece of work (max of FLOPs/rate and bytes/bandwidth,
on the device or the CPU), copies at link speed with an overlap rule, plus the fitted
software overheads times their event counts -- and turning it into tidy rows with
`source="model"` (harness.results.make_rows, the same schema as measured rows).
Does not own: the work itself (harness.costmodel.work, harness.costmodel.passcost), profiles,
calibration, validation.

    from harness.costmodel import predict, WorkloadShape
    p = predict("mixtral-8x7b", "fetch", WorkloadShape(4096, gen_tokens=64), "rtx4090-pcie4-x16",
                capacity=4, dtype="bfloat16")
    p.phases["decode"].tok_per_s, p.phases["decode"].exposed_copy_s
    rows = p.rows(workload="chat")              # tidy, source="model"

Per forward pass (all terms in seconds):

    compute  = roof(dense) + roof(attention) + sum_layers roof(experts on device)      [device rates]
               + sum_layers roof(experts on CPU)                                      [CPU rates]
    copies   = misses * expert_bytes / h2d  +  activations (cpu/hybrid) / d2h, h2d  +  streamed experts / h2d
    exposed  = the part of `copies` not hidden under compute (overlap rule below)
    overhead = sum over events (pass, layer, expert, row, slot, score, lookup, miss, cpu layer) of count * fitted cost
    time     = compute + exposed + overhead;     prefill_restored adds kv_bytes / h2d + restore overhead
    bound    = the resource of RESOURCES the phase's time is most spent on: each roof's bounding
               side (device/CPU FLOPs, device memory/host RAM bytes), exposed copies (the link),
               overheads (PhaseEstimate.spent_s holds the split, summing to time)

roof(flops, bytes) = max(s * flops / FLOP rate, bytes / bandwidth). Rates are the profile's at the
run's dtype (`HardwareProfile.rate`): FLOP/s per dtype, and for weight reads (dense and expert
matmuls) the GEMV rate at that dtype where the profile has one, else the memory bandwidth; a
FLOP rate the profile lacks for the dtype is refused, never borrowed from another dtype.
Attention counts the score pairs the engine's SDPA call computes -- a fresh pass's causal triangle
(is_causal: the keys above the diagonal skipped), a masked pass's whole T x S rectangle
(engine.blocks.attention.score_pairs) -- and its K/V read once at K heads (enable_gqa). s is
`Overheads.compute_scale`: 1 for a datasheet profile (peak rates); for a calibrated one a
fitted scale that, with the per-row/slot/score costs, accounts for how far the engine's small,
oddly shaped matmuls and elementwise work are from the profile's large-GEMM FLOP rate. It
scales the FLOP side only: the bytes side is already an achieved rate (GEMV, copy), and a
weight-read-bound matmul (one decode token through a large expert) runs at it.

Overlap (`overlap=`): "auto" follows the engine, asking the placement's traits --
  * cache misses with `traits.issue_ahead` (fetch's default): a layer's misses are queued on
    the copy stream at once, in compute order, so expert i computes while expert i+1 copies:
    per layer of U experts (compute e each, the fixed per-expert overheads included) of which
    m miss (copy c each), with the h = U - m hits spread evenly among the misses,
        layer = max(m*c + e*(1 + h/(m+1)),  U*e + max(0, c - e*h/(m+1)))
    and exposed = layer - U*e; with fewer than 2 cache slots each copy waits for the slot's
    previous expert, so every copy is exposed. Without issue_ahead (copy, wait, compute per
    expert) every miss is exposed;
  * streamed experts (stream): the same pipeline with m = U through the stream buffers;
  * activations of cpu/hybrid layers: waited for at once (exposed).
"none" exposes every copy; "full" hides copies under the pass's compute (exposed =
max(0, copies - compute): the bound a perfect prefetcher reaches); a float f in [0, 1]
exposes (1 - f) of every copy (e.g. a measured overlap_frac). Prefetchers are modelled only
through these modes.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.config import ModelConfig, preset
from engine.dtypes import dtype_bytes
from engine.placements import PlacementTraits
from engine.planner import PlanError, plan_memory
from harness.contract import session_tokens
from harness.costmodel.profiles import HardwareProfile, Overheads, load_profile
from harness.costmodel.passcost import EVENTS, expert_bytes, kv_bytes, pass_events, pass_flops
from harness.costmodel.work import (PhaseWork, PlacementSpec, Routing, WorkloadShape, apply_counts, apply_hit_rate,
                                    scenario_work)

if TYPE_CHECKING:     # the rows and tables load pandas; a prediction alone (moebench predict) does not
    import pandas as pd

OVERLAP_MODES = ("auto", "none", "full")
Overlap = str | float
# what a phase's time is spent on (PhaseEstimate.spent_s, .bound): each roof's side that bounds it --
# FLOPs or bytes, on the device or the CPU (a CPU expert's weight read is host RAM) -- the copies
# left exposed (the host<->device link) and the fitted software overheads. Disk is no term: the
# model assumes the weights a placement keeps off the device sit in host RAM.
RESOURCES = ("device compute", "device memory bandwidth", "CPU compute", "host RAM bandwidth", "link",
             "software overhead")


@dataclass
class PhaseEstimate:
    """The prediction for one phase; metric names follow DESIGN.md §5."""

    phase: str
    tokens: int
    reused_tokens: int
    time_s: float
    compute_s: float            # roofline compute, device + CPU
    copy_busy_s: float          # every host<->device copy at link speed (incl. KV restore)
    exposed_copy_s: float       # the part of copy_busy_s not hidden under compute
    overhead_s: float           # fitted software overheads
    restore_s: float | None     # KV restore (prefill_restored)
    h2d_bytes: float
    d2h_bytes: float
    expert_hits: float
    expert_misses: float
    expert_bytes: int
    steps: int                  # forward passes
    events: dict[str, float] = field(default_factory=dict)
    spent_s: dict[str, float] = field(default_factory=dict)    # RESOURCES -> seconds; they sum to time_s

    @property
    def tok_per_s(self) -> float | None:
        return self.tokens / self.time_s if self.time_s > 0 else None

    @property
    def bound(self) -> str | None:
        """The resource the phase spends most of its time on (RESOURCES); None for a phase of no time."""
        if not self.spent_s or max(self.spent_s.values()) <= 0:
            return None
        return max(self.spent_s, key=self.spent_s.__getitem__)

    def metrics(self) -> dict[str, float | None]:
        lookups = self.expert_hits + self.expert_misses
        m: dict[str, float | None] = {
            "time_s": self.time_s, "tokens": float(self.tokens), "tok_per_s": self.tok_per_s,
            "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes,
            "expert_hits": self.expert_hits, "expert_misses": self.expert_misses,
            "expert_hit_bytes": self.expert_hits * self.expert_bytes,
            "expert_miss_bytes": self.expert_misses * self.expert_bytes,
            "hit_rate": self.expert_hits / lookups if lookups else None,
            "byte_hit_rate": self.expert_hits / lookups if lookups else None,
            "copy_busy_s": self.copy_busy_s, "exposed_copy_s": self.exposed_copy_s,
            "compute_s": self.compute_s, "overhead_s": self.overhead_s}
        if self.phase == "decode":
            m["tpot_s_p50"] = self.time_s / self.steps if self.steps else None
        else:
            m["ttft_s"] = self.time_s
            m["reused_tokens"] = float(self.reused_tokens)
        if self.phase == "prefill_restored":
            m["restore_s"] = self.restore_s
        return m


EXTRA_UNITS = {"compute_s": "s", "overhead_s": "s"}


@dataclass
class Prediction:
    model: str
    cfg: ModelConfig
    placement: PlacementSpec
    shape: WorkloadShape
    profile: HardwareProfile
    dtype: str
    routing: str                 # label: synthetic-uniform | trace:... | measured
    overlap: Overlap
    phases: dict[str, PhaseEstimate]
    planned_device_bytes: int | None = None     # engine.planner's total for this placement and context
    fits_device_memory: bool | None = None      # vs the profile's device_memory_gib (None: unknown)

    def factors(self, workload: str = "shape") -> dict[str, Any]:
        from harness.engines.registry import predicted_engine     # the engine whose time this predicts
        pl, sh = self.placement, self.shape
        return {"engine": predicted_engine(), "model": self.model, "placement": pl.name,
                "cache_capacity": str(pl.capacity) if pl.uses_cache else None,
                "cache_policy": pl.policy if pl.uses_cache else None, "prefetch": "none", "workload": workload,
                "context_tokens": sh.context_tokens, "gen_tokens": sh.gen_tokens, "batch": sh.batch,
                "dtype": self.dtype, "kv_dtype": sh.kv_dtype,      # the treatment, as measured rows carry it
                "expert_quant": self.cfg.expert_quant.mode if self.cfg.expert_quant is not None else "none"}

    def rows(self, sweep_id: str | None = None, job_id: str | None = None, workload: str = "shape",
             extra: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Tidy rows (harness.results schema) with source="model", one repeat (null)."""
        from harness import results
        hw = self.profile
        factors = self.factors(workload)
        device = {"device_kind": hw.device_kind, "device_name": f"{hw.name} (profile)", "emulated": hw.emulated}
        job_id = job_id or ":".join(str(factors[k]) for k in ("model", "placement", "cache_capacity", "context_tokens",
                                                                "gen_tokens", "batch"))
        cols = {"profiler": "none", "hardware_profile": hw.name, "profile_source": hw.source,
                "routing": self.routing, "overlap": str(self.overlap), "ubatch": self.shape.ubatch,
                "resolved_capacity": self.placement.capacity, "planned_device_bytes": self.planned_device_bytes,
                "fits_device_memory": self.fits_device_memory, **(extra or {})}
        out: list[dict[str, Any]] = []
        for ph in self.phases.values():
            out += results.make_rows(factors, device, sweep_id or f"model-{hw.name}", job_id, None, ph.phase,
                                     ph.metrics(), "model", units=EXTRA_UNITS, extra=cols)
        return out

    def table(self, **kw: Any) -> pd.DataFrame:
        import pandas as pd
        return pd.DataFrame(self.rows(**kw))


# --- the model ----------------------------------------------------------------------------------
def predict(model: str | ModelConfig, placement: str | PlacementSpec, shape: WorkloadShape,
            profile: str | HardwareProfile, *, capacity: int | None = None, policy: str = "lru",
            placement_options: Mapping[str, Any] | None = None, dtype: str = "float32",
            routing: Routing | None = None, counts: Mapping[str, Mapping[str, float]] | None = None,
            hit_rate: float | Mapping[str, float] | None = None, overlap: Overlap = "auto",
            overheads: Overheads | None = None) -> Prediction:
    """Predict every phase of the scenario for `model` (a preset name, a checkpoint directory
    or a ModelConfig) under `placement` on `profile` (a name, a yaml path or a HardwareProfile).

    Cache traffic comes from `routing` (default: uniform synthetic) replayed through the
    placement's cache policy, unless `counts` gives measured totals per phase ({"decode":
    {"expert_hits": .., "expert_misses": .., "streamed": ..}}) or `hit_rate` (one number, or
    per phase) splits the simulated lookups at a chosen rate. overheads: default the
    profile's (zero for datasheet profiles)."""
    cfg = _model_config(model)
    name = model if isinstance(model, str) and not Path(model, "config.json").is_file() else (cfg.name or "model")
    spec = placement if isinstance(placement, PlacementSpec) else \
        PlacementSpec.from_options(placement, capacity, policy, placement_options)
    hw = load_profile(profile) if not isinstance(profile, HardwareProfile) else profile
    dt = dtype_bytes(dtype)
    _check_overlap(overlap)
    rates(hw, dtype, spec.traits(cfg), why=f"placement={spec.name}")      # refuse a missing figure up front
    work = scenario_work(cfg, spec, shape, routing)
    label = (routing or Routing.synthetic()).label
    if counts:
        label = "measured"
        for phase, c in counts.items():
            if phase in work:
                apply_counts(work[phase], c.get("expert_hits"), c.get("expert_misses"), c.get("streamed"))
    if hit_rate is not None:
        split = hit_rate if isinstance(hit_rate, Mapping) else dict.fromkeys(work, hit_rate)
        label = f"{label}, hit_rate={hit_rate}"
        for phase, h in split.items():
            if phase in work:
                apply_hit_rate(work[phase], float(h))
    ovh = overheads if overheads is not None else hw.overheads
    phases = {ph: estimate_phase(cfg, w, hw, dtype, spec, overlap, ovh) for ph, w in work.items()}
    budget = None if hw.device_memory_gib is None else int(hw.device_memory_gib * 2**30)
    planned, fits = planned_bytes(cfg, spec, shape, dt, budget)
    return Prediction(name, cfg, spec, shape, hw, dtype, label, overlap, phases, planned, fits)


def planned_bytes(cfg: ModelConfig, spec: PlacementSpec, shape: WorkloadShape, dtype_bytes: int,
                  budget: int | None = None) -> tuple[int, bool | None]:
    """Device bytes the engine's planner would reserve for this run (no budget, no reserve), and
    the planner's verdict on `budget` (None: no verdict) -- with the reserve it keeps from a budget,
    the verdict `moebench plan` gives, so the what-if and the plan never disagree on "fits"."""
    context = session_tokens(shape.context_tokens, shape.gen_tokens, shape.turn_tokens)
    plan = functools.partial(plan_memory, cfg, spec.name, spec.capacity if spec.uses_cache else None,
                             context=context, batch=shape.batch, ubatch=shape.ubatch, dtype_bytes=dtype_bytes,
                             placement_options=dict(spec.options), kv_dtype=shape.kv_dtype)
    total = plan(budget=None).total
    if budget is None:
        return total, None
    try:
        plan(budget=budget)
    except PlanError:
        return total, False
    return total, True


def what_if(model: str | ModelConfig, placement: str | PlacementSpec, shape: WorkloadShape,
            profiles: list[str | HardwareProfile] | None = None, **kw: Any) -> pd.DataFrame:
    """The same prediction on several profiles (default: every conf/hardware profile): one
    row per profile and phase with time, tok/s and its compute / exposed copy / overhead split."""
    import pandas as pd
    from harness.costmodel.profiles import list_profiles
    out = []
    for prof in profiles if profiles is not None else list_profiles():
        p = predict(model, placement, shape, prof, **kw)
        for ph in p.phases.values():
            out.append({"profile": p.profile.name, "link": p.profile.link, "phase": ph.phase, "time_s": ph.time_s,
                        "tok_per_s": ph.tok_per_s, "compute_s": ph.compute_s, "exposed_copy_s": ph.exposed_copy_s,
                        "overhead_s": ph.overhead_s, "h2d_GB": ph.h2d_bytes / 1e9,
                        "fits_device_memory": p.fits_device_memory})
    return pd.DataFrame(out)


def estimate_phase(cfg: ModelConfig, work: PhaseWork, hw: HardwareProfile, dtype: str,
                   placement: PlacementSpec, overlap: Overlap, overheads: Overheads) -> PhaseEstimate:
    """Sum the time model over a phase's passes (the module docstring's formula)."""
    terms = physical_terms(cfg, work, hw, dtype, placement, overlap, overheads)
    events = phase_events(cfg, work)
    cost = overheads.as_dict()
    overhead = float(sum(cost[e] * n for e, n in events.items()))
    restore = None
    if work.restore_tokens:
        restore = terms["restore_copy_s"] + cost["restore_s"]
    eb = expert_bytes(cfg, dtype_bytes(dtype))
    return PhaseEstimate(
        phase=work.phase, tokens=work.tokens, reused_tokens=work.reused_tokens,
        time_s=terms["physical_s"] + overhead, compute_s=terms["compute_s"], copy_busy_s=terms["copy_busy_s"],
        exposed_copy_s=terms["exposed_copy_s"], overhead_s=overhead, restore_s=restore,
        h2d_bytes=terms["h2d_bytes"], d2h_bytes=terms["d2h_bytes"], expert_hits=work.total("hits"),
        expert_misses=work.total("misses"), expert_bytes=eb, steps=len(work.passes), events=events,
        spent_s={**{k.removeprefix("spent:"): v for k, v in terms.items() if k.startswith("spent:")},
                 "software overhead": overhead})


def phase_events(cfg: ModelConfig, work: PhaseWork) -> dict[str, float]:
    """Overhead event counts of a phase (what calibration regresses on)."""
    events = dict.fromkeys(EVENTS, 0.0)
    for p in work.passes:
        for e, n in pass_events(cfg, p).items():
            events[e] += n
    events["restore_s"] = 1.0 if work.restore_tokens else 0.0
    return events


@dataclass(frozen=True)
class Rates:
    """The profile's figures at one dtype, in base units (FLOP/s, B/s); inf where not needed."""

    dev_flops: float
    dev_weights: float           # weight-read B/s of device matmuls (GEMV rate, else memory bandwidth)
    dev_mem: float               # device memory B/s (attention's KV)
    cpu_flops: float
    cpu_weights: float
    h2d: float
    d2h: float
    # the routed experts' (their weight type's figures where the profile gives them, else the above)
    dev_expert_flops: float
    dev_expert_weights: float
    cpu_expert_flops: float
    cpu_expert_weights: float


def rates(hw: HardwareProfile, dtype: str, traits: PlacementTraits, why: str = "",
          expert_type: str | None = None) -> Rates:
    """The profile's rates at `dtype` for a placement with these traits, the routed experts' at
    their `expert_type` where the profile gives figures for it; ProfileError names any figure it
    needs and lacks (at this dtype: a figure for another dtype is not used)."""
    hw.require("device_mem_gbps", "h2d_gbps", why=why + " (h2d_gbps: KV restore)")
    hw.require_rates(dtype, "device_tflops", why=why)
    if traits.uses_cpu:
        hw.require("cpu_mem_gbps", "d2h_gbps", why=why)
        hw.require_rates(dtype, "cpu_gflops", why=why)

    def gb(v: float | None) -> float:
        return float("inf") if v is None else v * 1e9

    def rate(figure: str, fallback: float | None = None, experts: bool = False) -> float:
        """A RATE_FIGURES figure at the run's dtype (the experts' type's first, for `experts`), else
        `fallback` (a GEMV's: the memory bandwidth), in base units."""
        v = hw.expert_rate(figure, expert_type if experts else None, dtype) or fallback
        return float("inf") if v is None else v * (1e12 if figure == "device_tflops" else 1e9)
    return Rates(dev_flops=rate("device_tflops"), dev_weights=rate("device_gemv_gbps", hw.device_mem_gbps),
                 dev_mem=gb(hw.device_mem_gbps), cpu_flops=rate("cpu_gflops"),
                 cpu_weights=rate("cpu_gemv_gbps", hw.cpu_mem_gbps), h2d=gb(hw.h2d_gbps), d2h=gb(hw.d2h_gbps),
                 dev_expert_flops=rate("device_tflops", experts=True), cpu_expert_flops=rate("cpu_gflops", experts=True),
                 dev_expert_weights=rate("device_gemv_gbps", hw.device_mem_gbps, experts=True),
                 cpu_expert_weights=rate("cpu_gemv_gbps", hw.cpu_mem_gbps, experts=True))


def expert_type_of(cfg: ModelConfig) -> str | None:
    """The routed experts' weight type when the config holds them in a format (engine.formats)."""
    return cfg.weight_bytes.expert_type if cfg.weight_bytes is not None else None


def physical_terms(cfg: ModelConfig, work: PhaseWork, hw: HardwareProfile, dtype: str,
                   placement: PlacementSpec, overlap: Overlap, overheads: Overheads = Overheads()) -> dict[str, float]:
    """Compute, copy and exposed-copy seconds and bytes moved of a phase, overheads excluded --
    except that the fixed per-expert overheads (expert_s, slot_s) count as compute that copies
    issued ahead hide under, and the FLOP side of each roof is scaled by `overheads.compute_scale`."""
    tr = placement.traits(cfg)
    r = rates(hw, dtype, tr, why=f"placement={placement.name}", expert_type=expert_type_of(cfg))
    s = overheads.compute_scale
    dtype_b = dtype_bytes(dtype)
    compute = flop_bound = copy_busy = exposed = h2d_bytes = d2h_bytes = 0.0
    spent = dict.fromkeys(RESOURCES[:-1], 0.0)          # overheads apart: estimate_phase adds them

    def roof(flops: Any, nbytes: Any, rate: float, bw: float, cpu: bool = False) -> Any:
        nonlocal flop_bound
        t_f, t_b = flops / rate, nbytes / bw
        by_flops = s * t_f >= t_b
        flop_bound += float(np.sum(np.where(by_flops, t_f, 0.0)))
        spent["CPU compute" if cpu else "device compute"] += float(np.sum(np.where(by_flops, s * t_f, 0.0)))
        spent["host RAM bandwidth" if cpu else "device memory bandwidth"] += float(np.sum(np.where(by_flops, 0.0, t_b)))
        return np.where(by_flops, s * t_f, t_b)
    for p in work.passes:
        f = pass_flops(cfg, p, dtype_b, work.kv_dtype)
        dev_experts = roof(f.dev_expert_flops, f.dev_expert_bytes, r.dev_expert_flops, r.dev_expert_weights)   # [M]
        cpu_experts = roof(f.cpu_expert_flops, f.cpu_expert_bytes, r.cpu_expert_flops, r.cpu_expert_weights,
                           cpu=True)                                                              # [M]
        comp = float(roof(f.dense_flops, f.dense_bytes, r.dev_flops, r.dev_weights)
                     + roof(f.attn_flops, f.attn_bytes, r.dev_flops, r.dev_mem)
                     + dev_experts.sum() + cpu_experts.sum())
        misses = f.miss_bytes / r.h2d                                                             # [M]
        act = f.act_d2h_bytes / r.d2h + f.act_h2d_bytes / r.h2d
        stream = f.stream_bytes / r.h2d                                                           # [M]
        copies = misses.sum() + act + stream.sum()
        if overlap == "auto":
            # what hides a layer's copies: its device experts' compute and their fixed host-side costs
            hide = dev_experts + p.unique * overheads.expert_s + (p.unique > 0) * p.rows * cfg.top_k * overheads.slot_s
            cached = pipelined_exposed(misses, hide, p.misses, p.unique, placement.capacity or 0) \
                if tr.issue_ahead else float(misses.sum())
            exp = act + cached + pipelined_exposed(stream, hide, p.streamed, p.streamed, tr.stream_buffers)
        elif overlap == "none":
            exp = copies
        elif overlap == "full":
            exp = max(0.0, copies - comp)
        else:
            exp = (1.0 - float(overlap)) * copies
        compute += comp
        copy_busy += copies
        exposed += exp
        h2d_bytes += f.miss_bytes.sum() + f.stream_bytes.sum() + f.act_h2d_bytes
        d2h_bytes += f.act_d2h_bytes
    restore_copy = 0.0
    if work.restore_tokens:
        kv = kv_bytes(cfg, work.restore_tokens, work.passes[0].batch if work.passes else 1, dtype_b, work.kv_dtype)
        restore_copy = kv / r.h2d
        copy_busy += restore_copy
        exposed += restore_copy          # the restore finishes before the turn's prefill starts
        h2d_bytes += kv
    spent["link"] = exposed
    out = {"compute_s": compute, "copy_busy_s": copy_busy, "exposed_copy_s": exposed, "physical_s": compute + exposed,
           "restore_copy_s": restore_copy, "h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes,
           "flop_bound_s": flop_bound,     # the FLOP-bound pieces' unscaled seconds (compute_s's part that s scales)
           **{f"spent:{k}": v for k, v in spent.items()}}     # physical_s by resource (RESOURCES)
    return {k: float(v) for k, v in out.items()}


def pipelined_exposed(copy: np.ndarray, compute: np.ndarray, copies: np.ndarray, runs: np.ndarray,
                      slots: int) -> float:
    """Exposed seconds of copies queued ahead of a layer's expert compute (the module docstring's
    formula), summed over layers. Per layer [M]: `copy` seconds of all its `copies` experts,
    `compute` seconds of all its `runs` experts (copies <= runs); `slots` the device buffers the
    copies land in (fewer than 2: each copy waits for the previous expert, nothing hides)."""
    m = copies > 0
    if not m.any():
        return 0.0
    if slots < 2:
        return float(copy[m].sum())
    c = copy[m] / copies[m]                                   # one copy
    # expected counts can be fractional (a simulated or measured total spread over passes):
    # below one copy per layer, the formula is that of one copy, weighted by how often it happens
    n_c, weight = np.maximum(copies[m], 1.0), np.minimum(copies[m], 1.0)
    n_e = np.maximum(runs[m], n_c)
    e = compute[m] / n_e
    ahead = (n_e - n_c) / (n_c + 1)               # hits computed before the first miss, on average
    layer = np.maximum(n_c * c + e * (1 + ahead), n_e * e + np.maximum(0.0, c - e * ahead))
    return float((weight * (layer - n_e * e)).sum())


def _model_config(model: str | ModelConfig) -> ModelConfig:
    """A preset name, a Hugging Face checkpoint directory (its config.json) or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    if Path(model, "config.json").is_file():
        return ModelConfig.from_hf_dir(model)
    return preset(model)


def _check_overlap(overlap: Overlap) -> None:
    if isinstance(overlap, str):
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap: allowed {list(OVERLAP_MODES)} or a fraction in [0, 1], got {overlap!r}")
    elif isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap: allowed {list(OVERLAP_MODES)} or a fraction in [0, 1], got {overlap!r}")
