"""The standard figures: a results DataFrame in, a matplotlib Figure out. No file I/O.

Owns: which rows each figure reads, how they are summarised (median over repeats, bars =
min..max over repeats), axis labels with units, and marking emulated runs on the figure -- one
module per kind of figure:

- `harness.plots.speed`: `capacity_sweep`, `ttft_by_prefix_state`
- `harness.plots.memory`: `bytes_per_token`, `overlap`, `memory_peaks`
- `harness.plots.predicted`: `measured_hit_rates`, `hit_rate_curves` (simulator), `what_if` (cost model)
- `harness.plots.frontier`: `treatment_frontier` (lossy treatments)
- `harness.plots.serving`: `load_curve` (goodput and p99 TPOT against the offered load; drawn by
  `moebench serve-sweep`, and by `moebench-plot` where the results hold serve rows)
- `harness.plots.common`: `MissingData`, the row selection and summaries they share

Does not own: how a figure looks -- the style table (one colour and marker per placement,
engine and policy), config labels, the order of configs and numeric axes, legends and titles
are `harness.plotstyle`'s, re-exported here as `STYLE_TABLE` and `style` -- nor loading results
(`harness.results.load`), writing PNGs (`moebench-plot`, `harness.analysis_cli`) or
simulation (`harness.sim`).

    from harness import plots, results
    df = results.load("results/samples")
    fig = plots.capacity_sweep(df)          # a matplotlib.figure.Figure; fig.savefig(...) to keep it

Every function raises `MissingData` (a ValueError) naming what it needed when the table
lacks it, so a caller can skip that figure with that reason. Speed figures read only
status-ok rows of un-instrumented runs (`profiler` "none" or null, DESIGN §7.5); the overlap
figure reads the instrumented `profiler="timeline"` pass, the hit-rate figure the
`profiler="trace"` pass, the treatment frontier the `profiler="quality"` pass of a sweep with a
lossy run. Figures are built without pyplot (no global state, no backend switching): they
display in a notebook and save from a script alike. In every figure a placement keeps its
colour (and, except where the marker tells lossy treatments apart, its marker); rate axes
(tok/s, GB/s, hit rate) start at zero; the legend sits below the axes.
"""
from __future__ import annotations

from collections.abc import Callable

import pandas as pd
from matplotlib.figure import Figure

from harness.plots.common import PHASE_LABELS, SPREAD, MissingData, speed_rows
from harness.plots.frontier import pareto_front, treatment_frontier
from harness.plots.memory import bytes_per_token, memory_peaks, overlap
from harness.plots.predicted import hit_rate_curves, measured_hit_rates, what_if
from harness.plots.serving import load_curve
from harness.plots.speed import capacity_sweep, ttft_by_prefix_state
from harness.plotstyle import STYLE_TABLE, style

__all__ = ["MissingData", "STANDARD", "EXPERIMENT_FIGURES", "STYLE_TABLE", "style", "PHASE_LABELS", "SPREAD",
           "capacity_sweep", "ttft_by_prefix_state", "bytes_per_token", "overlap", "memory_peaks",
           "hit_rate_curves", "measured_hit_rates", "speed_rows", "what_if", "treatment_frontier", "pareto_front",
           "load_curve"]

STANDARD: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "capacity_sweep": capacity_sweep,
    "ttft_by_prefix_state": ttft_by_prefix_state,
    "bytes_per_token": bytes_per_token,
    "overlap": overlap,
    "memory_peaks": memory_peaks,
}
# figures of rows only some results hold -- a lossy run's (experiment=kv_vs_residency), a load's serve
# pass: `moebench-plot` draws them beside the standard ones, and skips them with their reason where a
# results dir lacks their rows
EXPERIMENT_FIGURES: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "treatment_frontier": treatment_frontier,
    "load_curve": load_curve,
}
