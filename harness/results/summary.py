"""Summaries of a long results table: medians with their spread (DESIGN.md rule 7.7).

Owns: `spread_table` (one row per job, phase, source and metric: n, median, min, p25, p75, max
-- what summary.csv holds and terminal tables print) and `summarize` (wide: one row per job,
phase and source, one column of medians per metric, for notebooks). Both read only speed rows
(`harness.contract.speed_rows`: status ok, no instrumentation) and keep engine, client and
model values apart by `source`. Flagged repeats (harness.outliers: an outlier against their
siblings, or starved of CPU) are left out of the statistics; each row says how many of its
phase's repeats were (`n_flagged`) and by which flag (`flagged`), and whether the phase passed
its reference check (`check_ok`, null where not judged; `check_failed`: repeats beyond tolerance,
harness.checks). A failed job appears as a row with status "failed" and its error text. Does not
own: files (harness.results.store), the rules behind the flags.
"""
from __future__ import annotations

import pandas as pd

from harness import outliers
from harness.checks import phase_checks
from harness.contract import METRIC_UNITS, phase_rank, speed_rows
from harness.results.schema import DEVICE_COLUMNS, FACTOR_COLUMNS

SUMMARY_KEYS = ["sweep_id", "job_id", *FACTOR_COLUMNS, *DEVICE_COLUMNS, "phase", "source"]
SPREAD_STATS = ("n", "median", "min", "p25", "p75", "max")
FLAG_COLUMNS = ("check_ok", "check_failed", "n_flagged", "flagged")     # per (job, phase)


def _failed(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    failed = df[df["status"] == "failed"]
    failed = failed.assign(error=failed["error"] if "error" in failed.columns else pd.NA)
    return failed[[*SUMMARY_KEYS, "status", "error"]].drop_duplicates().reindex(columns=columns)


def _ordered(out: pd.DataFrame, df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Jobs in the order they appear in `df`, phases in the contract's order."""
    job_order = {j: i for i, j in enumerate(dict.fromkeys(zip(df["sweep_id"], df["job_id"])))}
    out = out.assign(_job=[job_order[k] for k in zip(out["sweep_id"], out["job_id"])],
                     _phase=[phase_rank(p) for p in out["phase"]])
    return out.sort_values(["_job", "_phase", *by], kind="stable").drop(columns=["_job", "_phase"]) \
        .reset_index(drop=True)


def _measured(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the speed rows no flag excludes, per (job, phase) the FLAG_COLUMNS)."""
    speed = speed_rows(df)
    flagged = outliers.flagged_windows(df)
    per_phase = phase_checks(df).merge(outliers.phase_flags(flagged), on=["sweep_id", "job_id", "phase"], how="outer")
    return outliers.kept(speed, flagged), per_phase


def _with_flags(stats: pd.DataFrame, per_phase: pd.DataFrame) -> pd.DataFrame:
    keys = ["sweep_id", "job_id", "phase"]
    out = stats.merge(per_phase, on=keys, how="left") if len(per_phase) else stats.assign(
        **dict.fromkeys(FLAG_COLUMNS, pd.NA))
    return out.assign(n_flagged=out["n_flagged"].fillna(0))


def _typed(out: pd.DataFrame) -> pd.DataFrame:
    """Counts as nullable integers, the check as a nullable bool (after concatenating failed jobs)."""
    return out.astype({"check_failed": "Int64", "n_flagged": "Int64", "check_ok": "boolean"})


def spread_table(df: pd.DataFrame) -> pd.DataFrame:
    """Long summary: per (job, phase, source, metric) the number of measured values and their
    median, min, 25th/75th percentiles and max, over the repeats no flag excludes, with the
    phase's FLAG_COLUMNS. Nulls are not values: a metric never measured has n = 0 and null
    statistics."""
    ok, per_phase = _measured(df)
    g = ok.groupby([*SUMMARY_KEYS, "metric"], dropna=False, sort=False)["value"]
    stats = pd.DataFrame({"n": g.count(), "median": g.median(), "min": g.min(),
                          "p25": g.quantile(0.25), "p75": g.quantile(0.75), "max": g.max()}).reset_index()
    stats["unit"] = [METRIC_UNITS.get(m) for m in stats["metric"]]
    if "unit" in ok.columns:   # metrics outside the contract carry their own unit
        units = ok.drop_duplicates("metric").set_index("metric")["unit"]
        stats["unit"] = stats["unit"].fillna(stats["metric"].map(units))
    stats["status"], stats["error"] = "ok", pd.NA
    stats = _with_flags(stats, per_phase)
    columns = [*SUMMARY_KEYS, "status", "metric", "unit", *SPREAD_STATS, *FLAG_COLUMNS, "error"]
    parts = [p for p in (stats.reindex(columns=columns), _failed(df, columns)) if len(p)]
    if not parts:
        return pd.DataFrame(columns=columns)
    out = pd.concat(parts, ignore_index=True)
    out = _typed(out)
    out["n"] = out["n"].astype("Int64")
    metric_rank = {m: i for i, m in enumerate(METRIC_UNITS)}
    out["_metric"] = [metric_rank.get(m, len(metric_rank)) for m in out["metric"]]
    return _ordered(out, df, ["source", "_metric", "metric"]).drop(columns=["_metric"])


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Wide table: one row per (job, phase, source), one column of medians per metric over the
    repeats no flag excludes, `n_repeats` (those repeats; null for rows that are no measurement,
    such as source=model) and the phase's FLAG_COLUMNS. A failed job is a row with status
    "failed" and its `error` text."""
    ok, per_phase = _measured(df)
    wide = (ok.groupby([*SUMMARY_KEYS, "metric"], dropna=False, sort=False)["value"].median()
            .unstack("metric"))
    n_repeats = ok.groupby(SUMMARY_KEYS, dropna=False, sort=False)["repeat"].nunique()
    n_repeats = n_repeats.where(n_repeats > 0)     # model rows (a roofline) are not repeats: null, not 0
    wide = wide.assign(n_repeats=n_repeats).reset_index()
    metrics = [m for m in METRIC_UNITS if m in wide.columns]
    metrics += sorted(c for c in wide.columns if c not in metrics and c not in SUMMARY_KEYS and c != "n_repeats")
    wide["status"] = "ok"
    wide["error"] = pd.NA
    wide = _with_flags(wide, per_phase)
    columns = [*SUMMARY_KEYS, "status", "n_repeats", *metrics, *FLAG_COLUMNS, "error"]
    parts = [p for p in (wide.reindex(columns=columns), _failed(df, columns)) if len(p)]
    if not parts:
        return pd.DataFrame(columns=columns)
    out = _ordered(pd.concat(parts, ignore_index=True), df, ["phase", "source"])
    out = _typed(out)
    out["n_repeats"] = out["n_repeats"].astype("Int64")
    return out
