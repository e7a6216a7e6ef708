"""Harness overhead per job and model loads per sweep, on the tiny model.

- Per-job overhead: wall time of `harness.runner.run` minus the model load and minus the
  time spent inside the scenario's engine passes (every `run_repeat`: warm-up, repeats,
  reference, ablation and timeline passes) -- what remains is the harness's own work:
  validation, workload building, the numerical check, rows, manifest, atomic Parquet
  writes. Target: at most 1 s.
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

from harness import engines, results, runner  # noqa: E402
from harness.profiling import passes  # noqa: E402
from harness.cli import CONF_DIR  # noqa: E402
from harness.report import Reporter  # noqa: E402
from harness.runner import JobContext, run  # noqa: E402


ENGINE_S = [0.0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ENGINE_S[0] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    runner.run_repeat = _timed(runner.run_repeat)          # every engine pass the runner makes
    passes.run_repeat = _timed(passes.run_repeat)
    out = Path(tempfile.mkdtemp())
    workloads = ("chat", "long_doc", "coding_agent", "chat", "long_doc", "coding_agent")
    walls = []
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for i, w in enumerate(workloads):
            cfg = compose(config_name="config", overrides=[f"workload={w}", "workload.context_tokens=3000",
                                                           "workload.gen_tokens=16", "run.repeats=1", "run.warmup=1"])
            ENGINE_S[0] = 0.0
            t0 = time.perf_counter()
            run(cfg, JobContext(out / str(i), "bench", str(i)), Reporter(quiet=True))
            wall = time.perf_counter() - t0
            df = results.load(out / str(i))
            load = df[(df.phase == "load") & (df.metric == "time_s")]["value"].fillna(0).sum()
            walls.append((w, wall, load, ENGINE_S[0]))
    print(f"model loads in this process for {len(workloads)} jobs sharing one engine configuration: "
          f"{len(engines.LOADS)} (measured engine + resident reference)")
    print(f"{'job':<14}{'wall s':>9}{'load s':>9}{'engine s':>10}{'overhead s':>12}")
    for w, wall, load, eng in walls:
        print(f"{w:<14}{wall:9.3f}{load:9.3f}{eng:10.3f}{wall - load - eng:12.3f}")
    over = [wall - load - eng for _, wall, load, eng in walls]
    print(f"harness overhead per job (wall - model load - engine passes): median {statistics.median(over):.3f} s, "
          f"max {max(over):.3f} s (target <= 1 s)")


if __name__ == "__main__":
    main()
