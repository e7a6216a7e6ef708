"""The speed figures: decode rate and TTFT against expert-cache capacity, and TTFT by the state
of the prefix (fresh, continued on the device, restored from host RAM).

Owns: `capacity_sweep` and `ttft_by_prefix_state`. Does not own: row selection and summaries
(`harness.plots.common`) or styles (`harness.plotstyle`).
"""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from harness.contract import PREFILL_PHASES
from harness.plots.common import (PHASE_LABELS, MissingData, auto_log, bar_axis, capacity_positions, config_columns,
                                  errorbar, mark_emulated, speed_rows, stats)
from harness.plotstyle import configs, fmt, from_zero, legend, numeric_positions, ordered, set_ticks, shade, wrap

# capacity_sweep's panels: (phase, metric, y label); the title names both quantities
CAPACITY_PANELS = (("decode", "tok_per_s", "decode tok/s\n(higher is better)"),
                   ("prefill_fresh", "ttft_s", "fresh-prefill TTFT, s\n(lower is better)"))
CAPACITY_AXIS = "expert-cache capacity"
# ttft_by_prefix_state: each prefill phase in its config's colour, told apart by shade and line
_PHASE_LOOK = {"prefill_fresh": (0.0, "-"), "prefill_continuation": (-0.4, "--"), "prefill_restored": (0.45, ":")}


def capacity_sweep(df: pd.DataFrame) -> Figure:
    """Decode tok/s and fresh-prefill TTFT vs expert-cache slots per layer, one line per
    placement (and other varying factors); placements without a cache as a reference line
    with its min..max band. One column per context length. A sweep of one capacity is drawn
    as bars, one per config (and titled so: per config, not vs capacity)."""
    rows = speed_rows(df)
    rows = rows[((rows["phase"] == "decode") & (rows["metric"] == "tok_per_s"))
                | ((rows["phase"] == "prefill_fresh") & (rows["metric"] == "ttft_s"))]
    if rows[rows["cache_capacity"].notna()].empty:     # the factor is set only where the placement keeps a cache
        raise MissingData("capacity sweep: no decode tok_per_s / prefill_fresh ttft_s rows of a placement with an "
                          "expert cache (a cache_capacity factor)")
    x, ticks = capacity_positions(rows)
    rows = rows.assign(capacity=x)
    contexts = ordered(rows["context_tokens"]) or [None]
    rows, series = configs(rows, config_columns(rows, exclude=("cache_capacity", "context_tokens")))
    single = rows["capacity"].nunique() == 1
    fig = Figure(figsize=(4.2 * len(contexts) + 1.5, 7.0), layout="constrained")
    axes = fig.subplots(2, len(contexts), squeeze=False, sharex=True)
    for j, ctx in enumerate(contexts):
        at_ctx = rows if ctx is None else rows[rows["context_tokens"] == ctx]
        for i, (phase, metric, ylabel) in enumerate(CAPACITY_PANELS):
            ax = axes[i, j]
            sub = at_ctx[(at_ctx["phase"] == phase) & (at_ctx["metric"] == metric)]
            for k, (label, st) in enumerate(series.items()):
                g = sub[sub["config"] == label]
                if g.empty:
                    continue
                s = stats(g, ["capacity"])
                if single:
                    yerr = [[s["median"].iloc[0] - s["lo"].iloc[0]], [s["hi"].iloc[0] - s["median"].iloc[0]]]
                    ax.bar(k, s["median"].iloc[0], yerr=yerr, color=st.color, capsize=3, label=label)
                elif g["capacity"].notna().any():
                    errorbar(ax, s["capacity"], s, label, st)
                else:
                    ref = f"{label}, no expert cache (band: min..max)"
                    ax.axhline(s["median"].iloc[0], color=st.color, linestyle="--", label=ref)
                    ax.axhspan(s["lo"].iloc[0], s["hi"].iloc[0], color=st.color, alpha=0.15, label=ref)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if not single and metric == "ttft_s":
                auto_log(ax, sub["value"])
            from_zero(ax)
            if i == 0:
                ax.set_title(f"context {fmt(ctx)} tokens" if ctx is not None else "")
        if single:
            bar_axis(axes[1, j], list(series), axis="x")
            axes[1, j].set_xlabel(wrap(f"config (cache placements at {next(iter(ticks.values()))} slots per layer)",
                                       4.0, 10))
        else:
            set_ticks(axes[1, j], ticks)
            axes[1, j].set_xlabel(f"{CAPACITY_AXIS} (slots per layer)")
    legend(fig, axes.ravel())
    mark_emulated(fig, rows, "Decode rate and TTFT " + ("per config" if single else f"vs {CAPACITY_AXIS}"))
    return fig


def ttft_by_prefix_state(df: pd.DataFrame) -> Figure:
    """TTFT vs context length for fresh prefill, continuation (KV still on the device) and
    restored session (KV back from host RAM); one panel per config, drawn in its placement's
    colour, the three prefill states told apart by shade and line style."""
    rows = speed_rows(df)
    rows = rows[rows["phase"].isin(PREFILL_PHASES) & (rows["metric"] == "ttft_s")]
    if rows.empty or rows["context_tokens"].isna().all():
        raise MissingData("ttft by prefix state: no prefill ttft_s rows with a context_tokens factor")
    rows, series = configs(rows, config_columns(rows, exclude=("context_tokens",)))
    x, ticks = numeric_positions(rows["context_tokens"])
    rows = rows.assign(ctx=x)
    ncols = min(4, len(series))
    nrows = -(-len(series) // ncols)
    fig = Figure(figsize=(3.4 * ncols + 1.0, 2.7 * nrows + 1.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
    for ax, (label, st) in zip(axes.ravel(), series.items()):
        sub = rows[rows["config"] == label]
        for phase, (amount, linestyle) in _PHASE_LOOK.items():
            s = stats(sub[sub["phase"] == phase], ["ctx"])
            if len(s):
                errorbar(ax, s["ctx"], s, PHASE_LABELS[phase], st, color=shade(st.base.color, amount),
                         linestyle=linestyle)
        ax.set_title(wrap(label, 3.2, 9), fontsize=9, color=shade(st.base.color, -0.3))
        ax.grid(alpha=0.3)
        set_ticks(ax, ticks)
    for ax in axes[:, 0]:
        ax.set_ylabel("TTFT (s)")
    for ax in axes.ravel()[len(series):]:
        ax.set_visible(False)
    for col in range(ncols):            # the lowest panel of each column carries the x axis
        lowest = axes[(len(series) - 1 - col) // ncols, col]
        lowest.xaxis.set_tick_params(labelbottom=True)
        lowest.set_xlabel("context length (tokens)")
    auto_log(axes[0, 0], rows["value"])      # shared y: one call sets every panel
    from_zero(axes[0, 0])
    legend(fig, [], extra=[Line2D([], [], color=shade("#404040", amount), linestyle=ls, marker="o",
                                  label=PHASE_LABELS[p]) for p, (amount, ls) in _PHASE_LOOK.items()])
    mark_emulated(fig, rows, "TTFT: fresh prefill vs prefix-cache continuation vs restored session")
    return fig
