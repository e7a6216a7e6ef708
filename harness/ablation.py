"""The copy ablation as a paired measurement: what this placement's phases cost beyond the same
work with every expert resident on the device.

Owns: deciding whether the ablation can run at all (the `resident` plan must fit the device
budget; if it does not, the rows are null with a reason, never a failed job), how the pairs are
ordered (`pair_order`), and the statistics of the paired differences
`time_s(placement, pair i) - time_s(resident, pair i)` per measured phase (`ablation_metrics`).
Does not own: running a repeat (harness.scenario), running the two engines or writing rows
(the `ablation` pass, harness.passes.ablation).

How it runs: `interleaved` (both engines fit the budget together): the resident engine first runs
`run.warmup` unrecorded repeats, then `run.repeats` pairs, one repeat of each side back to back,
the side that goes first alternating (placement first in even pairs): an order effect (the second
run of a pair finding caches the first one warmed, or the first one paying for the other side's
allocations) then cancels over the pairs instead of adding to every difference. `sequential`
(only one engine fits at a time): the measured repeats, then -- the measured engine freed -- the
resident ones; `skipped`: the resident plan does not fit.

The statistics, per phase (a calibration run, `run.ablation_aa=true` with `placement=resident`,
measures both sides resident -- an A/A check -- and tests its false-positive rate):

* `exposed_copy_ablation_s`: the median paired difference, never clamped (a negative difference
  is reported as measured).
* `exposed_copy_ablation_p_value`: an exact two-sided sign-flip permutation test of the mean
  difference (under "no difference" each pair's sign is a coin flip; every one of the 2^n sign
  patterns up to 16 pairs, 20000 seeded random ones beyond), Holm-adjusted over the job's
  phases, so a job -- whichever of its phases -- is flagged at most `ALPHA` of the time when
  nothing differs (four phases each tested at 5% flag 1 - 0.95^4 = 19% of such jobs). No
  normality is assumed: a t-interval on 3 pairs is only as good as that assumption.
* `exposed_copy_ablation_significant`: 1 when the adjusted p-value is below `ALPHA` and the
  median difference is at least `MIN_EFFECT` of the resident side's median phase time, 0 when
  not, null -- too few pairs, no verdict -- when it cannot be: fewer than `VERDICT_PAIRS`
  alternating pairs, or sequential pairs (one side ran after the other: drift between them is
  not a coin flip). `ablation_note` says which. Why 10 pairs when 8 already reach `ALPHA / phases`
  (2 / 2^n): at 8, one phase whose 8 differences share a sign passes, which pure chance does for
  3% of jobs and a small order or allocation effect between two resident engines for more; at
  10 chance is 0.8% a job, and such an effect must hold over 10 pairs in a row. The floor: two resident
  engines of one model are two allocations of the same weights, and a difference of a few percent
  between them -- where their memory landed -- can be consistent enough over the pairs to pass
  the test; that is no cost of the placement. Measured (A/A sweeps of 20 tiny jobs, 10 pairs, a
  quiet 2-core VM, 2026-12-04): the test passed in 4 of 120 jobs (3.3%, not the nominal 0.8%), at
  median differences of 1.5-5.3% of the resident phase time; with a 2% floor, 2 of 20 jobs were
  flagged in 2 of 8 such sweeps (one of them beside another pytest worker). Hence 6%: a
  placement's smaller cost is reported (median, interval) but never called significant.
* `exposed_copy_ablation_ci_low_s` / `_high_s`: the shifts of the differences that the (per
  phase, unadjusted) test does not reject at 95% -- null below 6 pairs, and for sequential pairs.
* `ablation_agrees` / `ablation_note`: the timeline pass measures the copies directly
  (`exposed_copy_s`, one instrumented repeat); after a timeline pass the ablation runs one on its
  resident engine too, so the copy time the placement *adds* is the difference of the two (a
  resident engine copies as well: the restored turn's KV). The ablation holds everything the
  placement adds over resident -- cache lookups, eviction, waits, bookkeeping, compute placed
  elsewhere -- so the two can differ by far more than copies. Where the timeline's added copy
  time lies outside the ablation's noise (its 95% interval; with fewer pairs than that needs,
  the range of the pairs) the row says `ablation_agrees=false` and the note shows both values;
  null when there is nothing to compare (no timeline pass, fewer than 2 pairs). The timeline's
  added copy time is the row's `ablation_timeline_s`.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from harness.contract import MEASURED_PHASES
from harness.scenario import RepeatResult

MODES = ("interleaved", "sequential", "skipped")
ALPHA = 0.05                   # the job's family-wise level (Holm over its phases)
MIN_EFFECT = 0.06              # a smaller median difference (of resident's phase time) is never significant
VERDICT_PAIRS = 10             # fewer alternating pairs: too few for a significance verdict (null, with the note)
CONFIDENCE = 0.95              # each phase's interval
EXACT_MAX_PAIRS = 16           # 2^16 sign patterns enumerated; beyond, a seeded random sample
RANDOM_PATTERNS = 20_000
STATS = ("exposed_copy_ablation_s", "exposed_copy_ablation_ci_low_s", "exposed_copy_ablation_ci_high_s",
         "exposed_copy_ablation_p_value", "exposed_copy_ablation_significant")


@dataclass
class Ablation:
    mode: str                                   # interleaved | sequential | skipped
    reason: str | None = None                   # why it was skipped / why sequential
    placement: list[RepeatResult] = field(default_factory=list)
    resident: list[RepeatResult] = field(default_factory=list)
    resident_timeline: RepeatResult | None = None   # the resident engine's instrumented repeat (run.timeline)


def pair_order(i: int) -> tuple[str, str]:
    """Which side runs first in pair `i` (interleaved): placement in even pairs, resident in odd."""
    return ("placement", "resident") if i % 2 == 0 else ("resident", "placement")


def _times(runs: list[RepeatResult], phase: str) -> list[float]:
    return [p.client["time_s"] for r in runs for p in r.phases if p.phase == phase]


# ----------------------------------------------------------------------------- the sign-flip test

def _sign_patterns(n: int) -> np.ndarray:
    """[P, n] of +-1: every pattern up to EXACT_MAX_PAIRS pairs, else a seeded random sample."""
    if n <= EXACT_MAX_PAIRS:
        bits = (np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1          # [2^n, n]
    else:
        bits = np.random.default_rng(0).integers(0, 2, size=(RANDOM_PATTERNS, n))  # [P, n]
    return 1 - 2 * bits


def sign_flip_p(diffs: Sequence[float], patterns: np.ndarray | None = None) -> float:
    """Two-sided p-value of "the mean paired difference is 0": the fraction of sign patterns whose
    mean difference is at least as far from 0 as the observed one (the observed pattern included)."""
    d = np.asarray(diffs, dtype=float)
    signs = _sign_patterns(len(d)) if patterns is None else patterns
    means = np.abs(signs @ d) / len(d)                                              # [P]
    observed = abs(d.mean())
    extreme = int((means >= observed * (1 - 1e-9)).sum())   # ties: the mirrored pattern, rounding
    if len(d) > EXACT_MAX_PAIRS:       # a random sample of patterns: count the observed one once more
        return (extreme + 1) / (len(signs) + 1)
    return extreme / len(signs)


def min_p(n: int) -> float:
    """The smallest p-value `sign_flip_p` can give for n pairs (every pair of one sign)."""
    return 1.0 if n < 1 else min(1.0, 2.0 / 2 ** n)


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment (family-wise error over the given tests)."""
    order = sorted(p_values, key=p_values.__getitem__)
    out, running = {}, 0.0
    for i, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * p_values[key]))
        out[key] = running
    return out


def shift_interval(diffs: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The shifts s for which the sign-flip test of `diffs - s` gives p > 1 - confidence: the
    interval the test itself implies. None when n pairs cannot reject anything at that level."""
    d = np.asarray(diffs, dtype=float)
    alpha = 1 - confidence
    if min_p(len(d)) > alpha:
        return None
    signs = _sign_patterns(len(d))
    accepted = lambda s: sign_flip_p(d - s, signs) > alpha  # noqa: E731
    centre, span = float(d.mean()), float(np.ptp(d)) or abs(float(d.mean())) or 1.0

    def edge(direction: float) -> float:
        inside, outside = centre, centre + direction * span
        while accepted(outside):                    # every shift past the pairs' range is rejected
            outside += direction * span
        for _ in range(60):                         # bisection to ~1e-18 of the span
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if accepted(mid) else (inside, mid)
        return inside
    return edge(-1.0), edge(1.0)


# ----------------------------------------------------------------------------- per phase, per job

@dataclass
class PhaseStats:
    """One phase's paired statistics before the job-wide adjustment."""

    diffs: list[float]
    p_raw: float | None = None
    interval: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)
    resident_median: float | None = None          # the resident side's median phase time (the floor's base)


def _phase_stats(diffs: list[float], mode: str, phases: int, alpha: float) -> PhaseStats:
    st = PhaseStats(diffs)   # a placement side's repeats pair with the resident's of the same index
    n = len(diffs)
    if n == 0:
        return st
    if mode == "sequential":
        st.notes.append("sequential pairs (the resident side ran after the measured one): drift between the "
                        "sides is not a coin flip, so no interval or significance")
        return st
    st.interval = shift_interval(diffs)
    needed = max(VERDICT_PAIRS, _pairs_for(alpha / phases))
    if n >= needed:
        st.p_raw = sign_flip_p(diffs)
    missing = [what for what, have in ((f"95% interval (needs {_pairs_for(1 - CONFIDENCE)} pairs)", st.interval),
                                       (f"significance verdict (needs {needed} alternating pairs: the sign-flip test "
                                        f"over {phases} phases at {alpha:g})", st.p_raw)) if have is None]
    if missing:
        verdict = "too few pairs, inconclusive: " if st.p_raw is None else ""
        st.notes.append(f"{n} pair(s): {verdict}no {' and no '.join(missing)}")
    return st


def _pairs_for(level: float) -> int:
    return next(n for n in range(1, 64) if min_p(n) <= level)


def ablation_metrics(ab: Ablation, timeline: Mapping[str, float | None] | None = None,
                     alpha: float = ALPHA) -> dict[str, dict[str, object]]:
    """Per measured phase: the statistics (`STATS`, null when skipped or not available), and
    `ablation_agrees` / `ablation_note` against the copy time the timeline passes say the
    placement adds: `timeline` (the measured engine's `exposed_copy_s` per phase, None when no
    timeline pass ran) minus the resident engine's (`ab.resident_timeline`)."""
    per_phase: dict[str, PhaseStats] = {}
    for phase in MEASURED_PHASES:
        a, b = _times(ab.placement, phase), _times(ab.resident, phase)
        per_phase[phase] = _phase_stats([x - y for x, y in zip(a, b)], ab.mode, len(MEASURED_PHASES), alpha)
        per_phase[phase].resident_median = statistics.median(b) if b else None
    tested = {ph: st.p_raw for ph, st in per_phase.items() if st.p_raw is not None}
    adjusted = holm(tested) if tested else {}
    out: dict[str, dict[str, object]] = {}
    for phase, st in per_phase.items():
        stats: dict[str, object] = dict.fromkeys(STATS)
        if st.diffs:
            stats["exposed_copy_ablation_s"] = statistics.median(st.diffs)
        if st.interval is not None:
            stats["exposed_copy_ablation_ci_low_s"], stats["exposed_copy_ablation_ci_high_s"] = st.interval
        if phase in adjusted:
            stats["exposed_copy_ablation_p_value"] = adjusted[phase]
            floor = MIN_EFFECT * (st.resident_median or 0.0)
            small = abs(statistics.median(st.diffs)) < floor
            stats["exposed_copy_ablation_significant"] = float(adjusted[phase] < alpha and not small)
            if adjusted[phase] < alpha and small:
                st.notes.append(f"p={adjusted[phase]:.3g}, but the median difference is below {MIN_EFFECT:.0%} of "
                                f"the resident phase time ({floor * 1e3:.3g} ms): not significant")
        added, how = _timeline_added(phase, timeline, ab.resident_timeline)
        agrees, note = agreement(st, added, how)
        out[phase] = {"stats": stats, "ablation_agrees": agrees, "ablation_timeline_s": added,
                      "ablation_note": "; ".join([*st.notes, note] if note else st.notes) or None}
    return out


def _timeline_added(phase: str, timeline: Mapping[str, float | None] | None,
                    resident: RepeatResult | None) -> tuple[float | None, str]:
    """(the exposed copy time the placement adds in `phase` by the timeline passes, how it was got);
    (None, why) when there is none."""
    if timeline is None:
        return None, ("no timeline pass ran before it (run.timeline=false, or not in run.passes): the ablation "
                      "is not checked against it")
    placed = timeline.get(phase)
    if placed is None or math.isnan(placed):
        return None, "the timeline pass recorded no exposed_copy_s for this phase"
    ph = resident.phase(phase) if resident is not None else None
    own = ph.engine.get("exposed_copy_s") if ph is not None else None
    if own is None or math.isnan(own):
        return placed, f"the timeline's exposed copy {placed * 1e3:.3g} ms (the resident engine's own not measured)"
    return placed - own, (f"the timeline's exposed copy {placed * 1e3:.3g} ms minus the resident engine's "
                          f"{own * 1e3:.3g} ms = {(placed - own) * 1e3:.3g} ms")


def agreement(st: PhaseStats, added: float | None, how: str) -> tuple[bool | None, str | None]:
    """Whether the copy time the timeline says the placement adds lies within the ablation's
    noise (True / False / None: nothing to compare), and the note that says why."""
    if len(st.diffs) < 2:
        return None, None
    if added is None:
        return None, how
    low, high, what = ((*st.interval, "95% interval") if st.interval is not None
                       else (min(st.diffs), max(st.diffs), f"range of its {len(st.diffs)} pairs"))
    if low <= added <= high:
        return True, None
    return False, (f"disagrees with the timeline: ablation {statistics.median(st.diffs) * 1e3:.3g} ms ({what} "
                   f"{low * 1e3:.3g}..{high * 1e3:.3g} ms) vs {how}; the ablation holds all the placement adds "
                   "over resident (cache lookups, eviction, waits, bookkeeping), not only exposed copies")
