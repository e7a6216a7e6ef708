"""The figures beside the measurements: the replay simulator's hit-rate curves with the
engine's measured hit rates on top, and the cost model's what-if predictions per hardware
profile.

Owns: `measured_hit_rates` (the engine points of the hit-rate figure), `hit_rate_curves` and
`what_if`. Does not own: the simulation (`harness.sim`), the predictions
(`harness.costmodel`), row selection (`harness.plots.common`) or styles (`harness.plotstyle`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from harness.contract import METRIC_UNITS
from harness.plots.common import PHASE_LABELS, MissingData, config_columns, profiled
from harness.plotstyle import configs, fmt, from_zero, is_rate, legend, ordered, style, suptitle
from harness.results import CONFIG_COLUMNS


def measured_hit_rates(df: pd.DataFrame, profiler: str = "trace") -> pd.DataFrame:
    """Engine hit rate over a whole repeat, per config: sum of expert_hits over its phases /
    sum of lookups. The default reads the `profiler="trace"` pass -- the same repeat that
    wrote `routing.npz`, so it is what a replay of that trace must give. Columns: the
    factors, capacity (slots per layer), lookups, hits, hit_rate."""
    rows = profiled(df, profiler)
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
    rows, series = configs(rows, config_columns(rows))
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
