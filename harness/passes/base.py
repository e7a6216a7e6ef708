"""The interface of a pass: one thing a job measures, run in the order `run.passes` lists.

Owns: `Pass` (its name, a one-line summary for `moebench --help`, the passes it reads, why it is
skipped for a job, and `run`, which emits its rows through the context), `Skip` (raised by a pass
that finds, before it emits anything, that it cannot apply), `RunContext` (what a pass sees: the
job's spec, its prompt samples, the measured adapter, the reference, the reporter, the job's rows,
and what earlier passes left: speed's measured repeats) and `emit_instrumented` (the rows of one
instrumented repeat). Does not own: the list, its checks and the registry (harness.passes), the
loop that runs them and records each one's status (harness.runner), the row schema
(harness.results), the phases (harness.scenario).

    class TTFTSpread(Pass):
        name = "ttft_spread"
        summary = "max - min time to first token over the measured repeats"
        needs = ("speed",)                        # listed before it: it reads ctx.measured

        def skip_reason(self, ctx):               # None: it runs; a reason goes into the manifest
            return None if len(ctx.measured) > 1 else "one measured repeat: no spread"

        def run(self, ctx):
            ttft = [r.phase("prefill_fresh").client["ttft_s"] for r in ctx.measured]
            ctx.emit(None, "prefill_fresh", {"ttft_spread_s": max(ttft) - min(ttft)}, "client", self.name,
                     units={"ttft_spread_s": "s"})

A pass's rows carry their own `profiler` label (its name, unless it says otherwise), so no
table reads them as speed rows, which are `profiler=none`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from harness.config import RunConf, RunSpec
    from harness.engines.base import EngineAdapter
    from harness.job import Job
    from harness.reference import Reference
    from harness.report import Reporter
    from harness.scenario import RepeatResult
    from harness.session import RunSession
    from workloads.base import WorkloadSample


class Skip(Exception):
    """Raised by `Pass.run` when it finds it cannot apply to this job (the engine has no hook it
    needs), before it emitted a row: recorded as skipped with this reason, never as a failure."""


class Pass(ABC):
    """One thing a job measures. Stateless: an instance per job, `run` once."""

    name: ClassVar[str]
    summary: ClassVar[str]                        # one line, for `moebench --help`
    needs: ClassVar[tuple[str, ...]] = ()         # passes listed before it: it reads what they measured
    after: ClassVar[tuple[str, ...]] = ()         # passes that, when listed, come before it (it reads their rows)
    profiler: ClassVar[str | None] = None         # the `profiler` label of its failed row (None: its name)
    fails_job: ClassVar[bool] = False             # its failure is the job's (speed: its rows are the job)
    uses_engine: ClassVar[bool] = True            # it runs the measured engine (skipped once that was freed)

    flag: ClassVar[tuple[str, Any] | None] = None  # (`run` field, value) that asks for it: ("profiler", "torch")

    @classmethod
    def asked_by(cls, run: RunConf) -> str | None:
        """The flag that asks for this pass when the run sets it (`run.profiler=torch`), so a
        `run.passes` without it is refused rather than the flag silently doing nothing."""
        if cls.flag is None:
            return None
        field, value = cls.flag
        return f"run.{field}={_shown(value)}" if getattr(run, field) == value else None

    def skip_reason(self, ctx: RunContext) -> str | None:
        """Why this job does without the pass (a flag, the engine, the placement), or None: it runs.
        The default: its `flag` is not set, saying what the run has instead (`run.profiler=none`)."""
        if self.flag is None:
            return None
        field, value = self.flag
        have = getattr(ctx.spec.run, field)
        return None if have == value else f"run.{field}={_shown(have)}"

    def skipped(self, ctx: RunContext, reason: str) -> None:
        """The rows a skipped pass leaves: none (its reason is in the manifest), unless a reader
        would misread its absence (the quality pass: null metrics with the reason)."""

    @abstractmethod
    def run(self, ctx: RunContext) -> None:
        """Measure; emit rows through `ctx.emit`. An exception is the pass's failed row (the job's
        other rows stay), or the job's failure for a pass that `fails_job`."""

    @property
    def label(self) -> str:
        return self.profiler or self.name


class ModelPass(Pass):
    """A pass that puts the cost model's figure beside what speed measured (roofline, prediction):
    it reads speed's repeats and the resolved capacity, never the engine, and applies only to an
    engine whose placements and cache the cost model describes (its adapter's `cost_model`)."""

    needs = ("speed",)
    uses_engine = False

    def skip_reason(self, ctx: RunContext) -> str | None:
        if not ctx.adapter.cost_model:
            return (f"engine={ctx.spec.engine}: the cost model describes this engine's placements and cache, "
                    "which this one is not")
        return None

    @staticmethod
    def measured(ctx: RunContext, side: str, metrics: tuple[str, ...]) -> dict[str, dict[str, float]]:
        """phase -> metric -> the median over speed's measured repeats, of the `side` (client or
        engine) metrics given; every phase the repeats have, with the metrics it has values of."""
        import statistics
        values: dict[str, dict[str, list[float]]] = {}
        for res in ctx.measured or ():
            for ph in res.phases:
                got, mine = getattr(ph, side), values.setdefault(ph.phase, {})
                for m in metrics:
                    if got.get(m) is not None:
                        mine.setdefault(m, []).append(got[m])
        return {ph: {m: statistics.median(v) for m, v in d.items()} for ph, d in values.items()}


@dataclass
class RunContext:
    """What the passes of one job see, from the engine stop on."""

    spec: RunSpec
    job: Job                                      # the rows, steps, columns and pass record (harness.job)
    session: RunSession                           # the run's engine cache (a pass may free the engine)
    reporter: Reporter
    sample: WorkloadSample                        # the measured prompt
    warm: WorkloadSample | None                   # another session's, warming the expert cache (run.expert_cache=warm)
    adapter: EngineAdapter                        # the measured engine
    reference: Reference | None                   # the exact reference (run.check_reference, trace_oracle)
    measured: list[RepeatResult] | None = None    # speed's measured repeats, for the passes that need speed
    engine_freed: str | None = None               # how the measured engine was freed; later passes using it skip
    engine_finished: bool = False

    @property
    def job_dir(self) -> Path:
        return self.job.ctx.job_dir

    def emit(self, repeat: int | None, phase: str, metrics: dict, source: str, profiler: str = "none",
             units: dict | None = None, **more: Any) -> None:
        """Rows of one (repeat, phase, source): harness.job.Job.emit."""
        self.job.emit(repeat, phase, metrics, source, profiler, units, **more)

    def status(self, name: str) -> str | None:
        """`ran`, `skipped` or `failed` for a pass this job has reached; None otherwise."""
        return self.job.pass_status(name)

    def finish_engine(self) -> None:
        """The measured engine's part of the job is over: its progress detached (it may serve the
        next job, with that job's reporter) and what it leaves (a server's log) saved in the job
        dir, once. Losing those loses no measurement: a failed save is its own failed row."""
        if self.engine_finished:
            return
        self.engine_finished = True
        self.adapter.set_progress(None)
        try:
            self.adapter.save_artifacts(self.job_dir)
        except OSError as exc:
            self.job.failed_part("artifacts", exc)

    def free_engine(self, how: str) -> None:
        """Free the measured engine for something else that needs the device (the ablation's
        resident side, where only one engine fits): finished first; a later pass that runs it is
        skipped, saying `how` it was freed."""
        self.finish_engine()
        self.session.engines.release()
        self.engine_freed = how


def _shown(value: Any) -> str:
    """A config value as an override spells it (`true`, not `True`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def emit_instrumented(ctx: RunContext, res: RepeatResult, profiler: str, **more: Any) -> None:
    """The rows of one instrumented repeat (timeline, routing trace, torch.profiler): repeat 0 of
    its own `profiler` label, client and engine side of every phase."""
    for ph in res.phases:
        ctx.emit(0, ph.phase, ph.client, "client", profiler, expert_cache=ph.expert_cache, **ph.columns, **more)
        ctx.emit(0, ph.phase, ph.engine, "engine", profiler, expert_cache=ph.expert_cache, **ph.columns, **more)
