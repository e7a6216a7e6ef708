"""Serving under load on the default model, CPU: the harness's own time per request, and a rate
sweep with Poisson arrivals on both engines and two placements each.

- Overhead: a 64-request Poisson load (16 requests/s, at most 4 in flight, 128-token prompts,
  16-token replies) on our engine and on llama-server; the serve pass's
  `harness_overhead_s_per_request` (ours: the client loop's wall time outside the engine's steps;
  llama-server: the client process's CPU time while the requests are served) against the target
  of 1 ms.
- Rate sweep: `load.rate` = 2, 4, 8, 16 requests/s, ours with `placement=resident` and `fetch`
  (4 slots), llama.cpp with every expert resident and with `--cpu-moe`: completed requests/s,
  p99 TTFT and p99 TPOT per step. On the CPU these are the CPU's figures (ours on the emulated
  device): compare them within one run.

Run: `python benchmarks/bench_serving.py [--skip-llamacpp] [--overhead-only] [--repeats N]` (not a
test; prints its figures; exit 1 when an overhead's median is over the target). Needs llama.cpp built
(`make llamacpp`) unless skipped. `--overhead-only` skips the rate sweep (its 16 jobs, most of the
time); `--repeats N` runs each overhead job N times and prints every figure and their median (the
figure is CPU time on cores the server shares: on a busy machine it moves from run to run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import results  # noqa: E402
from harness.contract import served_summary_rows  # noqa: E402

TARGET_S = 1e-3
COMMON = ["workload=chat", "workload.context_tokens=256", "run.repeats=1", "run.warmup=0", "run.quiet=true",
          "run.passes=[speed,serve]", "load=poisson", "load.warmup_requests=4", "load.max_concurrency=4",
          "load.input_len=128", "load.output_len=16"]
ENGINES = {"ours resident": ["placement=resident"], "ours fetch 4": ["placement=fetch", "cache.capacity=4"],
           "llama.cpp resident": ["engine=llamacpp"], "llama.cpp --cpu-moe": ["engine=llamacpp", "engine.cpu_moe=true"]}


def serve(args: list[str], out: Path) -> dict[str, float]:
    """One job; its serving summary (client source) by metric."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *COMMON, *args, f"run.out={out}"], env=env,
                          capture_output=True, text=True)
    runs = sorted((out / "runs").glob("*"))
    if not runs:
        raise SystemExit(f"no run for {args}: {proc.stderr[-2000:]}")
    df = results.load(runs[-1])
    rows = served_summary_rows(df)
    rows = rows[rows.source == "client"]
    if rows.empty:
        raise SystemExit(f"no serving summary for {args}: {df[df.status == 'failed'].error.tolist()}")
    return rows.set_index("metric")["value"].to_dict()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-llamacpp", action="store_true", help="ours only")
    p.add_argument("--overhead-only", action="store_true", help="the harness overhead only, no rate sweep")
    p.add_argument("--repeats", type=int, default=1, help="runs of each overhead job (default 1); the median is judged")
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    engines = {k: v for k, v in ENGINES.items() if not (a.skip_llamacpp and "llama" in k)}
    tmp, code = Path(tempfile.mkdtemp(prefix="moebench-bench-serving-")), 0
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    median_of = f", median of {a.repeats} runs" if a.repeats > 1 else ""
    print(f"harness overhead per request, 64 requests at 16 req/s (target <= 1 ms{median_of}):")
    for name in (n for n in engines if "fetch" not in n and "cpu-moe" not in n):
        runs = [serve([*engines[name], "load.rate=16", "load.requests=64"],
                      tmp / f"overhead-{name.replace(' ', '_')}-{i}")["harness_overhead_s_per_request"]
                for i in range(a.repeats)]
        over = statistics.median(runs)
        code |= over > TARGET_S
        each = f"  (runs: {', '.join(f'{r * 1e3:.3f}' for r in runs)})" if len(runs) > 1 else ""
        print(f"  {name:<22} {over * 1e3:.3f} ms  {'ok' if over <= TARGET_S else 'OVER TARGET'}{each}")
    if a.overhead_only:
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return code
    print("rate sweep, 32 requests each: completed req/s | p99 TTFT ms | p99 TPOT ms")
    for name, args in engines.items():
        cells = []
        for rate in (2, 4, 8, 16):
            s = serve([*args, f"load.rate={rate}", "load.requests=32"], tmp / f"{name.replace(' ', '_')}-{rate}")
            cells.append(f"{rate:>2}/s: {s['request_throughput']:.2f} | {s['ttft_s_p99'] * 1e3:.1f} | "
                         f"{s['tpot_s_p99'] * 1e3:.2f}")
        print(f"  {name:<22} " + "   ".join(cells))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return code


if __name__ == "__main__":
    sys.exit(main())
