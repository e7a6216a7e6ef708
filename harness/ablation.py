"""The copy ablation as a paired measurement: what this placement's phases cost beyond the same
work with every expert resident on the device.

Owns: deciding whether the ablation can run at all (the `resident` plan must fit the device
budget; if it does not, the rows are null with a reason, never a failed job), how it runs
(`interleaved`: one repeat of each side in turn, when both engines fit the budget together;
`sequential`: the measured repeats, then -- with the measured engine freed -- the resident
ones; either way the resident engine first runs `run.warmup` unrecorded repeats, as the measured
one did), and the statistics: per phase the median of the paired differences
`time_s(placement, repeat i) - time_s(resident, repeat i)`, with a 95% interval and a
significance flag (the interval is the t-interval of the mean paired difference; "not
significant" when it spans 0). Never clamped: a negative difference is reported as measured.
Does not own: running a repeat (harness.scenario) or rows (harness.runner).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from harness.contract import MEASURED_PHASES
from harness.scenario import RepeatResult

MODES = ("interleaved", "sequential", "skipped")


@dataclass
class Ablation:
    mode: str                                   # interleaved | sequential | skipped
    reason: str | None = None                   # why it was skipped / why sequential
    placement: list[RepeatResult] = field(default_factory=list)
    resident: list[RepeatResult] = field(default_factory=list)


def _times(runs: list[RepeatResult], phase: str) -> list[float]:
    return [p.client["time_s"] for r in runs for p in r.phases if p.phase == phase]


def paired_stats(diffs: list[float], confidence: float = 0.95) -> dict[str, float | None]:
    """Median paired difference, the t-interval of the mean difference, and whether it excludes 0.
    With fewer than 2 pairs the interval (and so the significance) is null."""
    if not diffs:
        return dict.fromkeys(("exposed_copy_ablation_s", "exposed_copy_ablation_ci_low_s",
                              "exposed_copy_ablation_ci_high_s", "exposed_copy_ablation_significant"))
    med = statistics.median(diffs)
    low = high = sig = None
    if len(diffs) >= 2:
        from scipy.stats import t

        mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
        half = t.ppf(0.5 + confidence / 2, len(diffs) - 1) * sd / math.sqrt(len(diffs))
        low, high = mean - half, mean + half
        sig = float(low > 0 or high < 0)
    return {"exposed_copy_ablation_s": med, "exposed_copy_ablation_ci_low_s": low,
            "exposed_copy_ablation_ci_high_s": high, "exposed_copy_ablation_significant": sig}


def ablation_metrics(ab: Ablation) -> dict[str, dict[str, float | None]]:
    """Per measured phase, the paired statistics (all null when skipped)."""
    out = {}
    for phase in MEASURED_PHASES:
        a, b = _times(ab.placement, phase), _times(ab.resident, phase)
        out[phase] = paired_stats([x - y for x, y in zip(a, b)])
    return out
