"""One readable table per sweep, llama-bench style: one row per configuration, only the factors
that vary as columns, key metrics per phase as median ± spread, each job's reference check
(`ok`, `FAIL (2 of 12)`: phase-repeats beyond tolerance of those judged, `—`: not judged) and
its flagged repeats, failed jobs with the first line of their error -- and `moebench table DIR
--format md|csv|json|latex` to print it from any results dir for pasting into issues and papers.

Owns: which metrics the table shows by default (`COLUMNS`), how a cell is summarised (median of
the speed rows' repeats -- flagged repeats excluded, harness.outliers --, ± half the min-max
range, n), the lines under it (`notes`: check failures counted, what a flag means), and the four
text formats. Does not own: loading (harness.results.load), the per-job detail tables
(harness.report), the check and flag rules (harness.checks, harness.outliers).

    from harness.table import sweep_table, render
    t = sweep_table(results.load("results/sweeps/s1"))
    print(render(t, "md"))
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from harness import outliers
from harness.checks import job_checks
from harness.contract import QUALITY_PHASE, SERVE_PHASE, repeat_rows
from harness.model_id import WEIGHTS_CAVEATS, weights_label
from harness.order import natural_key
from harness.results import CONFIG_COLUMNS

FORMATS = ("md", "csv", "json", "latex")
PREDICTION = "prediction"          # the prediction pass's rows (harness.passes.prediction)
SERVE = SERVE_PHASE                # the serve pass's rows: its phase and its profiler label (harness.passes.serve)


@dataclass(frozen=True)
class Column:
    label: str
    phase: str
    metric: str
    source: str                 # never mixed (DESIGN.md §5): speeds as the client saw them, counters from the engine
    scale: float = 1.0
    fmt: str = ".3f"
    # the rows it reads: the measured repeats' (`none`, flagged ones excluded) or a pass's own
    # (`quality`: one measurement per job, shown where a job has one)
    profiler: str = "none"


COLUMNS = (Column("pp tok/s", "prefill_fresh", "tok_per_s", "client", fmt=".1f"),
           Column("TTFT s", "prefill_fresh", "ttft_s", "client", fmt=".4f"),
           Column("tg tok/s", "decode", "tok_per_s", "client", fmt=".1f"),
           Column("TPOT p50 ms", "decode", "tpot_s_p50", "client", 1e-3, fmt=".2f"),
           Column("cont. TTFT s", "prefill_continuation", "ttft_s", "client", fmt=".4f"),
           Column("restored TTFT s", "prefill_restored", "ttft_s", "client", fmt=".4f"),
           Column("decode hit rate", "decode", "hit_rate", "engine"),
           Column("decode h2d MiB", "decode", "h2d_bytes", "engine", 2**20, fmt=".2f"),
           Column("max|Δlogit|", "decode", "max_abs_logit_diff", "engine", fmt=".1e"),
           Column("max|Δlogprob|", "decode", "max_abs_logprob_diff", "engine", fmt=".1e"),   # top-k only (llama.cpp)
           Column("token agr.", "decode", "token_agreement", "engine"),
           # the quality pass against the exact reference (0 and 1 for an exact run; null with its
           # reason where the pass did not run or the engine gives no per-position logits)
           Column("KL mean", QUALITY_PHASE, "kl_div_mean", "engine", fmt=".2e", profiler=QUALITY_PHASE),
           Column("top-1 agr.", QUALITY_PHASE, "top1_agreement", "engine", profiler=QUALITY_PHASE),
           # the prediction pass: the cost model's figure for the job's own config on this machine's
           # calibrated profile, and measured / predicted - 1 (shown where a profile made one)
           Column("pred pp tok/s", "prefill_fresh", "predicted_tok_per_s", "model", fmt=".1f", profiler=PREDICTION),
           Column("pp resid.", "prefill_fresh", "prediction_residual", "model", fmt="+.2f", profiler=PREDICTION),
           Column("pred tg tok/s", "decode", "predicted_tok_per_s", "model", fmt=".1f", profiler=PREDICTION),
           Column("tg resid.", "decode", "prediction_residual", "model", fmt="+.2f", profiler=PREDICTION),
           # the serve pass (load=...): the measured window's summary, and the batch the engine saw
           Column("req/s", SERVE, "request_throughput", "client", fmt=".2f", profiler=SERVE),
           Column("out tok/s", SERVE, "output_throughput", "client", fmt=".1f", profiler=SERVE),
           Column("TTFT p99 s", SERVE, "ttft_s_p99", "client", fmt=".4f", profiler=SERVE),
           Column("TPOT p99 ms", SERVE, "tpot_s_p99", "client", 1e-3, fmt=".2f", profiler=SERVE),
           Column("goodput req/s", SERVE, "request_goodput", "client", fmt=".2f", profiler=SERVE),
           Column("seqs/step", SERVE, "sequences_per_step", "engine", fmt=".2f", profiler=SERVE),
           Column("experts/layer/step", SERVE, "distinct_experts_per_layer_step", "engine", fmt=".2f",
                  profiler=SERVE),
           Column("serve hit rate", SERVE, "serve_hit_rate", "engine", profiler=SERVE))

# per job beside the metric columns: the expert-cache slots per layer its engine resolved (what
# cache.capacity=auto or cache.capacity_bytes came to; rows' `resolved_capacity`), the reference
# check (harness.checks) and the flagged repeats (harness.outliers); "cache slots", "check" and
# "flagged repeats" are shown, the rest are for csv/json readers
SLOTS, CHECK, FLAGGED = "cache slots", "check", "flagged repeats"
WEIGHTS = "weights"             # what the job's model's weights are (harness.model_id.weights_label)
JOB_COLUMNS = (SLOTS, CHECK, "check failed", "check judged", "check reason", FLAGGED, "flagged n", WEIGHTS)


JOB = ["sweep_id", "job_id"]     # a job's identity: job ids repeat across sweeps (every single run is "run")


def _per_job(df: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """Each job's value of each column: its first non-null one (a job's early rows may lack a
    column its engine adds later, e.g. llama.cpp's knobs after the load)."""
    return df.groupby(JOB, sort=False)[cols].first()


def _varying(df: pd.DataFrame) -> list[str]:
    """The columns that tell the jobs apart: the config columns that vary, and the sweep id
    where the rows come from several sweeps (the same config measured twice is two rows)."""
    cols = [c for c in CONFIG_COLUMNS if c in df.columns]
    per_job = _per_job(df, cols)
    # a failed job's row leaves unset what it never reached: its nulls are no setting, so no difference
    failed = df["status"].eq("failed").groupby([df[k] for k in JOB], sort=False).any().reindex(per_job.index)
    varying = [c for c in cols if per_job[c][~(failed & per_job[c].isna())].astype(str).nunique(dropna=False) > 1]
    varying = varying or ["placement"]
    return ["sweep_id", *varying] if df["sweep_id"].nunique() > 1 else varying


def sweep_table(df: pd.DataFrame, columns: Sequence[Column] = COLUMNS) -> pd.DataFrame:
    """One row per job: the varying factors, then per column `<label>` (median), `<label> ±`
    (half the min-max range over repeats), `<label> n` and `<label> source` -- over the repeats no
    flag excludes, or a pass's own rows --, the job's `JOB_COLUMNS`; failed jobs get
    `status`/`error`. A pass's columns (the quality pass's) and the cache slots are there when some
    job has them: results of runs without the pass keep the columns they always had."""
    factors = _varying(df)
    values = _per_job(df, [c for c in factors if c != "sweep_id"])
    rows_of = {"none": outliers.kept(repeat_rows(df))}                     # the measured repeats
    for profiler in {c.profiler for c in columns} - {"none"}:
        mask = (df["status"] == "ok") & df["value"].notna() & (df["profiler"] == profiler) if "profiler" in df else None
        rows_of[profiler] = df[mask] if mask is not None else df.iloc[:0]
    columns = [c for c in columns if c.profiler == "none" or
               ((rows_of[c.profiler]["metric"] == c.metric) & (rows_of[c.profiler]["phase"] == c.phase)).any()]
    slots = _per_job(df, ["resolved_capacity"])["resolved_capacity"] if _has(df, "resolved_capacity") else None
    checks, flags = job_checks(df), outliers.job_flags(df)
    out = []
    for job_key, job in df.groupby(JOB, sort=False):
        row = {c: job[c].iloc[0] if c == "sweep_id" else values.loc[job_key, c] for c in factors}
        failed = job[job["status"] == "failed"]
        row["status"] = "failed" if len(failed) else "ok"
        row["error"] = str(failed.iloc[0].get("error", "")).splitlines()[0] if len(failed) else None
        if slots is not None:
            row[SLOTS] = None if pd.isna(slots.loc[job_key]) else int(float(slots.loc[job_key]))
        for col in columns:
            rows = rows_of[col.profiler]
            mine = rows[(rows["sweep_id"] == job_key[0]) & (rows["job_id"] == job_key[1])]
            here = mine[(mine["phase"] == col.phase) & (mine["metric"] == col.metric)]
            # the column's source; a job that has only another (llama-bench imports: the engine's
            # own timings) shows that one, labelled -- one source per cell, never mixed
            source = col.source if (here["source"] == col.source).any() else next(iter(sorted(set(here["source"]))), None)
            vals = here[here["source"] == source]["value"].dropna()
            row[col.label] = float(vals.median()) / col.scale if len(vals) else None
            row[f"{col.label} ±"] = float(vals.max() - vals.min()) / 2 / col.scale if len(vals) > 1 else None
            row[f"{col.label} n"] = int(len(vals))
            row[f"{col.label} source"] = source if len(vals) else None
        check, flag = checks.get(job_key), flags.get(job_key)
        row.update({CHECK: check.text() if check else "—", "check failed": check.failed if check else None,
                    "check judged": check.judged if check else None, "check reason": check.reason if check else None,
                    FLAGGED: flag.text() if flag else None, "flagged n": flag.flagged if flag else None,
                    WEIGHTS: weights_label(str(job["model"].iloc[0])) if "model" in job else None})
        out.append(row)
    # numeric factors in their natural order (contexts 512 < 1024, not as text, whatever order
    # the jobs' files were read in); text factors (placements) keep the sweep's order
    first_seen = {c: {v: i for i, v in enumerate(dict.fromkeys(str(r[c]) for r in out))} for c in factors}

    def rank(c: str, v: object) -> tuple:
        k = natural_key(v)
        return (1, first_seen[c][str(v)]) if k[0] == 1 else k[:2]        # text: its first appearance

    def key(r: dict) -> tuple:
        return tuple(rank(c, r[c]) for c in factors)

    out.sort(key=key)
    types = {"check failed": "Int64", "check judged": "Int64", "flagged n": "Int64"}
    return pd.DataFrame(out).astype({**types, **({SLOTS: "Int64"} if slots is not None else {})})


def _missing(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _cell(value: float | None, spread: float | None, fmt: str) -> str:
    if _missing(value):
        return "—"
    text = format(value, fmt)
    return text if _missing(spread) else f"{text} ± {format(spread, fmt)}"


def display_rows(t: pd.DataFrame, columns: Sequence[Column] = COLUMNS) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of text cells: factors, then 'median ± spread' per metric column that has
    any value, the check and flagged repeats, then the error of failed jobs."""
    factors = [c for c in t.columns if c not in ("status", "error", *JOB_COLUMNS) and not any(
        c == col.label or c.startswith(col.label + " ") for col in columns)]
    shown = [col for col in columns if col.label in t and t[col.label].notna().any()]
    # beside the factors the slots where any job's engine resolved some; after the metrics the
    # check where any job carries one, the flags where any job has measured repeats
    slots = [SLOTS] if _has(t, SLOTS) else []
    per_job = [c for c, shows in ((CHECK, _has(t, "check judged")), (FLAGGED, _has(t, FLAGGED))) if shows]
    header = [*factors, *slots, *(col.label for col in shown), *per_job] + \
        (["error"] if (t["status"] == "failed").any() else [])
    rows = []
    for _, r in t.iterrows():
        cells = ["—" if pd.isna(r[c]) else str(r[c]) for c in [*factors, *slots]]
        cells += [_cell(r[col.label], r[f"{col.label} ±"], col.fmt)
                  + ("" if r[f"{col.label} source"] in (None, col.source) or pd.isna(r[f"{col.label} source"])
                     else f" ({r[f'{col.label} source']})") for col in shown]
        cells += ["—" if pd.isna(r[c]) else str(r[c]) for c in per_job]
        if "error" in header:
            cells.append("" if pd.isna(r["error"]) else str(r["error"]))
        rows.append(cells)
    return header, rows


def _has(t: pd.DataFrame, column: str) -> bool:
    """Whether any job has a value in `column` (results from before it have none)."""
    return column in t and bool(t[column].notna().any())


def notes(t: pd.DataFrame) -> list[str]:
    """The lines under a table: how many jobs failed their reference check (and why some were not
    judged), what a flagged repeat is, where any job has one, and what the weights behind the quality
    columns are, where any job has quality figures."""
    out = []
    if _has(t, "check judged"):
        failed, judged = t[t["check failed"].fillna(0) > 0], t[t["check judged"].fillna(0) > 0]
        unjudged = t[(t[CHECK] == "—") & t["check reason"].notna()]
        parts = ([f"{len(failed)} of {len(judged)} judged job(s) FAIL (check_ok=false; first: "
                  f"{failed.iloc[0]['check reason']})"] if len(failed) else
                 [f"all {len(judged)} judged job(s) within tolerance"] if len(judged) else [])
        parts += [f"{len(unjudged)} job(s) not judged ({unjudged.iloc[0]['check reason']})"] if len(unjudged) else []
        out.append("reference check: " + "; ".join(parts))
    if _has(t, "flagged n") and t["flagged n"].fillna(0).gt(0).any():
        out.append(f"flagged repeats are excluded from the medians and spreads: outlier = at least "
                   f"{outliers.MIN_RATIO:g}x off its siblings' median and beyond {outliers.K:g} robust sigmas "
                   f"(judged from {outliers.MIN_REPEATS} repeats); starved = its process got too little CPU over "
                   "the window (the rows' starved_reason says what was measured)")
    quality = [c.label for c in COLUMNS if c.profiler == QUALITY_PHASE and _has(t, c.label)]
    if quality and _has(t, WEIGHTS):
        measured = t.loc[t[quality].notna().any(axis=1), WEIGHTS].dropna()      # the weights of jobs with figures
        kinds = [k for k in dict.fromkeys(measured) if k in WEIGHTS_CAVEATS]
        if kinds:
            out.append(f"{', '.join(quality)} measured on " + "; on ".join(f"{k}: {WEIGHTS_CAVEATS[k]}" for k in kinds))
    return out


def render(t: pd.DataFrame, fmt: str, columns: Sequence[Column] = COLUMNS) -> str:
    """The table in `fmt`; md and latex end with `notes` (csv and json carry the same as columns)."""
    if fmt not in FORMATS:
        raise ValueError(f"format: allowed {list(FORMATS)}, got {fmt!r}")
    if fmt == "csv":
        return t.to_csv(index=False)
    if fmt == "json":
        return json.dumps(json.loads(t.to_json(orient="records")), indent=1) + "\n"
    header, rows = display_rows(t, columns)
    if fmt == "md":
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
        under = notes(t)
        lines += ["", *under] if under else []
        return "\n".join(lines) + "\n"
    tex = lambda s: (s.replace("\\", "\\textbackslash{}").replace("&", "\\&").replace("%", "\\%")  # noqa: E731
                     .replace("_", "\\_").replace("#", "\\#").replace("±", "$\\pm$").replace("Δ", "$\\Delta$")
                     .replace("—", "--"))
    lines = ["\\begin{tabular}{" + "l" * len(header) + "}", "\\hline",
             " & ".join(map(tex, header)) + " \\\\", "\\hline"]
    lines += [" & ".join(map(tex, r)) + " \\\\" for r in rows]
    lines += ["\\hline", "\\end{tabular}"]
    lines += [f"% {tex(n)}" for n in notes(t)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`moebench table DIR [--format md|csv|json|latex]`."""
    p = argparse.ArgumentParser(prog="moebench table", description="One row per configuration of a results dir.")
    p.add_argument("results", help="a job dir, sweep dir, tree or .parquet")
    p.add_argument("--format", default="md", choices=FORMATS)
    args = p.parse_args(argv)
    from harness import results
    try:
        df = results.load(args.results)
    except (FileNotFoundError, results.ResultsError) as exc:
        print(f"moebench table: {exc}", file=sys.stderr)
        return 2
    if df.empty:
        print(f"moebench table: no rows under {args.results}", file=sys.stderr)
        return 1
    t = sweep_table(df)
    sys.stdout.write(render(t, args.format))
    if args.format in ("csv", "json"):          # the data stays parseable; its notes go beside it
        for line in notes(t):
            print(line, file=sys.stderr)
    return 0
