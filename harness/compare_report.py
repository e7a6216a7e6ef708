"""The markdown report of a comparison (a CI job summary): the verdict and why, the two sides,
the rule, the checks, regressions, pairs that could not be compared, other significant changes.

Owns: rendering a `harness.compare.Comparison` (what it reads of one: `Reported`). Does not own:
anything it renders -- the table, the verdict and its reasons are `harness.compare`'s.

    from harness.compare import compare_paths
    print(compare_paths(BASE, NEW, ["decode.tok_per_s:-5%"]).markdown())   # calls render()
"""
from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import pandas as pd

from harness.compare_checks import EXIT_CODES, VERDICTS, Check

REPORT_COLUMNS = ("config", "phase", "metric", "source", "n_base", "n_new", "median_base", "median_new", "ratio",
                  "p_value", "test", "check", "verdict", "note")
MAX_REASONS = 30                     # reasons listed under the verdict; the table holds the rest
HEADLINES = {"FAIL": "a check found a significant regression beyond its threshold",
             "INCOMPLETE": "not everything in the base was compared",
             "INCONCLUSIVE": "a check could not tell",
             "PASS": "every base config compared, no check beyond its threshold"}


class Reported(Protocol):
    """What the report reads of a comparison (`harness.compare.Comparison`)."""

    table: pd.DataFrame
    checks: list[Check]
    base: dict[str, Any]
    new: dict[str, Any]
    alpha: float
    min_change: float

    @property
    def regressions(self) -> pd.DataFrame: ...

    @property
    def verdict(self) -> str: ...

    def incomplete_reasons(self) -> list[str]: ...

    def inconclusive_reasons(self) -> list[str]: ...


def render(cmp: Reported, max_rows: int = 200) -> str:
    t, regress, verdict = cmp.table, cmp.regressions, cmp.verdict
    lines = ["# moebench comparison", "", f"**{verdict}** -- {HEADLINES[verdict]} (exit {EXIT_CODES[verdict]})", ""]
    reasons = ([f"{len(regress)} regression(s), listed below"] if len(regress) else []) \
        + cmp.incomplete_reasons() + cmp.inconclusive_reasons()
    lines += [f"- {r}" for r in reasons[:MAX_REASONS]]
    if len(reasons) > MAX_REASONS:
        lines.append(f"- ... {len(reasons) - MAX_REASONS} more (the comparison table has every pair)")
    lines += ["", "Verdicts, the first that holds: FAIL (1) a regression; INCOMPLETE (3) nothing compared, a base "
                  "config or checked metric without a comparable counterpart, or a check that matched nothing; "
                  "INCONCLUSIVE (4) a check beyond its threshold without significance, or no checked (or, with no "
                  "checks, no compared) pair with the samples to test; PASS (0) otherwise.", ""]
    for name, side in (("base", cmp.base), ("new", cmp.new)):
        commits = ", ".join(side.get("commits") or ["unknown"]) + (" (dirty)" if side.get("dirty") else "")
        lines.append(f"- **{name}**: `{side.get('path', '')}` -- {side.get('jobs', 0)} job(s), commit {commits}, "
                     f"moebench {', '.join(side.get('moebench') or ['?'])}, torch {', '.join(side.get('torch') or ['?'])}; "
                     f"device {'; '.join(side.get('devices') or ['?'])}")
    lines += ["", f"Rule: Mann-Whitney U (two-sided, alpha={cmp.alpha:g}) when the sample sizes allow p < alpha "
                  "(4+ repeats a side), else non-overlap of 95% t intervals (2-3 a side); 1 sample: never significant. "
                  f"A change is listed as significant only at {cmp.min_change * 100:g}% or more of the base "
                  "median; checks use their own thresholds. Medians over un-instrumented repeats; ratio = new / base.",
              ""]
    if cmp.checks:
        lines += ["## Checks", "", "| check | compared | regression | improvement | inconclusive | ok | not comparable |",
                  "|---|---|---|---|---|---|---|"]
        for c in cmp.checks:
            sub = t[t["check"].map(lambda joined, c=c: str(c) in joined.split(", "))]
            counts = {v: int((sub["verdict"] == v).sum()) for v in VERDICTS}
            compared = len(sub) - counts["not comparable"]
            lines.append(f"| `{c}` | {compared} | {counts['regression']} | {counts['improvement']} | "
                         f"{counts['inconclusive']} | {counts['ok']} | {counts['not comparable']} |")
        lines.append("")
    else:
        lines += ["No checks given: nothing gates on a change; significant changes are listed below.", ""]
    if len(regress):
        lines += ["## Regressions", "", md_table(regress, max_rows), ""]
    checked = t[(t["check"] != "") & (t["verdict"] != "not comparable") & (t["verdict"] != "regression")]
    if len(checked):
        lines += ["<details><summary>Checked metrics without a regression ({})</summary>".format(len(checked)), "",
                  md_table(checked, max_rows), "", "</details>", ""]
    nc = t[t["verdict"] == "not comparable"]
    if len(nc):
        reasons_nc = nc.groupby("note")["config"].nunique()
        lines += ["## Not comparable", ""]
        lines += [f"- {why} ({n} config(s))" for why, n in reasons_nc.items()]
        lines.append("")
    changed = t[t["significant"] & (t["check"] == "")]
    if len(changed):
        lines += [f"<details><summary>Other significant changes, unchecked ({len(changed)})</summary>", "",
                  md_table(changed, max_rows), "", "</details>", ""]
    return "\n".join(lines)


def md_table(df: pd.DataFrame, max_rows: int) -> str:
    cols = [c for c in REPORT_COLUMNS if c in df.columns]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    body = ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for _, r in df.head(max_rows).iterrows()]
    more = [f"\n... {len(df) - max_rows} more rows in the table file"] if len(df) > max_rows else []
    return "\n".join([head, *body, *more])


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")
