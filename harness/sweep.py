"""What makes a sweep directory trustworthy across reruns: who may write it, which sweep it
holds, which jobs in it are still valid, and how an interrupted run ends.

Owns:
- `job_fingerprint`: the hash of a job's resolved measurement config (cosmetic keys dropped,
  `harness.contract.COSMETIC_KEYS`) plus the model's identity (preset name + seed, or the
  checkpoint's path and its files' sizes and mtimes). A rerun skips a job only when the
  fingerprint recorded with it matches (harness.runner asks `resume_decision`).
- `SweepLock`: one writer per sweep dir (an `flock` on `<sweep>/.lock`, released by the kernel
  even when the holder is killed); a second process is refused with the holder's pid and command.
- `stale_jobs`: the finished jobs whose recorded config no longer matches what their overrides
  give (the CLI retires them when a sweep resumes, before any job runs, so a resume that dies
  midway never leaves an older config's results beside the new ones).
- `claim_sweep`: the sweep's identity (its command-line overrides) recorded in `sweep.json`; a
  dir that holds a *different* sweep is refused, naming the differing keys, unless
  `run.resume=add` (add these jobs beside the others) or `run.resume=replace` (clear it first).
- `Interrupted` and `handle_signals`: SIGTERM and Ctrl-C become one exception the CLI turns
  into a one-line message and exit code 128+signal, after writing the completed jobs' table.
- `job_dirname`: the Hydra resolver naming job dirs after their overrides, so the same job
  lands in the same dir whatever order a sweep lists its values in.
- where a sweep's or run's dir may be (`check_dir_name`, `check_subpath`, `check_own_dir`): a
  config value naming a dir *under* the results root (`run.sweep_id`, `hydra.sweep.subdir`)
  stays under it; a dir given in full (`hydra.sweep.dir`, `hydra.run.dir`, like `run.out`
  itself) may be anywhere but the results root or a dir above it.
Does not own: running jobs (harness.runner), the files of a job (harness.store).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.contract import COSMETIC_KEYS, RESUME_MODES

log = logging.getLogger(__name__)
LOCK_FILE = ".lock"
SWEEP_FILE = "sweep.json"
_MAX_DIRNAME = 120


class SweepError(RuntimeError):
    """A sweep dir cannot be used as asked; the message says why and what to do."""


# ----------------------------------------------------------------------------- fingerprints

def _drop(cfg: Mapping[str, Any], dotted: str) -> dict[str, Any]:
    group, _, key = dotted.partition(".")
    out = dict(cfg)
    if group in out and isinstance(out[group], Mapping):
        out[group] = {k: v for k, v in out[group].items() if k != key}
    return out


def measurement_config(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config minus Hydra's own node, the cosmetic keys and a `load` of none."""
    cfg = {k: v for k, v in resolved.items() if k != "hydra"}
    if (cfg.get("load") or {}).get("name", "none") == "none":
        cfg.pop("load", None)              # no load is what every job measured before the group existed
    for key in COSMETIC_KEYS:
        cfg = _drop(cfg, key)
    return cfg


def model_identity(model: Mapping[str, Any]) -> dict[str, Any]:
    """Preset name + seed + truncation, or the checkpoint's resolved path and every file in it
    (name, size, mtime): a checkpoint rewritten in place is a different model."""
    path = model.get("path")
    if not path:
        return {"preset": model.get("name"), "seed": model.get("seed"), "num_layers": model.get("num_layers")}
    p = Path(path).expanduser()
    try:
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file())
    except OSError as exc:
        files = [("<unreadable>", str(exc))]
    return {"path": str(p.resolve()), "files": files}


def job_fingerprint(resolved: Mapping[str, Any]) -> str:
    """Hash of what a job measures: its measurement config and its model's identity."""
    cfg = measurement_config(resolved)
    payload = {"config": cfg, "model_identity": model_identity(cfg.get("model") or {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measurement_key(resolved: Mapping[str, Any], inapplicable: Iterable[str]) -> str:
    """`job_fingerprint` without the config nodes that do not apply to the job (e.g. `cache` for a
    placement that keeps none): two jobs of one key measure the same thing."""
    drop = set(inapplicable)
    return job_fingerprint({k: v for k, v in resolved.items() if k not in drop})


def twin_of(job_dir: Path, key: str) -> Path | None:
    """A sibling job dir of the same sweep that completed (ok) with measurement key `key`."""
    from harness.results import read_done, recorded_done     # pandas: loaded by the runs that read results
    for other in sorted(p for p in job_dir.parent.iterdir() if p.is_dir() and p != job_dir):
        recorded = recorded_done(other) or {}    # the record first; only a candidate's files are verified
        if recorded.get("measurement_key") != key or recorded.get("status") != "ok":
            continue
        done = read_done(other)
        if done is not None and done.get("measurement_key") == key and done.get("status") == "ok":
            return other
    return None



@dataclass(frozen=True)
class ResumeDecision:
    run: bool
    reason: str


def resume_decision(done: Mapping[str, Any] | None, fingerprint: str, retry_failed: bool,
                    incomplete: str | None = None) -> ResumeDecision:
    """Whether a job must run, given the verified DONE record found in its dir (None: none there,
    or one its files do not bear out: `incomplete` says what, harness.results.inspect_job)."""
    if done is None:
        return ResumeDecision(True, f"{incomplete}; it runs again" if incomplete else "not run yet")
    if done.get("config_hash") != fingerprint:
        return ResumeDecision(True, f"its recorded config hash {done.get('config_hash')} differs from {fingerprint}")
    if done.get("status") == "failed":
        if retry_failed:
            return ResumeDecision(True, "it failed before (run.retry_failed=true)")
        return ResumeDecision(False, "it failed before and run.retry_failed=false")
    return ResumeDecision(False, "already complete with the same config hash")


def stale_jobs(sweep_dir: Path, resolve: Callable[[list[str]], Mapping[str, Any]]) -> list[tuple[Path, str]]:
    """The finished jobs of `sweep_dir` whose results came from another config than their own
    overrides give now -- the config files or a checkpoint changed since they ran -- each with why:
    its manifest's overrides resolved again (`resolve`: overrides -> resolved config) and
    fingerprinted against its DONE. A job whose overrides do not compose here (an interpolation
    only Hydra's app resolves, a preset since removed) or without a readable manifest is left
    alone, unchecked: its own run decides when the sweep reaches it."""
    from harness.results import read_done
    out: list[tuple[Path, str]] = []
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        done = read_done(d)
        if done is None:
            continue
        try:
            overrides = list(json.loads((d / "manifest.json").read_text())["overrides"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            now = job_fingerprint(resolve(overrides))
        except Exception as exc:  # noqa: BLE001 -- any failure to compose: unchecked, never retired on a guess
            log.warning("cannot check %s against the config files now (%s: %s); it is checked when it runs",
                        d.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            continue
        if now != done.get("config_hash"):
            out.append((d, f"config hash {done.get('config_hash')} -> {now}"))
    return out


# ----------------------------------------------------------------------------- job dir names

def job_dirname(override_dirname: str) -> str:
    """A job's dir name from Hydra's `override_dirname` (sorted `key=value` pairs). A path
    separator in a value becomes `_`, and then a hash of the overrides as given is appended, so
    `model.path=a/b` and `model.path=a_b` stay two dirs (they were one, the second job's results
    overwriting the first's); a name too long for a dir is cut, ending in the hash of all of it."""
    given = override_dirname or "default"
    digest = "-" + hashlib.sha1(given.encode()).hexdigest()[:8]
    name = given.replace(os.sep, "_") + (digest if os.sep in given else "")
    if len(name) > _MAX_DIRNAME:
        name = name[:_MAX_DIRNAME - len(digest)] + digest
    return name


# ----------------------------------------------------------------------------- where dirs may be

def check_dir_name(key: str, value: str) -> None:
    """`value` names one dir directly under another (run.sweep_id under <run.out>/sweeps): one
    path component, so the dir stays where it belongs. Raises SweepError in one line."""
    if value in (".", "..") or os.sep in value or (os.altsep and os.altsep in value) or "\0" in value:
        raise SweepError(f"{key}={value}: it names one dir under <run.out>/sweeps, so it may not leave it; "
                         "allowed: a name without '/' that is not '.' or '..' (to write a sweep elsewhere, "
                         "give run.out or hydra.sweep.dir)")


def check_subpath(key: str, value: str) -> None:
    """`value` is a relative path under another dir (hydra.sweep.subdir under the sweep dir): no
    absolute path, no `..`. An interpolation is Hydra's to resolve and is not checked here."""
    if "${" in value:
        return
    if Path(value).is_absolute() or ".." in Path(value).parts:
        raise SweepError(f"{key}={value}: a job's dir lies under its sweep dir; allowed: a relative path "
                         "without '..' components")


def check_own_dir(key: str, value: str, root: str | os.PathLike[str]) -> None:
    """A dir given in full (hydra.sweep.dir, hydra.run.dir) may be anywhere -- it is the user's
    choice, as `run.out` is -- except the results root or a dir above it: those hold every other
    sweep, run and the reference cache, which a sweep dir's own files would mix with and
    `run.resume=replace` would delete."""
    given, top = Path(value).resolve(), Path(root).resolve()
    if given == top or given in top.parents:
        raise SweepError(f"{key}={value}: that is the results root ({root}) or a dir above it, which holds every "
                         "other sweep and the reference cache; allowed: a dir of its own, e.g. one under it")


# ----------------------------------------------------------------------------- one writer

class SweepLock:
    """An exclusive, non-blocking `flock` on `<sweep dir>/.lock` for the life of the process."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = sweep_dir
        self._fd: int | None = None

    def __enter__(self) -> "SweepLock":
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        path = self.sweep_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SweepError(f"sweep dir {self.sweep_dir} is being written by another moebench ({holder}); "
                             "wait for it to finish, or give this run another run.sweep_id") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(sys.argv)}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)       # closing releases the flock
            self._fd = None


# ----------------------------------------------------------------------------- sweep identity

def _sweep_values(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(key, its values sorted) per task override, parsed by Hydra's own override parser (so a
    sweep's choices and ranges are expanded), Hydra's own keys and the cosmetic keys left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from harness.hydra_errors import one_line

    raw = [a for a in argv if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(raw)
    except OverrideParseException as exc:      # one line naming the override, not Hydra's traceback
        raise SweepError(one_line(exc, raw) or str(exc)) from None
    out = []
    for o in parsed:
        key = o.key_or_group
        if key.startswith("hydra.") or key.startswith("hydra/") or key in COSMETIC_KEYS:
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        out.append((key, sorted(set(values))))
    return sorted(out)


def sweep_overrides(argv: Sequence[str]) -> list[str]:
    """The overrides that define a sweep, normalised (`key=v1,v2,...`, values and keys sorted), so
    the same sweep written in another order is the same sweep."""
    return [f"{key}={','.join(values)}" for key, values in _sweep_values(argv)]


def sweep_size(argv: Sequence[str]) -> int:
    """How many jobs the basic sweeper makes of these overrides (the product of the value counts)."""
    n = 1
    for _, values in _sweep_values(argv):
        n *= len(values)
    return n


def _as_dict(overrides: Sequence[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def differing_keys(recorded: Sequence[str], now: Sequence[str]) -> list[str]:
    a, b = _as_dict(recorded), _as_dict(now)
    return [f"{k}: {a.get(k, '(unset)')} (recorded) vs {b.get(k, '(unset)')} (now)"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def claim_sweep(sweep_dir: Path, overrides: Sequence[str], mode: str, command: Sequence[str]) -> str:
    """Record or check which sweep `sweep_dir` holds; returns what happened ("new", "resume",
    "add", "replace"). Call with the lock held."""
    if mode not in RESUME_MODES:
        raise SweepError(f"run.resume: allowed {list(RESUME_MODES)}, got {mode!r}")
    path = sweep_dir / SWEEP_FILE
    entry = {"overrides": list(overrides), "command": list(command), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    recorded: list[dict[str, Any]] = []
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())["sweeps"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SweepError(f"{path} is unreadable ({exc}); run.resume=replace starts the sweep dir over") from None
    others = [p for p in sweep_dir.iterdir() if p.name not in (LOCK_FILE, SWEEP_FILE)] if sweep_dir.is_dir() else []
    if mode == "replace":                  # asked for a fresh start: always honoured
        for p in others:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        recorded, outcome = [], "replace"
    elif not recorded and not others:
        outcome = "new"
    elif any(r.get("overrides") == list(overrides) for r in recorded):
        return "resume"
    elif mode == "add":
        outcome = "add"
    else:
        what = ("; ".join(differing_keys(recorded[-1]["overrides"], overrides)) if recorded
                else f"it holds {len(others)} entries written without a sweep record")
        raise SweepError(f"sweep dir {sweep_dir} holds a different sweep ({what}); "
                         "add run.resume=add to add these jobs to it, run.resume=replace to clear it first, "
                         "or give this sweep another run.sweep_id")
    from harness.results import atomic_write_text   # lazy: the store imports pyarrow
    atomic_write_text(path, json.dumps({"sweeps": [*recorded, entry]}, indent=2) + "\n")
    return outcome


# ----------------------------------------------------------------------------- signals

class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived; a BaseException so no `except Exception` (Hydra's job runner,
    the runner's failed-row handler) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_SIGNALS: dict[str, Any] = {"open": False, "pending": None}


def _raise(signum: int, frame: Any) -> None:
    if not _SIGNALS["open"]:           # Hydra's own code, e.g. composing the next job's config, which an
        _SIGNALS["pending"] = signum   # exception raised part-way leaves broken: delivered at the next
        return                         # `interruptible()` or `deliver_pending()`
    raise Interrupted(signum)


def deliver_pending() -> None:
    """Raise `Interrupted` for a signal that arrived outside `interruptible()`, if one did."""
    signum, _SIGNALS["pending"] = _SIGNALS["pending"], None
    if signum is not None:
        raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Where SIGTERM/SIGINT raise `Interrupted` at once (a job's own code); one that arrived before,
    in Hydra's code, is raised on entry."""
    deliver_pending()
    _SIGNALS["open"] = True
    try:
        yield
    finally:
        _SIGNALS["open"] = False


def handle_signals() -> None:
    """Turn SIGTERM and SIGINT into `Interrupted` in the main thread: at once inside
    `interruptible()`, else at its next entry or `deliver_pending()`."""
    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGINT, _raise)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGTERM/SIGINT while a table is written; a signal that arrived meanwhile is delivered
    after (and raises `Interrupted` then)."""
    blocked = {signal.SIGTERM, signal.SIGINT}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
