"""One job, end to end: validate -> memory plan -> reference (CPU) -> measured engine (cached per process) ->
warm-up and repeats, each phase checked -> quality vs the exact reference -> instrumented
passes -> paired ablation -> tidy rows + manifest, written atomically into the job dir.

Owns: the job lifecycle (`Job`), skipping a job only when its recorded config hash matches
(`harness.sweep.resume_decision`), and turning any failure into rows: a job that fails becomes
a `status=failed` row so a sweep goes on; a profiling pass that fails records its own failed
row and keeps the job's measured rows; a job whose dir cannot be written (found before it is
measured) or whose files cannot be written becomes a failed row held in memory for the sweep
table (`JobOutcome.unwritten`).
Does not own: the phases (harness.scenario), the reference (harness.reference), storage
format (harness.results), the CLI (harness.cli).

    from harness.runner import JobContext, run
    outcome = run(cfg, JobContext(job_dir, sweep_id, job_id), Reporter())
"""
from __future__ import annotations

import logging
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from engine.kvquant import DEFAULT_KV_DTYPE, is_lossy
from engine.nvtx_ranges import NvtxRanges
from engine.placements import needs_cache
from engine.planner import PlanError, plan_memory
from harness import results
from harness.ablation import Ablation, ablation_metrics, pair_order
from harness.config import DEFAULT_CAPACITY, RunSpec, validate
from harness.checks import LOSSY_REASON, NO_REFERENCE_REASON, RepeatCheck
from harness.contract import CHECK_METRICS, MEASURED_PHASES, PREFIX_CACHE, QUALITY_METRICS, QUALITY_PHASE
from harness.dtype_speed import dtype_speed
from harness.engines import ENGINES, EngineAdapter as Adapter, get_adapter, release_cached, session_tokens_of
from harness.engines.moebench import MoebenchAdapter
from harness.machine import MachineLoad, job_threads
from harness.manifest import collect_manifest
from harness.measure import PhaseProbe
from harness.outliers import flag_outliers
from harness.model_id import model_id
from harness.passes import (CudaProfilerRange, relaunch_under_nsys, timeline_pass, torch_profile_pass, trace_pass,
                            under_nsys)
from harness.plan import job_plan
from harness.profiling.torchprof import PROFILER_UNITS
from harness.quality import compare_explained as quality_compare, quality_pass
from harness.reference import Reference, reference_for
from harness.roofline import Roofline, frac, roofline
from harness.report import Reporter
from harness.scenario import RepeatResult, check_metrics, compare_phase, run_repeat
from harness.sweep import job_fingerprint, measurement_key, resume_decision, twin_of
from workloads import build as build_workload
from workloads.base import WorkloadSample
from workloads.tokenize import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class JobContext:
    job_dir: Path
    sweep_id: str
    job_id: str
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    overrides: list[str] | None = None   # the job's Hydra task overrides (what `moebench rerun` replays)
    in_sweep: bool = False               # a multirun job: a twin in the same sweep may stand in for it
    # called with the job id once whatever the job's dir holds as complete is this run's: found
    # current (the same config hash) or, about to be measured, its older DONE removed
    reached: Callable[[str], None] | None = None


@dataclass
class JobOutcome:
    rows: list[dict]
    steps: list[dict] = field(default_factory=list)
    error: str | None = None          # the job (or one of its passes) failed
    skipped: str | None = None        # why it did not run (resume)
    unwritten: bool = False           # its files could not be written: `rows` is the failed row to keep


def factors_of(cfg: DictConfig) -> dict[str, Any]:
    """The swept factors, read leniently so even an invalid config gets a failed row."""
    g = lambda key, default=None: OmegaConf.select(cfg, key, default=default)  # noqa: E731
    placement = g("placement.name")
    options = {k: v for k, v in (g("placement") or {}).items() if k != "name"}
    try:
        uses_cache = needs_cache(placement, options)
    except (TypeError, ValueError):   # invalid options: validate() reports them; the row still gets factors
        uses_cache = False
    try:
        from harness.engines import ENGINES
        ours = ENGINES.get(g("engine.name")).uses_placement
    except (ValueError, ImportError):             # an unknown engine: validate() reports it
        ours = True
    if not ours:                                  # the engine's own knobs are its columns
        placement, uses_cache = None, False
    quant = g("experts.quant", "none") if ours else None     # another engine's weights are its own knobs
    capacity, capacity_bytes = g("cache.capacity"), g("cache.capacity_bytes")
    capacity = "bytes" if capacity_bytes is not None and capacity is None else (capacity or DEFAULT_CAPACITY)
    kv_dtype = g("kv.dtype", DEFAULT_KV_DTYPE)
    return {"engine": g("engine.name"), "model": g("model.name"), "placement": placement,
            "cache_capacity": str(capacity) if uses_cache else None,
            "cache_capacity_bytes": str(capacity_bytes) if uses_cache and capacity_bytes is not None else None,
            "expert_quant": quant,
            "cache_policy": g("cache.policy") if uses_cache else None,
            "prefetch": g("prefetch.name") if ours else None,
            "workload": g("workload.name"), "context_tokens": g("workload.context_tokens"),
            "gen_tokens": g("workload.gen_tokens"), "batch": g("workload.batch"), "dtype": g("model.dtype"),
            "kv_dtype": kv_dtype, "lossy": _lossy(kv_dtype, g("model.dtype"), quant)}


def _lossy(kv_dtype: Any, dtype: Any, quant: Any) -> bool | None:
    """Whether the job runs a lossy treatment: quantised experts or a KV format that loses
    precision ("auto" dtype: the checkpoint's, which only a lossless kv_dtype leaves exact
    whatever it is); None when its config is too broken to say. Corrected once the engine is
    built (Job._load)."""
    if quant is not None and quant != "none":
        return True
    try:
        kv = kv_dtype != DEFAULT_KV_DTYPE if dtype == "auto" else is_lossy(kv_dtype, dtype)
    except ValueError:
        return None
    return kv if quant is not None or kv else None


def _resolved_kind(device: str) -> str:
    """The device a job's engine will run on (DESIGN §3: auto = CUDA when available)."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


class Job:
    """One job's state while it runs: its spec, its rows and how to emit them."""

    def __init__(self, cfg: DictConfig, ctx: JobContext, reporter: Reporter) -> None:
        self.cfg, self.ctx, self.reporter = cfg, ctx, reporter
        self.factors = factors_of(cfg)
        self.device: dict[str, Any] = {"device_kind": None, "device_name": None, "emulated": None}
        self.extra: dict[str, Any] = {"host": socket.gethostname()}
        self.rows: list[dict] = []
        self.steps: list[dict] = []
        self.errors: list[str] = []
        self.load_start: MachineLoad | None = None
        self.load_end: MachineLoad | None = None
        self.reference: Reference | None = None
        self.adapter: Adapter | None = None
        self.check_dtype = "float32"           # the run's dtype once the engine is built (_load)

    # --- rows -------------------------------------------------------------------------------
    def emit(self, repeat: int | None, phase: str, metrics: dict, source: str, profiler: str = "none",
             units: dict | None = None, **more: Any) -> None:
        self.rows.extend(results.make_rows(self.factors, self.device, self.ctx.sweep_id, self.ctx.job_id, repeat,
                                           phase, metrics, source, units=units,
                                           extra={**self.extra, "profiler": profiler,
                                                  "prefix_cache": PREFIX_CACHE.get(phase), **more}))

    def emit_repeat(self, r: int, res: RepeatResult, profiler: str, check: bool) -> None:
        """Rows of one repeat; with `check`, every phase that produced tokens carries its own
        numerical check against the reference (null when there is no reference) and its verdict
        (harness.checks: `check_ok`, `check_tolerance`, `check_reason`)."""
        ref = self.reference.result if (check and self.reference is not None) else None
        skip = LOSSY_REASON if self.factors.get("lossy") else None if ref is not None else NO_REFERENCE_REASON
        judge = RepeatCheck(self.check_dtype, skip, self.adapter.suppressed_tokens if self.adapter else frozenset())
        for ph in res.phases:
            state = {"expert_cache": ph.expert_cache, **ph.columns}     # ph.columns: starved, on every row of it
            self.emit(r, ph.phase, ph.client, "client", profiler, **state)
            engine_metrics, verdict = dict(ph.engine), {}
            if ph.tokens:                    # null when unchecked or nothing to compare with, never 0
                theirs = ref.phase(ph.phase) if ref else None
                cmp = compare_phase(ph, theirs) if theirs is not None and theirs.tokens else None
                engine_metrics.update(check_metrics(cmp) if cmp else dict.fromkeys(CHECK_METRICS))
                verdict = judge.phase(ph.phase, cmp).columns()
            self.emit(r, ph.phase, engine_metrics, "engine", profiler, **state, **verdict)
        self.steps.extend({"sweep_id": self.ctx.sweep_id, "job_id": self.ctx.job_id, "repeat": r,
                           "profiler": profiler, "phase": "decode", "step": i, "tpot_s": s}
                          for i, s in enumerate(res.steps))

    def failed_part(self, part: str, exc: BaseException) -> None:
        """A part of the job (a profiling pass) failed: its own failed row; the rest stays."""
        text = f"{type(exc).__name__}: {exc}"
        log.error("job %s: %s failed: %s", self.ctx.job_id, part, text)
        self.errors.append(f"{part}: {text}")
        self.rows.append(results.failed_row(self.factors, self.device, self.ctx.sweep_id, self.ctx.job_id, text,
                                            phase=part, extra={**self.extra, "profiler": part}))

    # --- the job --------------------------------------------------------------------------------
    def execute(self) -> JobOutcome:
        try:
            self._measure()
        except Exception as exc:  # noqa: BLE001 -- any failure becomes a failed row; the sweep goes on
            text = f"{type(exc).__name__}: {exc}"
            log.error("job %s failed: %s", self.ctx.job_id, text)
            log.debug("%s", traceback.format_exc())
            if self.adapter is not None:     # keep what the engine left (a server's log), then never reuse it
                try:
                    self.adapter.save_artifacts(self.ctx.job_dir)
                except OSError as err:
                    log.warning("job %s: could not save the engine's artifacts: %s", self.ctx.job_id, err)
                release_cached()
            row = results.failed_row(self.factors, self.device, self.ctx.sweep_id, self.ctx.job_id, text,
                                     extra=self.extra)
            return JobOutcome([row], error=text)
        error = "; ".join(self.errors) or None
        return JobOutcome(self.rows, self.steps, error=error)

    def _measure(self) -> None:
        spec = validate(self.cfg)                                       # before any weight is read
        job_plan(spec)      # the engine's own memory plan: a budget it cannot fit fails here, not after the reference
        torch.set_num_threads(job_threads(spec))
        threads = torch.get_num_threads()
        self.load_start = MachineLoad.sample(threads)
        self.extra.update(threads=threads, load_avg_start=self.load_start.load_avg_1m,
                          other_busy_cores=self.load_start.other_busy_cores, machine_busy=self.load_start.busy)
        if self.load_start.busy:
            self.reporter.warn(self.load_start.warning())
        sample = self._sample(spec, spec.workload.seed)
        warm = self._sample(spec, spec.workload.seed + 1) if spec.run.expert_cache == "warm" else None
        if spec.run.check_reference or spec.prefetch == "trace_oracle":
            with self.reporter.step("reference (every expert resident, CPU)"):
                self.reference = reference_for(spec, sample, Path(spec.run.out))
            self.extra["reference"] = self.reference.origin if spec.run.check_reference else None
        eng, loaded = self._load(spec)
        known = dict(ubatch=spec.workload.ubatch, token_source=sample.token_source,
                     resolved_capacity=eng.resolved_capacity, placement_options=repr(spec.placement_options),
                     expert_cache_mode=spec.run.expert_cache)
        knobs = dict(eng.knobs())                   # an engine's own knobs (llama.cpp's -ngl, -ub, -t ...)
        knobs.pop("kv_dtype", None)                 # the factor column names the kv.dtype treatment; llama.cpp's
        known.update(knobs)                         # own cache types stay in cache_type_k / cache_type_v
        if eng.compute_dtype is not None:           # a dtype this machine runs slower than float32 (16.4)
            speed = dtype_speed(eng.compute_dtype, eng.device_kind)
            known.update(speed.as_extra())
            if speed.warning():
                self.reporter.warn(speed.warning())
        if spec.hardware.device_memory and (gap := eng.budget_gap()):   # DESIGN §4: one budget for every engine
            self.reporter.warn(f"hardware.device_memory={spec.hardware.device_memory} is not held by "
                               f"engine={spec.engine}: {gap}")
        self.extra.update(known)
        for row in self.rows:                       # the load rows came first: the same settings columns, so
            row.update(known)                       # tables and comparisons tell their configs apart too
        gen, run_cfg = spec.workload.gen_tokens, spec.run
        for i in range(run_cfg.warmup):                                 # excluded from every table
            with self.reporter.step(f"warm-up {i + 1}/{run_cfg.warmup}"):
                run_repeat(eng, sample, gen, keep_logits=False, warm_with=warm)
        measured = []
        nvtx_child = run_cfg.profiler == "nsys" and under_nsys()
        with CudaProfilerRange():
            if nvtx_child:
                eng.set_instrument(NvtxRanges())
            for r in range(run_cfg.repeats):
                with self.reporter.step(f"repeat {r + 1}/{run_cfg.repeats}"):
                    measured.append(run_repeat(eng, sample, gen, keep_logits=run_cfg.check_reference, warm_with=warm))
            eng.set_instrument(None)
        for r, res in enumerate(measured):
            self.emit_repeat(r, res, "nsys" if nvtx_child else "none", check=run_cfg.check_reference)
        flag_outliers(self.rows)                    # each repeat against its siblings (harness.outliers)
        self._quality(spec, eng, sample)
        self._roofline(spec, eng, measured)
        self._passes(spec, eng, sample, warm)
        eng.set_progress(None)                     # the adapter may serve the next job, with its own reporter
        try:
            eng.save_artifacts(self.ctx.job_dir)   # auxiliary files: losing them loses no measurement
        except OSError as exc:
            self.failed_part("artifacts", exc)
        self._ablation(spec, eng, sample, measured, warm)
        self.load_end = MachineLoad.sample(threads)

    def _sample(self, spec: RunSpec, seed: int) -> WorkloadSample:
        w = spec.workload
        tok = load_tokenizer(spec.model.path, spec.model_config.vocab_size, w.tokens)
        return build_workload(w.name, tok, w.context_tokens, w.turn_tokens, w.batch, seed, w.tokens)

    def _load(self, spec: RunSpec) -> tuple[Adapter, bool]:
        kind = _resolved_kind(spec.hardware.device)
        prefetch_options = dict(spec.prefetch_options)
        if spec.prefetch == "trace_oracle":                             # the oracle replays the reference's passes
            prefetch_options["steps"] = self.reference.steps
        key_extra = (self.reference.key,) if spec.prefetch == "trace_oracle" else ()
        with PhaseProbe(kind, None, ENGINES.get(spec.engine).allocates_here) as probe:
            with self.reporter.step("loading the model"):
                eng, loaded = get_adapter(spec, prefetch_options=prefetch_options, key_extra=key_extra,
                                          progress=self.reporter.progress)
        self.adapter = eng
        # what this engine runs (llama.cpp's defaults too): known now, exact ones included
        self.factors["lossy"] = bool(spec.lossy or eng.lossy)
        self.check_dtype = spec.dtype                               # the check's tolerance is the run dtype's
        eng.set_progress(self.reporter.progress)
        self.device = {"device_kind": eng.device_kind, "device_name": eng.device_name, "emulated": eng.emulated}
        load = {"time_s": probe.time_s if loaded else None,
                "peak_host_rss_bytes": probe.peak_host_rss_bytes if loaded else None,
                "peak_device_bytes": probe.peak_device_bytes if loaded else None,
                "peak_device_reserved_bytes": probe.peak_device_reserved_bytes if loaded else None,
                "emulated_device_peak_bytes": eng.device_peak() if loaded else None}
        self.emit(0, "load", load, "client", model_load="cold" if loaded else "reused", expert_cache="cold")
        # the engine's own load, without one-time setup (imports, a GGUF conversion, probes)
        self.emit(0, "load", {"time_s": eng.load_s if loaded else None}, "engine",
                  model_load="cold" if loaded else "reused", expert_cache="cold")
        return eng, loaded

    # --- quality against the exact reference (exact runs too: 0 / 1 there) -------------------------
    def _quality(self, spec: RunSpec, eng: Adapter, sample: WorkloadSample) -> None:
        """The `quality` phase (harness.quality): every metric measured, or null with its reason in
        the row's `quality_reason`; NaN or inf in the pass is the quality part's failed row."""
        ref = self.reference.quality if (spec.run.check_reference and self.reference is not None) else None
        metrics: dict[str, float | None] = dict.fromkeys(QUALITY_METRICS)
        reasons: dict[str, str] = {}
        if not spec.run.check_reference:
            reasons = dict.fromkeys(metrics, "no exact reference (run.check_reference=false)")
        elif ref is None:
            reasons = dict.fromkeys(metrics, "the exact reference holds no quality pass")
        elif getattr(eng, "engine", None) is None or spec.engine != "moebench":
            reasons = dict.fromkeys(metrics, f"engine={spec.engine} gives no full-vocabulary logits per position")
        else:
            try:
                with self.reporter.step("quality pass (teacher-forced and greedy, vs the exact reference)"):
                    gen = spec.workload.gen_tokens
                    forced = quality_pass(eng.engine, sample.contexts, gen, forced=ref.continuation)
                    free = quality_pass(eng.engine, sample.contexts, gen)
                metrics, reasons = quality_compare(forced, ref, free.continuation)
            except Exception as exc:  # noqa: BLE001 -- a failed quality pass keeps the job's measured rows
                self.failed_part(QUALITY_PHASE, exc)
                return
        # its own pass, like the timeline's: profiler=quality keeps it out of speed rows and out of the
        # per-phase checks, which read profiler=none; a null metric's row carries why, a measured one none
        def reason_of(m: str) -> str | None:
            return reasons.get(m) if metrics[m] is None else None

        unexplained = [m for m, v in metrics.items() if v is None and not reasons.get(m)]
        if unexplained:
            raise RuntimeError(f"quality metrics {unexplained} are null with no reason")
        for reason in dict.fromkeys(map(reason_of, metrics)):
            self.emit(0, QUALITY_PHASE, {m: v for m, v in metrics.items() if reason_of(m) == reason}, "engine",
                      QUALITY_PHASE, quality_reason=reason)

    # --- the physical limit beside every speed ---------------------------------------------------
    def _roofline(self, spec: RunSpec, eng: Adapter, measured: list[RepeatResult]) -> None:
        """Per phase: the bound from bytes and FLOPs at this machine's measured rates, and how close
        the measured median came (source=model; null with the reason when there are no rates)."""
        if spec.engine != "moebench":
            return
        by_phase: dict[str, dict[str, list[float]]] = {}
        for res in measured:
            for ph in res.phases:
                d = by_phase.setdefault(ph.phase, {})
                for m in ("expert_hits", "expert_misses"):
                    if ph.engine.get(m) is not None:
                        d.setdefault(m, []).append(ph.engine[m])
                if ph.client.get("tok_per_s") is not None:
                    d.setdefault("tok_per_s", []).append(ph.client["tok_per_s"])
        med = {ph: {m: statistics.median(v) for m, v in d.items() if v} for ph, d in by_phase.items()}
        counts = {ph: {m: d[m] for m in ("expert_hits", "expert_misses") if m in d} for ph, d in med.items()}
        try:
            bound = roofline(spec, {ph: c for ph, c in counts.items() if c}, eng.resolved_capacity)
        except Exception as exc:  # noqa: BLE001 -- a bound is a diagnostic; it never fails the job
            bound = Roofline(None, reason=f"{type(exc).__name__}: {exc}")
        for phase in MEASURED_PHASES:
            if phase not in med:
                continue
            b = bound.phases.get(phase)
            self.emit(None, phase, {"roofline_tok_per_s": b, "frac_of_roofline": frac(med[phase].get("tok_per_s"), b)},
                      "model", roofline_profile=bound.profile, roofline_basis=bound.basis, roofline_reason=bound.reason)

    # --- instrumented passes: each may fail on its own ---------------------------------------
    def _passes(self, spec: RunSpec, eng: Adapter, sample: WorkloadSample, warm: WorkloadSample | None) -> None:
        run_cfg, gen, job_dir = spec.run, spec.workload.gen_tokens, self.ctx.job_dir
        timing = "emulated" if eng.emulated else "cuda_events"   # how copy/compute intervals were timed
        if run_cfg.timeline or run_cfg.trace:
            try:
                with self.reporter.step("timeline pass"):
                    res = timeline_pass(eng, sample, gen, run_cfg.nvtx, job_dir / "trace.json" if run_cfg.trace else None,
                                        warm_with=warm)
                if res is not None:
                    self._emit_pass(res, "timeline", copy_timing=timing)
            except Exception as exc:  # noqa: BLE001
                self.failed_part("timeline", exc)
        if run_cfg.record_trace:
            try:
                with self.reporter.step("routing trace pass"):
                    res = trace_pass(eng, sample, gen, job_dir / "routing.npz")
                if res is not None:
                    self._emit_pass(res, "trace")
            except Exception as exc:  # noqa: BLE001
                self.failed_part("trace", exc)
        if run_cfg.profiler == "torch":
            try:
                with self.reporter.step("torch.profiler pass"):
                    res, summary = torch_profile_pass(eng, sample, gen, job_dir / "torch_trace.json", warm_with=warm)
                self._emit_pass(res, "torch")
                self.emit(0, "all", summary, "torch", "torch", units=PROFILER_UNITS)
            except Exception as exc:  # noqa: BLE001
                self.failed_part("torch", exc)
        if run_cfg.profiler == "nsys" and not under_nsys():
            try:
                overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
                for r in relaunch_under_nsys(job_dir, overrides):
                    self.emit(None, r["scope"], {r["metric"]: r["value"]}, "nsys", "nsys", units={r["metric"]: r["unit"]})
            except Exception as exc:  # noqa: BLE001
                self.failed_part("nsys", exc)

    def _emit_pass(self, res: RepeatResult, profiler: str, **more: Any) -> None:
        for ph in res.phases:
            self.emit(0, ph.phase, ph.client, "client", profiler, expert_cache=ph.expert_cache, **ph.columns, **more)
            self.emit(0, ph.phase, ph.engine, "engine", profiler, expert_cache=ph.expert_cache, **ph.columns, **more)

    # --- the paired ablation --------------------------------------------------------------------
    def _ablation(self, spec: RunSpec, eng: Adapter, sample: WorkloadSample, measured: list[RepeatResult],
                  warm: WorkloadSample | None) -> None:
        """The paired ablation's rows (harness.ablation): per phase its statistics, checked against the
        timeline pass; the raw samples of each side beside them (profiler=ablation). For
        placement=resident only as the A/A calibration (`run.ablation_aa`): resident against resident."""
        if not spec.run.ablation or spec.engine != "moebench":
            return
        if spec.placement == "resident" and not spec.run.ablation_aa:
            return
        ab = self._plan_ablation(spec, eng)
        try:
            if ab.mode != "skipped":
                ab = self._run_ablation(spec, eng, sample, measured, warm, ab)
        except Exception as exc:  # noqa: BLE001
            self.failed_part("ablation", exc)
            return
        for phase, res in ablation_metrics(ab, self._timeline_exposed()).items():
            self.emit(None, phase, res["stats"], "client", ablation_mode=ab.mode, ablation_reason=ab.reason,
                      **{k: v for k, v in res.items() if k != "stats"})
        interleaved = ab.mode == "interleaved"
        sides = [("resident", ab.resident), *([("placement", ab.placement)] if interleaved else [])]
        for side, runs in sides:               # the raw samples (the placement side's: the measured repeats if sequential)
            for r, res in enumerate(runs):
                for ph in res.phases:
                    self.emit(r, ph.phase, {"time_s": ph.client["time_s"]}, "client", "ablation",
                              ablation_side=side, ablation_mode=ab.mode,
                              ablation_first=pair_order(r)[0] if interleaved else None)

    def _timeline_exposed(self) -> dict[str, float | None] | None:
        """Per phase, the timeline pass's `exposed_copy_s` (None when no timeline pass ran)."""
        rows = [r for r in self.rows if r.get("profiler") == "timeline" and r.get("source") == "engine"
                and r.get("status") == "ok" and r.get("metric") == "exposed_copy_s"]
        return {r["phase"]: r["value"] for r in rows} if rows else None

    def _plan_ablation(self, spec: RunSpec, eng: Adapter) -> Ablation:
        """Whether the resident side fits the device budget, alone and beside the measured engine."""
        engine = eng.engine
        budget = engine.device.ledger.budget
        w, mcfg = spec.workload, engine.cfg
        try:
            resident = plan_memory(mcfg, "resident", None, budget, session_tokens_of(spec), w.batch, w.ubatch,
                                   engine.model.dtype.itemsize, device_kind=engine.device.kind, kv_dtype=engine.kv_dtype)
        except PlanError as exc:
            reason = f"the resident plan does not fit the device budget: {str(exc).splitlines()[0]}"
            return Ablation("skipped", reason)
        if budget is None or resident.total + engine.plan.total <= budget:
            return Ablation("interleaved")
        return Ablation("sequential", "both engines together exceed the device budget")

    def _run_ablation(self, spec: RunSpec, eng: Adapter, sample: WorkloadSample, measured: list[RepeatResult],
                      warm: WorkloadSample | None, ab: Ablation) -> Ablation:
        gen, n = spec.workload.gen_tokens, spec.run.repeats
        if ab.mode == "sequential":
            release_cached()          # the measured engine leaves the device before the resident one arrives
            ab.placement = measured
        resident = MoebenchAdapter(spec, placement="resident")
        repeat_of = {"placement": lambda: run_repeat(eng, sample, gen, keep_logits=False, warm_with=warm),
                     "resident": lambda: run_repeat(resident, sample, gen, keep_logits=False)}
        try:
            with self.reporter.step(f"ablation ({ab.mode}): the same work with every expert resident"):
                for _ in range(spec.run.warmup):       # warmed as the measured engine was: a fair pair
                    repeat_of["resident"]()
                for i in range(n):
                    # which side goes first alternates: an order effect cancels over the pairs
                    for side in (pair_order(i) if ab.mode == "interleaved" else ("resident",)):
                        getattr(ab, side).append(repeat_of[side]())
                if spec.run.timeline:                  # the copies a resident engine makes too (the KV restore)
                    ab.resident_timeline = timeline_pass(resident, sample, gen, False, None)
        finally:
            resident.close()
        return ab


def run_job(cfg: DictConfig, ctx: JobContext, reporter: Reporter) -> JobOutcome:
    """Measure one job (no resume check, nothing written): its rows, steps and error."""
    return Job(cfg, ctx, reporter).execute()


def _measurement_key(cfg: DictConfig, resolved: dict) -> str:
    """The job's `sweep.measurement_key`: without placement, cache and prefetch for an engine they
    do not apply to, without `cache` for a placement that keeps no expert cache -- what its factors
    (`factors_of`) leave null. An invalid config's twin failed too, and `twin_of` takes ok ones only."""
    factors = factors_of(cfg)
    inapplicable = (["placement", "cache", "prefetch"] if factors["placement"] is None
                    else [] if factors["cache_capacity"] is not None else ["cache"])
    return measurement_key(resolved, inapplicable)


def _reached(ctx: JobContext) -> None:
    if ctx.reached is not None:
        ctx.reached(ctx.job_id)


def run(cfg: DictConfig, ctx: JobContext, reporter: Reporter) -> JobOutcome:
    """Run and store one job, unless its dir already holds it with the same config hash."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    fingerprint = job_fingerprint(resolved)
    retry = bool(OmegaConf.select(cfg, "run.retry_failed", default=True))
    done, damaged = results.inspect_job(ctx.job_dir)
    if damaged:                              # a DONE its files do not bear out: never skipped as complete
        reporter.warn(f"{ctx.job_id}: {damaged}; it runs again")
    decision = resume_decision(done, fingerprint, retry, damaged)
    if not decision.run:
        _reached(ctx)
        reporter.info(f"skip {ctx.job_id}: {decision.reason}")
        return JobOutcome([], skipped=decision.reason)
    key = _measurement_key(cfg, resolved)
    twin = twin_of(ctx.job_dir, key) if ctx.in_sweep else None
    job = Job(cfg, ctx, reporter)
    try:
        if twin is not None:
            results.remove_job(ctx.job_dir)      # what it held (an older config's) is not this sweep's
        else:
            # what it held was another config's, or a failed attempt; and a dir that cannot be
            # written is found now, before the job is measured for nothing
            results.prepare_job_dir(ctx.job_dir)
    except OSError as exc:
        _reached(ctx)
        return _unwritten(job, JobOutcome([]), exc)
    if twin is not None:
        reason = f"the same measurement as {twin.name} (what differs does not apply to this job)"
        reporter.info(f"skip {ctx.job_id}: {reason}")
        return JobOutcome([], skipped=reason)
    _reached(ctx)                            # before its DONE is written: an interrupt after it finds it reached
    t0 = time.perf_counter()
    outcome = job.execute()
    manifest = collect_manifest(resolved, extra={
        "sweep_id": ctx.sweep_id, "job_id": ctx.job_id, "status": "failed" if outcome.error else "ok",
        "config_hash": fingerprint, "command": ctx.command, "overrides": ctx.overrides, "harness_wall_s": time.perf_counter() - t0,
        "threads": job.extra.get("threads"), "device": job.device, "lossy": job.factors.get("lossy"),
        "model_id": model_id(resolved.get("model") or {}),      # what moebench-compare pairs models by
        "treatment": {"kv_dtype": job.factors.get("kv_dtype"), "expert_quant": job.factors.get("expert_quant")},
        "machine_load": {"start": job.load_start and job.load_start.as_dict(),
                         "end": job.load_end and job.load_end.as_dict()}})
    try:
        results.write_job(ctx.job_dir, outcome.rows, manifest, config_hash=fingerprint, steps=outcome.steps,
                          measurement_key=key)
    except OSError as exc:
        return _unwritten(job, outcome, exc)
    return outcome


def _unwritten(job: Job, outcome: JobOutcome, exc: OSError) -> JobOutcome:
    """A job whose dir cannot be written: one failed row, held in memory for the sweep table."""
    ctx = job.ctx
    text = f"cannot write the job's files in {ctx.job_dir}: {exc}"
    log.error("job %s: %s", ctx.job_id, text)
    row = results.failed_row(job.factors, job.device, ctx.sweep_id, ctx.job_id, text, extra=job.extra)
    return replace(outcome, rows=[row], steps=[], error=text, unwritten=True)
