"""The lossy-treatment figure: decode speed against the quality a treatment gives up (KV in
lower precision, quantised experts), and the frontier of treatments nothing else beats.

Owns: `treatment_frontier` and `pareto_front`. Drawn only where the results hold a lossy run:
an exact-only sweep has no trade to show, and the figure raises `MissingData` saying so (what
draws every figure skips it with that reason). Does not own: the quality pass
(`harness.quality`), row selection (`harness.plots.common`) or styles (`harness.plotstyle`).
"""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from harness import contract
from harness.order import number
from harness.plots.common import MissingData, config_columns, mark_emulated, speed_rows
from harness.plotstyle import EXACT_TREATMENT, configs, fmt, from_zero, label_points, legend, markers, ordered

TREATMENTS = ("kv_dtype", "expert_quant")
_KEYS = ["sweep_id", "job_id"]


def _treatment(kv: object, experts: object) -> str:
    kv = kv if isinstance(kv, str) else EXACT_TREATMENT["kv_dtype"]
    experts = experts if isinstance(experts, str) else EXACT_TREATMENT["expert_quant"]
    exact = (kv, experts) == (EXACT_TREATMENT["kv_dtype"], EXACT_TREATMENT["expert_quant"])
    return f"KV {kv} · experts {experts}" + (" (exact)" if exact else "")


def pareto_front(points: pd.DataFrame) -> pd.DataFrame:
    """The points no other point beats on both axes (lower `kl` and higher `tok_s`), by KL."""
    pts = points.sort_values(["kl", "tok_s"], ascending=[True, False])
    best, keep = float("-inf"), []
    for i, r in pts.iterrows():
        if r["tok_s"] > best:
            keep.append(i)
            best = r["tok_s"]
    return pts.loc[keep]


def _lossy(points: pd.DataFrame) -> pd.Series:
    """Which jobs ran a lossy treatment: their `lossy` label, or (results written before it) a
    treatment other than the exact one."""
    if "lossy" in points.columns:
        return points["lossy"].astype("boolean").fillna(False).astype(bool)
    return ~points["treatment"].str.endswith("(exact)")


def _auto_slots(points: pd.DataFrame) -> pd.Series:
    """The slots each point's cache was sized to, where the config does not already say them
    (a capacity of "auto"); empty text elsewhere."""
    if "resolved_capacity" not in points.columns:
        return pd.Series("", index=points.index)
    requested = points["cache_capacity"] if "cache_capacity" in points.columns else pd.Series(None, index=points.index)
    return pd.Series([f"{int(s)} slots" if pd.notna(s) and number(c) is None else ""
                      for s, c in zip(pd.to_numeric(points["resolved_capacity"], errors="coerce"), requested)],
                     index=points.index)


def treatment_frontier(df: pd.DataFrame) -> Figure:
    """Decode tok/s vs quality lost (mean KL(reference || treatment), nats/token, from the
    `quality` pass), one point per job: in its placement's colour (configs of one placement
    shaded), its treatment (`kv_dtype` x `expert_quant`) told by marker; one panel per context
    length at the sweep's device budget. A point whose cache was sized automatically names the
    slots its treatment left; a dashed line joins the frontier (no other point is both faster and
    closer to the exact model). KL starts at 0, where exact runs sit (a symmetric-log axis).
    Raises `MissingData` when no run is lossy."""
    if "profiler" not in df.columns or not (df["profiler"] == contract.QUALITY_PHASE).any():
        raise MissingData("treatment frontier: no quality rows (profiler=quality: kl_div_mean of each treatment "
                          "against the exact reference)")
    speed = speed_rows(df)
    speed = speed[(speed["phase"] == "decode") & (speed["metric"] == "tok_per_s") & (speed["source"] == "client")]
    ok = df[df["status"] == "ok"]
    quality = ok[(ok["profiler"] == contract.QUALITY_PHASE) & (ok["metric"] == "kl_div_mean")]
    if speed.empty or quality.empty:
        raise MissingData("treatment frontier: needs decode tok_per_s speed rows and kl_div_mean quality rows")
    kl = quality.groupby(_KEYS)["value"].median().rename("kl")
    points = speed.groupby(_KEYS)["value"].agg(tok_s="median", lo="min", hi="max").join(kl, how="inner")
    info = speed.drop_duplicates(_KEYS).set_index(_KEYS)
    cols = config_columns(speed, exclude=(*TREATMENTS, "context_tokens"))
    wanted = [*cols, "context_tokens", "cache_capacity", "resolved_capacity", "lossy", *TREATMENTS]
    points = points.join(info[[c for c in dict.fromkeys(wanted) if c in info.columns]]).reset_index()
    points["treatment"] = [_treatment(r.get("kv_dtype"), r.get("expert_quant")) for _, r in points.iterrows()]
    if points.empty or not _lossy(points).any():
        raise MissingData("treatment frontier: no lossy run here (every job is exact: KV in the model's dtype, "
                          "experts unquantised), so there is no speed-for-quality trade to draw; it needs a lossy "
                          "treatment such as kv.dtype=q8 or experts.quant=int8 (experiment=kv_vs_residency)")
    treatments = sorted(points["treatment"].unique(), key=lambda t: (not t.endswith("(exact)"), t))
    marks = markers(treatments)
    points, series = configs(points, cols)
    points = points.assign(slots=_auto_slots(points))
    contexts = (ordered(points["context_tokens"]) if "context_tokens" in points.columns else []) or [None]
    fig = Figure(figsize=(max(4.4 * len(contexts) + 1.0, 7.5), 5.2), layout="constrained")
    axes = fig.subplots(1, len(contexts), squeeze=False)[0]
    named = []
    for ax, ctx in zip(axes, contexts):
        here = points if ctx is None else points[points["context_tokens"] == ctx]
        for (config, treatment), g in here.groupby(["config", "treatment"], sort=False):
            ax.errorbar(g["kl"], g["tok_s"], yerr=[g["tok_s"] - g["lo"], g["hi"] - g["tok_s"]], marker=marks[treatment],
                        linestyle="none", color=series[config].color, capsize=3, clip_on=False, label="_nolegend_")
        front = pareto_front(here)
        ax.plot(front["kl"], front["tok_s"], color="0.4", linestyle="--", linewidth=1, label="frontier")
        positive = here["kl"][here["kl"] > 0]
        # linear up to a tenth of the smallest loss, so every lossy point sits on the log part among decade ticks
        ax.set_xscale("symlog", linthresh=float(positive.min()) / 10 if len(positive) else 1e-6)
        ax.set_xlim(left=0)                 # KL is never negative: exact runs sit on the axis
        ax.set_xlabel("quality lost: mean KL(reference || treatment), nats\n(lower is better)")
        ax.set_ylabel("decode tok/s (higher is better)")
        ax.set_title(f"context {fmt(ctx)} tokens" if ctx is not None else "")
        ax.grid(alpha=0.3)
        from_zero(ax)
        named.append((ax, [(r["kl"], r["tok_s"], r["slots"]) for _, r in here.iterrows() if r["slots"]]))
    legend(fig, axes, extra=[*(Patch(facecolor=st.color, label=label) for label, st in series.items()),
                             *(Line2D([], [], color="0.3", marker=marks[t], linestyle="none", label=t)
                               for t in treatments)])
    budget = sorted({str(v) for v in info.get("device_memory", pd.Series(dtype=object)).dropna()})
    mark_emulated(fig, df[df["job_id"].isin(points["job_id"])],
                  "Speed vs quality of each KV / expert treatment" + (f" at {', '.join(budget)}" if budget else ""))
    for ax, pts in named:                 # last: placing them lays the finished figure out
        label_points(fig, ax, pts)
    return fig
