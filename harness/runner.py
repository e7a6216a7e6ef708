"""One job, end to end: validate -> plan -> reference -> engine -> passes -> write.

Owns: the order of those stops and what a failure at each becomes. A job is skipped only when its
dir holds it with the same config hash (harness.sweep.resume_decision), or a twin in the same
sweep measured the same thing; a job that fails becomes one `status=failed` row, so a sweep goes
on; a pass that fails records its own failed row and the job's other rows stay; every listed
pass's status (ran, skipped with its reason, failed with its error) goes into the manifest's
`passes`; a job whose dir cannot be written (found before it is measured) or whose files cannot
be written becomes a failed row held in memory for the sweep table (`JobOutcome.unwritten`).
Does not own: the job's rows and its engine (harness.job), what each pass measures
(harness.passes), the reference (harness.reference), storage (harness.results), the run's
session (harness.session), the CLI (harness.cli).

    from harness.runner import JobContext, run
    outcome = run(cfg, JobContext(job_dir, sweep_id, job_id), Reporter())    # a session of its own
    outcome = run(cfg, ctx, reporter, session)          # a sweep's jobs share one (the engine is reused)
"""
from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from engine.planner import PlanError
from harness import results
from harness.config import validate
from harness.factors import measurement_key_of
from harness.job import Job, JobContext, JobOutcome, load_engine, sample_of
from harness.machine import LoadWindow, job_threads
from harness.manifest import collect_manifest
from harness.passes import PASSES
from harness.passes.base import RunContext, Skip
from harness.plan import job_plan
from harness.reference import reference_for
from harness.report import Reporter
from harness.session import RunSession, session_or_own
from harness.sweep import job_fingerprint, resume_decision, twin_of

__all__ = ["JobContext", "JobOutcome", "run", "run_job", "run_passes"]
log = logging.getLogger(__name__)


def run_job(cfg: DictConfig, ctx: JobContext, reporter: Reporter, session: RunSession | None = None) -> JobOutcome:
    """Measure one job (no resume check, nothing written): its rows, steps, error and passes."""
    with session_or_own(session) as s:
        return _execute(Job(cfg, ctx), reporter, s)


def _execute(job: Job, reporter: Reporter, session: RunSession) -> JobOutcome:
    try:
        _measure(job, reporter, session)
    except Exception as exc:  # noqa: BLE001 -- any failure becomes a failed row; the sweep goes on
        log.error("job %s failed: %s: %s", job.ctx.job_id, type(exc).__name__, exc)     # the whole message
        log.debug("%s", traceback.format_exc())
        text = row_error(exc)
        if job.adapter is not None:      # keep what the engine left (a server's log), then never reuse it
            try:
                job.adapter.save_artifacts(job.ctx.job_dir)
            except OSError as err:
                log.warning("job %s: could not save the engine's artifacts: %s", job.ctx.job_id, err)
            session.engines.release()
        for name in OmegaConf.select(job.cfg, "run.passes", default=None) or ():
            if job.pass_status(str(name)) is None:
                job.record_pass(str(name), "skipped", "not reached: the job failed")
        return JobOutcome([job.failed_row(text)], error=text, passes=job.passes)
    return JobOutcome(job.rows, job.steps, error="; ".join(job.errors) or None, passes=job.passes)


def row_error(exc: Exception) -> str:
    """A failed job's `error` column: `Type: message`, except that a plan that does not fit keeps
    only its first line (what did not fit, by how much) -- its memory breakdown goes to the job's
    log, where `moebench plan` shows it too."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PlanError) and "\n" in text.strip():
        first, rest = text.strip().split("\n", 1)
        return f"{first} (the plan's breakdown, {len(rest.splitlines())} lines, is in the job's log)"
    return text


def _measure(job: Job, reporter: Reporter, session: RunSession) -> None:
    spec = validate(job.cfg)                                        # before any weight is read
    job_plan(spec)      # the engine's own memory plan: a budget it cannot fit fails here, not after the reference
    torch.set_num_threads(job_threads(spec))
    threads = torch.get_num_threads()
    # other processes' load over the job's start (its workload and reference: own work, no wait of its own)
    window = LoadWindow(threads)
    try:
        sample = sample_of(spec, spec.workload.seed)
        warm = sample_of(spec, spec.workload.seed + 1) if spec.run.expert_cache == "warm" else None
        reference = None
        if spec.run.check_reference or spec.prefetch == "trace_oracle":
            with reporter.step("reference (every expert resident, CPU)"):
                reference = reference_for(spec, sample, Path(spec.run.out), session.references,
                                          session.engines.release)
            job.extra["reference"] = reference.origin if spec.run.check_reference else None
    finally:
        job.load_start = start = window.close()
        job.extra.update(threads=threads, load_avg_start=start.load_avg_1m, other_busy_cores=start.other_busy_cores,
                         machine_busy=start.busy)
    if start.busy:
        reporter.warn(start.warning())
    adapter = load_engine(job, spec, sample, reference, reporter, session)
    ctx = RunContext(spec, job, session, reporter, sample, warm, adapter, reference)
    window = LoadWindow(threads)          # over the measurement: the engine's server is a child, its own
    run_passes(ctx, spec.run.passes)
    ctx.finish_engine()
    job.load_measured = window.close()


def run_passes(ctx: RunContext, names: Sequence[str]) -> None:
    """Each listed pass in order: skipped with its reason (a flag, the engine, or the measured
    engine freed by an earlier pass), run, or failed on its own -- its failed row, the job's other
    rows kept -- unless its failure is the job's (`Pass.fails_job`)."""
    for name in names:
        p = PASSES.get(name)()
        engine_gone = f"the measured engine was freed {ctx.engine_freed}" if ctx.engine_freed and p.uses_engine else None
        reason = engine_gone or p.skip_reason(ctx)
        if reason is None:
            try:
                p.run(ctx)
            except Skip as skip:
                reason = str(skip)
            except Exception as exc:  # noqa: BLE001 -- a pass's failure is its own row, the rest stays
                if p.fails_job:
                    ctx.job.record_pass(name, "failed", f"{type(exc).__name__}: {exc}")
                    raise
                ctx.job.record_pass(name, "failed", ctx.job.failed_part(p.label, exc))
                continue
            else:
                ctx.job.record_pass(name, "ran")
                continue
        p.skipped(ctx, reason)
        ctx.job.record_pass(name, "skipped", reason)


def run(cfg: DictConfig, ctx: JobContext, reporter: Reporter, session: RunSession | None = None) -> JobOutcome:
    """Run and store one job, unless its dir already holds it with the same config hash."""
    with session_or_own(session) as s:
        return _run(cfg, ctx, reporter, s)


def _run(cfg: DictConfig, ctx: JobContext, reporter: Reporter, session: RunSession) -> JobOutcome:
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
    key = measurement_key_of(cfg, resolved)
    twin = twin_of(ctx.job_dir, key) if ctx.in_sweep else None
    job = Job(cfg, ctx)
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
    outcome = _execute(job, reporter, session)
    manifest = collect_manifest(resolved, extra=job.manifest_fields(resolved, outcome, fingerprint,
                                                                    time.perf_counter() - t0))
    try:
        results.write_job(ctx.job_dir, outcome.rows, manifest, config_hash=fingerprint, steps=outcome.steps,
                          measurement_key=key)
    except OSError as exc:
        return _unwritten(job, outcome, exc)
    return outcome


def _reached(ctx: JobContext) -> None:
    if ctx.reached is not None:
        ctx.reached(ctx.job_id)


def _unwritten(job: Job, outcome: JobOutcome, exc: OSError) -> JobOutcome:
    """A job whose dir cannot be written: one failed row, held in memory for the sweep table."""
    text = f"cannot write the job's files in {job.ctx.job_dir}: {exc}"
    log.error("job %s: %s", job.ctx.job_id, text)
    return replace(outcome, rows=[job.failed_row(text)], steps=[], error=text, unwritten=True)
