"""The checks and the significance test of a comparison (the rules: harness.compare's docstring).

Owns: `Check` (a declarative regression check, `decode.tok_per_s:-5%`, parsed and judged on a
ratio), `difference` (whether two samples differ significantly: Mann-Whitney U, or the
non-overlap of t intervals when the samples are too few for it), `min_mwu_p`, `CompareError`
and the verdict names (`VERDICTS` of a pair, `EXIT_CODES` of a comparison). Does not own: which
samples are compared or how pairs are made (harness.compare), or the report
(harness.compare_report).

    from harness.compare_checks import Check, difference
    Check.parse("decode.tok_per_s:-5%").verdict(ratio=0.9, significant=True)     # "regression"
    difference([1.0, 1.1, 0.9, 1.0], [2.0, 2.1, 1.9, 2.0])                       # (True, 0.028..., "mwu")
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness import results
from harness.contract import ALL_PHASES

ALPHA = 0.05
# a check's verdict on one pair, the worst first
VERDICTS = ("regression", "improvement", "inconclusive", "ok", "not comparable")
# the comparison's verdict -> moebench-compare's exit code (2: bad arguments or unreadable results)
EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3, "INCONCLUSIVE": 4}
_CHECK_RE = re.compile(r"^(?P<phase>[\w*]+)\.(?P<metric>\w+):(?P<sign>[+-])(?P<pct>\d+(?:\.\d+)?)%$")


def _request_metrics() -> dict:
    from harness.serving.metrics import REQUEST_METRICS
    return REQUEST_METRICS


def unit_of(metric: str) -> str | None:
    """A metric's unit: the contract's, or a served request's (harness.serving.metrics); None: unknown."""
    if metric in results.METRIC_UNITS:
        return results.METRIC_UNITS[metric]
    entry = _request_metrics().get(metric)
    return entry[0] if entry else None


class CompareError(ValueError):
    """A check string, a path or a result set that cannot be compared."""


# ----------------------------------------------------------------------------- checks

@dataclass(frozen=True)
class Check:
    """`decode.tok_per_s:-5%`: a decrease of more than 5% is a regression."""

    phase: str
    metric: str
    threshold: float          # signed fraction: -0.05 = "a decrease beyond 5% is bad"

    @classmethod
    def parse(cls, text: str) -> "Check":
        m = _CHECK_RE.match(text.strip())
        if not m:
            raise CompareError(f"check {text!r}: expected PHASE.METRIC:+X% or PHASE.METRIC:-X% "
                               f"(e.g. decode.tok_per_s:-5%, prefill_fresh.ttft_s:+10%); "
                               f"phases: {list(ALL_PHASES)} or *")
        phase, metric = m["phase"], m["metric"]
        if phase != "*" and phase not in ALL_PHASES:
            raise CompareError(f"check {text!r}: phase {phase!r} unknown; allowed {list(ALL_PHASES)} or *")
        if unit_of(metric) is None:
            raise CompareError(f"check {text!r}: metric {metric!r} unknown; allowed {sorted(results.METRIC_UNITS)} "
                               f"or a served request's {sorted(_request_metrics())}")
        pct = float(m["pct"])
        if pct <= 0:
            raise CompareError(f"check {text!r}: the threshold must be above 0%")
        return cls(phase, metric, (-1 if m["sign"] == "-" else 1) * pct / 100)

    def matches(self, phase: str, metric: str) -> bool:
        return metric == self.metric and self.phase in ("*", phase)

    def verdict(self, ratio: float, significant: bool) -> str:
        change = ratio - 1
        t = self.threshold
        # beyond, not at: a change of exactly X% (exact counters: 1.01e6 / 1e6 - 1 > 0.01 in floating point) is not beyond X%
        at = math.isclose(abs(change), abs(t), rel_tol=1e-9)
        bad = not at and (change < t if t < 0 else change > t)
        good = not at and (change > -t if t < 0 else change < -t)
        if bad:
            return "regression" if significant else "inconclusive"
        if good and significant:
            return "improvement"
        return "ok"

    def __str__(self) -> str:
        return f"{self.phase}.{self.metric}:{'+' if self.threshold > 0 else '-'}{abs(self.threshold) * 100:g}%"


# ----------------------------------------------------------------------------- statistics

def min_mwu_p(n_a: int, n_b: int) -> float:
    """Smallest two-sided p-value an exact Mann-Whitney U test can give for these sizes."""
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a))


def difference(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> tuple[bool, float | None, str]:
    """(significant, p-value or None, test used: "mwu" | "ci" | "constant" | "too few").

    See the module docstring for the rule."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 1 or len(b) < 1:
        return False, None, "too few"
    if len(a) < 2 or len(b) < 2:                   # one sample on a side: never significant (1 vs 40: p < 0.05)
        return False, None, "too few"
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return bool(a[0] != b[0]), None, "constant"
    if min_mwu_p(len(a), len(b)) < alpha:
        from scipy.stats import mannwhitneyu
        p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
        return p < alpha, p, "mwu"
    lo_a, hi_a = _t_interval(a)
    lo_b, hi_b = _t_interval(b)
    return bool(hi_a < lo_b or hi_b < lo_a), None, "ci"


def _t_interval(x: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    from scipy.stats import t
    half = t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean() - half), float(x.mean() + half)
