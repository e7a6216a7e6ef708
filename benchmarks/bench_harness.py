"""Harness overhead per job and model loads per sweep, on the tiny model.

- Per-job overhead: wall time of `harness.runner.run` (validate, workload, warm-up, repeats,
  reference check, rows, manifest, atomic writes) minus the model-load time, for jobs
  whose engine is already loaded. Target: at most 1 s.
- Loads: a sweep over three workloads at one engine configuration loads the model once
  (plus once for the `resident` reference), not once per job.

Run: `python benchmarks/bench_harness.py` (not a test; prints its figures).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

from harness import engines, results  # noqa: E402
from harness.cli import CONF_DIR  # noqa: E402
from harness.report import Reporter  # noqa: E402
from harness.runner import JobContext, run  # noqa: E402


def main() -> None:
    out = Path(tempfile.mkdtemp())
    workloads = ("chat", "long_doc", "coding_agent", "chat", "long_doc", "coding_agent")
    walls, loads_s = [], []
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for i, w in enumerate(workloads):
            cfg = compose(config_name="config", overrides=[f"workload={w}", "workload.context_tokens=3000",
                                                           "workload.gen_tokens=16", "run.repeats=1", "run.warmup=1"])
            t0 = time.perf_counter()
            run(cfg, JobContext(out / str(i), "bench", str(i)), Reporter(quiet=True))
            wall = time.perf_counter() - t0
            df = results.load(out / str(i))
            load = df[(df.phase == "load") & (df.metric == "time_s")]["value"].fillna(0).sum()
            phases = df[(df.phase != "load") & (df.metric == "time_s")]["value"].sum()
            walls.append((w, wall, load, phases))
    print(f"model loads in this process for {len(workloads)} jobs sharing one engine configuration: "
          f"{len(engines.LOADS)} (measured engine + resident reference)")
    print(f"{'job':<14}{'wall s':>9}{'load s':>9}{'phases s':>10}{'overhead s':>12}")
    for w, wall, load, phases in walls:
        print(f"{w:<14}{wall:9.3f}{load:9.3f}{phases:10.3f}{wall - load - phases:12.3f}")
    warm = [wall - load for _, wall, load, _ in walls[1:]]
    print(f"per-job wall excluding model load (jobs 2..{len(walls)}): median {statistics.median(warm):.3f} s, "
          f"max {max(warm):.3f} s; this includes one warm-up run and the measured engine work")


if __name__ == "__main__":
    main()
