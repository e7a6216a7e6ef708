"""Predicted vs measured: predict every job of a measured table, join on the job's factors and
phase, and report the error -- itself a column (DESIGN.md §8) -- two ways.

Owns: `job_inputs` (what a job dir says beyond its rows: the model it ran, from the manifest,
and the routing it recorded, `routing.npz` from `run.record_trace=true`), `predict_for`
(predicted rows, source="model", for the jobs of a measured table), `prediction_errors` (the
join, with `pred_over_measured` = predicted / measured and `abs_err` = |predicted - measured| /
measured),
`two_ways` (both comparisons in one table, column `counts`) and `summarize` /
`summarize_two_ways` (median, p90 and max of abs_err per placement). Does not own: the model
(harness.costmodel.timemodel) or loading results (harness.results.load).

The two ways (`counts=`):
  "simulated"  the honest prediction, and the headline: each phase's expert hits and misses
               come from routing replayed through the job's cache policy -- the job's own
               recorded trace when it wrote one, else `routing` (default: uniform synthetic).
               Nothing measured about the run but its configuration goes in.
  "measured"   the measured engine rows' hits, misses and streamed experts replace the
               simulated ones, so the comparison tests the time model alone.

    from harness import results
    from harness.costmodel import load_profile
    from harness.costmodel.validate import job_inputs, two_ways, summarize_two_ways
    measured = results.load("results/sweeps/my-sweep")
    table = two_ways(measured, load_profile("measured"), inputs=job_inputs("results/sweeps/my-sweep"))
    print(summarize_two_ways(table))

Measured rows used: status ok, the given profiler (default "none": speed rows; instrumented
passes are ignored), the four timed phases (load and kv_offload are not predicted), repeats
pooled over jobs with equal factors. `stat="median"` compares with the median repeat;
`stat="best"` with the fastest one (min time_s, max tok_per_s) -- on a shared machine the two
differ by what other processes did.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.config import PRESETS, ModelConfig
from engine.dtypes import DTYPE_NAMES, dtype_bytes
from engine.trace import load_trace
from harness.config import ModelConf, expert_quant_of, model_config_of
from harness.contract import SPEED_PROFILER, profiled_rows
from harness.costmodel.timemodel import predict
from harness.costmodel.profiles import HardwareProfile
from harness.costmodel.passcost import expert_bytes
from harness.costmodel.work import PHASES, PlacementSpec, Routing, WorkloadShape
from engine.kvquant import KV_DTYPES
from harness.results import FACTOR_COLUMNS, MANIFEST_FILE, job_complete

log = logging.getLogger(__name__)
OPTIONAL_KEYS = ("placement_options", "ubatch")     # extra columns joined on when both tables have them
STATS = ("median", "best")
COUNTS = ("simulated", "measured")                  # the headline first
HIGHER_IS_BETTER = {"tok_per_s"}
TRACE_FILE = "routing.npz"                          # what run.record_trace=true writes in the job dir
_NA = "<na>"


def measured_rows(measured: pd.DataFrame, profiler: str = SPEED_PROFILER) -> pd.DataFrame:
    """The rows predictions are compared with: the contract's rows of `profiler` (default: the
    speed rows, `harness.contract.profiled_rows`) in the phases the model predicts, as the
    client or the engine measured them."""
    df = profiled_rows(measured, profiler)
    return df[df["phase"].isin(PHASES) & df["source"].isin(["client", "engine"])]


# --- what a job dir says beyond its rows ------------------------------------------------------
@dataclass(frozen=True)
class JobInputs:
    """A measured job's model (as harness.config resolves its `model` node: preset or
    checkpoint, truncation) and its recorded routing trace, if any."""

    cfg: ModelConfig
    trace: Path | None = None


def job_inputs(root: str | Path) -> dict[tuple[str, str], JobInputs]:
    """(sweep_id, job_id) -> JobInputs for every complete job dir under `root`."""
    out: dict[tuple[str, str], JobInputs] = {}
    fields = {f.name for f in dataclasses.fields(ModelConf)}
    for manifest in sorted(Path(root).rglob(MANIFEST_FILE)):
        job_dir = manifest.parent
        if not job_complete(job_dir):
            continue
        m = json.loads(manifest.read_text())
        model = (m.get("config") or {}).get("model")
        if not model or m.get("sweep_id") is None or m.get("job_id") is None:
            continue
        try:
            cfg = model_config_of(ModelConf(**{k: v for k, v in model.items() if k in fields}))
            experts = (m.get("config") or {}).get("experts")
            quant = expert_quant_of(experts, cfg) if experts else None      # the stored bytes the job moved
            if quant is not None:
                cfg = cfg.replace(expert_quant=quant)
        except ValueError as exc:              # a checkpoint (or popularity file) that moved since the run
            log.warning("%s: cannot resolve the job's model (%s); it is predicted from its name if a preset", job_dir, exc)
            continue
        trace = job_dir / TRACE_FILE
        out[(str(m["sweep_id"]), str(m["job_id"]))] = JobInputs(cfg, trace if trace.is_file() else None)
    return out


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


def predict_for(measured: pd.DataFrame, profile: HardwareProfile, *, counts: str = "simulated",
                routing: Routing | None = None, inputs: Mapping[tuple[str, str], JobInputs] | None = None,
                overlap: str | float = "auto") -> pd.DataFrame:
    """Predicted rows (source="model") for every distinct job of `measured`, with column
    `counts` saying where the cache traffic came from (module docstring): "simulated" replays
    the job's recorded trace (from `inputs`) or else `routing` (default: uniform synthetic);
    "measured" takes the measured engine rows' counts. `inputs` (`job_inputs(root)`) also
    gives the job's model; without it the factor `model` must name an untruncated preset."""
    if counts not in COUNTS:
        raise ValueError(f"counts: allowed {list(COUNTS)}, got {counts!r}")
    df = measured_rows(measured)
    if df.empty:
        raise ValueError("no measured speed rows (status ok, profiler none, phases "
                         f"{list(PHASES)}) to predict for")
    inputs = inputs or {}
    rows: list[dict[str, Any]] = []
    for key, job in _jobs(df):
        found = [inputs[k] for k in zip(job["sweep_id"].astype(str), job["job_id"].astype(str)) if k in inputs]
        cfg = found[0].cfg if found else PRESETS.get(key["model"])
        if cfg is None:
            log.warning("skipping model %r: no job inputs (job_inputs(root)) and not a preset (known: %s)",
                        key["model"], ", ".join(sorted(PRESETS)))
            continue
        batch = int(key["batch"])
        cont = _median(job, "prefill_continuation", "tokens")
        shape = WorkloadShape(int(key["context_tokens"]), int(key["gen_tokens"]), batch,
                              turn_tokens=int(cont // batch) - 1 if cont else 64,
                              ubatch=int(key.get("ubatch") or 512),
                              kv_dtype=key["kv_dtype"] if key.get("kv_dtype") in KV_DTYPES else "model")
        options = ast.literal_eval(key["placement_options"]) if key.get("placement_options") else {}
        capacity = _capacity(key, job)
        spec = PlacementSpec.from_options(key["placement"], capacity, key["cache_policy"], options)
        dtype = key["dtype"] if key["dtype"] in DTYPE_NAMES else "float32"
        phase_counts, job_routing = None, routing
        if counts == "measured":
            phase_counts = _measured_counts(job, cfg, spec, dtype)
        else:
            traces = [i.trace for i in found if i.trace is not None]
            if traces:
                job_routing = Routing.from_trace(load_trace(traces[0]))
        p = predict(cfg, spec, shape, profile, dtype=dtype, routing=job_routing, counts=phase_counts, overlap=overlap)
        p.model = key["model"]
        # the prediction for this job carries the job's own factors and join keys (its requested
        # cache.capacity, e.g. "auto", not the resolved slots; its treatment), so the two join in
        # `prediction_errors`
        rows += [{**r, **key} for r in p.rows(sweep_id=f"model-{profile.name}", job_id=str(job["job_id"].iloc[0]),
                                              workload=key["workload"], extra={"counts": counts})]
    return pd.DataFrame(rows)


def _capacity(key: dict[str, Any], job: pd.DataFrame) -> int | None:
    if "resolved_capacity" in job.columns and job["resolved_capacity"].notna().any():
        return int(job["resolved_capacity"].dropna().iloc[0])
    cap = key.get("cache_capacity")
    return int(cap) if cap not in (None, "auto") else None


def _measured_counts(job: pd.DataFrame, cfg: ModelConfig, spec: PlacementSpec,
                     dtype: str) -> dict[str, dict[str, float]]:
    """Per phase: measured hits/misses, and for a streaming placement the experts it streamed
    (expert bytes moved beyond the misses' copies)."""
    out: dict[str, dict[str, float]] = {}
    eb = expert_bytes(cfg, dtype_bytes(dtype))
    for phase in PHASES:
        c: dict[str, float] = {}
        for m in ("expert_hits", "expert_misses"):
            v = _median(job, phase, m, "engine")
            if v is not None:
                c[m] = v
        if spec.traits(cfg).stream_threshold is not None:
            moved = _median(job, phase, "h2d_expert_bytes", "engine") or 0.0
            c["streamed"] = max(0.0, moved - c.get("expert_misses", 0.0) * eb) / eb
        if c:
            out[phase] = c
    return out


def prediction_errors(predicted: pd.DataFrame, measured: pd.DataFrame,
                      metrics: Sequence[str] = ("time_s", "tok_per_s"), stat: str = "median",
                      profiler: str = SPEED_PROFILER) -> pd.DataFrame:
    """One row per (job factors, phase, metric) present in both: predicted, measured
    (`stat` over repeats of the `profiler` pass: "none" = speed rows, "timeline" for the
    measured copy/overlap metrics), their spread, `pred_over_measured` and `abs_err`, and the
    prediction's `counts` and `routing` labels."""
    if stat not in STATS:
        raise ValueError(f"stat: allowed {list(STATS)}, got {stat!r}")
    meas = measured_rows(measured, profiler)
    meas = meas[meas["metric"].isin(metrics)]
    pred = predicted[(predicted["source"] == "model") & predicted["metric"].isin(metrics)]
    keys = [k for k in _keys(meas) if k in pred.columns] + ["phase", "metric"]
    m = _filled(meas, keys).groupby(keys, dropna=False)["value"]
    agg = pd.DataFrame({"measured_median": m.median(), "measured_min": m.min(), "measured_max": m.max(),
                        "n_measured": m.count()}).reset_index()
    labels = [c for c in ("counts", "routing") if c in pred.columns]
    p = _filled(pred, keys).groupby(keys, dropna=False).agg(
        predicted=("value", "first"), **{c: (c, "first") for c in labels}).reset_index()
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


def two_ways(measured: pd.DataFrame, profile: HardwareProfile, *, inputs: Mapping[tuple[str, str], JobInputs] | None = None,
             routing: Routing | None = None, stat: str = "median", metrics: Sequence[str] = ("time_s", "tok_per_s"),
             overlap: str | float = "auto") -> pd.DataFrame:
    """`prediction_errors` of both predictions (counts simulated -- the headline -- and measured) in one
    table, told apart by column `counts`."""
    return pd.concat([prediction_errors(predict_for(measured, profile, counts=c, routing=routing, inputs=inputs,
                                                    overlap=overlap), measured, metrics=metrics, stat=stat)
                      for c in COUNTS], ignore_index=True)


def summarize_two_ways(table: pd.DataFrame, by: Sequence[str] = ("placement",), metric: str = "time_s",
                       ways: Sequence[str] = COUNTS) -> pd.DataFrame:
    """One row per `by` group (and "all"): n and median/p90/max |error| of each `counts` label
    in `ways` (default: simulated -- the headline -- then measured), columns `<way>_median`, ..."""
    parts = []
    for c in ways:
        s = summarize(table[table["counts"] == c], by=by, metric=metric).set_index(list(by))
        cols = ["median_abs_err", "p90_abs_err", "max_abs_err"]
        parts.append(s[(["n"] if c == ways[0] else []) + cols].rename(columns={k: f"{c}_{k.removesuffix('_abs_err')}"
                                                                             for k in cols}))
    return pd.concat(parts, axis=1).reset_index()


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
