"""`moebench rerun JOB_DIR [--out DIR]`: run one recorded job again, as a single run, from its manifest.

Owns: reading the job's recorded Hydra overrides, composing them again and checking that the
result is the measurement config the manifest recorded (so a rerun measures the same thing --
if the config files changed since, it is refused with the differing keys); the context the job
ran in, set again: the recorded environment (`harness.manifest.recorded_env`: OpenMP/BLAS thread
pools, CUDA, torch's allocator) and the recorded intra-op thread count (`run.threads`, added only
where the recorded environment would not give it on this machine); one line for each part of
the context it cannot set -- another git commit, another Python, package or engine build
(`EngineAdapter.builds`); and the argv of the new single run (its own run dir, never the
original job's). Does not own: running (harness.cli).

Why a new process: the OpenMP and BLAS runtimes read their variables once, when torch loads
them, and `harness.cli` has imported torch before any command line is read. So where the
environment differs from the recorded one, `Rerun.exec` replaces this process (same pid, so
signals reach the run as before) with `python -m harness.cli <overrides>` in the recorded
environment; where it does not, the run goes on in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from harness.results import MANIFEST_FILE
from harness.sweep import measurement_config


@dataclass(frozen=True)
class Rerun:
    """The single run that repeats a job: its argv, the environment it must start in, and one
    line per difference from the job's context this rerun cannot remove."""
    argv: list[str]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def needs_new_process(self) -> bool:
        return self.env != dict(os.environ)

    def exec(self) -> NoReturn:
        """Replace this process with the run, in the recorded environment."""
        sys.stdout.flush()
        sys.stderr.flush()                   # execve drops Python's buffers
        os.execve(sys.executable, [sys.executable, "-m", "harness.cli", *self.argv], self.env)


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def plan_rerun(argv: list[str]) -> Rerun:
    p = argparse.ArgumentParser(prog="moebench rerun", description="Run one recorded job again from its manifest, "
                                "in its recorded environment and thread count.")
    p.add_argument("job_dir", help="a job directory (with manifest.json)")
    p.add_argument("--out", help="run dir for the new run (default: <run.out>/runs/rerun-<time>)")
    args = p.parse_args(argv)
    path = Path(args.job_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    overrides = manifest.get("overrides")
    if overrides is None:
        raise ValueError(f"{path} records no command-line overrides (the job was not run through the moebench "
                         "CLI), so it cannot be replayed")
    overrides = [o for o in overrides if not o.startswith("hydra.")]
    cfg = _composed(overrides, manifest, args.job_dir)
    from omegaconf import OmegaConf

    env, notes = recorded_environment(manifest)
    threads = _threads_override(manifest, OmegaConf.select(cfg, "run.threads"), env)
    if threads is not None:
        overrides = [*overrides, threads[0]]
        notes.append(threads[1])
    notes += context_differences(manifest, env)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    out = args.out or f"{OmegaConf.select(cfg, 'run.out') or 'results'}/runs/rerun-{stamp}"
    return Rerun([*overrides, f"hydra.run.dir={out}"], env, notes)


def _composed(overrides: list[str], manifest: Mapping[str, Any], job_dir: str) -> Any:
    """The config the overrides compose to now; refused unless it is the recorded measurement config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from harness.cli import CONF_DIR
    from harness.config import BAD_CONFIG, config_error_line
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
    except BAD_CONFIG as exc:
        raise ValueError(f"the config files changed since {job_dir} ran: its recorded overrides no longer "
                         f"compose ({config_error_line(exc)})") from None
    from harness.plugin_keys import drop_not_applicable
    drop_not_applicable(cfg, overrides)          # as the job did: a `++` option its plugin lacks
    now = measurement_config(OmegaConf.to_container(cfg, resolve=True))
    then = measurement_config(manifest.get("config") or {})
    a, b = _flatten(then), _flatten(now)
    diff = [f"{k}: {a.get(k)!r} (recorded) vs {b.get(k)!r} (now)" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        raise ValueError(f"the config files changed since {job_dir} ran, so its overrides no longer give the "
                         f"recorded config: {'; '.join(diff)}")
    return cfg


# --- the environment and the threads ------------------------------------------------------------
def recorded_environment(manifest: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(this process's environment with the recorded variables set as the job had them -- those it
    had unset, unset -- and a line saying what that changes); a manifest that records no
    environment leaves this one as it is, and says so."""
    from harness.manifest import env_recorded
    recorded = manifest.get("env")
    if not isinstance(recorded, Mapping):
        return dict(os.environ), ["the manifest records no environment (OMP_NUM_THREADS, MKL_NUM_THREADS, ...): "
                                  "the job runs again in this one"]
    env = {k: v for k, v in os.environ.items() if not env_recorded(k)}
    env.update({str(k): str(v) for k, v in recorded.items()})
    changed = [f"{k}={env[k]} (here {os.environ[k]})" if k in os.environ and k in env else
               f"{k}={env[k]} (unset here)" if k in env else f"{k} unset (here {os.environ[k]})"
               for k in sorted(set(env) | set(os.environ)) if env.get(k) != os.environ.get(k)]
    notes = [f"the job's environment is set again: {', '.join(changed)}"] if changed else []
    return env, notes


@contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _threads_override(manifest: Mapping[str, Any], config_threads: int | None,
                      env: Mapping[str, str]) -> tuple[str, str] | None:
    """(`run.threads=N`, why) when the job set no run.threads and the recorded environment does not
    give its recorded N intra-op threads on this machine (the default, OMP_NUM_THREADS or the
    physical cores, differs here); None when the replayed overrides and environment give it."""
    from harness.machine import default_threads
    recorded = manifest.get("threads")
    if config_threads is not None or not isinstance(recorded, int):
        return None
    with _environ(env):
        here = default_threads()
    if here == recorded:
        return None
    return (f"run.threads={recorded}", f"the job ran with {recorded} intra-op thread(s) by default (no run.threads); "
            f"the default here is {here}, so run.threads={recorded} is set")


# --- what a rerun cannot set --------------------------------------------------------------------
def context_differences(manifest: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """One line per difference between the job's recorded code and what runs it again: git commit
    and uncommitted changes, Python, package versions, and the engine's own builds (found in `env`,
    the rerun's environment: LLAMA_CPP_BIN says which llama-server runs)."""
    from harness.manifest import REPO_DIR, git_info, package_versions
    notes = _git_difference(manifest.get("git") or {}, git_info(REPO_DIR))
    then_py = (manifest.get("python") or {}).get("version")
    if then_py and then_py != platform.python_version():
        notes.append(f"Python is {platform.python_version()} here, the job ran with {then_py}")
    then, now = manifest.get("packages") or {}, package_versions()
    for name in sorted(set(then) & set(now)):
        if then[name] != now[name]:
            notes.append(f"{name} is {now[name] or 'not installed'} here, the job ran with "
                         f"{then[name] or 'it not installed'}")
    return notes + _build_differences(manifest, env)


def _git_difference(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    if not then.get("commit"):
        return ["the manifest records no git commit: the code that ran is unknown"]
    if not now.get("commit"):
        return [f"the job ran at commit {then['commit']}; this installation is not a git checkout, so whether "
                "its code differs is unknown"]
    dirty = lambda info, where: f" ({where} with uncommitted changes)" if info.get("dirty") else ""  # noqa: E731
    if then["commit"] != now["commit"]:
        return [f"the checkout is at commit {now['commit']}{dirty(now, 'here')}, the job ran at "
                f"{then['commit']}{dirty(then, 'then')}"]
    if then.get("dirty") or now.get("dirty"):
        where = " and ".join(w for w, info in (("when the job ran", then), ("here", now)) if info.get("dirty"))
        return [f"the checkout is at the job's commit {now['commit']}, with uncommitted changes {where}: the code "
                "may differ"]
    return []


def _build_differences(manifest: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The engine's builds (e.g. the llama-server's commit) beside those the manifest recorded."""
    from harness.manifest import engine_builds, engine_name
    config = manifest.get("config") or {}
    with _environ(env):                  # LLAMA_CPP_BIN, MOEBENCH_CACHE: which build the rerun finds
        now = engine_builds(config)
    engine = engine_name(config)
    then = manifest.get("engine_builds")
    if not now:
        return [f"engine={engine}: cannot tell which build would run here"] if now is None and then else []
    if not isinstance(then, Mapping):
        return [f"engine={engine}: the manifest records no build ({', '.join(sorted(now))}); here: "
                + ", ".join(f"{k}={v}" for k, v in sorted(now.items()))]
    return [f"engine={engine}: {key} is {value} here, the job ran with {then.get(key) or 'an unrecorded one'}"
            for key, value in sorted(now.items()) if then.get(key) != value]
