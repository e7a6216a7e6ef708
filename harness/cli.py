"""`moebench`: the Hydra app -- a thin shim over harness.runner.run -- and its sub-commands.

    moebench                                   # tiny model, coding-agent workload, one job
    moebench -m placement=resident,fetch cache.capacity=2,4 workload.context_tokens=1024,4096
    moebench rerun results/sweeps/<id>/<job>   # the same job again, from its manifest
    moebench plan [-m] [overrides]             # the memory plan (no weights read)
    moebench fit --search context [overrides]  # the largest setting that fits (context, capacity, n_cpu_layers)
    moebench predict [-m] [overrides] [--format human|json]   # predicted prefill/decode tok/s, TTFT, what bounds them
    moebench table results/sweeps/<id> --format md|csv|json|latex
    moebench calibrate --out conf/hardware/this-machine.yaml   # the cost model's profile of this machine
    moebench trace import --from vllm FILE.jsonl --model NAME --out t.npz   # another engine's routing as a trace
    moebench serve-sweep load=poisson load.slo=mixtral-8x7b [overrides]   # the highest load within the SLO

A sweep's directory is `<run.out>/sweeps/<run.sweep_id>`; without run.sweep_id it is a hash of
the command line's measurement overrides, so re-running the same command resumes the sweep:
a job is skipped only when its recorded config hash matches (every finished job's is checked
when the sweep resumes, and a stale one retired before any job runs), failed jobs run again
(run.retry_failed=false keeps them), and a dir holding a different sweep is refused
(run.resume=add|replace). One process writes a sweep dir at a time. SIGTERM or Ctrl-C ends
the sweep after writing the table of the jobs completed so far (exit 143 / 130). The process
exits non-zero if any job failed, any job failed its reference check (one line names them), or a
table could not be written, after the table is written; a sweep dir that cannot be written at
all, or a write of Hydra's own that fails, ends the run with the table of the finished jobs and
one line naming the path and the OS error.

A command's state across its jobs (the engine kept between them, the references computed, the
progress display, the sweep's tally) is one harness.session.RunSession that `main` makes and
hands to the Hydra app, a closure over it (`build_app`), and on to each job's `runner.run`; the
sweep table is written when Hydra returns, whatever launcher ran the jobs.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness.cli_args import (CONFIG_SOURCE_FLAGS, check_run_dir, hydra_args, is_multirun, override_of, quiet_of,
                              split_args, sweep_dir_of)
from harness.config import register_configs
from harness.engines.registry import CommandTable
from harness.sweep import (Interrupted, SweepError, SweepLock, claim_sweep, deliver_pending, handle_signals,
                           interruptible, job_dirname, signals_deferred, sweep_overrides, sweep_size)

if TYPE_CHECKING:       # the run's modules (torch, pandas) load when a run starts, not for --help or plan
    from harness.runner import JobContext, JobOutcome
    from harness.session import RunSession

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()
if not OmegaConf.has_resolver("moebench_job_dir"):
    OmegaConf.register_new_resolver("moebench_job_dir", job_dirname)


def _job_context(session: RunSession) -> JobContext:
    from harness.runner import JobContext
    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    job_dir = Path(hc.runtime.output_dir)
    # a single run's id holds a hash of where it ran, so two runs in dirs of one name (R/a/latest,
    # R/b/latest) are two jobs of a tree, not one that a load keeps the first of
    sweep_id = Path(hc.sweep.dir).name if multirun else \
        f"run-{job_dir.name}-{hashlib.sha256(str(job_dir.resolve()).encode()).hexdigest()[:8]}"
    job_id = (hc.job.override_dirname or "default") if multirun else "run"
    return JobContext(job_dir, sweep_id, job_id, overrides=list(hc.overrides.task), in_sweep=multirun,
                      reached=session.handled_jobs.add)


def build_app(session: RunSession) -> Callable[[], None]:
    """The Hydra app of one command: a closure over its session. A launcher that runs the jobs in
    other processes pickles the task function, and the session with it, as a fresh one there."""
    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
    def app(cfg: DictConfig) -> None:
        with interruptible():
            _job(cfg, session)
    return app


def _job(cfg: DictConfig, session: RunSession) -> None:
    from harness.plugin_keys import drop_not_applicable, not_applicable_line
    from harness.report import Reporter
    from harness.runner import run
    _freeze_startup_heap(session)
    ctx = _job_context(session)
    quiet = bool(cfg.run.quiet)
    dropped = drop_not_applicable(cfg, ctx.overrides or [])         # a sweep's option its plugin lacks
    session.quiet = session.quiet or quiet
    progress = session.progress               # None in a launcher's worker process
    if progress is not None:
        progress.quiet = progress.quiet or quiet
        progress.start(ctx.job_id)
    if dropped:
        Reporter(quiet).info(not_applicable_line(cfg, dropped))
    try:
        outcome = run(cfg, ctx, Reporter(quiet, sweep=progress), session)
    finally:
        if progress is not None:
            progress.finish()
    if outcome.error:
        session.failed_jobs += 1
    if outcome.unwritten:
        session.unwritten.extend(outcome.rows)
    if HydraConfig.get().mode.name != "MULTIRUN":
        _finish_single(ctx, quiet, outcome, session)


def _freeze_startup_heap(session: RunSession) -> None:
    """Before the command's first engine loads: everything alive now -- the interpreter's, torch's,
    pandas' and Hydra's objects from import, kept for the whole process -- leaves the cyclic
    collector's reach (gc.freeze). The collections that give a closed engine's memory back
    (harness.engines, harness.reference) then walk only what was made since: on the tiny model
    each walked ~0.14 s of import-time objects, several times a job. Once per process, and only
    while no engine is loaded, so nothing a run later releases is ever frozen."""
    import gc
    if gc.get_freeze_count() == 0 and not session.engines.loaded():
        gc.freeze()


def _finish_single(ctx: JobContext, quiet: bool, outcome: JobOutcome, session: RunSession) -> None:
    from harness import results
    from harness.report import Reporter
    if outcome.unwritten:
        print(f"moebench: {outcome.error}", file=sys.stderr)
        return
    if outcome.skipped:
        return
    from harness.checks import failed_check_jobs
    df = results.load(ctx.job_dir)
    Reporter(quiet).summary(df, "run")
    print(f"results: {ctx.job_dir / 'rows.parquet'}")
    session.check_failed = failed_check_jobs(df)


def _launch(argv: list[str], sweep_dir: Path | None, session: RunSession) -> int:
    """Run Hydra, then write the sweep's table; an interrupt ends the sweep with the table of the
    jobs completed so far."""
    sys.argv = [sys.argv[0], *hydra_args(argv)]
    if sweep_dir is not None:
        from harness.report import SweepProgress
        session.progress = SweepProgress(_sweep_jobs(argv), quiet=quiet_of(argv))
    try:
        with hydra_raises(), mode_from_flags(argv):
            build_app(session)()
        if sweep_dir is not None:        # after the last job, whatever happened to the others
            session.end_sweep(sweep_dir, quiet=quiet_of(argv) or session.quiet)
        deliver_pending()                # one that arrived while Hydra or the table wrapped up
    except Interrupted as exc:
        session.close_progress()
        with signals_deferred():
            where = ""
            if sweep_dir is not None and sweep_dir.is_dir():
                df = session.write_table(sweep_dir)
                jobs = set() if df is None else set(df["job_id"])
                where = (f"; the table of the {len(jobs)} completed job(s) is in {sweep_dir}" if jobs else
                         f"; {session.table_error}" if session.table_error else
                         f"; no job in {sweep_dir} had finished, so it has no table")
                if older := len(jobs - session.handled_jobs):
                    where += (f" ({older} of them not reached by this run: their results are from before it, "
                              + ("under the config it checked when it started)" if session.configs_checked else
                                 "their configs unchecked until the command runs again)"))
        if sweep_dir is None:             # a single run keeps no progress to resume from
            again = ("a single run does not resume (one interrupted before it finished wrote no results): run "
                     "the command again to measure it from the start")
        elif override_of(argv, "run.resume") == "replace":
            again = ("run the command again without run.resume=replace to resume (with it, the sweep starts over "
                     "and the completed jobs are deleted)")
        else:
            again = "run the same command again to resume"
        print(f"moebench: interrupted by {exc}{where}; {again}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 -- what Hydra raised to us (hydra_raises)
        session.close_progress()
        return _hydra_failed(exc, argv, sweep_dir, session)
    finally:
        session.close_progress()
    if session.check_failed:             # after the table: the run measured, but not what the reference computes
        from harness.checks import failure_line
        print(f"moebench: {failure_line(session.check_failed)}", file=sys.stderr)
    if session.table_error:
        print(f"moebench: {session.table_error}", file=sys.stderr)
        return 1
    return 1 if session.failed_jobs or session.check_failed else 0


@contextlib.contextmanager
def hydra_raises() -> Iterator[None]:
    """Hydra catches what its own code raises -- a config that does not compose, or a write of its
    own failing (a job's or run's dir, the sweep's multirun.yaml: disk full, read-only) -- prints a
    traceback and exits, ending a sweep without its table; with HYDRA_FULL_ERROR set it raises it
    instead, to `_launch`, which ends an OS error in one line after the table (`_hydra_failed`)."""
    before = os.environ.get(_FULL_ERROR)
    os.environ[_FULL_ERROR] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_FULL_ERROR, None)
        else:
            os.environ[_FULL_ERROR] = before


_FULL_ERROR = "HYDRA_FULL_ERROR"


def mode_settable(argv: list[str]) -> bool:
    """Whether anything but moebench's own config could set `hydra.mode` for this command: a
    `hydra.mode` override, or another config source (-cp/-cd/-cn, hydra.searchpath)."""
    flags, overrides = split_args(argv)
    keys = {o.lstrip("+~").partition("=")[0] for o in overrides}
    return bool(CONFIG_SOURCE_FLAGS & set(flags)) or bool(keys & {"hydra.mode", "hydra.searchpath"})


@contextlib.contextmanager
def mode_from_flags(argv: list[str]) -> Iterator[None]:
    """Before it runs anything, Hydra composes the whole config once only to read `hydra.mode`
    (`Hydra.get_mode`), then composes it again to run: ~0.35 s a command on 2 cores, as long as a
    tiny job's measurement. moebench's config never sets the mode (tests/harness/test_hydra_mode.py
    composes every experiment to hold it), so where the command line cannot set it either
    (`mode_settable`), Hydra's own answer is None -- the flags decide -- and the first composition
    is skipped; otherwise Hydra asks as it always does."""
    if mode_settable(argv):
        yield
        return
    from hydra._internal.hydra import Hydra
    asked = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None
    try:
        yield
    finally:
        Hydra.get_mode = asked


def _hydra_failed(exc: Exception, argv: list[str], sweep_dir: Path | None, session: RunSession) -> int:
    """What Hydra raised (hydra_raises). An OS error -- one of Hydra's own writes failed; the
    job-level ones of ours end as failed rows in harness.runner -- ends the run: the table of the
    jobs finished so far, written where it can be and shown, then one line naming the path and the
    error. Anything else is reported as Hydra would: its own config errors in their few lines, the
    rest as a traceback (always, when the user set HYDRA_FULL_ERROR)."""
    from hydra.errors import CompactHydraException, HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(exc, OSError) or isinstance(exc, HydraException):   # a missing config is an IOError too
        if isinstance(exc, CompactHydraException) and os.environ.get(_FULL_ERROR) is None:
            from harness.hydra_errors import one_line
            if (line := one_line(exc, split_args(argv)[1])) is not None:     # a bad override: key, type, value
                print(f"moebench: {line}", file=sys.stderr)
                return 1
            print(exc, file=sys.stderr)
            if isinstance(exc.__cause__, OmegaConfBaseException):
                print(exc.__cause__, file=sys.stderr)
            return 1
        raise exc
    if sweep_dir is None:
        print(f"moebench: cannot write the run's files: {exc}", file=sys.stderr)
        return 1
    quiet = quiet_of(argv)
    with signals_deferred():
        written = session.write_table(sweep_dir) is not None
        n = session.show_table(sweep_dir, quiet, "" if written else " (not written)")
    table = ("no job of it finished" if not n else f"the table of its {n} finished job(s) is in {sweep_dir}" if written
             else f"the table of its {n} finished job(s) could not be written ({session.table_error})")
    print(f"moebench: the sweep in {sweep_dir} cannot go on: {exc}; {table}", file=sys.stderr)
    return 1


def _retire_stale(sweep_dir: Path, argv: list[str], session: RunSession) -> None:
    """Before a resumed sweep runs any job: retire every finished job whose results came from
    another config than its overrides give now (harness.sweep.stale_jobs), so that however the
    run ends -- completed, interrupted, killed -- the dir never holds an older config's results
    beside the new ones. Its rows stay as the mark of an incomplete job; it runs again."""
    from harness.plan import composer
    from harness.results import DONE_FILE, remove_job
    from harness.sweep import stale_jobs

    flags, overrides = split_args(argv)
    if CONFIG_SOURCE_FLAGS & set(flags):                     # composed from elsewhere: not reproducible here
        return
    session.configs_checked = True
    finished = sum((d / DONE_FILE).is_file() for d in sweep_dir.iterdir())
    if finished > 20 and (override_of(argv, "run.quiet") or "false").lower() != "true":     # ~0.1 s each
        print(f"moebench: checking the configs of the {finished} jobs this sweep finished before", file=sys.stderr)
    # Hydra leaves its own overrides (a search path) out of a job's recorded ones: the command's apply
    hydra_own = [o for o in overrides if o.lstrip("+~").startswith("hydra.")]
    with composer() as compose:
        stale = stale_jobs(sweep_dir, lambda overrides: OmegaConf.to_container(compose([*overrides, *hydra_own]),
                                                                             resolve=True))
    if not stale:
        return
    for job_dir, _ in stale:
        remove_job(job_dir)
    session.write_table(sweep_dir)
    shown = "; ".join(f"{d.name}: {why}" for d, why in stale[:3]) + ("; ..." if len(stale) > 3 else "")
    print(f"moebench: {len(stale)} finished job(s) in {sweep_dir} ran under another config than their overrides "
          f"give now (the config files or a checkpoint changed since); their results are retired and they run "
          f"again: {shown}", file=sys.stderr)


def _sweep_jobs(argv: list[str]) -> int:
    """How many jobs this multirun makes (an experiment's sweeper params included)."""
    from harness.plan import expand
    try:
        return len(expand(split_args(argv)[1]))
    except Exception:  # noqa: BLE001 -- a count for progress only; Hydra reports a bad sweep itself
        return sweep_size(argv)


# `moebench <command> ...`: sub-commands dispatched before Hydra (module:function taking argv); then
# every engine adapter's own (its `commands`: `moebench setup llamacpp` ...), asked of the registry
COMMANDS = CommandTable({
    "plan": "harness.plan:plan_main",              # the memory plan, before any weight is read
    "fit": "harness.plan:fit_main",                # the largest context / capacity, fewest CPU layers
    "predict": "harness.predict:predict_main",     # predicted rates and bounds on a hardware profile, with the plan
    "table": "harness.table:main",                 # one row per configuration of a results dir
    "calibrate": "harness.costmodel.calibrate:main",   # measure this machine, write a hardware profile
    "trace": "harness.traces.cli:main",            # trace import: other engines' routing -> a routing trace
    "serve-sweep": "harness.serve_sweep:main",     # the highest load within the SLO, per configuration
})


def _help(argv: list[str]) -> int:
    """`moebench --help [overrides]`: harness.cli_help's text, the config composed from the
    overrides (a sweep's first values); a bad override in one line, exit 2."""
    from harness.cli_help import config_help, first_values, usage
    from harness.config import BAD_CONFIG, config_error_line
    from harness.plan import composer
    print(usage(__doc__ or ""))
    try:
        with composer(hydra=True) as compose:
            cfg = compose(first_values(split_args(argv)[1]))
    except BAD_CONFIG as exc:
        print(f"moebench: {config_error_line(exc)}", file=sys.stderr)
        return 2
    print(config_help(cfg, CONF_DIR))
    return 0


def _command_group(argv: list[str]) -> int | None:
    """`moebench setup`, `moebench import --help`: the first word of a two-word command without
    its second, answered with the commands it begins (exit 0 for --help, 2 otherwise); a bare
    word that is neither a command nor an override (every override holds `=`, or starts with
    `~`) refused in one line, before Hydra reads it as one. None: not a command word."""
    word = argv[0] if argv else ""
    if not word or word.startswith(("-", "~", "+")) or "=" in word:
        return None
    known = sorted(COMMANDS) + ["rerun"]
    under = [c for c in known if c.split()[0] == word]
    if under:
        print(f"moebench {word}: one of: {', '.join(f'moebench {c}' for c in under)} (`moebench {under[0]} "
              f"--help` for its options)", file=sys.stdout if _asks_help(argv) else sys.stderr)
        return 0 if _asks_help(argv) else 2
    print(f"moebench: unknown command {word!r}; allowed: {', '.join(known)}, or overrides (key=value, "
          "group=option; `moebench --help` lists them)", file=sys.stderr)
    return 2


def _asks_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def main() -> None:
    argv = sys.argv[1:]
    for words in (2, 1):                         # `moebench setup llamacpp` before `moebench plan`
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            import importlib
            module, _, fn = COMMANDS[name].partition(":")
            sys.exit(getattr(importlib.import_module(module), fn)(argv[words:]))
    if argv[:1] != ["rerun"] and (code := _command_group(argv)) is not None:
        sys.exit(code)
    if argv[:1] == ["rerun"]:
        from harness.rerun import plan_rerun
        try:
            rerun = plan_rerun(argv[1:])
        except (SweepError, ValueError, OSError) as exc:
            print(f"moebench rerun: {exc}", file=sys.stderr)
            sys.exit(2)
        for note in rerun.notes:
            print(f"moebench rerun: {note}", file=sys.stderr)
        if rerun.needs_new_process():    # torch's thread runtimes read the environment once, at import
            rerun.exec()
        argv = rerun.argv
    try:
        argv = _scoped(argv)
    except ValueError as exc:                    # harness.plugin_keys.OptionScopeError
        print(f"moebench: {exc}", file=sys.stderr)
        sys.exit(1)
    if _asks_help(argv):                         # no run, no session (Hydra's own: --hydra-help)
        sys.exit(_help(argv))
    handle_signals()
    from harness.session import RunSession
    session = RunSession()
    try:
        code = _single_or_sweep(argv, session)
    finally:
        session.close()                          # the cached engine (a llama.cpp server) goes now
    sys.exit(code)


def _scoped(argv: list[str]) -> list[str]:
    """argv with a sweep's plugin options made to apply where they exist (harness.plugin_keys:
    `-m placement=resident,hybrid placement.n_cpu_layers=2`); raises its one-line error where one
    applies to no chosen plugin."""
    from harness.plan import compose_once
    from harness.plugin_keys import scope_options
    flags, overrides = split_args(argv)
    scoped = scope_options(overrides, is_multirun(argv), compose_once)
    return argv if scoped == overrides else [*flags, *scoped]


def _check_sweep(argv: list[str]) -> None:
    """A sweep Hydra would reject while composing its jobs -- an unknown group option, a key or a
    value its schema refuses -- is refused before its dir is made or locked (nothing is left under
    the results root): its jobs are composed first as Hydra will compose them, enough of them that
    every value of every swept key is in one (the rest combine the same values). Raises SweepError
    with the one line. A sweep composed from another config source (-cp, -cn) is left to Hydra."""
    from harness.config import BAD_CONFIG
    from harness.plan import composer, expand
    flags, overrides = split_args(argv)
    if CONFIG_SOURCE_FLAGS & set(flags):
        return
    try:
        jobs, seen = expand(overrides), set()
        with composer(hydra=True) as compose:
            for job in jobs:
                if not seen.issuperset(job):
                    compose(job)
                    seen.update(job)
    except BAD_CONFIG as exc:
        raise SweepError(_compose_error(exc, overrides)) from None


def _compose_error(exc: BaseException, overrides: list[str]) -> str:
    """One line for a composition error (harness.hydra_errors), a missing group option with the
    options there are."""
    from harness.config import config_error_line
    from harness.hydra_errors import one_line
    return one_line(exc, overrides) or config_error_line(exc)


def _single_or_sweep(argv: list[str], session: RunSession) -> int:
    if not is_multirun(argv):
        try:
            check_run_dir(argv)
        except SweepError as exc:
            print(f"moebench: {exc}", file=sys.stderr)
            return 1
        return _launch(argv, None, session)
    sweep_dir = None
    try:
        sweep_dir = sweep_dir_of(argv)
        _check_sweep(argv)
        with SweepLock(sweep_dir):
            if claim_sweep(sweep_dir, sweep_overrides(argv), override_of(argv, "run.resume") or "auto",
                           ["moebench", *argv]) in ("resume", "add"):
                _retire_stale(sweep_dir, argv, session)
            code = _launch(argv, sweep_dir, session)
    except SweepError as exc:
        print(f"moebench: {exc}", file=sys.stderr)
        code = 1
    except Interrupted as exc:          # before any job started: nothing to write
        print(f"moebench: interrupted by {exc} before the sweep started", file=sys.stderr)
        code = exc.exit_code
    except OSError as exc:              # the sweep dir cannot be made, locked or recorded (read-only, full, not ours)
        code = _cannot_write(sweep_dir, exc, argv, session)
    return code


def _cannot_write(sweep_dir: Path | None, exc: OSError, argv: list[str], session: RunSession) -> int:
    """Before any job: the sweep dir cannot be written, so nothing of this run could be kept. The
    table of the jobs it finished before is shown (from their dirs), then one line naming the
    path and the OS error."""
    quiet = quiet_of(argv)
    n = session.show_table(sweep_dir, quiet, as_found=True) if sweep_dir is not None and sweep_dir.is_dir() else 0
    before = "" if not n else f"; it holds {n} finished job(s): " + (f"moebench table {sweep_dir}" if quiet else
                                                                      "the table above")
    print(f"moebench: cannot write the sweep dir {sweep_dir}: {exc}{before}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
