"""`moebench`: the Hydra app. A thin shim over harness.runner.run.

    moebench                                   # tiny model, coding-agent workload, one job
    moebench -m placement=resident,fetch cache.capacity=2,4 workload.context_tokens=1024,4096
    moebench calibrate --out conf/hardware/this-machine.yaml   # the cost model's profile of this machine

A sweep's directory is `<run.out>/sweeps/<run.sweep_id>`; without run.sweep_id it is a hash
of the command line, so re-running the same command resumes the sweep (completed jobs are
skipped). The process exits non-zero if any job failed, after the table is written.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness.callbacks import STATE
from harness.config import register_configs
from harness.report import Reporter
from harness.runner import JobContext, run

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


def _job_context() -> JobContext:
    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    job_dir = Path(hc.runtime.output_dir)
    sweep_id = Path(hc.sweep.dir).name if multirun else f"run-{job_dir.name}"
    job_id = (hc.job.override_dirname or "default") if multirun else "run"
    return JobContext(job_dir, sweep_id, f"{hc.job.num}:{job_id}" if multirun else job_id)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig) -> None:
    ctx = _job_context()
    error = run(cfg, ctx, Reporter(bool(cfg.run.quiet)))
    if HydraConfig.get().mode.name != "MULTIRUN":
        _finish_single(ctx, bool(cfg.run.quiet), error)


def _finish_single(ctx: JobContext, quiet: bool, error: str | None) -> None:
    from harness import results
    Reporter(quiet).summary(results.load(ctx.job_dir), "run")
    print(f"results: {ctx.job_dir / 'rows.parquet'}")
    if error:
        STATE["failed_jobs"] = 1


def _sweep_dir_override(argv: list[str]) -> list[str]:
    """Give a multirun a deterministic sweep dir (hash of its overrides) unless the user set one."""
    if not any(a in ("-m", "--multirun") for a in argv) or any(a.startswith("hydra.sweep.dir=") for a in argv):
        return argv
    overrides = sorted(a for a in argv if "=" in a and not a.startswith("-"))
    opts = dict(a.split("=", 1) for a in overrides)
    sweep_id = opts.get("run.sweep_id") or "sweep-" + hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:10]
    return [*argv, f"hydra.sweep.dir={opts.get('run.out', 'results')}/sweeps/{sweep_id}"]


def main() -> None:
    if sys.argv[1:2] == ["calibrate"]:       # `moebench calibrate`: measure this machine, write a profile
        from harness.costmodel.calibrate import main as calibrate
        sys.exit(calibrate(sys.argv[2:]))
    sys.argv = [sys.argv[0], *_sweep_dir_override(sys.argv[1:])]
    app()
    if STATE["failed_jobs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
