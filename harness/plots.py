"""The standard figures: a results DataFrame in, a matplotlib Figure out. No file I/O.

Owns: which rows each figure reads, how they are summarised (median over repeats, bars =
min..max over repeats), axis labels with units, and marking emulated runs on the figure.
Does not own: how a figure looks -- the style table (one colour and marker per placement,
engine and policy), the order of configs and numeric axes, legends and titles are
`harness.plotstyle`'s, re-exported here as `STYLE_TABLE` and `style` -- nor loading results
(`harness.results.load`), writing PNGs (`moebench-plot`, `harness.analysis_cli`) or
simulation (`harness.sim`).

    from harness import plots, results
    df = results.load("results/samples")
    fig = plots.capacity_sweep(df)          # a matplotlib.figure.Figure; fig.savefig(...) to keep it

Every function raises `MissingData` (a ValueError) naming what it needed when the table
lacks it, so a caller can skip that figure. Speed figures read only status-ok rows of
un-instrumented runs (`profiler` "none" or null, DESIGN §7.5); the overlap figure reads the
instrumented `profiler="timeline"` pass, the hit-rate figure the `profiler="trace"` pass.
Figures are built without pyplot (no global state, no backend switching): they display in
a notebook and save from a script alike. In every figure a placement keeps its colour and
marker; rate axes (tok/s, GB/s, hit rate) start at zero; the legend sits below the axes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from harness import contract
from harness.contract import EMULATED_OVERLAP_NOTE, METRIC_UNITS, PHASES, PREFILL_PHASES
from harness.plotstyle import (STYLE_TABLE, Series, configs, fmt, from_zero, is_rate, legend, numeric_positions,
                               ordered, set_ticks, shade, style, suptitle, wrap)
from harness.results import CONFIG_COLUMNS

__all__ = ["MissingData", "STANDARD", "EXPERIMENT_FIGURES", "STYLE_TABLE", "style", "capacity_sweep", "ttft_by_prefix_state",
           "bytes_per_token", "overlap", "memory_peaks", "hit_rate_curves", "measured_hit_rates", "speed_rows",
           "what_if", "treatment_frontier"]

PHASE_LABELS = {"load": "load", "prefill_fresh": "fresh prefill", "decode": "decode",
                "prefill_continuation": "continuation (KV on device)", "prefill_restored": "restored (KV from host)",
                "kv_offload": "KV offload"}
SPREAD = "median over repeats; bars: min..max"
_MIB = 2.0**20
# ttft_by_prefix_state: each prefill phase in its config's colour, told apart by shade and line
_PHASE_LOOK = {"prefill_fresh": (0.0, "-"), "prefill_continuation": (-0.4, "--"), "prefill_restored": (0.45, ":")}


class MissingData(ValueError):
    """The table lacks the rows a figure needs (the message says which)."""


# ----------------------------------------------------------------------------- row selection

speed_rows = contract.speed_values      # the contract's speed rows that hold a value


def _profiled(df: pd.DataFrame, profiler: str) -> pd.DataFrame:
    if "profiler" not in df.columns:
        return df.iloc[0:0]
    return df[(df["status"] == "ok") & (df["profiler"] == profiler)]


def _config_columns(df: pd.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    """Config columns that vary in `df` (placement always), minus `exclude`: what tells series
    apart. Also `source` where one metric of one phase comes from both (llama.cpp times a decode
    as the client sees it and by its own clock; its RSS is the harness's or the server's), so
    that no series pools the two (DESIGN §5)."""
    cols = [c for c in CONFIG_COLUMNS if c in df.columns and c not in exclude
            and (c == "placement" or df[c].nunique(dropna=True) > 1)]
    both = "source" in df.columns and (df.groupby(["phase", "metric"])["source"].nunique() > 1).any()
    return [*cols, "source"] if both else cols


def _stats(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """median, min, max and count of `value` per key (NaN keys kept)."""
    g = df.groupby(list(keys), dropna=False, sort=True)["value"]
    return g.agg(median="median", lo="min", hi="max", n="count").reset_index()


def _capacity_positions(df: pd.DataFrame) -> tuple[pd.Series, dict[float, str]]:
    """Slots per layer on a numeric axis: the requested capacity, the resolved one for "auto",
    and an unresolved text value after the largest number; NaN where the placement has no cache."""
    req = df["cache_capacity"].astype(object)
    if "resolved_capacity" in df.columns:
        resolved = pd.to_numeric(df["resolved_capacity"], errors="coerce")
        req = req.where(pd.to_numeric(req, errors="coerce").notna() | resolved.isna(), resolved)
    return numeric_positions(req.where(req.notna(), None))


def _mark_emulated(fig: Figure, df: pd.DataFrame, title: str, note: str | None = None) -> None:
    emulated = df["emulated"].astype("boolean") if "emulated" in df.columns else pd.Series(dtype="boolean")
    if emulated.fillna(False).all() and len(emulated):
        title += f"  [{note or 'emulated device: the CPU stands in for the GPU; no link speed or device memory'}]"
    elif emulated.fillna(False).any():
        title += "  [some runs on an emulated device]"
    devices = sorted({str(d) for d in df.get("device_name", pd.Series(dtype=object)).dropna().unique()})
    suptitle(fig, f"{title}\n" + ("device: " + ", ".join(devices) + "; " if devices else "") + SPREAD)


def _auto_log(ax: Axes, values: Sequence[float]) -> None:
    """Log scale only when the values span more than 20x."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0], dtype=float)
    if len(v) and v.max() / v.min() > 20:
        ax.set_yscale("log")


def _errorbar(ax: Axes, x: Sequence[float], s: pd.DataFrame, label: str, st: Series, **kw) -> None:
    med = s["median"].to_numpy(dtype=float)
    yerr = np.vstack([med - s["lo"].to_numpy(dtype=float), s["hi"].to_numpy(dtype=float) - med])
    look = {"color": st.color, "marker": st.marker, "linestyle": st.linestyle, **kw}
    ax.errorbar(x, med, yerr=yerr, capsize=3, label=label, **look)


def _keys(series: dict[str, Series]) -> list[Patch]:
    """Legend keys for bar charts whose bars are named by their tick labels: one per placement/engine."""
    seen = {(st.kind, st.name): st.base for st in series.values()}
    return [Patch(facecolor=base.color, label=name) for (_, name), base in seen.items()]


def _bar_axis(ax: Axes, labels: Sequence[str], axis: str = "y") -> None:
    if axis == "y":
        ax.set_yticks(np.arange(len(labels)), [wrap(lab, 2.4, 8) for lab in labels], fontsize=8)
        ax.invert_yaxis()
    else:
        ax.set_xticks(np.arange(len(labels)), labels, rotation=30, ha="right", fontsize=8)


def _byte_unit(values: Sequence[float]) -> tuple[float, str]:
    top = float(np.nanmax(values)) if len(values) else 0.0
    for scale, unit in ((2.0**30, "GiB"), (_MIB, "MiB"), (2.0**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1.0, "B"


# ----------------------------------------------------------------------------- figures

def capacity_sweep(df: pd.DataFrame) -> Figure:
    """Decode tok/s and fresh-prefill TTFT vs expert-cache slots per layer, one line per
    placement (and other varying factors); placements without a cache as a reference line
    with its min..max band. One column per context length. A sweep of one capacity is drawn
    as bars, one per config."""
    rows = speed_rows(df)
    rows = rows[((rows["phase"] == "decode") & (rows["metric"] == "tok_per_s"))
                | ((rows["phase"] == "prefill_fresh") & (rows["metric"] == "ttft_s"))]
    if rows[rows["cache_capacity"].notna()].empty:     # the factor is set only where the placement keeps a cache
        raise MissingData("capacity sweep: no decode tok_per_s / prefill_fresh ttft_s rows of a placement with an "
                          "expert cache (a cache_capacity factor)")
    x, ticks = _capacity_positions(rows)
    rows = rows.assign(capacity=x)
    contexts = ordered(rows["context_tokens"]) or [None]
    rows, series = configs(rows, _config_columns(rows, exclude=("cache_capacity", "context_tokens")))
    single = rows["capacity"].nunique() == 1
    fig = Figure(figsize=(4.2 * len(contexts) + 1.5, 7.0), layout="constrained")
    axes = fig.subplots(2, len(contexts), squeeze=False, sharex=True)
    panels = (("decode", "tok_per_s", "decode tok/s (higher is better)"),
              ("prefill_fresh", "ttft_s", "fresh-prefill TTFT, s (lower is better)"))
    for j, ctx in enumerate(contexts):
        at_ctx = rows if ctx is None else rows[rows["context_tokens"] == ctx]
        for i, (phase, metric, ylabel) in enumerate(panels):
            ax = axes[i, j]
            sub = at_ctx[(at_ctx["phase"] == phase) & (at_ctx["metric"] == metric)]
            for k, (label, st) in enumerate(series.items()):
                g = sub[sub["config"] == label]
                if g.empty:
                    continue
                s = _stats(g, ["capacity"])
                if single:
                    yerr = [[s["median"].iloc[0] - s["lo"].iloc[0]], [s["hi"].iloc[0] - s["median"].iloc[0]]]
                    ax.bar(k, s["median"].iloc[0], yerr=yerr, color=st.color, capsize=3, label=label)
                elif g["capacity"].notna().any():
                    _errorbar(ax, s["capacity"], s, label, st)
                else:
                    ref = f"{label} (no expert cache; band: min..max)"
                    ax.axhline(s["median"].iloc[0], color=st.color, linestyle="--", label=ref)
                    ax.axhspan(s["lo"].iloc[0], s["hi"].iloc[0], color=st.color, alpha=0.15, label=ref)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if not single and metric == "ttft_s":
                _auto_log(ax, sub["value"])
            from_zero(ax)
            if i == 0:
                ax.set_title(f"context {fmt(ctx)} tokens" if ctx is not None else "")
        if single:
            _bar_axis(axes[1, j], list(series), axis="x")
            axes[1, j].set_xlabel(wrap(f"config (cache placements at {next(iter(ticks.values()))} slots per layer)",
                                       4.0, 10))
        else:
            set_ticks(axes[1, j], ticks)
            axes[1, j].set_xlabel("expert-cache capacity (slots per layer)")
    legend(fig, axes.ravel())
    _mark_emulated(fig, rows, "Decode rate and TTFT vs expert-cache capacity")
    return fig


def ttft_by_prefix_state(df: pd.DataFrame) -> Figure:
    """TTFT vs context length for fresh prefill, continuation (KV still on the device) and
    restored session (KV back from host RAM); one panel per config, drawn in its placement's
    colour, the three prefill states told apart by shade and line style."""
    rows = speed_rows(df)
    rows = rows[rows["phase"].isin(PREFILL_PHASES) & (rows["metric"] == "ttft_s")]
    if rows.empty or rows["context_tokens"].isna().all():
        raise MissingData("ttft by prefix state: no prefill ttft_s rows with a context_tokens factor")
    rows, series = configs(rows, _config_columns(rows, exclude=("context_tokens",)))
    x, ticks = numeric_positions(rows["context_tokens"])
    rows = rows.assign(ctx=x)
    ncols = min(4, len(series))
    nrows = -(-len(series) // ncols)
    fig = Figure(figsize=(3.4 * ncols + 1.0, 2.7 * nrows + 1.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
    for ax, (label, st) in zip(axes.ravel(), series.items()):
        sub = rows[rows["config"] == label]
        for phase, (amount, linestyle) in _PHASE_LOOK.items():
            s = _stats(sub[sub["phase"] == phase], ["ctx"])
            if len(s):
                _errorbar(ax, s["ctx"], s, PHASE_LABELS[phase], st, color=shade(st.base.color, amount),
                          linestyle=linestyle)
        ax.set_title(wrap(label, 3.2, 9), fontsize=9, color=shade(st.base.color, -0.3))
        ax.grid(alpha=0.3)
        set_ticks(ax, ticks)
    for ax in axes[-1]:
        ax.set_xlabel("context length (tokens)")
    for ax in axes[:, 0]:
        ax.set_ylabel("TTFT (s)")
    for ax in axes.ravel()[len(series):]:
        ax.set_visible(False)
    _auto_log(axes[0, 0], rows["value"])      # shared y: one call sets every panel
    from_zero(axes[0, 0])
    legend(fig, [], extra=[Line2D([], [], color=shade("#404040", amount), linestyle=ls, marker="o",
                                  label=PHASE_LABELS[p]) for p, (amount, ls) in _PHASE_LOOK.items()])
    _mark_emulated(fig, rows, "TTFT: fresh prefill vs prefix-cache continuation vs restored session")
    return fig


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
    per, series = configs(per, _config_columns(per))
    phases = [p for p in PHASES if p in set(per["phase"])]
    scale, unit = _byte_unit(per["value"].to_numpy())
    labels = list(series)
    fig = Figure(figsize=(3.3 * len(phases) + 2.5, 0.32 * len(labels) + 2.6), layout="constrained")
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=True)[0]
    y = np.arange(len(labels))
    for ax, phase in zip(axes, phases):
        s = _stats(per[per["phase"] == phase], ["config"]).set_index("config").reindex(labels)
        med = s["median"].to_numpy(dtype=float) / scale
        err = np.vstack([med - s["lo"].to_numpy(dtype=float) / scale, s["hi"].to_numpy(dtype=float) / scale - med])
        ax.barh(y, med, xerr=err, color=[series[lab].color for lab in labels], capsize=2)
        ax.set_title(PHASE_LABELS.get(phase, phase), fontsize=9)
        ax.set_xlabel(f"h2d {unit} per token")
        ax.grid(alpha=0.3, axis="x")
    _bar_axis(axes[0], labels)
    legend(fig, [], extra=_keys(series))
    _mark_emulated(fig, per, "Bytes moved host->device per token")
    return fig


_HIDDEN = "hidden under compute (overlap_s): solid"
_EXPOSED = "exposed (exposed_copy_s): hatched"


def overlap(df: pd.DataFrame) -> Figure:
    """Copy time hidden under compute (overlap_s, solid) vs exposed (exposed_copy_s, hatched),
    per config in its placement's colour and per phase, from the instrumented timeline pass;
    overlap_frac and link GB/s annotated."""
    rows = _profiled(df, "timeline")
    rows = rows[rows["metric"].isin(["copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps"])]
    if rows.empty:
        raise MissingData("overlap: no profiler=timeline rows (run with run.timeline=true, the default)")
    rows, series = configs(rows, _config_columns(rows))
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
    _bar_axis(axes[0], labels)
    legend(fig, [], extra=[Patch(facecolor="0.35", label=_HIDDEN),
                           Patch(facecolor="0.85", edgecolor="0.35", hatch="////", label=_EXPOSED),
                           *_keys({lab: series[lab] for lab in labels})])
    _mark_emulated(fig, rows, "Copy/compute overlap (instrumented timeline pass; label: overlap_frac)",
                   note=EMULATED_OVERLAP_NOTE)
    return fig


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
    rows, series = configs(rows, _config_columns(rows, exclude=("context_tokens",)))
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
                s = _stats(g, ["phase"]).set_index("phase").reindex(phases)
                _errorbar(ax, x + (k - (len(series) - 1) / 2) * dodge,
                          s.assign(**{c: s[c] / _MIB for c in ("median", "lo", "hi")}), label, st, markersize=4)
            ax.set_xticks(x, [PHASE_LABELS[p] for p in phases], rotation=30, ha="right", fontsize=8)
            ax.set_title(f"peak {what}" + (f", context {fmt(ctx)} tokens" if ctx is not None else ""), fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(f"peak {what} (MiB)")
    if not device:
        note = fig.add_subplot(grid[1, :])
        note.set_axis_off()
        note.text(0.5, 0.5, "peak device memory: not measured (null on an emulated device, never 0)",
                  ha="center", va="center", transform=note.transAxes)
    legend(fig, axes)
    _mark_emulated(fig, rows, "Memory peaks per phase")
    return fig


# ----------------------------------------------------------------------------- hit rates

def measured_hit_rates(df: pd.DataFrame, profiler: str = "trace") -> pd.DataFrame:
    """Engine hit rate over a whole repeat, per config: sum of expert_hits over its phases /
    sum of lookups. The default reads the `profiler="trace"` pass -- the same repeat that
    wrote `routing.npz`, so it is what a replay of that trace must give. Columns: the
    factors, capacity (slots per layer), lookups, hits, hit_rate."""
    rows = _profiled(df, profiler) if profiler != "none" else speed_rows(df)
    rows = rows[rows["metric"].isin(["expert_hits", "expert_misses"]) & rows["value"].notna()]
    if rows.empty:
        raise MissingData(f"measured hit rates: no expert_hits/expert_misses rows with profiler={profiler!r}"
                          + (" (run with run.record_trace=true)" if profiler == "trace" else ""))
    req = pd.to_numeric(rows["cache_capacity"], errors="coerce")
    if "resolved_capacity" in rows.columns:
        req = req.fillna(pd.to_numeric(rows["resolved_capacity"], errors="coerce"))
    rows = rows.assign(capacity=req)
    keys = [c for c in CONFIG_COLUMNS if c in rows.columns] + ["capacity", "sweep_id", "job_id", "repeat"]
    wide = rows.pivot_table(index=keys, columns="metric", values="value", aggfunc="sum", dropna=False).dropna(how="all")
    wide = wide.groupby(level=keys[:-3], dropna=False).median().reset_index()
    wide["lookups"] = wide["expert_hits"] + wide["expert_misses"]
    wide["hit_rate"] = wide["expert_hits"] / wide["lookups"]
    return wide.rename(columns={"expert_hits": "hits"}).drop(columns=["expert_misses"])


_UNREACHABLE = "above the offline optimum: no policy reaches it"


def hit_rate_curves(sim: pd.DataFrame, measured: pd.DataFrame | None = None, *, facet: str | None = None,
                    emulated: bool | None = None) -> Figure:
    """Simulated hit rate vs cache capacity per policy (`harness.sim.replay` rows, layer
    "all"), belady drawn as the bound with the unreachable region above it shaded; measured
    engine points (`measured_hit_rates`, or any frame with capacity and hit_rate, optional
    cache_policy and placement) on top, in their placement's colour and marker, edged in their
    policy's colour. `facet` (e.g. "context_tokens", a column of both frames) gives one panel
    per value."""
    sim = sim[sim["layer"].astype(str) == "all"] if "layer" in sim.columns else sim
    if sim.empty:
        raise MissingData("hit-rate curves: no simulated rows (replay(...) with layer 'all')")
    values = ordered(sim[facet]) if facet else [None]
    fig = Figure(figsize=(4.5 * len(values) + 1.0, 4.8), layout="constrained")
    axes = fig.subplots(1, len(values), squeeze=False, sharey=True)[0]
    policies = list(dict.fromkeys(sim["policy"]))
    for ax, v in zip(axes, values):
        s = sim if v is None else sim[sim[facet] == v]
        for policy in policies:
            p = s[s["policy"] == policy].sort_values("capacity")
            st = style("policy", policy)
            if policy == "belady":
                ax.plot(p["capacity"], p["hit_rate"], color=st.color, linestyle="--",
                        label="simulated belady (offline optimum: the bound)")
                ax.fill_between(p["capacity"], p["hit_rate"], 1.0, color="0.88", label=_UNREACHABLE, zorder=0)
            else:
                ax.plot(p["capacity"], p["hit_rate"], color=st.color, marker=st.marker, markersize=4,
                        label=f"simulated {policy}")
        if measured is not None and len(measured):
            m = measured if v is None or facet not in measured.columns else measured[measured[facet] == v]
            m = m.assign(cache_policy=m["cache_policy"] if "cache_policy" in m.columns else "?")
            for (placement, policy), g in m.groupby([m["placement"] if "placement" in m.columns
                                                     else pd.Series("engine", index=m.index), "cache_policy"]):
                where = style("placement", placement) if "placement" in m.columns else style("policy", policy)
                ax.scatter(g["capacity"], g["hit_rate"], s=70, marker=where.marker, color=where.color,
                           edgecolor=style("policy", policy).color, linewidth=1.5, zorder=5,
                           label=f"measured {placement} ({policy})")
        ax.set_xlabel("expert-cache capacity (slots per layer)")
        ax.set_title(f"{facet} = {fmt(v)}" if facet else "")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate (hits / lookups)")
    legend(fig, axes)
    title = "Expert-cache hit rate: simulator vs engine"
    if emulated:
        title += "  [engine points from an emulated device; hit rates do not depend on it]"
    suptitle(fig, title)
    return fig


# ----------------------------------------------------------------------------- cost model

_NO_FIT = "hatched, faded: does not fit the profile's device memory"


def what_if(predicted: pd.DataFrame, panels: Sequence[tuple[str, str]] = (("decode", "tok_per_s"),
                                                                           ("prefill_fresh", "ttft_s"))) -> Figure:
    """Cost-model predictions (rows with source="model" and a `hardware_profile` column, e.g.
    `harness.costmodel.predict(...).table()` concatenated over profiles) per hardware profile,
    one bar per config in its placement's colour; configs whose planned device memory does not
    fit the profile (`fits_device_memory` False) are hatched and faded. Rates from zero, times
    on a log axis when they span more than 20x."""
    rows = predicted[(predicted["source"] == "model") & predicted["value"].notna()] \
        if "source" in predicted.columns else predicted
    if rows.empty or "hardware_profile" not in rows.columns:
        raise MissingData("what-if: no predicted rows (source='model') with a hardware_profile column")
    rows, series = configs(rows, _config_columns(rows))
    profiles = list(dict.fromkeys(rows["hardware_profile"]))
    height = 0.8 / max(len(series), 1)
    fig = Figure(figsize=(5.2 * len(panels) + 2.0, 0.12 * len(profiles) * len(series) + 0.3 * len(profiles) + 2.0),
                 layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    y = np.arange(len(profiles))
    for ax, (phase, metric) in zip(axes, panels):
        sub = rows[(rows["phase"] == phase) & (rows["metric"] == metric)]
        for k, (label, st) in enumerate(series.items()):
            c = sub[sub["config"] == label].drop_duplicates("hardware_profile").set_index("hardware_profile")
            c = c.reindex(profiles)
            fits = c["fits_device_memory"] if "fits_device_memory" in c.columns else pd.Series(True, index=c.index)
            no = fits.map(lambda f: f is False or f is np.False_).to_numpy()
            offset = y + (k - (len(series) - 1) / 2) * height
            value = c["value"].to_numpy(dtype=float)
            ok = ~np.isnan(value)
            for mask, faded in ((ok & ~no, False), (ok & no, True)):
                if mask.any():
                    bars = ax.barh(offset[mask], value[mask], height=height, color=st.color,
                                   alpha=0.35 if faded else 1.0, hatch="//" if faded else None, label=label)
                    if is_rate(metric):        # from zero, a slow config's bar is short: its value says it
                        ax.bar_label(bars, fmt="%.3g", fontsize=6, padding=2)
        unit = METRIC_UNITS.get(metric, "")
        ax.set_xlabel(f"predicted {PHASE_LABELS.get(phase, phase)} {metric} ({unit})")
        if is_rate(metric):
            ax.margins(x=0.08)
            from_zero(ax, "x")
        elif (sub["value"].max() / sub["value"][sub["value"] > 0].min()) > 20:
            ax.set_xscale("log")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, profiles, fontsize=8)
    axes[0].invert_yaxis()
    keys = [Patch(facecolor=st.color, label=label) for label, st in series.items()]
    legend(fig, [], extra=[*keys, Patch(facecolor="0.8", edgecolor="0.3", hatch="//", label=_NO_FIT)])
    model = ", ".join(sorted(rows["model"].dropna().astype(str).unique())) if "model" in rows.columns else ""
    suptitle(fig, f"What-if: cost-model predictions for {model} per hardware profile (source=model, not measured)")
    return fig


_TREATMENTS = ("kv_dtype", "expert_quant")


def _treatment(row: pd.Series) -> str:
    kv = row.get("kv_dtype")
    ex = row.get("expert_quant")
    return f"KV {kv if isinstance(kv, str) else 'model'} · experts {ex if isinstance(ex, str) else 'none'}"


def _frontier(points: pd.DataFrame) -> pd.DataFrame:
    """The points no other point beats on both axes (lower KL and higher tok/s), by KL."""
    pts = points.sort_values(["kl", "tok_s"], ascending=[True, False])
    best, keep = -np.inf, []
    for i, r in pts.iterrows():
        if r["tok_s"] > best:
            keep.append(i)
            best = r["tok_s"]
    return pts.loc[keep]


def treatment_frontier(df: pd.DataFrame) -> Figure:
    """Decode tok/s vs quality lost (mean KL(reference || treatment), nats/token, from the
    `quality` pass) for every treatment (`kv_dtype` x `expert_quant`), one panel per context
    length at the sweep's device budget; each point names the expert slots per layer its
    treatment left, and a line joins the frontier (no other treatment is both faster and
    closer to the exact model). Exact runs sit at KL 0 (a symmetric-log axis)."""
    if "profiler" not in df.columns or not (df["profiler"] == contract.QUALITY_PHASE).any():
        raise MissingData("treatment frontier: no quality rows (profiler=quality: kl_div_mean of each treatment "
                          "against the exact reference)")
    speed = speed_rows(df)
    speed = speed[(speed["phase"] == "decode") & (speed["metric"] == "tok_per_s") & (speed["source"] == "client")]
    ok = df[df["status"] == "ok"]
    quality = ok[(ok["profiler"] == contract.QUALITY_PHASE) & (ok["metric"] == "kl_div_mean")]
    if speed.empty or quality.empty:
        raise MissingData("treatment frontier: needs decode tok_per_s speed rows and kl_div_mean quality rows")
    kl = quality.groupby("job_id")["value"].median()
    first = df.groupby("job_id").first()
    points = speed.groupby("job_id")["value"].agg(tok_s="median", lo="min", hi="max").join(kl.rename("kl"),
                                                                                          how="inner")
    points = points.join(first[[c for c in ("context_tokens", "resolved_capacity", *_TREATMENTS)
                                if c in first.columns]])
    points["treatment"] = [_treatment(r) for _, r in points.iterrows()]
    contexts = ordered(points["context_tokens"]) if "context_tokens" in points else [None]
    labels = sorted(points["treatment"].unique(), key=lambda t: (t != "KV model · experts none", t))
    colors = {t: f"C{i % 10}" for i, t in enumerate(labels)}
    fig = Figure(figsize=(4.4 * len(contexts) + 1.0, 4.8), layout="constrained")
    axes = fig.subplots(1, len(contexts), squeeze=False)[0]
    for ax, ctx in zip(axes, contexts):
        here = points if ctx is None else points[points["context_tokens"] == ctx]
        for t in labels:
            g = here[here["treatment"] == t]
            if g.empty:
                continue
            ax.errorbar(g["kl"], g["tok_s"], yerr=[g["tok_s"] - g["lo"], g["hi"] - g["tok_s"]], fmt="o",
                        color=colors[t], capsize=3, label=t)
            for _, r in g.iterrows():
                slots = r.get("resolved_capacity")
                if pd.notna(slots):
                    ax.annotate(f"{int(slots)} slots", (r["kl"], r["tok_s"]), textcoords="offset points",
                                xytext=(4, 4), fontsize=7)
        front = _frontier(here)
        ax.plot(front["kl"], front["tok_s"], color="0.4", linestyle="--", linewidth=1, label="frontier")
        positive = here["kl"][here["kl"] > 0]
        ax.set_xscale("symlog", linthresh=float(positive.min()) if len(positive) else 1e-6)
        ax.set_xlabel("quality lost: mean KL(reference || treatment), nats\n(lower is better)")
        ax.set_ylabel("decode tok/s (higher is better)")
        ax.set_title(f"context {fmt(ctx)} tokens" if ctx is not None else "")
        ax.grid(alpha=0.3)
        from_zero(ax)
    legend(fig, axes)
    budget = sorted({str(v) for v in first.get("device_memory", pd.Series(dtype=object)).dropna()})
    _mark_emulated(fig, df[df["job_id"].isin(points.index)],
                   "Speed vs quality of each KV / expert treatment" + (f" at {', '.join(budget)}" if budget else ""))
    return fig


STANDARD: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "capacity_sweep": capacity_sweep,
    "ttft_by_prefix_state": ttft_by_prefix_state,
    "bytes_per_token": bytes_per_token,
    "overlap": overlap,
    "memory_peaks": memory_peaks,
}
# figures of one experiment's rows (experiment=kv_vs_residency): moebench-plot draws them when a
# results dir holds their rows and says nothing otherwise (unless asked for with --only)
EXPERIMENT_FIGURES: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "treatment_frontier": treatment_frontier,
}
