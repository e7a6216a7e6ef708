"""`moebench rerun JOB_DIR [--out DIR]`: run one recorded job again, as a single run, from its manifest.

Owns: reading the job's recorded Hydra overrides, composing them again and checking that the
result is the measurement config the manifest recorded (so a rerun measures the same thing --
if the config files changed since, it is refused with the differing keys), and the argv of the
new single run (its own run dir, never the original job's). Does not own: running (harness.cli).
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

from harness.results import MANIFEST_FILE
from harness.sweep import measurement_config


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def rerun_args(argv: list[str]) -> list[str]:
    p = argparse.ArgumentParser(prog="moebench rerun", description="Run one recorded job again from its manifest.")
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
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from harness.cli import CONF_DIR
    from harness.config import BAD_CONFIG, config_error_line
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
    except BAD_CONFIG as exc:
        raise ValueError(f"the config files changed since {args.job_dir} ran: its recorded overrides no longer "
                         f"compose ({config_error_line(exc)})") from None
    now = measurement_config(OmegaConf.to_container(cfg, resolve=True))
    then = measurement_config(manifest.get("config") or {})
    a, b = _flatten(then), _flatten(now)
    diff = [f"{k}: {a.get(k)!r} (recorded) vs {b.get(k)!r} (now)" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        raise ValueError(f"the config files changed since {args.job_dir} ran, so its overrides no longer give the "
                         f"recorded config: {'; '.join(diff)}")
    out = args.out or f"{OmegaConf.select(cfg, 'run.out') or 'results'}/runs/rerun-{datetime.now().strftime('%Y-%m-%d_%H-%M-%S-%f')}"
    return [*overrides, f"hydra.run.dir={out}"]
