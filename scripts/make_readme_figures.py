"""Make the guide's figures (docs/*.png) from real runs (nothing here is drawn from made-up numbers).

1. docs/timeline.png: the Perfetto trace of one `moebench ... run.trace=true` job, drawn
   with matplotlib (compute and copy rows, phase bands), zoomed on a few decode steps.
2. docs/cache_curve.png: the LRU hit-rate curve for every capacity (stack distances) and the
   belady bound, replayed from a routing trace the engine recorded, with the engine's own
   measured hit rates for fetch+lru at several capacities on the same prompt on top.
3. docs/samples_capacity_sweep.png: `harness.plots.capacity_sweep` of the committed sample
   results (what `moebench-plot results/samples --only capacity_sweep` writes), no run needed.

Run: `python scripts/make_readme_figures.py` (about a minute on 2 cores), or name the figures
to make: `python scripts/make_readme_figures.py samples`. Prints the numbers it plotted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.trace import load_trace  # noqa: E402
from harness import plots, results  # noqa: E402
from harness.analysis_cli import plot_parser  # noqa: E402
from harness.sim.replay import lru_curve, replay  # noqa: E402

COMMON = ["workload=chat", "workload.context_tokens=1024", "workload.gen_tokens=48", "run.quiet=true"]


def moebench(args: list[str], out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "harness.cli", *args, f"run.out={out}"], check=True, env=env)


def timeline_figure(out: Path, dest: Path) -> None:
    moebench(["placement=fetch", "cache.capacity=2", "prefetch=next_layer_gate", "run.repeats=1",
              "run.trace=true", "run.ablation=false", *COMMON], out)
    job = next((out / "runs").iterdir())
    trace = json.loads((job / "trace.json").read_text())
    ev = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    decode = next(e for e in ev if e["cat"] == "phase" and e["name"] == "decode")
    mid = decode["ts"] + decode["dur"] * 0.5
    first_copy = min((e["ts"] for e in ev if e["cat"] == "copy" and e["ts"] >= mid), default=mid)
    t0 = max(decode["ts"], first_copy - 500)
    t1 = t0 + 3000          # 3 ms of decode, from just before a copy half-way through
    fig, ax = plt.subplots(figsize=(11, 2.6))
    rows = {"layer": 2.0, "expert": 1.0, "attention": 1.0, "router": 1.0, "copy": 0.0}
    colors = {"layer": "#d9d9f3", "expert": "#f28e2b", "attention": "#59a14f", "router": "#edc948", "copy": "#e15759"}
    for e in ev:
        if e["cat"] not in rows or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
        ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3)], (rows[e["cat"]] - 0.4, 0.8),
                       facecolors=colors[e["cat"]], edgecolor="white", linewidth=0.3)
    ax.set_yticks([0, 1, 2], ["copies (worker)", "attention / router / expert", "layer"])
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("time (ms), a 3 ms window of the decode phase")
    ax.set_title("moebench timeline: fetch, 2 slots/layer, next_layer_gate prefetch, tiny-mixtral, "
                 "emulated device (CPU)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in ("attention", "router", "expert", "copy")]
    ax.legend(handles, ["attention", "router", "expert", "copy"], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(dest, dpi=130)
    df = results.load(job)
    tl = df[(df.profiler == "timeline")].pivot_table(index="phase", columns="metric", values="value")
    print(tl[["copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "prefetch_issued", "prefetch_used"]])


def cache_curve_figure(out: Path, dest: Path) -> None:
    moebench(["placement=resident", "run.repeats=1", "run.record_trace=true", "run.ablation=false",
              "run.timeline=false", *COMMON], out / "trace")
    job = next((out / "trace" / "runs").iterdir())
    trace = load_trace(job / "routing.npz")
    curve = lru_curve(trace)
    curve = curve[curve.layer == "all"]
    bound = replay(trace, ["belady"], list(range(trace.top_k, trace.n_experts + 1)))   # the capacities the engine runs
    bound = bound[bound.layer == "all"]
    moebench(["-m", "placement=fetch", "cache.policy=lru", "cache.capacity=2,3,4,5,6,7,8", "run.repeats=1",
              "run.ablation=false", "run.timeline=false", "run.sweep_id=curve", *COMMON], out / "sweep")
    df = results.load(out / "sweep" / "sweeps" / "curve")
    df = df[(df.profiler == "none") & (df.metric.isin(["expert_hits", "expert_misses"]))]
    sums = df.groupby(["cache_capacity", "metric"])["value"].sum().unstack()
    measured = (sums["expert_hits"] / (sums["expert_hits"] + sums["expert_misses"])).rename(int)
    measured.index = measured.index.astype(int)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve.capacity, curve.hit_rate, "-", label="LRU, simulated (stack distances, one pass)")
    ax.plot(bound.capacity, bound.hit_rate, "--", label="belady (offline optimum), simulated")
    ax.plot(measured.index, measured.values, "o", label="fetch+lru, measured in the engine")
    ax.set_xlabel("expert cache capacity (slots per layer)")
    ax.set_ylabel("hit rate (hits / lookups)")
    ax.set_title("tiny-mixtral, chat @1024 + 48 generated, one repeat\n(trace recorded by the engine; "
                 "emulated device)", fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=130)
    print("capacity, LRU sim, belady sim, measured:")
    for c in range(2, 9):
        print(c, round(float(curve[curve.capacity == c].hit_rate.iloc[0]), 4),
              round(float(bound[bound.capacity == c].hit_rate.iloc[0]), 4), round(float(measured.get(c)), 4))


def samples_figure(dest: Path) -> None:
    fig = plots.capacity_sweep(results.load(REPO / "results" / "samples"))
    fig.savefig(dest, dpi=plot_parser().get_default("dpi"))      # as moebench-plot writes it
    print(f"wrote {dest}")


FIGURES = ("timeline", "cache_curve", "samples")


def main() -> None:
    p = argparse.ArgumentParser(description="Make the guide's figures (docs/*.png).")
    # no `choices=`: Python 3.11's argparse checks an empty positional list against them and refuses it
    p.add_argument("figures", nargs="*", help=f"any of {', '.join(FIGURES)} (default: all)")
    which = p.parse_args().figures or FIGURES
    if set(which) - set(FIGURES):
        p.error(f"figures: allowed {', '.join(FIGURES)}, got {', '.join(sorted(set(which) - set(FIGURES)))}")
    docs = REPO / "docs"
    docs.mkdir(exist_ok=True)
    if "samples" in which:
        samples_figure(docs / "samples_capacity_sweep.png")
    with tempfile.TemporaryDirectory() as d:
        if "timeline" in which:
            timeline_figure(Path(d) / "timeline", docs / "timeline.png")
        if "cache_curve" in which:
            cache_curve_figure(Path(d) / "curve", docs / "cache_curve.png")


if __name__ == "__main__":
    main()
