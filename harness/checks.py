"""The reference check's verdict: whether a measured phase reproduced the exact reference, within
which tolerance, and how many of a job's checks failed.

Owns: the tolerance rule (`tolerance`), judging one repeat's phases in the order they ran
(`RepeatCheck`, from the per-token comparison `harness.scenario.compare_phase` makes), the row
columns a verdict becomes (`check_ok`, `check_tolerance`, `check_reason`), and reading them back
per job (`job_checks`, `failed_check_jobs`) for the tables and the run's exit. Does not own:
comparing tensors (harness.scenario), the reference (harness.reference), printing
(harness.table, harness.report). Nothing here imports torch at module level.

The rule, in one place:
  * float32: every logit within 1e-5 of the reference's (DESIGN §3's invariant); an engine that
    reports only its top-k logprobs (llama.cpp) within 1e-4 of the reference's log-softmax -- an
    independent implementation (its own GEMV order and softmax): its measured differences on the
    tiny models are an order of magnitude below, the margin is for longer dot products;
  * bfloat16 / float16: the float32 logit tolerance scaled by the dtype's epsilon over float32's
    (2^16 and 2^13: 0.66 and 0.082), for either metric -- the same number of units of rounding
    as the invariant allows in float32. Within our engine every placement runs the reference's
    kernels (bitwise equal on the CPU, as the exactness tests check); across implementations and
    devices half-precision rounding differs by about one unit at the logits' scale;
  * tokens: every generated token equals the reference's, except a near-tie the tolerance
    explains -- the reference's margin between its token and the engine's is within twice the
    tolerance (each of the two logits may move by it). From that token on the engine continues
    another sequence, so that row's later steps, and later phases of the repeat, are not judged
    (null, with the reason), never compared against a context they do not share;
  * a token the engine was told never to produce (end of generation under llama.cpp's
    ignore_eos, which every engine's fixed-length decode needs) that the reference chose: the
    engine's other token follows from that instruction; the row is not judged from there;
  * a lossy treatment (`lossy=true`) is not judged exact: null, with the reason; its agreement,
    differences and quality metrics say how far it is. No reference (run.check_reference=false):
    null, with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

LOGIT = "max_abs_logit_diff"
LOGPROB = "max_abs_logprob_diff"
FP32_TOLERANCE = {LOGIT: 1e-5, LOGPROB: 1e-4}
CHECK_COLUMNS = ("check_ok", "check_tolerance", "check_reason")
LOSSY_REASON = ("lossy treatment: not judged against the exact reference (its token agreement, differences "
                "and quality metrics say how far it is)")
NO_REFERENCE_REASON = "no exact reference (run.check_reference=false)"


def tolerance(metric: str, dtype: str) -> float:
    """The largest |difference| of `metric` (max_abs_logit_diff or max_abs_logprob_diff) an exact
    run in `dtype` may show against the reference."""
    if metric not in FP32_TOLERANCE:
        raise ValueError(f"check metric: allowed {list(FP32_TOLERANCE)}, got {metric!r}")
    if dtype == "float32":
        return FP32_TOLERANCE[metric]
    import torch

    from engine.dtypes import torch_dtype
    return FP32_TOLERANCE[LOGIT] * torch.finfo(torch_dtype(dtype)).eps / torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Verdict:
    ok: bool | None                 # None: not judged (`reason` says why)
    tolerance: float | None
    reason: str | None = None       # why not judged, or what exceeded the tolerance

    def columns(self) -> dict[str, Any]:
        return dict(zip(CHECK_COLUMNS, (self.ok, self.tolerance, self.reason)))


@dataclass
class Comparison:
    """One phase against the reference's same phase, per token the reference produced (step) and
    per row: the |difference| of `metric` (None where the engine gave nothing to compare), whether
    the engine's token is the reference's, and the reference's margin of its own token over the
    engine's (0 when equal, None when the engine produced no token there)."""
    metric: str | None                                   # LOGIT, LOGPROB, or None: tokens only
    diffs: list[list[float | None]]                      # [step][row]
    same: list[list[bool]]                               # [step][row]
    margins: list[list[float | None]]                    # [step][row]
    wanted: list[list[int]]                              # [step][row] the reference's tokens


@dataclass
class RepeatCheck:
    """Judges one repeat's phases in the order they ran. `skip`: why nothing is judged (a lossy
    treatment, no reference)."""
    dtype: str
    skip: str | None = None
    # ids the engine was told never to produce (llama.cpp's end-of-generation tokens under ignore_eos):
    # where the reference chose one, the engine's other token is that instruction, not an error
    suppressed: frozenset[int] = frozenset()
    diverged: dict[int, str] = field(default_factory=dict)    # row -> where it left the reference's tokens

    def phase(self, name: str, cmp: Comparison | None) -> Verdict:
        if self.skip is not None:
            return Verdict(None, None, self.skip)
        if cmp is None:
            return Verdict(None, None, f"the reference has no {name} to compare with")
        tol = tolerance(cmp.metric or LOGIT, self.dtype)
        rows = range(len(cmp.same[0]) if cmp.same else 0)
        judged = [b for b in rows if b not in self.diverged]
        if not judged:
            first = next(iter(self.diverged.values()))
            return Verdict(None, tol, f"not judged: {first}, so this phase's context is not the reference's")
        failures = [f for b in judged if (f := self._row(name, cmp, b, tol)) is not None]
        # a row that left the reference's tokens here: judged up to there, and the row says where
        left = [self.diverged[b] for b in judged if b in self.diverged]
        return Verdict(not failures, tol, "; ".join(failures or left) or None)

    def _row(self, name: str, cmp: Comparison, b: int, tol: float) -> str | None:
        """What in row `b` exceeds the tolerance, or None; records a near-tie divergence."""
        where = f" in row {b}" if len(cmp.same[0]) > 1 else ""
        for i, (diffs, same, margins) in enumerate(zip(cmp.diffs, cmp.same, cmp.margins)):
            d = diffs[b]
            if d is not None and d > tol:
                return f"{name} token {i}{where}: {cmp.metric} {d:.3g} > tolerance {tol:.3g}"
            if same[b]:
                continue
            m = margins[b]
            if cmp.wanted[i][b] in self.suppressed:
                self.diverged[b] = (f"{name} token {i}{where}: the reference's token {cmp.wanted[i][b]} ends generation, "
                                    "which the engine was told to suppress (ignore_eos)")
                return None
            if m is None:
                return f"{name} token {i}{where}: the engine produced no token where the reference did"
            if m > 2 * tol:
                return (f"{name} token {i}{where}: another token than the reference's, which leads it by "
                        f"{m:.3g} > 2 x tolerance {tol:.3g}")
            self.diverged[b] = (f"{name} token {i}{where} took another token than the reference's at a near-tie "
                                f"(margin {m:.3g} <= 2 x tolerance {tol:.3g})")
            return None
        return None


# --- reading verdicts back -------------------------------------------------------------------------
JOB = ["sweep_id", "job_id"]


def _checked(df: "pd.DataFrame") -> "pd.DataFrame":
    """One row per checked (job, profiler, repeat, phase) with its `check_ok` (NA: not judged) and
    `check_reason`; empty when the rows carry no checks (results from before they did)."""
    import pandas as pd

    if "check_ok" not in df.columns:
        return pd.DataFrame(columns=[*JOB, "check_ok", "check_reason"])
    reason = df["check_reason"] if "check_reason" in df.columns else pd.Series(None, index=df.index, dtype=object)
    # a verdict sits on every engine row of its phase: check_ok, or null with the reason it was not judged
    mask = (df["status"] == "ok") & df["repeat"].notna() & (df["check_ok"].notna() | reason.notna())
    rows = df[mask].assign(check_ok=df.loc[mask, "check_ok"].astype("boolean"), check_reason=reason[mask])
    keys = [*JOB, "profiler", "repeat", "phase"] if "profiler" in df.columns else [*JOB, "repeat", "phase"]
    return rows.groupby(keys, dropna=False, sort=False)[["check_ok", "check_reason"]].first().reset_index()


def phase_checks(df: "pd.DataFrame") -> "pd.DataFrame":
    """Per (sweep_id, job_id, phase) that carries checks: `check_ok` (False if any repeat failed,
    True if every judged one passed, NA if none was judged) and `check_failed` (repeats failed)."""
    import pandas as pd

    c = _checked(df)
    if c.empty:
        return pd.DataFrame(columns=[*JOB, "phase", "check_ok", "check_failed"])
    # nullable booleans: NA (not judged) is neither
    g = c.assign(failed=c["check_ok"].eq(False).fillna(False).astype(int),
                 passed=c["check_ok"].eq(True).fillna(False).astype(int))
    out = g.groupby([*JOB, "phase"], sort=False)[["failed", "passed"]].sum().reset_index()
    ok = pd.Series(pd.NA, index=out.index, dtype="boolean")
    ok[out["passed"] > 0] = True
    ok[out["failed"] > 0] = False
    return out.assign(check_ok=ok, check_failed=out["failed"]).drop(columns=["failed", "passed"])


@dataclass(frozen=True)
class JobCheck:
    checked: int          # phases x repeats that carry a verdict or a reason
    judged: int
    failed: int
    reason: str | None    # a failure's, or why some were not judged

    def text(self) -> str:
        """`ok`, `ok (8 of 12 judged)`, `FAIL (2 of 12)`, or `—` (nothing judged)."""
        if self.failed:
            return f"FAIL ({self.failed} of {self.judged})"
        if not self.judged:
            return "—"
        return "ok" if self.judged == self.checked else f"ok ({self.judged} of {self.checked} judged)"


def job_checks(df: "pd.DataFrame") -> dict[tuple[str, str], JobCheck]:
    """Per (sweep_id, job_id) that carries checks: how many phase-repeats were judged and failed."""
    out = {}
    for key, g in _checked(df).groupby(JOB, sort=False):
        ok = g["check_ok"]
        failed = g[ok.eq(False).fillna(False)]        # NA: not judged, not failed
        reasons = failed["check_reason"].dropna() if len(failed) else g[ok.isna()]["check_reason"].dropna()
        out[key] = JobCheck(len(g), int(ok.notna().sum()), len(failed), reasons.iloc[0] if len(reasons) else None)
    return out


def failed_check_jobs(df: "pd.DataFrame") -> list[str]:
    """The job ids (sweep_id/job_id where several sweeps) whose reference check failed."""
    bad = [k for k, c in job_checks(df).items() if c.failed]
    several = len({s for s, _ in bad}) > 1
    return [f"{s}/{j}" if several else j for s, j in bad]


def failure_line(jobs: list[str]) -> str:
    """The one line a run whose checks failed ends with."""
    shown = ", ".join(jobs[:5]) + (", ..." if len(jobs) > 5 else "")
    return (f"{len(jobs)} job(s) failed the reference check (check_ok=false: a logit or logprob beyond its "
            f"tolerance, or another token than the exact reference's): {shown}")
