"""Predicted vs measured: predict every job of a measured table, join on the job's factors and
phase, and report the error -- itself a column (DESIGN.md §8).

Owns: `predict_for` (predicted rows, source="model", for the jobs of a measured table, with
cache traffic taken from the measured rows or simulated), `compare` (the join, with
`pred_over_measured` = predicted / measured and `abs_err` = |predicted - measured| / measured)
and `summarize` (median, p90 and max of abs_err per placement). Does not own: the model
(harness.costmodel.timemodel) or loading results (harness.results.load).

    from harness import results
    from harness.costmodel import load_profile
    from harness.costmodel.validate import predict_for, compare, summarize
    measured = results.load("results/sweeps/my-sweep")
    predicted = predict_for(measured, load_profile("measured"))
    table = compare(predicted, measured)             # one row per (job factors, phase, metric)
    print(summarize(table))

Measured rows used: status ok, profiler "none" (speed rows; instrumented passes are ignored),
the four timed phases (load is not predicted), repeats pooled over jobs with equal factors.
`stat="median"` compares with the median repeat; `stat="best"` with the fastest one (min
time_s, max tok_per_s) -- on a shared machine the two differ by what other processes did.
"""
from __future__ import annotations

import ast
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from engine.config import PRESETS
from engine.dtypes import DTYPE_NAMES, dtype_bytes
from harness.costmodel.timemodel import predict
from harness.costmodel.profiles import HardwareProfile
from harness.costmodel.work import PHASES, PlacementSpec, Routing, WorkloadShape, expert_bytes, kv_bytes
from harness.results import FACTOR_COLUMNS

log = logging.getLogger(__name__)
OPTIONAL_KEYS = ("placement_options", "ubatch")     # extra columns joined on when both tables have them
STATS = ("median", "best")
HIGHER_IS_BETTER = {"tok_per_s"}
_NA = "<na>"


def speed_rows(measured: pd.DataFrame) -> pd.DataFrame:
    """The rows predictions are compared with (see the module docstring)."""
    df = measured[(measured["status"] == "ok") & measured["phase"].isin(PHASES)]
    if "profiler" in df.columns:
        df = df[df["profiler"].fillna("none") == "none"]
    return df[df["source"].isin(["client", "engine"])]


def _keys(df: pd.DataFrame) -> list[str]:
    return [*FACTOR_COLUMNS, *[k for k in OPTIONAL_KEYS if k in df.columns]]


def _jobs(df: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    keys = _keys(df)
    filled = df[keys].astype(object).where(df[keys].notna(), _NA)
    out = []
    for _, idx in filled.groupby(keys, sort=True, dropna=False).groups.items():
        rows = df.loc[idx]
        first = rows.iloc[0]
        out.append(({k: (None if pd.isna(first[k]) else first[k]) for k in keys}, rows))
    return out


def _median(rows: pd.DataFrame, phase: str, metric: str, source: str | None = None) -> float | None:
    sel = rows[(rows["phase"] == phase) & (rows["metric"] == metric)]
    if source is not None:
        sel = sel[sel["source"] == source]
    vals = sel["value"].dropna()
    return float(vals.median()) if len(vals) else None


def predict_for(measured: pd.DataFrame, profile: HardwareProfile, *, counts: str = "measured",
                routing: Routing | None = None, overlap: str | float = "auto") -> pd.DataFrame:
    """Predicted rows (source="model") for every distinct job of `measured`.

    counts="measured": each phase's expert hits/misses (and streamed experts) come from the
    measured engine rows, so the comparison tests the time model alone; "simulated": they
    come from `routing` (default: uniform synthetic) replayed through the cache policy."""
    if counts not in ("measured", "simulated"):
        raise ValueError(f"counts: allowed ['measured', 'simulated'], got {counts!r}")
    df = speed_rows(measured)
    if df.empty:
        raise ValueError("no measured speed rows (status ok, profiler none, phases "
                         f"{list(PHASES)}) to predict for")
    rows: list[dict[str, Any]] = []
    for key, job in _jobs(df):
        if key["model"] not in PRESETS:
            log.warning("skipping model %r: predictions need a preset's shapes (known: %s)", key["model"],
                        ", ".join(sorted(PRESETS)))
            continue
        cfg = PRESETS[key["model"]]
        batch = int(key["batch"])
        cont = _median(job, "prefill_continuation", "tokens")
        shape = WorkloadShape(int(key["context_tokens"]), int(key["gen_tokens"]), batch,
                              turn_tokens=int(cont // batch) - 1 if cont else 64,
                              ubatch=int(key.get("ubatch") or 512))
        options = ast.literal_eval(key["placement_options"]) if key.get("placement_options") else {}
        capacity = _capacity(key, job)
        spec = PlacementSpec.from_options(key["placement"], capacity, key["cache_policy"], options)
        dtype = key["dtype"] if key["dtype"] in DTYPE_NAMES else "float32"
        phase_counts = _measured_counts(job, cfg, spec, shape, dtype) if counts == "measured" else None
        p = predict(cfg, spec, shape, profile, dtype=dtype, routing=routing, counts=phase_counts, overlap=overlap)
        p.model = key["model"]
        extra = {k: key[k] for k in OPTIONAL_KEYS if k in key}
        rows += p.rows(sweep_id=f"model-{profile.name}", job_id=str(job["job_id"].iloc[0]),
                       workload=key["workload"], extra=extra)
    return pd.DataFrame(rows)


def _capacity(key: dict[str, Any], job: pd.DataFrame) -> int | None:
    if "resolved_capacity" in job.columns and job["resolved_capacity"].notna().any():
        return int(job["resolved_capacity"].dropna().iloc[0])
    cap = key.get("cache_capacity")
    return int(cap) if cap not in (None, "auto") else None


def _measured_counts(job: pd.DataFrame, cfg, spec: PlacementSpec, shape: WorkloadShape,
                     dtype: str) -> dict[str, dict[str, float]]:
    """Per phase: measured hits/misses, and for stream the experts it streamed (from bytes)."""
    out: dict[str, dict[str, float]] = {}
    dt = dtype_bytes(dtype)
    eb = expert_bytes(cfg, dt)
    for phase in PHASES:
        c: dict[str, float] = {}
        for m in ("expert_hits", "expert_misses"):
            v = _median(job, phase, m, "engine")
            if v is not None:
                c[m] = v
        if spec.traits(cfg).stream_threshold is not None:
            h2d = _median(job, phase, "h2d_bytes", "engine") or 0.0
            kv = kv_bytes(cfg, _restored_tokens(shape), shape.batch, dt) if phase == "prefill_restored" else 0
            c["streamed"] = max(0.0, h2d - c.get("expert_misses", 0.0) * eb - kv) / eb
        if c:
            out[phase] = c
    return out


def _restored_tokens(shape: WorkloadShape) -> int:
    return shape.context_tokens + shape.gen_tokens - 1 + shape.turn_tokens + 1


def compare(predicted: pd.DataFrame, measured: pd.DataFrame, metrics: Sequence[str] = ("time_s", "tok_per_s"),
            stat: str = "median") -> pd.DataFrame:
    """One row per (job factors, phase, metric) present in both: predicted, measured
    (`stat` over repeats), their spread, `pred_over_measured` and `abs_err`."""
    if stat not in STATS:
        raise ValueError(f"stat: allowed {list(STATS)}, got {stat!r}")
    meas = speed_rows(measured)
    meas = meas[meas["metric"].isin(metrics)]
    pred = predicted[(predicted["source"] == "model") & predicted["metric"].isin(metrics)]
    keys = [k for k in _keys(meas) if k in pred.columns] + ["phase", "metric"]
    m = _filled(meas, keys).groupby(keys, dropna=False)["value"]
    agg = pd.DataFrame({"measured_median": m.median(), "measured_min": m.min(), "measured_max": m.max(),
                        "n_measured": m.count()}).reset_index()
    p = _filled(pred, keys).groupby(keys, dropna=False)["value"].first().rename("predicted").reset_index()
    out = p.merge(agg, on=keys, how="inner")
    if out.empty:
        raise ValueError(f"no predicted row matches a measured one on {keys}")
    higher = out["metric"].isin(HIGHER_IS_BETTER)
    if stat == "median":
        out["measured"] = out["measured_median"]
    else:
        out["measured"] = np.where(higher, out["measured_max"], out["measured_min"])
    out["pred_over_measured"] = out["predicted"] / out["measured"]
    out["abs_err"] = (out["predicted"] - out["measured"]).abs() / out["measured"]
    out["stat"] = stat
    for k in keys:                                   # back to nulls and numbers
        out[k] = out[k].where(out[k] != _NA, None)
        if k in ("context_tokens", "gen_tokens", "batch", "ubatch"):
            out[k] = pd.to_numeric(out[k]).astype("Int64")
    return out


def _filled(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Key columns as comparable text: nulls as a marker, 512 and 512.0 alike."""
    df = df.copy()
    for k in keys:
        df[k] = [_NA if v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA
                 else str(int(v)) if isinstance(v, (float, np.floating)) and float(v).is_integer()
                 else str(v) for v in df[k].tolist()]
    return df


def summarize(table: pd.DataFrame, by: Sequence[str] = ("placement",), metric: str = "time_s") -> pd.DataFrame:
    """The error distribution of `metric`: count, median, p90 and max of abs_err, and the
    median pred_over_measured, per `by` group and over all ("all")."""
    t = table[table["metric"] == metric]

    def stats(g: pd.DataFrame) -> dict[str, float]:
        e = g["abs_err"].to_numpy()
        return {"n": len(e), "median_abs_err": float(np.median(e)), "p90_abs_err": float(np.quantile(e, 0.9)),
                "max_abs_err": float(e.max()), "median_pred_over_measured": float(g["pred_over_measured"].median())}

    rows = [{**dict(zip(by, key if isinstance(key, tuple) else (key,))), **stats(g)}
            for key, g in t.groupby(list(by), dropna=False)]
    rows.append({**dict.fromkeys(by, "all"), **stats(t)})
    return pd.DataFrame(rows)
