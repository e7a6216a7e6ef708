"""The serving figure: what a load does to goodput and to the slowest tokens, per placement.

Owns: `load_curve` -- from the serve pass's summary rows (harness.passes.serve), the window's
goodput under its SLO (or, without one, the completed requests per second) and the p99 TPOT
against the offered load (`load_rate`, or `load_max_concurrency` for a closed loop), one line per
placement and cache size. Does not own: running the load (harness.serving) or styles
(harness.plotstyle).
"""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from harness.contract import served_summary_rows
from harness.plots.common import MissingData

KEYS = ["sweep_id", "job_id"]


def serve_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per job: its load and configuration columns and its summary metrics as columns."""
    rows = served_summary_rows(df)
    if rows.empty:
        raise MissingData("serving: no serve rows (run a job with load=..., the serve pass)")
    wide = rows.pivot_table(index=KEYS, columns="metric", values="value", aggfunc="first")
    info = rows.drop_duplicates(KEYS).set_index(KEYS)[[c for c in ("placement", "cache_capacity", "load",
                                                                   "load_rate", "load_max_concurrency", "slo",
                                                                   "emulated") if c in rows]]
    return info.join(wide).reset_index()


def load_curve(df: pd.DataFrame) -> Figure:
    """Goodput (requests/s meeting the SLO; completed requests/s without one) and p99 TPOT against
    the offered load, one line per placement and cache size."""
    s = serve_summary(df)
    x = "load_rate" if s["load_rate"].notna().any() else "load_max_concurrency"
    good = "request_goodput" if "request_goodput" in s and s["request_goodput"].notna().any() else "request_throughput"
    s["config"] = s["placement"].astype(str) + s["cache_capacity"].map(lambda c: "" if pd.isna(c) else f" ({c} slots)")
    fig = Figure(figsize=(10, 4))
    a, b = fig.subplots(1, 2)
    for config, g in s.sort_values(x).groupby("config", sort=False):
        a.plot(g[x], g[good], marker="o", label=config)
        b.plot(g[x], g["tpot_s_p99"] * 1e3, marker="o", label=config)
    xlabel = "offered load (requests/s)" if x == "load_rate" else "max concurrency (closed loop)"
    slo = next(iter(s["slo"].dropna()), None) if "slo" in s else None
    a.set(xlabel=xlabel, ylabel=f"goodput, requests/s meeting SLO {slo}" if good == "request_goodput" and slo
          else "completed requests/s", ylim=(0, None))
    b.set(xlabel=xlabel, ylabel="p99 TPOT (ms)", ylim=(0, None))
    a.legend(title="placement", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    if bool(s.get("emulated", pd.Series([False])).any()):
        fig.suptitle("emulated device: the CPU's figures, not a GPU's", fontsize=9)
    fig.tight_layout()
    return fig
