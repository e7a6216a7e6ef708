"""The standard figures: a results DataFrame in, a matplotlib Figure out. No file I/O.

Owns: which rows each figure reads, how they are summarised (median over repeats, bars =
min..max over repeats), axis labels with units, and marking emulated runs on the figure.
Does not own: loading results (`harness.results.load`), writing PNGs (`moebench-plot`,
`harness.analysis_cli`), simulation (`harness.sim`).

    from harness import plots, results
    df = results.load("results/samples")
    fig = plots.capacity_sweep(df)          # a matplotlib.figure.Figure; fig.savefig(...) to keep it

Every function raises `MissingData` (a ValueError) naming what it needed when the table
lacks it, so a caller can skip that figure. Speed figures read only status-ok rows of
un-instrumented runs (`profiler` "none" or null, DESIGN §7.5); the overlap figure reads the
instrumented `profiler="timeline"` pass, the hit-rate figure the `profiler="trace"` pass.
Figures are built without pyplot (no global state, no backend switching): they display in
a notebook and save from a script alike.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from harness import contract
from harness.contract import EMULATED_OVERLAP_NOTE, PHASES, PREFILL_PHASES
from harness.results import FACTOR_COLUMNS

__all__ = ["MissingData", "STANDARD", "capacity_sweep", "ttft_by_prefix_state", "bytes_per_token", "overlap",
           "memory_peaks", "hit_rate_curves", "measured_hit_rates", "speed_rows", "what_if"]

PHASE_LABELS = {"load": "load", "prefill_fresh": "fresh prefill", "decode": "decode",
                "prefill_continuation": "continuation (KV on device)", "prefill_restored": "restored (KV from host)",
                "kv_offload": "KV offload"}
SPREAD = "median over repeats; bars: min..max"
_MIB = 2.0**20


class MissingData(ValueError):
    """The table lacks the rows a figure needs (the message says which)."""


# ----------------------------------------------------------------------------- row selection

speed_rows = contract.speed_values      # the contract's speed rows that hold a value


def _profiled(df: pd.DataFrame, profiler: str) -> pd.DataFrame:
    if "profiler" not in df.columns:
        return df.iloc[0:0]
    return df[(df["status"] == "ok") & (df["profiler"] == profiler)]


def _config_columns(df: pd.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    """Factors that vary in `df` (placement always), minus `exclude`: what tells lines apart."""
    cols = [c for c in FACTOR_COLUMNS if c in df.columns and c not in exclude
            and (c == "placement" or df[c].nunique(dropna=True) > 1)]
    return cols


def _label(row: pd.Series | dict, cols: Sequence[str]) -> str:
    parts = []
    for c in cols:
        v = row[c]
        if v is None or (not isinstance(v, str) and pd.isna(v)):
            continue
        parts.append(str(v) if c == "placement" else f"{_SHORT.get(c, c)}={v}")
    return " ".join(parts) or "all"


_SHORT = {"cache_capacity": "cap", "cache_policy": "policy", "context_tokens": "ctx", "gen_tokens": "gen"}


def _with_label(df: pd.DataFrame, cols: Sequence[str]) -> pd.DataFrame:
    df = df.copy()
    df["config"] = [_label(r, cols) for _, r in df[list(cols)].iterrows()] if len(df) else []
    return df


def _stats(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """median, min, max and count of `value` per key (NaN keys kept)."""
    g = df.groupby(list(keys), dropna=False, sort=True)["value"]
    return g.agg(median="median", lo="min", hi="max", n="count").reset_index()


def _capacity_x(df: pd.DataFrame) -> pd.Series:
    """Slots per layer: the requested capacity, or the resolved one for "auto"."""
    req = pd.to_numeric(df["cache_capacity"], errors="coerce")
    if "resolved_capacity" in df.columns:
        req = req.fillna(pd.to_numeric(df["resolved_capacity"], errors="coerce"))
    return req


def _mark_emulated(fig: Figure, df: pd.DataFrame, title: str, note: str | None = None) -> None:
    emulated = df["emulated"].astype("boolean") if "emulated" in df.columns else pd.Series(dtype="boolean")
    if emulated.fillna(False).all() and len(emulated):
        title += f"  [{note or 'emulated device: the CPU stands in for the GPU; no link speed or device memory'}]"
    elif emulated.fillna(False).any():
        title += "  [some runs on an emulated device]"
    devices = sorted({str(d) for d in df.get("device_name", pd.Series(dtype=object)).dropna().unique()})
    sub = ("device: " + ", ".join(devices) + "; " if devices else "") + SPREAD
    fig.suptitle(f"{title}\n{sub}", fontsize=10)


def _colors(labels: Sequence[str]) -> dict[str, tuple]:
    """A stable colour per label: tab10 up to 10 labels, tab20 beyond."""
    from matplotlib import colormaps
    labels = sorted(set(labels))
    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {lab: cmap(i % cmap.N) for i, lab in enumerate(labels)}


def _auto_log(ax: Axes, values: Sequence[float]) -> None:
    """Log scale only when the values span more than 20x."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0], dtype=float)
    if len(v) and v.max() / v.min() > 20:
        ax.set_yscale("log")


def _errorbar(ax: Axes, x: Sequence[float], s: pd.DataFrame, label: str, **kw) -> None:
    med = s["median"].to_numpy(dtype=float)
    yerr = np.vstack([med - s["lo"].to_numpy(dtype=float), s["hi"].to_numpy(dtype=float) - med])
    ax.errorbar(x, med, yerr=yerr, marker="o", capsize=3, label=label, **kw)


def _legend(fig: Figure, axes: Sequence[Axes]) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="outside right upper", fontsize=8)


def _byte_unit(values: Sequence[float]) -> tuple[float, str]:
    top = float(np.nanmax(values)) if len(values) else 0.0
    for scale, unit in ((2.0**30, "GiB"), (_MIB, "MiB"), (2.0**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1.0, "B"


# ----------------------------------------------------------------------------- figures

def capacity_sweep(df: pd.DataFrame) -> Figure:
    """Decode tok/s and fresh-prefill TTFT vs expert-cache slots per layer, one line per
    placement (and other varying factors); placements without a cache as horizontal bands.
    One column per context length."""
    rows = speed_rows(df)
    rows = rows[((rows["phase"] == "decode") & (rows["metric"] == "tok_per_s"))
                | ((rows["phase"] == "prefill_fresh") & (rows["metric"] == "ttft_s"))]
    cached = rows[rows["cache_capacity"].notna()]          # the factor is set only where the placement keeps a cache
    if cached.empty or _capacity_x(cached).isna().all():
        raise MissingData("capacity sweep: no decode tok_per_s / prefill_fresh ttft_s rows of a placement with an "
                          "expert cache (a cache_capacity factor)")
    rows = rows.assign(capacity=_capacity_x(rows))
    contexts = sorted(rows["context_tokens"].dropna().unique()) or [None]
    cols = _config_columns(rows, exclude=("cache_capacity", "context_tokens"))
    rows = _with_label(rows, cols)
    colors = _colors(rows["config"])
    fig = Figure(figsize=(4.2 * len(contexts) + 2.5, 6.5), layout="constrained")
    axes = fig.subplots(2, len(contexts), squeeze=False, sharex=True)
    panels = (("decode", "tok_per_s", "decode tok/s (higher is better)"),
              ("prefill_fresh", "ttft_s", "fresh-prefill TTFT, s (lower is better)"))
    for j, ctx in enumerate(contexts):
        at_ctx = rows if ctx is None else rows[rows["context_tokens"] == ctx]
        for i, (phase, metric, ylabel) in enumerate(panels):
            ax = axes[i, j]
            sub = at_ctx[(at_ctx["phase"] == phase) & (at_ctx["metric"] == metric)]
            for label, g in sub.groupby("config", sort=True):
                color = colors[label]
                if g["capacity"].notna().any():
                    s = _stats(g, ["capacity"])
                    _errorbar(ax, s["capacity"], s, label, color=color)
                else:
                    s = _stats(g, ["config"]).iloc[0]
                    ax.axhline(s["median"], color=color, linestyle="--", label=label)
                    ax.axhspan(s["lo"], s["hi"], color=color, alpha=0.12)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"context {ctx} tokens" if ctx is not None else "")
            if i == 1:
                ax.set_xlabel("expert-cache capacity (slots per layer)")
                _auto_log(ax, sub["value"])
    _legend(fig, axes.ravel())
    _mark_emulated(fig, rows, "Decode rate and TTFT vs expert-cache capacity")
    return fig


def ttft_by_prefix_state(df: pd.DataFrame) -> Figure:
    """TTFT of a fresh prefill vs a continuation (KV on the device) vs a restored session
    (KV brought back from host RAM), against context length; one panel per config."""
    rows = speed_rows(df)
    rows = rows[rows["phase"].isin(PREFILL_PHASES) & (rows["metric"] == "ttft_s")]
    if rows.empty:
        raise MissingData("TTFT by prefix state: no ttft_s rows for prefill_fresh / prefill_continuation / "
                          "prefill_restored")
    cols = _config_columns(rows, exclude=("context_tokens",))
    rows = _with_label(rows, cols)
    configs = sorted(rows["config"].unique())
    ncol = min(4, len(configs))
    nrow = -(-len(configs) // ncol)
    fig = Figure(figsize=(3.6 * ncol + 2.2, 3.0 * nrow + 0.6), layout="constrained")
    axes = fig.subplots(nrow, ncol, squeeze=False, sharex=True, sharey=True)
    for ax, label in zip(axes.ravel(), configs):
        sub = rows[rows["config"] == label]
        for k, phase in enumerate(PREFILL_PHASES):
            s = _stats(sub[sub["phase"] == phase], ["context_tokens"])
            if len(s):
                _errorbar(ax, s["context_tokens"].astype(float), s, PHASE_LABELS[phase], color=f"C{k}")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("context length (tokens)")
    for ax in axes[:, 0]:
        ax.set_ylabel("TTFT (s)")
    for ax in axes.ravel()[len(configs):]:
        ax.set_visible(False)
    _auto_log(axes[0, 0], rows["value"])      # shared y: one call sets every panel
    _legend(fig, axes.ravel())
    _mark_emulated(fig, rows, "TTFT: fresh prefill vs prefix-cache continuation vs restored session")
    return fig


def bytes_per_token(df: pd.DataFrame) -> Figure:
    """Host->device bytes per processed token (h2d_bytes / tokens of the same repeat and
    phase), per config, one panel per phase."""
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
    cols = _config_columns(per)
    per = _with_label(per, cols)
    phases = [p for p in PHASES if p in set(per["phase"])]
    scale, unit = _byte_unit(per["value"].to_numpy())
    configs = sorted(per["config"].unique())
    fig = Figure(figsize=(3.3 * len(phases) + 2.5, 0.32 * len(configs) + 2.0), layout="constrained")
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=True)[0]
    y = np.arange(len(configs))
    placement_of = per.drop_duplicates("config").set_index("config")["placement"]
    by_placement = _colors(placement_of.astype(str))
    bar_colors = [by_placement[str(placement_of[c])] for c in configs]
    for ax, phase in zip(axes, phases):
        s = _stats(per[per["phase"] == phase], ["config"]).set_index("config").reindex(configs)
        med = s["median"].to_numpy(dtype=float) / scale
        err = np.vstack([med - s["lo"].to_numpy(dtype=float) / scale, s["hi"].to_numpy(dtype=float) / scale - med])
        ax.barh(y, med, xerr=err, color=bar_colors, capsize=2)
        ax.set_title(PHASE_LABELS.get(phase, phase), fontsize=9)
        ax.set_xlabel(f"h2d {unit} per token")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, configs, fontsize=8)
    axes[0].invert_yaxis()
    _mark_emulated(fig, per, "Bytes moved host->device per token")
    return fig


def overlap(df: pd.DataFrame) -> Figure:
    """Copy time hidden under compute (overlap_s) vs exposed (exposed_copy_s), per config
    and phase, from the instrumented timeline pass; overlap_frac and link GB/s annotated."""
    rows = _profiled(df, "timeline")
    rows = rows[rows["metric"].isin(["copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps"])]
    if rows.empty:
        raise MissingData("overlap: no profiler=timeline rows (run with run.timeline=true, the default)")
    cols = _config_columns(rows)
    rows = _with_label(rows, cols)
    wide = rows.pivot_table(index=["config", "phase"], columns="metric", values="value", aggfunc="median")
    wide = wide[wide.get("copy_busy_s", pd.Series(0.0, index=wide.index)).fillna(0) > 0]
    if wide.empty:
        raise MissingData("overlap: the timeline pass recorded no copies (no placement that moves weights?)")
    phases = [p for p in PHASES if p in set(wide.index.get_level_values("phase"))]
    configs = sorted(set(wide.index.get_level_values("config")))
    fig = Figure(figsize=(3.3 * len(phases) + 2.5, 0.35 * len(configs) + 2.0), layout="constrained")
    axes = fig.subplots(1, len(phases), squeeze=False, sharey=True)[0]
    y = np.arange(len(configs))
    for ax, phase in zip(axes, phases):
        w = wide.xs(phase, level="phase").reindex(configs)
        hidden = w.get("overlap_s", pd.Series(np.nan, index=w.index)).to_numpy(dtype=float) * 1e3
        exposed = w.get("exposed_copy_s", pd.Series(np.nan, index=w.index)).to_numpy(dtype=float) * 1e3
        ax.barh(y, np.nan_to_num(hidden), color="C2", label="hidden under compute (overlap_s)")
        ax.barh(y, np.nan_to_num(exposed), left=np.nan_to_num(hidden), color="C3", label="exposed (exposed_copy_s)")
        for yi, cfg in zip(y, configs):
            frac = w.loc[cfg].get("overlap_frac") if cfg in w.index else None
            link = w.loc[cfg].get("link_gbps") if cfg in w.index else None
            note = "" if frac is None or pd.isna(frac) else f"{frac:.0%}"
            if link is not None and not pd.isna(link):
                note += f" {link:.1f} GB/s"
            total = np.nan_to_num(hidden[yi]) + np.nan_to_num(exposed[yi])
            if note:
                ax.text(total, yi, " " + note, va="center", fontsize=7)
        ax.set_title(PHASE_LABELS.get(phase, phase), fontsize=9)
        ax.set_xlabel("copy busy time (ms)")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, configs, fontsize=8)
    axes[0].invert_yaxis()
    _legend(fig, axes)
    _mark_emulated(fig, rows, "Copy/compute overlap (instrumented timeline pass; label: overlap_frac)",
                   note=EMULATED_OVERLAP_NOTE)
    return fig


def memory_peaks(df: pd.DataFrame) -> Figure:
    """Peak host RSS and (when measured) peak device memory per phase, one line per config.
    On an emulated device the device panel says it was not measured (null, never 0)."""
    rows = speed_rows(df)
    rows = rows[rows["metric"].isin(["peak_host_rss_bytes", "peak_device_bytes"])]
    if rows[rows["metric"] == "peak_host_rss_bytes"].empty:
        raise MissingData("memory peaks: no peak_host_rss_bytes rows")
    cols = _config_columns(rows)
    rows = _with_label(rows, cols)
    phases = [p for p in PHASES if p in set(rows["phase"])]
    colors = _colors(rows["config"])
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False)[0]
    x = np.arange(len(phases))
    for ax, metric, what in zip(axes, ("peak_host_rss_bytes", "peak_device_bytes"), ("host RSS", "device memory")):
        sub = rows[rows["metric"] == metric]
        if sub.empty:
            ax.text(0.5, 0.5, f"peak {what}: not measured\n(null on an emulated device, never 0)",
                    ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            ax.set_xticks(x, [PHASE_LABELS[p] for p in phases], rotation=30, ha="right", fontsize=8)
            ax.set_title(f"peak {what}")
            continue
        for label, g in sub.groupby("config", sort=True):
            s = _stats(g, ["phase"]).set_index("phase").reindex(phases)
            color = colors[label]
            _errorbar(ax, x, s.assign(**{k: s[k] / _MIB for k in ("median", "lo", "hi")}), label, color=color)
        ax.set_xticks(x, [PHASE_LABELS[p] for p in phases], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"peak {what} (MiB)")
        ax.set_title(f"peak {what} per phase")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
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
    rows = rows.assign(capacity=_capacity_x(rows))
    keys = [c for c in FACTOR_COLUMNS if c in rows.columns] + ["capacity", "sweep_id", "job_id", "repeat"]
    wide = rows.pivot_table(index=keys, columns="metric", values="value", aggfunc="sum", dropna=False).dropna(how="all")
    wide = wide.groupby(level=keys[:-3], dropna=False).median().reset_index()
    wide["lookups"] = wide["expert_hits"] + wide["expert_misses"]
    wide["hit_rate"] = wide["expert_hits"] / wide["lookups"]
    return wide.rename(columns={"expert_hits": "hits"}).drop(columns=["expert_misses"])


def hit_rate_curves(sim: pd.DataFrame, measured: pd.DataFrame | None = None, *, facet: str | None = None,
                    emulated: bool | None = None) -> Figure:
    """Simulated hit rate vs cache capacity per policy (`harness.sim.replay` rows, layer
    "all"), belady drawn as the bound; measured engine points (`measured_hit_rates`, or
    any frame with capacity and hit_rate, optional cache_policy) on top. `facet` (e.g.
    "context_tokens", a column of both frames) gives one panel per value."""
    sim = sim[sim["layer"].astype(str) == "all"] if "layer" in sim.columns else sim
    if sim.empty:
        raise MissingData("hit-rate curves: no simulated rows (replay(...) with layer 'all')")
    values = sorted(sim[facet].dropna().unique()) if facet else [None]
    fig = Figure(figsize=(4.5 * len(values) + 2.2, 4.0), layout="constrained")
    axes = fig.subplots(1, len(values), squeeze=False, sharey=True)[0]
    policies = list(dict.fromkeys(sim["policy"]))
    for ax, v in zip(axes, values):
        s = sim if v is None else sim[sim[facet] == v]
        for k, policy in enumerate(policies):
            p = s[s["policy"] == policy].sort_values("capacity")
            bound = policy == "belady"
            ax.plot(p["capacity"], p["hit_rate"], color="k" if bound else f"C{k}", linestyle="--" if bound else "-",
                    marker="." if not bound else None,
                    label=f"simulated {policy}" + (" (offline optimum: the bound)" if bound else ""))
        if measured is not None and len(measured):
            m = measured if v is None or facet not in measured.columns else measured[measured[facet] == v]
            for policy, g in m.groupby(m["cache_policy"] if "cache_policy" in m.columns else pd.Series("?", index=m.index)):
                k = policies.index(policy) if policy in policies else len(policies)
                ax.scatter(g["capacity"], g["hit_rate"], s=70, marker="X", color=f"C{k}", edgecolor="k", zorder=5,
                           label=f"measured engine ({policy})")
        ax.set_xlabel("expert-cache capacity (slots per layer)")
        ax.set_title(f"{facet} = {v}" if facet else "")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate (hits / lookups)")
    _legend(fig, axes)
    title = "Expert-cache hit rate: simulator vs engine"
    if emulated:
        title += "  [engine points from an emulated device; hit rates do not depend on it]"
    fig.suptitle(title, fontsize=10)
    return fig


# ----------------------------------------------------------------------------- cost model

def what_if(predicted: pd.DataFrame, panels: Sequence[tuple[str, str]] = (("decode", "tok_per_s"),
                                                                           ("prefill_fresh", "ttft_s"))) -> Figure:
    """Cost-model predictions (rows with source="model" and a `hardware_profile` column, e.g.
    `harness.costmodel.predict(...).table()` concatenated over profiles) per hardware profile,
    one bar per config; configs whose planned device memory does not fit the profile
    (`fits_device_memory` False) are hatched and faded."""
    rows = predicted[(predicted["source"] == "model") & predicted["value"].notna()] \
        if "source" in predicted.columns else predicted
    if rows.empty or "hardware_profile" not in rows.columns:
        raise MissingData("what-if: no predicted rows (source='model') with a hardware_profile column")
    cols = _config_columns(rows)
    rows = _with_label(rows, cols)
    profiles = list(dict.fromkeys(rows["hardware_profile"]))
    configs = sorted(rows["config"].unique())
    colors = _colors(configs)
    height = 1.0 / (len(configs) + 1)
    fig = Figure(figsize=(5.2 * len(panels) + 2.5, 0.55 * len(profiles) * max(1.0, len(configs) / 3) + 1.8),
                 layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    y = np.arange(len(profiles))
    for ax, (phase, metric) in zip(axes, panels):
        sub = rows[(rows["phase"] == phase) & (rows["metric"] == metric)]
        for k, cfg in enumerate(configs):
            c = sub[sub["config"] == cfg].set_index("hardware_profile").reindex(profiles)
            fits = c["fits_device_memory"] if "fits_device_memory" in c.columns else pd.Series(True, index=c.index)
            for yi, (prof, r) in zip(y, c.iterrows()):
                if pd.isna(r["value"]):
                    continue
                no = fits.get(prof) is False or (isinstance(fits.get(prof), (bool, np.bool_)) and not fits.get(prof))
                ax.barh(yi + (k - (len(configs) - 1) / 2) * height, r["value"], height=height, color=colors[cfg],
                        alpha=0.35 if no else 1.0, hatch="//" if no else None)
            ax.barh([], [], color=colors[cfg], label=cfg)            # legend entry, unhatched
        unit = _UNITS.get(metric, "")
        ax.set_xlabel(f"predicted {PHASE_LABELS.get(phase, phase)} {metric} ({unit})")
        ax.set_xscale("log")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, profiles, fontsize=8)
    axes[0].invert_yaxis()
    _legend(fig, axes)
    model = ", ".join(sorted(rows["model"].dropna().astype(str).unique())) if "model" in rows.columns else ""
    fig.suptitle(f"What-if: cost-model predictions for {model} per hardware profile (source=model, not measured)\n"
                 "hatched: does not fit the profile's device memory", fontsize=10)
    return fig


_UNITS = {"tok_per_s": "tok/s", "ttft_s": "s", "time_s": "s", "tpot_s_p50": "s"}


STANDARD: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "capacity_sweep": capacity_sweep,
    "ttft_by_prefix_state": ttft_by_prefix_state,
    "bytes_per_token": bytes_per_token,
    "overlap": overlap,
    "memory_peaks": memory_peaks,
}
