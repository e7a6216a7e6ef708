"""One job's state while it runs, and the stops before its passes that build it: the workload
sample and the measured engine.

Owns: `JobContext` (where a job writes and who it is), `JobOutcome` (what it gave: rows, steps,
its error or why it was skipped, the record of its passes), `Job` (its factors, device and
settings columns, rows, steps, errors, the status of each pass, and failed rows: a part that
fails -- a pass, saving the engine's artifacts -- records its own and the job's other rows
stay), `sample_of` (the workload sample of a seed) and `load_engine` (the measured adapter from
the run's engine cache, its load rows, and the settings columns every row of the job carries).
Does not own: the order of the stops (harness.runner), the passes (harness.passes), the engine
cache (harness.engines.EngineCache), the row schema (harness.results).
"""
from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from engine.registry import PLACEMENTS
from harness import results
from harness.contract import PREFIX_CACHE
from harness.dtype_speed import dtype_speed
from harness.engines import ENGINES, EngineAdapter
from harness.factors import factors_of
from harness.machine import MachineLoad
from harness.measure import PhaseProbe
from harness.model_id import model_id
from harness.passes import DEFAULT_PASSES
from workloads import build as build_workload
from workloads.base import WorkloadSample
from workloads.tokenize import load_tokenizer

if TYPE_CHECKING:
    from harness.config import RunSpec
    from harness.reference import Reference
    from harness.report import Reporter
    from harness.session import RunSession

log = logging.getLogger(__name__)
PASS_STATUSES = ("ran", "skipped", "failed")


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
    passes: list[dict] = field(default_factory=list)   # {name, status, reason} per listed pass (the manifest's)


class Job:
    """One job's rows while it runs, and the columns each of them carries."""

    def __init__(self, cfg: DictConfig, ctx: JobContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.factors = factors_of(cfg)
        self.device: dict[str, Any] = {"device_kind": None, "device_name": None, "emulated": None}
        self.extra: dict[str, Any] = {"host": socket.gethostname()}
        self.rows: list[dict] = []
        self.steps: list[dict] = []
        self.errors: list[str] = []
        self.passes: list[dict] = []        # {name, status, reason}, in the order run
        self.adapter: EngineAdapter | None = None   # the measured engine, once built (load_engine)
        self.load_start: MachineLoad | None = None
        self.load_measured: MachineLoad | None = None     # over the passes, to the engine freed
        self.check_dtype = "float32"        # the run's dtype once the engine is built (load_engine)

    def emit(self, repeat: int | None, phase: str, metrics: dict, source: str, profiler: str = "none",
             units: dict | None = None, **more: Any) -> None:
        """Rows of one (repeat, phase, source), with the job's factors, device and settings columns."""
        self.rows.extend(results.make_rows(self.factors, self.device, self.ctx.sweep_id, self.ctx.job_id, repeat,
                                           phase, metrics, source, units=units,
                                           extra={**self.extra, "profiler": profiler,
                                                  "prefix_cache": PREFIX_CACHE.get(phase), **more}))

    def add_columns(self, columns: dict[str, Any]) -> None:
        """Settings every row carries, known once the engine is built: the rows emitted before (the
        load rows) get them too, so tables and comparisons tell their configs apart."""
        self.extra.update(columns)
        for row in self.rows:
            row.update(columns)

    def failed_part(self, part: str, exc: BaseException) -> str:
        """A part of the job (a pass) failed: its own failed row; the rest stays. Returns the error."""
        text = f"{type(exc).__name__}: {exc}"
        log.error("job %s: %s failed: %s", self.ctx.job_id, part, text)
        self.errors.append(f"{part}: {text}")
        self.rows.append(results.failed_row(self.factors, self.device, self.ctx.sweep_id, self.ctx.job_id, text,
                                            phase=part, extra={**self.extra, "profiler": part}))
        return text

    def failed_row(self, text: str) -> dict:
        """The one row of a job that failed as a whole."""
        return results.failed_row(self.factors, self.device, self.ctx.sweep_id, self.ctx.job_id, text, extra=self.extra)

    def manifest_fields(self, resolved: dict[str, Any], outcome: JobOutcome, config_hash: str,
                        wall_s: float) -> dict[str, Any]:
        """What the job's manifest holds beside the machine's facts (harness.manifest): who it is,
        its status and passes, its device, threads, treatment and the machine's load around it."""
        ctx = self.ctx
        return {"sweep_id": ctx.sweep_id, "job_id": ctx.job_id, "status": "failed" if outcome.error else "ok",
                "config_hash": config_hash, "command": ctx.command, "overrides": ctx.overrides, "harness_wall_s": wall_s,
                "threads": self.extra.get("threads"), "device": self.device, "lossy": self.factors.get("lossy"),
                "model_id": model_id(resolved.get("model") or {}),      # what moebench-compare pairs models by
                "treatment": {"kv_dtype": self.factors.get("kv_dtype"), "expert_quant": self.factors.get("expert_quant")},
                "passes": outcome.passes, "default_passes": list(DEFAULT_PASSES),
                "machine_load": {"start": self.load_start and self.load_start.as_dict(),
                                 "measurement": self.load_measured and self.load_measured.as_dict()}}

    def record_pass(self, name: str, status: str, reason: str | None = None) -> None:
        assert status in PASS_STATUSES, status
        self.passes.append({"name": name, "status": status, "reason": reason})

    def pass_status(self, name: str) -> str | None:
        return next((p["status"] for p in self.passes if p["name"] == name), None)


SERVE_RENDER_TOKENS = 4096      # a serving prompt is cut from a conversation rendered this long (or longer)


def prompts_of(spec: RunSpec, lengths: list[int], seed: int, shares: list[bool] | None = None,
               prefix: int = 0) -> list[list[int]]:
    """Serving requests' prompts, request i from a conversation of the job's workload with a seed of
    its own. Without a shared prefix: the conversation's first lengths[i] tokens (requests differ,
    and share what the workload's conversations begin with, as its system prompt). With one
    (`prefix` tokens, the sharing requests marked in `shares`): a sharing request is the first
    `prefix` tokens of one common conversation, then its own conversation's tokens after them; the
    others skip their own first `prefix` tokens, so they begin with none of what the sharing
    requests share."""
    w = spec.workload
    tok = load_tokenizer(spec.model.path, spec.model_config.vocab_size, w.tokens)

    def conversation(s: int, n: int) -> list[int]:
        return build_workload(w.name, tok, max(n, SERVE_RENDER_TOKENS), 0, 1, s, w.tokens).contexts[0][:n]
    head = conversation(seed * 1_000_003 + 1_000_002, prefix) if prefix else []   # request ids stay below
    out = []
    for i, n in enumerate(lengths):
        own = conversation(seed * 1_000_003 + i, n + prefix)
        out.append(head + own[prefix:n] if shares and shares[i] else own[prefix:prefix + n])
    return out


def sample_of(spec: RunSpec, seed: int) -> WorkloadSample:
    """The job's workload sample for `seed`, tokenised with the checkpoint's own tokenizer if it has one."""
    w = spec.workload
    tok = load_tokenizer(spec.model.path, spec.model_config.vocab_size, w.tokens)
    return build_workload(w.name, tok, w.context_tokens, w.turn_tokens, w.batch, seed, w.tokens)


def _resolved_kind(device: str) -> str:
    """The device a job's engine will run on (DESIGN §3: auto = CUDA when available)."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def load_engine(job: Job, spec: RunSpec, sample: WorkloadSample, reference: Reference | None,
                reporter: Reporter, session: RunSession) -> EngineAdapter:
    """The job's measured adapter (built, or reused from the run's cache), its load rows (client
    and the engine's own; null times when reused), and the settings columns every row carries."""
    prefetch_options = dict(spec.prefetch_options)
    if spec.prefetch == "trace_oracle":                             # the oracle replays the reference's passes
        prefetch_options["steps"] = reference.steps
    key_extra = (reference.key,) if spec.prefetch == "trace_oracle" else ()
    with PhaseProbe(_resolved_kind(spec.hardware.device), None, ENGINES.get(spec.engine).allocates_here) as probe:
        with reporter.step("loading the model"):
            eng, loaded = session.engines.get(spec, prefetch_options=prefetch_options, key_extra=key_extra,
                                              progress=reporter.progress)
    job.adapter = eng
    # what this engine runs (llama.cpp's defaults too): known now, exact ones included
    job.factors["lossy"] = bool(spec.lossy or eng.lossy)
    job.check_dtype = spec.dtype                                    # the check's tolerance is the run dtype's
    eng.set_progress(reporter.progress)
    job.device = {"device_kind": eng.device_kind, "device_name": eng.device_name, "emulated": eng.emulated}
    load = {"time_s": probe.time_s, "peak_host_rss_bytes": probe.peak_host_rss_bytes,
            "peak_device_bytes": probe.peak_device_bytes,
            "peak_device_reserved_bytes": probe.peak_device_reserved_bytes,
            "emulated_device_peak_bytes": eng.device_peak()}
    model_load = "cold" if loaded else "reused"
    job.emit(0, "load", {k: v if loaded else None for k, v in load.items()}, "client", model_load=model_load,
             expert_cache="cold")
    # the engine's own load, without one-time setup (imports, a GGUF conversion, probes)
    job.emit(0, "load", {"time_s": eng.load_s if loaded else None}, "engine", model_load=model_load,
             expert_cache="cold")
    known = dict(ubatch=spec.workload.ubatch, token_source=sample.token_source,
                 resolved_capacity=eng.resolved_capacity, placement_options=repr(PLACEMENTS.get(spec.placement).recorded_options(
                     spec.placement_options)),
                 placement_map=eng.placement_map(), expert_cache_mode=spec.run.expert_cache)
    if spec.load is not None:                   # requests over time (the serve pass): what tells loads apart
        known.update(load=spec.load.name, load_rate=spec.load.rate, load_max_concurrency=spec.load.max_concurrency)
    knobs = dict(eng.knobs())                   # an engine's own knobs (llama.cpp's -ngl, -ub, -t ...)
    knobs.pop("kv_dtype", None)                 # the factor column names the kv.dtype treatment; llama.cpp's
    known.update(knobs)                         # own cache types stay in cache_type_k / cache_type_v
    if eng.compute_dtype is not None:           # a dtype this machine runs slower than float32
        speed = dtype_speed(eng.compute_dtype, eng.device_kind)
        known.update(speed.as_extra())
        if speed.warning():
            reporter.warn(speed.warning())
    if spec.hardware.device_memory and (gap := eng.budget_gap()):   # DESIGN §4: one budget for every engine
        reporter.warn(f"hardware.device_memory={spec.hardware.device_memory} is not held by "
                      f"engine={spec.engine}: {gap}")
    job.add_columns(known)
    return eng
