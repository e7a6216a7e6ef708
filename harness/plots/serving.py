"""The serving figure: what a load does to goodput and to the slowest tokens, per configuration.

Owns: `load_curve` -- from the serve pass's summary rows (harness.passes.serve), the window's
goodput under its SLO (or, without one, the completed requests per second) and the p99 TPOT
against the offered load (`load_rate`, or `load_max_concurrency` for a closed loop), one line per
configuration (placement and cache size, and any other config column that varies) in its
placement's style. Drawn by `moebench serve-sweep` beside its runs and by `moebench-plot` where
the results hold serve rows. Does not own: running the load (harness.serving), row selection
(harness.contract) or styles (harness.plotstyle).
"""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from harness.contract import served_summary_rows
from harness.plots.common import MissingData, config_columns, mark_emulated
from harness.plotstyle import configs, from_zero, legend

KEYS = ["sweep_id", "job_id"]
# the offered load on the x axis: the arrival rate, or a closed loop's requests in flight
LOAD_AXES = {"load_rate": "offered load (requests/s)", "load_max_concurrency": "requests in flight (closed loop)"}


def serve_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per job: its config columns (each as its rows hold it) and its summary metrics as columns."""
    rows = served_summary_rows(df)
    if rows.empty:
        raise MissingData("serving: no serve rows (run a job with load=..., the serve pass)")
    wide = rows.pivot_table(index=KEYS, columns="metric", values="value", aggfunc="first")
    info = rows.drop_duplicates(KEYS).set_index(KEYS).drop(columns=["metric", "value", "unit", "source"],
                                                            errors="ignore")
    return info.join(wide).reset_index()


def load_curve(df: pd.DataFrame) -> Figure:
    """Goodput (requests/s meeting the SLO; completed requests/s without one) and p99 TPOT against
    the offered load, one line per configuration; the title marks runs on the emulated device."""
    rows = served_summary_rows(df)
    s = serve_summary(df)
    x = "load_rate" if s["load_rate"].notna().any() else "load_max_concurrency"
    s = s[s[x].notna()]
    s, series = configs(s, config_columns(rows, exclude=tuple(LOAD_AXES)))
    good = "request_goodput" if "request_goodput" in s and s["request_goodput"].notna().any() else "request_throughput"
    slo = next(iter(s["slo"].dropna()), None) if "slo" in s else None
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    a, b = fig.subplots(1, 2)
    for label, st in series.items():
        g = s[s["config"] == label].sort_values(x)
        look = {"color": st.color, "marker": st.marker, "linestyle": st.linestyle, "label": label}
        a.plot(g[x], g[good], **look)
        b.plot(g[x], g["tpot_s_p99"] * 1e3, **look)
    for ax in (a, b):
        ax.set_xlabel(LOAD_AXES[x])
        ax.grid(alpha=0.3)
        if x == "load_max_concurrency":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        from_zero(ax)
    a.set_ylabel("goodput (requests/s within SLO)" if good == "request_goodput" else "completed requests/s")
    b.set_ylabel("p99 TPOT (ms)")
    legend(fig, [a])
    title = "Goodput and p99 TPOT against the offered load" + (f"; SLO {slo}" if good == "request_goodput" and slo
                                                              else "")
    drawn = rows.set_index(KEYS).index.isin(s.set_index(KEYS).index)
    mark_emulated(fig, rows[drawn], title, spread="a point: one run's steady window")
    return fig
