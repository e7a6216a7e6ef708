"""The byte figures: what crosses the host-device link per token, how much of the copy time
compute hides, and the memory each phase holds at its peak.

Owns: `bytes_per_token`, `overlap` and `memory_peaks`. Does not own: row selection and
summaries (`harness.plots.common`) or styles (`harness.plotstyle`).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from harness.contract import EMULATED_OVERLAP_NOTE, PHASES
from harness.plots.common import (MIB, PHASE_LABELS, MissingData, bar_axis, byte_unit, config_columns, errorbar,
                                  mark_emulated, placement_keys, profiled, speed_rows, stats)
from harness.plotstyle import configs, fmt, from_zero, legend, ordered, shade, wrap

_HIDDEN = "hidden under compute (overlap_s): solid"
_EXPOSED = "exposed (exposed_copy_s): hatched"


def bytes_per_token(df: pd.DataFrame) -> Figure:
    """Host->device bytes per processed token (h2d_bytes / tokens of the same repeat and
    phase), one bar per config in its placement's colour, one panel per phase."""
    rows = speed_rows(df)
    keys = ["sweep_id", "job_id", "repeat", "phase"]
    h2d = rows[rows["metric"] == "h2d_bytes"].groupby(keys, dropna=False)["value"].first()
    tokens = rows[rows["metric"] == "tokens"].groupby(keys, dropna=False)["value"].first()
    per = (h2d / tokens).dropna()
    per = per[np.isfinite(per)]
    if per.empty:
        raise MissingData("bytes per token: no h2d_bytes rows with the tokens of the same repeat and phase")
    info = rows.drop_duplicates(["sweep_id", "job_id"]).set_index(["sweep_id", "job_id"])
    per = per.rename("value").reset_index().join(info.drop(columns=["repeat", "phase", "value"], errors="ignore"),
                                                 on=["sweep_id", "job_id"])
    per, series = configs(per, config_columns(per))
    phases = [p for p in PHASES if p in set(per["phase"])]
    scale, unit = byte_unit(per["value"].to_numpy())
    labels = list(series)
    fig = Figure(figsize=(3.3 * len(phases) + 2.5, 0.32 * len(labels) + 2.6), layout="constrained")
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=True)[0]
    y = np.arange(len(labels))
    for ax, phase in zip(axes, phases):
        s = stats(per[per["phase"] == phase], ["config"]).set_index("config").reindex(labels)
        med = s["median"].to_numpy(dtype=float) / scale
        err = np.vstack([med - s["lo"].to_numpy(dtype=float) / scale, s["hi"].to_numpy(dtype=float) / scale - med])
        ax.barh(y, med, xerr=err, color=[series[lab].color for lab in labels], capsize=2)
        ax.set_title(PHASE_LABELS.get(phase, phase), fontsize=9)
        ax.set_xlabel(f"h2d {unit} per token")
        ax.grid(alpha=0.3, axis="x")
    bar_axis(axes[0], labels)
    legend(fig, [], extra=placement_keys(series))
    mark_emulated(fig, per, "Bytes moved host->device per token")
    return fig


def overlap(df: pd.DataFrame) -> Figure:
    """Copy time hidden under compute (overlap_s, solid) vs exposed (exposed_copy_s, hatched),
    per config in its placement's colour and per phase, from the instrumented timeline pass;
    overlap_frac and link GB/s annotated."""
    rows = profiled(df, "timeline")
    rows = rows[rows["metric"].isin(["copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps"])]
    if rows.empty:
        raise MissingData("overlap: no profiler=timeline rows (run with run.timeline=true, the default)")
    rows, series = configs(rows, config_columns(rows))
    wide = rows.pivot_table(index=["config", "phase"], columns="metric", values="value", aggfunc="median")
    wide = wide[wide.get("copy_busy_s", pd.Series(0.0, index=wide.index)).fillna(0) > 0]
    if wide.empty:
        raise MissingData("overlap: the timeline pass recorded no copies (no placement that moves weights?)")
    phases = [p for p in PHASES if p in set(wide.index.get_level_values("phase"))]
    labels = [lab for lab in series if lab in set(wide.index.get_level_values("config"))]
    colors = [series[lab].color for lab in labels]
    fig = Figure(figsize=(3.3 * len(phases) + 2.5, 0.35 * len(labels) + 2.8), layout="constrained")
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=True)[0]
    y = np.arange(len(labels))
    for ax, phase in zip(axes, phases):
        w = wide.xs(phase, level="phase").reindex(labels)
        hidden = np.nan_to_num(w.get("overlap_s", pd.Series(np.nan, index=w.index)).to_numpy(dtype=float) * 1e3)
        exposed = np.nan_to_num(w.get("exposed_copy_s", pd.Series(np.nan, index=w.index)).to_numpy(dtype=float) * 1e3)
        ax.barh(y, hidden, color=colors, label=_HIDDEN)
        ax.barh(y, exposed, left=hidden, color=[shade(c, 0.6) for c in colors], edgecolor=colors, hatch="////",
                linewidth=0, label=_EXPOSED)
        for yi, cfg in zip(y, labels):
            frac, link = w.loc[cfg].get("overlap_frac"), w.loc[cfg].get("link_gbps")
            note = "" if frac is None or pd.isna(frac) else f"{frac:.0%}"
            if link is not None and not pd.isna(link):
                note += f" {link:.1f} GB/s"
            if note:
                ax.text(hidden[yi] + exposed[yi], yi, " " + note, va="center", fontsize=7)
        ax.set_title(PHASE_LABELS.get(phase, phase), fontsize=9)
        ax.set_xlabel("copy busy time (ms)")
        ax.grid(alpha=0.3, axis="x")
        ax.margins(x=0.18)            # room for the annotation after the longest bar
        from_zero(ax, "x")
    bar_axis(axes[0], labels)
    legend(fig, [], extra=[Patch(facecolor="0.35", label=_HIDDEN),
                           Patch(facecolor="0.85", edgecolor="0.35", hatch="////", label=_EXPOSED),
                           *placement_keys({lab: series[lab] for lab in labels})])
    mark_emulated(fig, rows, "Copy/compute overlap (instrumented timeline pass; label: overlap_frac)",
                  note=EMULATED_OVERLAP_NOTE)
    return fig


_NOT_MEASURED = "peak device memory: not measured (null on an emulated device, never 0)"


def memory_peaks(df: pd.DataFrame) -> Figure:
    """Peak host RSS and (when measured) peak device memory per phase, one line per config,
    one column per context length. On an emulated device a note says the device peak was not
    measured (null, never 0)."""
    rows = speed_rows(df)
    rows = rows[rows["metric"].isin(["peak_host_rss_bytes", "peak_device_bytes"])]
    if rows[rows["metric"] == "peak_host_rss_bytes"].empty:
        raise MissingData("memory peaks: no peak_host_rss_bytes rows")
    contexts = ordered(rows["context_tokens"]) if "context_tokens" in rows.columns else []
    contexts = contexts or [None]
    rows, series = configs(rows, config_columns(rows, exclude=("context_tokens",)))
    phases = [p for p in PHASES if p in set(rows["phase"])]
    device = not rows[rows["metric"] == "peak_device_bytes"].empty
    metrics = [("peak_host_rss_bytes", "host RSS")] + ([("peak_device_bytes", "device memory")] if device else [])
    fig = Figure(figsize=(3.8 * len(contexts) + 1.5, 3.4 * len(metrics) + 2.6), layout="constrained")
    grid = fig.add_gridspec(2, len(contexts), height_ratios=[1, 1 if device else 0.12])
    x = np.arange(len(phases))
    dodge = 0.3 / max(len(series), 1)          # configs side by side, so equal peaks do not hide each other
    axes: list[Axes] = []
    for i, (metric, what) in enumerate(metrics):
        for j, ctx in enumerate(contexts):
            ax = fig.add_subplot(grid[i, j], sharey=axes[i * len(contexts)] if j else None)
            axes.append(ax)
            sub = rows[rows["metric"] == metric]
            sub = sub if ctx is None else sub[sub["context_tokens"] == ctx]
            for k, (label, st) in enumerate(series.items()):
                g = sub[sub["config"] == label]
                if g.empty:
                    continue
                s = stats(g, ["phase"]).set_index("phase").reindex(phases)
                errorbar(ax, x + (k - (len(series) - 1) / 2) * dodge,
                         s.assign(**{c: s[c] / MIB for c in ("median", "lo", "hi")}), label, st, markersize=4)
            ax.set_xticks(x, [PHASE_LABELS[p] for p in phases], rotation=30, ha="right", rotation_mode="anchor",
                          fontsize=8)
            ax.set_title(f"peak {what}" + (f", context {fmt(ctx)} tokens" if ctx is not None else ""), fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(f"peak {what} (MiB)")
    if not device:
        note = fig.add_subplot(grid[1, :])
        note.set_axis_off()
        note.text(0.5, 0.5, wrap(_NOT_MEASURED, fig.get_figwidth() * 0.9, 10), ha="center", va="center",
                  transform=note.transAxes)
    legend(fig, axes)
    mark_emulated(fig, rows, "Memory peaks per phase")
    return fig
