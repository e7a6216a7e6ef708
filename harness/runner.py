"""One job, end to end: validate -> engine (cached per process) -> workload -> warm-up and
repeats -> tidy rows + manifest, written atomically into the job dir.

Owns: the job lifecycle, the numerical check against `resident` (cached per model and
prompt), skipping jobs already complete, and turning any failure into a `status=failed`
row so a sweep goes on. Does not own: the phases (harness.scenario), storage format
(harness.results), the CLI (harness.cli).

    from harness.runner import run
    job_dir = run(cfg)        # cfg: a composed Hydra DictConfig
"""
from __future__ import annotations

import hashlib
import logging
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from engine.nvtx_ranges import NvtxRanges
from engine.placements import needs_cache
from harness import results
from harness.config import RunSpec, validate
from harness.engines import get_adapter
from harness.manifest import collect_manifest
from harness.measure import PhaseProbe
from harness.profiling.passes import (PROFILER_UNITS, CudaProfilerRange, ablation, relaunch_under_nsys,
                                      timeline_pass, torch_profile_pass, trace_pass, under_nsys)
from harness.scenario import PREFIX_CACHE, RepeatResult, compare, run_repeat
from harness.report import Reporter
from workloads import build as build_workload
from workloads.tokenize import load_tokenizer

log = logging.getLogger(__name__)
_REFERENCE: dict[tuple, RepeatResult] = {}
_STEPS: dict[tuple, dict[int, list[list[int]]]] = {}


@dataclass
class JobContext:
    job_dir: Path
    sweep_id: str
    job_id: str


def factors_of(cfg: DictConfig) -> dict[str, Any]:
    """The swept factors, read leniently so even an invalid config gets a failed row."""
    g = lambda key, default=None: OmegaConf.select(cfg, key, default=default)  # noqa: E731
    placement = g("placement.name")
    options = {k: v for k, v in (g("placement") or {}).items() if k != "name"}
    try:
        uses_cache = needs_cache(placement, options)
    except (TypeError, ValueError):   # invalid options: validate() reports them; the row still gets factors
        uses_cache = False
    return {"engine": g("engine.name"), "model": g("model.name"), "placement": placement,
            "cache_capacity": str(g("cache.capacity")) if uses_cache else None,
            "cache_policy": g("cache.policy") if uses_cache else None, "prefetch": g("prefetch.name"),
            "workload": g("workload.name"), "context_tokens": g("workload.context_tokens"),
            "gen_tokens": g("workload.gen_tokens"), "batch": g("workload.batch"), "dtype": g("model.dtype")}


def _sample(spec: RunSpec):
    w = spec.workload
    tok = load_tokenizer(spec.model.path, spec.model_config.vocab_size)
    return build_workload(w.name, tok, w.context_tokens, w.turn_tokens, w.batch, w.seed, w.tokens)


def _prompt_key(spec: RunSpec, sample) -> tuple:
    return (spec.model.name, spec.model.path, spec.model.dtype, spec.model.num_layers, spec.model.seed,
            spec.hardware.device, spec.workload.gen_tokens, spec.workload.ubatch,
            hashlib.sha1(repr((sample.contexts, sample.continuations)).encode()).hexdigest())


def _reference(spec: RunSpec, sample, record_steps: bool = False) -> RepeatResult:
    """The `resident` run of this prompt (cached per model and prompt): logits and tokens for
    the numerical check, and the per-pass expert sets a trace_oracle prefetcher replays."""
    key = _prompt_key(spec, sample)
    if key not in _REFERENCE:
        ref, _ = get_adapter(spec, placement="resident")
        ref.engine.model.step_log = {}
        try:
            res = run_repeat(ref, sample, spec.workload.gen_tokens, keep_logits=True)
        finally:
            res_steps, ref.engine.model.step_log = ref.engine.model.step_log, None
        _REFERENCE[key] = res
        _STEPS[key] = res_steps
    return _REFERENCE[key]


def _engine_for(spec: RunSpec, sample):
    """The measured engine; a trace_oracle prefetcher first needs the reference's steps."""
    if spec.prefetch == "trace_oracle":
        _reference(spec, sample)
        return get_adapter(spec, prefetch_options={"steps": _STEPS[_prompt_key(spec, sample)]},
                           key_extra=_prompt_key(spec, sample))
    return get_adapter(spec)


def run_job(cfg: DictConfig, ctx: JobContext, reporter: Reporter) -> tuple[list[dict], str | None]:
    """Rows for one job, and the error text if it failed."""
    factors = factors_of(cfg)
    device = {"device_kind": None, "device_name": None, "emulated": None}
    try:
        spec = validate(cfg)                       # before any model loads
        if spec.run.threads is not None:
            torch.set_num_threads(spec.run.threads)
        sample = _sample(spec)
        with PhaseProbe("cuda" if spec.hardware.device == "cuda" else "cpu", None) as load_probe:
            eng, loaded = _engine_for(spec, sample)
        device = {"device_kind": eng.device_kind, "device_name": eng.device_name, "emulated": eng.emulated}
        extra = {"host": socket.gethostname(), "ubatch": spec.workload.ubatch, "token_source": sample.token_source,
                 "resolved_capacity": eng.resolved_capacity, "placement_options": repr(spec.placement_options)}
        rows: list[dict] = []

        def emit(repeat: int | None, phase: str, metrics: dict, source: str, profiler: str = "none",
                 units: dict | None = None, **more: Any) -> None:
            rows.extend(results.make_rows(factors, device, ctx.sweep_id, ctx.job_id, repeat, phase, metrics, source,
                                          units=units, extra={**extra, "profiler": profiler,
                                                              "prefix_cache": PREFIX_CACHE.get(phase), **more}))

        def emit_repeat(r: int, res: RepeatResult, profiler: str, check: dict | None) -> None:
            for ph in res.phases:
                emit(r, ph.phase, ph.client, "client", profiler)
                engine_metrics = dict(ph.engine)
                if ph.phase == "decode":
                    engine_metrics.update(check or {"max_abs_logit_diff": None, "token_agreement": None})
                emit(r, ph.phase, engine_metrics, "engine", profiler)

        load_metrics = {"time_s": load_probe.time_s if loaded else None,
                        "peak_host_rss_bytes": load_probe.peak_host_rss_bytes if loaded else None,
                        "peak_device_bytes": load_probe.peak_device_bytes if loaded else None}
        emit(0, "load", load_metrics, "client", model_load="cold" if loaded else "reused")
        gen, run_cfg = spec.workload.gen_tokens, spec.run
        # warm-up (excluded); its logits serve the numerical check, so measured repeats copy nothing extra
        check_run = None
        for i in range(max(run_cfg.warmup, 1 if run_cfg.check_reference else 0)):
            with reporter.step(f"warm-up {i + 1}"):
                check_run = run_repeat(eng, sample, gen, keep_logits=run_cfg.check_reference)
        check = None
        if run_cfg.check_reference and check_run is not None:
            ref = check_run if spec.engine == "moebench" and spec.placement == "resident" else _reference(spec, sample)
            check = compare(check_run, ref)
        measured = []
        nvtx_child = run_cfg.profiler == "nsys" and under_nsys()
        with CudaProfilerRange():
            if nvtx_child:
                eng.set_instrument(NvtxRanges())
            for r in range(run_cfg.repeats):
                with reporter.step(f"repeat {r + 1}/{run_cfg.repeats}"):
                    measured.append(run_repeat(eng, sample, gen, keep_logits=False))
            eng.set_instrument(None)
        for r, res in enumerate(measured):
            emit_repeat(r, res, "nsys" if nvtx_child else "none", check)
        _profiling_passes(spec, eng, sample, measured, ctx, emit, emit_repeat, reporter)
        return rows, None
    except Exception as exc:  # noqa: BLE001 -- any failure becomes a failed row; the sweep goes on
        log.error("job %s failed: %s", ctx.job_id, exc)
        log.debug("%s", traceback.format_exc())
        return [results.failed_row(factors, device, ctx.sweep_id, ctx.job_id, f"{type(exc).__name__}: {exc}")], \
            f"{type(exc).__name__}: {exc}"


def _profiling_passes(spec: RunSpec, eng, sample, measured: list[RepeatResult], ctx: JobContext, emit, emit_repeat,
                      reporter: Reporter) -> None:
    """Everything instrumented, after the speed measurements (their rows carry `profiler`)."""
    run_cfg, gen = spec.run, spec.workload.gen_tokens
    if run_cfg.ablation and not (spec.engine == "moebench" and spec.placement == "resident"):
        ref, _ = get_adapter(spec, placement="resident")
        with reporter.step("ablation: the same work with every expert resident"):
            resident = [run_repeat(ref, sample, gen, keep_logits=False) for _ in range(run_cfg.repeats)]
        for phase, value in ablation(measured, resident).items():
            emit(None, phase, {"exposed_copy_ablation_s": value}, "client")
    if run_cfg.timeline or run_cfg.trace:
        with reporter.step("timeline pass"):
            res = timeline_pass(eng, sample, gen, run_cfg.nvtx, ctx.job_dir / "trace.json" if run_cfg.trace else None)
        if res is not None:
            emit_repeat(0, res, "timeline", None)
    if run_cfg.record_trace:
        with reporter.step("routing trace pass"):
            res = trace_pass(eng, sample, gen, ctx.job_dir / "routing.npz")
        if res is not None:
            emit_repeat(0, res, "trace", None)
    if run_cfg.profiler == "torch":
        with reporter.step("torch.profiler pass"):
            res, summary = torch_profile_pass(eng, sample, gen, ctx.job_dir / "torch_trace.json")
        emit_repeat(0, res, "torch", None)
        emit(0, "all", summary, "torch", "torch", units=PROFILER_UNITS)
    if run_cfg.profiler == "nsys" and not under_nsys():
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        for r in relaunch_under_nsys(ctx.job_dir, overrides):
            emit(None, r["scope"], {r["metric"]: r["value"]}, "nsys", "nsys", units={r["metric"]: r["unit"]})


def run(cfg: DictConfig, ctx: JobContext, reporter: Reporter) -> str | None:
    """Run and store one job; returns the error text when it failed (None when ok or skipped)."""
    if results.job_complete(ctx.job_dir):
        reporter.info(f"skip {ctx.job_id}: already complete in {ctx.job_dir}")
        return None
    t0 = time.perf_counter()
    rows, error = run_job(cfg, ctx, reporter)
    manifest = collect_manifest(OmegaConf.to_container(cfg, resolve=True),
                                extra={"sweep_id": ctx.sweep_id, "job_id": ctx.job_id, "status": "failed" if error else "ok",
                                       "harness_wall_s": time.perf_counter() - t0})
    results.write_job(ctx.job_dir, rows, manifest)
    return error
