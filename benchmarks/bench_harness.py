"""Harness overhead per job and model loads per sweep, on the tiny model.

- Per-job overhead: wall time of `harness.runner.run` minus the model load, minus the
  time spent inside the scenario's engine repeats (every `run_repeat` of the passes: warm-up,
  repeats, ablation and timeline) and minus building the CPU reference (a load and one repeat,
  once per prompt: later jobs with the same prompt reuse it) -- what remains is the
  harness's own work: validation, workload building, the machine-load samples, the numerical
  check, rows, manifest, atomic Parquet writes. Target: at most 1 s.
- Loads: a sweep over three workloads at one engine configuration loads the measured model
  once, not once per job.

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

from harness import results, runner  # noqa: E402
from harness.cli import CONF_DIR  # noqa: E402
from harness.passes import ablation, speed, timeline, torch_profile, trace  # noqa: E402
from harness.report import Reporter  # noqa: E402
from harness.runner import JobContext, run  # noqa: E402
from harness.session import RunSession  # noqa: E402


SPENT = {"engine": 0.0, "reference": 0.0}


def _timed(fn, bucket: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[bucket] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    for module in (speed, timeline, trace, torch_profile, ablation):   # every engine repeat a pass makes
        module.run_repeat = _timed(module.run_repeat, "engine")
    runner.reference_for = _timed(runner.reference_for, "reference")
    session = RunSession()                                             # the jobs of one run: the engine reused
    out = Path(tempfile.mkdtemp())
    workloads = ("chat", "long_doc", "coding_agent", "chat", "long_doc", "coding_agent")
    walls = []
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for i, w in enumerate(workloads):
            cfg = compose(config_name="config", overrides=[f"workload={w}", "workload.context_tokens=3000",
                                                           "workload.gen_tokens=16", "run.repeats=1", "run.warmup=1"])
            SPENT.update(engine=0.0, reference=0.0)
            t0 = time.perf_counter()
            run(cfg, JobContext(out / str(i), "bench", str(i)), Reporter(quiet=True), session)
            wall = time.perf_counter() - t0
            df = results.load(out / str(i))
            load = df[(df.phase == "load") & (df.metric == "time_s")]["value"].fillna(0).sum()
            walls.append((w, wall, load, SPENT["engine"], SPENT["reference"]))
    print(f"measured-engine loads in this process for {len(workloads)} jobs sharing one engine configuration: "
          f"{len(session.engines.loads)}")
    print(f"{'job':<14}{'wall s':>9}{'load s':>9}{'engine s':>10}{'reference s':>13}{'overhead s':>12}")
    for w, wall, load, eng, ref in walls:
        print(f"{w:<14}{wall:9.3f}{load:9.3f}{eng:10.3f}{ref:13.3f}{wall - load - eng - ref:12.3f}")
    over = [wall - load - eng - ref for _, wall, load, eng, ref in walls]
    print(f"harness overhead per job (wall - model load - engine passes - reference): median "
          f"{statistics.median(over):.3f} s, max {max(over):.3f} s (target <= 1 s)")


if __name__ == "__main__":
    main()
