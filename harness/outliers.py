"""Flagged repeats: a measured window (one repeat's phase) whose speed is an outlier against its
siblings, or whose process was starved of CPU, and what the tables do with them.

Owns: the outlier rule (`outliers`, its constants below, in one place), the `outlier` row column
(`outlier_flags`: the runner stores it, tables fill it where results predate it), and the
windows the medians leave out (`flagged_windows`, `kept`) with the per-job account the tables
print (`job_flags`). The `starved` column is the measurement's own (harness.measure); rows
without it count as not starved. Does not own: measuring (harness.scenario), printing
(harness.table, harness.report, harness.results.summary).

The rule: among a job's un-instrumented repeats of one phase, metric and source, a value is an
outlier when its log lies more than K scales from the median log, the scale being the larger of
the logs' MAD (x 1.4826, a normal sample's sigma) and ln(MIN_RATIO) / K: an outlier is beyond
its siblings' own spread and at least MIN_RATIO times slower or faster than their median (a
time and its rate get the same verdict). Below that floor a MAD of three to five repeats
measures jitter (on a busy 2-core machine single repeats ran 1.7x off their median). With fewer
than MIN_REPEATS repeats nothing is flagged (two values cannot say which one is off). Only the
speeds a stall shows in are judged (OUTLIER_METRICS); counters are deterministic.

Medians exclude flagged windows: every row of a (repeat, phase) with a flag leaves the
tables' medians and spreads, which say how many repeats were flagged, by which flag, and that
they were excluded.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from harness.contract import phase_rank, repeat_rows

K = 3.5                       # the modified z-score cut (Iglewicz and Hoaglin)
MAD_SIGMA = 1.4826            # MAD -> standard deviation of a normal sample
MIN_RATIO = 2.0               # an outlier is at least this many times off the median
MIN_REPEATS = 3
OUTLIER_METRICS = ("time_s", "ttft_s", "tok_per_s", "tpot_s_p50")
FLAGS = ("starved", "outlier")
JOB = ["sweep_id", "job_id"]
WINDOW = [*JOB, "repeat", "phase"]
GROUP = [*JOB, "phase", "metric", "source"]


def outliers(values: Sequence[float]) -> list[bool] | None:
    """Which of one group's repeats are outliers; None with fewer than MIN_REPEATS (or a value
that is no positive speed)."""
    if len(values) < MIN_REPEATS or min(values) <= 0:
        return None
    logs = [math.log(v) for v in values]
    m = statistics.median(logs)
    mad = statistics.median(abs(v - m) for v in logs)
    scale = max(MAD_SIGMA * mad, math.log(MIN_RATIO) / K)
    return [abs(v - m) > K * scale for v in logs]


def _judged(df: pd.DataFrame) -> pd.DataFrame:
    """The rows the rule judges: measured repeats of un-instrumented runs, with a value."""
    speed = repeat_rows(df)
    return speed[speed["metric"].isin(OUTLIER_METRICS) & speed["value"].notna()]


def outlier_flags(df: pd.DataFrame) -> pd.Series:
    """The `outlier` column of `df`'s rows: True/False where judged, NA elsewhere (other metrics,
    instrumented or failed rows, too few repeats). Stored flags are kept; rows without one
    (results from before the column) get the rule's."""
    out = pd.Series(pd.NA, index=df.index, dtype="boolean")
    for _, g in _judged(df).groupby(GROUP, sort=False, dropna=False):
        flags = outliers(g["value"].tolist())
        if flags is not None:
            out.loc[g.index] = flags
    if "outlier" in df.columns:
        out = _bools(df["outlier"]).fillna(out)
    return out


def _bools(col: pd.Series) -> pd.Series:
    """A flag column as nullable booleans (a file may hold it as all-null objects)."""
    return col.astype("object").where(col.notna(), None).astype("boolean")


def flagged_windows(df: pd.DataFrame) -> pd.DataFrame:
    """Per measured window (sweep_id, job_id, repeat, phase) of the speed rows that has a flag:
    a bool column per flag."""
    speed = repeat_rows(df)
    marks = pd.DataFrame({"outlier": outlier_flags(speed).fillna(False),
                          "starved": (_bools(speed["starved"]).fillna(False) if "starved" in speed.columns
                                      else pd.Series(False, index=speed.index))}, index=speed.index)
    per = pd.concat([speed[WINDOW], marks[list(FLAGS)]], axis=1).groupby(WINDOW, sort=False, dropna=False).any()
    return per[per.any(axis=1)].astype(bool)


def kept(df: pd.DataFrame, flagged: pd.DataFrame | None = None) -> pd.DataFrame:
    """`df` without the rows of flagged windows (`flagged_windows(df)` unless given): what medians
    are taken over."""
    flagged = flagged_windows(df) if flagged is None else flagged
    if flagged.empty:
        return df
    keys = pd.MultiIndex.from_frame(df[WINDOW].astype(object))
    return df[~keys.isin(flagged.index)]


def phase_flags(flagged: pd.DataFrame) -> pd.DataFrame:
    """Per (sweep_id, job_id, phase) with flagged windows: `n_flagged` (repeats) and `flagged`
    (which flags, e.g. "starved,outlier")."""
    if flagged.empty:
        return pd.DataFrame(columns=[*JOB, "phase", "n_flagged", "flagged"])
    keys = [*JOB, "phase"]
    return pd.DataFrame([{**dict(zip(keys, key)), "n_flagged": g["repeat"].nunique(),
                          "flagged": ",".join(n for n in FLAGS if g[n].any())}
                         for key, g in flagged.reset_index().groupby(keys, sort=False)])


@dataclass(frozen=True)
class JobFlags:
    repeats: int                    # measured repeats of the job's speed rows
    flagged: int                    # of them, with any flagged window
    by_flag: dict[str, tuple[int, list[str]]]    # flag -> (repeats with a window so flagged, their phases)

    def text(self) -> str:
        """`none of 5`, `2 of 5 (outlier 1: decode; starved 1: prefill_fresh), excluded`,
        `too few repeats to judge (2 < 3)`."""
        few = self.repeats < MIN_REPEATS
        if not self.flagged:
            return f"too few repeats to judge ({self.repeats} < {MIN_REPEATS})" if few else f"none of {self.repeats}"
        which = "; ".join(f"{f} {n}: {', '.join(phases)}" for f, (n, phases) in self.by_flag.items() if n)
        return (f"{self.flagged} of {self.repeats} ({which}), excluded"
                + ("; too few repeats to judge outliers" if few else ""))


def job_flags(df: pd.DataFrame) -> dict[tuple[str, str], JobFlags]:
    """Per (sweep_id, job_id) with measured repeats: how many were flagged, by which flag."""
    speed = repeat_rows(df)
    flagged = flagged_windows(df).reset_index()
    out = {}
    for key, g in speed.groupby(JOB, sort=False):
        mine = flagged[(flagged["sweep_id"] == key[0]) & (flagged["job_id"] == key[1])]
        by_flag = {f: (int(mine[mine[f]]["repeat"].nunique()), sorted(set(mine[mine[f]]["phase"]), key=phase_rank))
                   for f in FLAGS}
        out[key] = JobFlags(int(g["repeat"].nunique()), int(mine["repeat"].nunique()), by_flag)
    return out


def flag_outliers(rows: list[dict]) -> None:
    """Set the `outlier` column of a job's rows, once its repeats are emitted (the runner)."""
    judged = [i for i, r in enumerate(rows) if r.get("metric") in OUTLIER_METRICS and r.get("repeat") is not None]
    if not judged:
        return
    df = pd.DataFrame([rows[i] for i in judged], index=judged).drop(columns=["outlier"], errors="ignore")
    for i, flag in outlier_flags(df).dropna().items():
        rows[i]["outlier"] = bool(flag)
