"""What the standard figures share: the rows they read, how they summarise repeats, and the
marks every figure carries (units, bars of min..max, the emulated-device note).

Owns: `MissingData` (the one error a figure raises for a table that lacks its rows), row
selection (speed rows; one instrumented pass; the config columns that tell series apart), the
median/min/max summary, capacities on a numeric axis, and small drawing helpers (error-bar
series, keys of bar charts, byte units, the title that marks emulated runs). Does not own: any
one figure (the modules beside it) or how a figure looks (`harness.plotstyle`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from harness import contract
from harness.plotstyle import Series, numeric_positions, suptitle, wrap
from harness.results import CONFIG_COLUMNS

PHASE_LABELS = {"load": "load", "prefill_fresh": "fresh prefill", "decode": "decode",
                "prefill_continuation": "continuation (KV on device)", "prefill_restored": "restored (KV from host)",
                "kv_offload": "KV offload"}
SPREAD = "median over repeats; bars: min..max"
MIB = 2.0**20

speed_rows = contract.speed_values      # the contract's speed rows that hold a value
profiled = contract.profiled_rows       # the status-ok rows of one instrumented pass ("timeline", ...)


class MissingData(ValueError):
    """The table lacks the rows a figure needs (the message says which)."""


def config_columns(df: pd.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    """Config columns that vary in `df` (placement always), minus `exclude`: what tells series
    apart. Also `source` where one metric of one phase comes from both (llama.cpp times a decode
    as the client sees it and by its own clock; its RSS is the harness's or the server's), so
    that no series pools the two (DESIGN §5)."""
    cols = [c for c in CONFIG_COLUMNS if c in df.columns and c not in exclude
            and (c == "placement" or df[c].nunique(dropna=True) > 1)]
    both = "source" in df.columns and (df.groupby(["phase", "metric"])["source"].nunique() > 1).any()
    return [*cols, "source"] if both else cols


def stats(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """median, min, max and count of `value` per key (NaN keys kept)."""
    g = df.groupby(list(keys), dropna=False, sort=True)["value"]
    return g.agg(median="median", lo="min", hi="max", n="count").reset_index()


def capacity_positions(df: pd.DataFrame) -> tuple[pd.Series, dict[float, str]]:
    """Slots per layer on a numeric axis: the requested capacity, the resolved one for "auto",
    and an unresolved text value after the largest number; NaN where the placement has no cache."""
    req = df["cache_capacity"].astype(object)
    if "resolved_capacity" in df.columns:
        resolved = pd.to_numeric(df["resolved_capacity"], errors="coerce")
        req = req.where(pd.to_numeric(req, errors="coerce").notna() | resolved.isna(), resolved)
    return numeric_positions(req.where(req.notna(), None))


def mark_emulated(fig: Figure, df: pd.DataFrame, title: str, note: str | None = None, spread: str = SPREAD) -> None:
    """The figure's title: `title`, marked when its runs were on an emulated device, then the
    devices and `spread`: what a point of it summarises (by default, a median over repeats)."""
    emulated = df["emulated"].astype("boolean") if "emulated" in df.columns else pd.Series(dtype="boolean")
    if emulated.fillna(False).all() and len(emulated):
        title += f"  [{note or 'emulated device: the CPU stands in for the GPU; no link speed or device memory'}]"
    elif emulated.fillna(False).any():
        title += "  [some runs on an emulated device]"
    devices = sorted({str(d) for d in df.get("device_name", pd.Series(dtype=object)).dropna().unique()})
    suptitle(fig, f"{title}\n" + ("device: " + ", ".join(devices) + "; " if devices else "") + spread)


def auto_log(ax: Axes, values: Sequence[float]) -> None:
    """Log scale only when the values span more than 20x."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0], dtype=float)
    if len(v) and v.max() / v.min() > 20:
        ax.set_yscale("log")


def errorbar(ax: Axes, x: Sequence[float], s: pd.DataFrame, label: str, st: Series, **kw) -> None:
    """A series' medians at `x` with min..max bars, in its style (`kw` overrides)."""
    med = s["median"].to_numpy(dtype=float)
    yerr = np.vstack([med - s["lo"].to_numpy(dtype=float), s["hi"].to_numpy(dtype=float) - med])
    look = {"color": st.color, "marker": st.marker, "linestyle": st.linestyle, **kw}
    ax.errorbar(x, med, yerr=yerr, capsize=3, label=label, **look)


def placement_keys(series: dict[str, Series]) -> list[Patch]:
    """Legend keys for bar charts whose bars are named by their tick labels: one per placement/engine."""
    seen = {(st.kind, st.name): st.base for st in series.values()}
    return [Patch(facecolor=base.color, label=name) for (_, name), base in seen.items()]


def bar_axis(ax: Axes, labels: Sequence[str], axis: str = "y") -> None:
    """Name the bars of a bar chart by config on `axis` (top to bottom on y)."""
    if axis == "y":
        ax.set_yticks(np.arange(len(labels)), [wrap(lab, 2.4, 8) for lab in labels], fontsize=8)
        ax.invert_yaxis()
    else:
        ax.set_xticks(np.arange(len(labels)), labels, rotation=30, ha="right", rotation_mode="anchor", fontsize=8)


def byte_unit(values: Sequence[float]) -> tuple[float, str]:
    """The binary unit (and its size) the largest of `values` reads best in."""
    top = float(np.nanmax(values)) if len(values) else 0.0
    for scale, unit in ((2.0**30, "GiB"), (MIB, "MiB"), (2.0**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1.0, "B"
