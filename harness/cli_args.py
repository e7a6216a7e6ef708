"""The moebench command line as text, before Hydra sees it: which flags take a value, Hydra's
flags apart from the overrides (`split_args`), the value an override gives (`override_of`), the
sweep dir a multirun writes (`sweep_dir_of`) and the argv Hydra is handed (`hydra_args`).

Owns: reading argv. Does not own: what the overrides mean (harness.config), the sweep's lock and
claim (harness.sweep), running anything (harness.cli).

    split_args(["x=1", "-m", "y=2"])          # (["-m"], ["x=1", "y=2"])
    sweep_dir_of(["-m", "run.sweep_id=a"])    # results/sweeps/a
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from harness.contract import COSMETIC_KEYS
from harness.sweep import SweepError, check_dir_name, check_own_dir, check_subpath, sweep_overrides

__all__ = ["CONFIG_SOURCE_FLAGS", "SWEEP_DIR_KEYS", "check_run_dir", "hydra_args", "is_multirun", "override_of",
           "quiet_of", "split_args", "sweep_dir_of"]


def is_multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def quiet_of(argv: list[str]) -> bool:
    return (override_of(argv, "run.quiet") or "false").lower() == "true"


def override_of(argv: list[str], key: str) -> str | None:
    vals = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == key and "=" in a]
    return vals[-1] if vals else None


SWEEP_DIR_KEYS = ("hydra.sweep.dir", "run.sweep_id", "run.out")   # what names a multirun's dir


def sweep_dir_of(argv: list[str]) -> Path:
    """The sweep dir a multirun writes: hydra.sweep.dir if given, else <run.out>/sweeps/<run.sweep_id,
    or a hash of the measurement overrides>. An interpolation (`${...}`) in any of the three is
    refused: the dir is locked and claimed before Hydra starts, at the path as written, while Hydra
    would write where the interpolation resolves (a second writer got in, an interrupt's table
    came out empty). What names a dir under the results root stays under it (run.sweep_id is one
    dir name, hydra.sweep.subdir a relative path); a dir given in full may not be the root or
    above it (harness.sweep.check_own_dir). `run.out` itself may be any path: it is the root."""
    for key in SWEEP_DIR_KEYS:
        value = override_of(argv, key)
        if value is not None and "${" in value:
            raise SweepError(f"{key}={value}: a sweep's dir must be a plain path, known before Hydra starts "
                             "(it is locked and claimed first), not an interpolation; let the shell expand "
                             "it instead, e.g. run.out=$HOME/results")
    root = override_of(argv, "run.out") or "results"
    if (subdir := override_of(argv, "hydra.sweep.subdir")) is not None:
        check_subpath("hydra.sweep.subdir", subdir)
    given = override_of(argv, "hydra.sweep.dir")
    if given:
        check_own_dir("hydra.sweep.dir", given, root)
        return Path(given)
    sweep_id = override_of(argv, "run.sweep_id")
    if sweep_id:
        check_dir_name("run.sweep_id", sweep_id)
    sweep_id = sweep_id or "sweep-" + hashlib.sha1("\n".join(sweep_overrides(argv)).encode()).hexdigest()[:10]
    return Path(root) / "sweeps" / sweep_id


def check_run_dir(argv: list[str]) -> None:
    """A single run's dir given in full (hydra.run.dir) may be anywhere but the results root or
    above it; without it, the run's dir is <run.out>/runs/<time> (conf/config.yaml)."""
    if (given := override_of(argv, "hydra.run.dir")) and "${" not in given:
        check_own_dir("hydra.run.dir", given, override_of(argv, "run.out") or "results")


# Hydra's flags that take a value (argparse would read an override after them as that value)
# where configs come from
CONFIG_SOURCE_FLAGS = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"}
VALUE_FLAGS = CONFIG_SOURCE_FLAGS | {"-p", "--package", "-c", "--cfg", "--experimental-rerun", "--shell-completion"}
INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides), wherever on the line each was given:
    argparse stops reading overrides after a flag, so `moebench a=1 -m b=2` needs them apart."""
    flags, overrides, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-"):
            flags.append(a)
            takes = a in VALUE_FLAGS or (a in ("-i", "--info") and i + 1 < len(argv) and argv[i + 1] in INFO_CHOICES)
            if takes and i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
        else:
            overrides.append(a)
        i += 1
    return flags, overrides


def hydra_args(argv: list[str]) -> list[str]:
    """argv as Hydra's parser needs it (flags first) plus what every moebench run sets: job dir
    names without the cosmetic keys, and for a multirun its deterministic sweep dir."""
    flags, overrides = split_args(argv)
    keys = ",".join([*COSMETIC_KEYS, "hydra.sweep.dir"])
    extra = [f"hydra.job.config.override_dirname.exclude_keys=[{keys}]"]
    if is_multirun(argv) and override_of(argv, "hydra.sweep.dir") is None:
        extra.append(f"hydra.sweep.dir={sweep_dir_of(argv)}")
    return [*flags, *overrides, *extra]
