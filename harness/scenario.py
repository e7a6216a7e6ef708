"""The scenario: one session driven through the measured phases, each timed directly.

Owns: the phase sequence of DESIGN.md §4 -- prefill_fresh, decode, prefill_continuation
(earlier KV still on the device), kv_offload (the displacement between turns, its own phase),
prefill_restored (the earlier KV restored from host RAM) -- the metrics each phase records,
the state each phase starts from (expert cache cold or warm, prefix state), the logits and
tokens each phase produced (for the numerical check, `check_phase`), the raw per-step
decode latencies, and refusing NaN or inf in what an engine that does not check its own outputs
returned (`check_received`: logits, or llama-server's top-k logprobs). Does not own: building
engines (harness.engines), rows and files (harness.runner), where the reference comes from
(harness.reference).

Per repeat the expert cache starts cold, or -- `expert_cache="warm"` -- as a previous turn of
another session left it (the steady state of a running server). Continuation and restored
turns feed the pending reply token plus `turn_tokens` new tokens on top of the whole earlier
session, so `reused_tokens` is the session length before the turn.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.counters import METRICS as COUNTER_METRICS
from engine.finite import NonFiniteError, nonfinite_count
from engine.timeline import Timeline
from harness.checks import LOGIT, LOGPROB, Comparison
from harness.contract import CHECK_METRICS, OFFLOAD_PHASE
from harness.engines.base import EngineAdapter as Adapter, Produced
from harness.measure import PhaseProbe, percentile, rates
from harness.profiling.overlap import OVERLAP_METRICS, overlap_metrics
from workloads.base import WorkloadSample

log = logging.getLogger(__name__)


@dataclass
class PhaseResult:
    phase: str
    client: dict[str, float | None] = field(default_factory=dict)   # measured around the request
    engine: dict[str, float | None] = field(default_factory=dict)   # read from the engine's counters
    logits: list[torch.Tensor] = field(default_factory=list)        # host fp32 [B, V] per token produced
    tokens: list[list[int]] = field(default_factory=list)           # per token produced: one id per row
    top_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)   # per token: per row
    expert_cache: str | None = None                                  # cold | warm at phase start; None: no cache
    columns: dict[str, object] = field(default_factory=dict)         # row columns of every row of the phase (starved)


@dataclass
class RepeatResult:
    phases: list[PhaseResult]
    steps: list[float] = field(default_factory=list)                 # per decode step, seconds
    windows: list[tuple[str, float, float]] = field(default_factory=list)   # (phase, start, end), perf_counter

    def phase(self, name: str) -> PhaseResult | None:
        return next((p for p in self.phases if p.phase == name), None)

    @property
    def tokens(self) -> list[list[int]]:
        """Generated ids per row: prefill's first token, then decode's."""
        cols = [t for name in ("prefill_fresh", "decode") if (p := self.phase(name)) for t in p.tokens]
        return [list(row) for row in zip(*cols)]


# A hook between phases (the phase about to run, the adapter, the session); tests use it to
# inject faults, the warm expert-cache state uses the engine as the previous phase left it.
PhaseHook = Callable[[str, Adapter, object], None]


def _host(logits: torch.Tensor | None) -> torch.Tensor | None:
    """A host fp32 copy of logits, for the check (the token was already read, so no extra sync)."""
    return None if logits is None else logits.detach().to("cpu", dtype=torch.float32, copy=True)


def _phase(name: str, probe: PhaseProbe, tokens: int | None, extra: dict[str, float | None],
           timeline: Timeline | None, emulated: bool) -> PhaseResult:
    t = probe.time_s
    client = {"time_s": t, "tokens": None if tokens is None else float(tokens),
              "tok_per_s": tokens / t if tokens and t > 0 else None,
              "peak_device_bytes": probe.peak_device_bytes,
              "peak_device_reserved_bytes": probe.peak_device_reserved_bytes,
              "peak_host_rss_bytes": probe.peak_host_rss_bytes,
              "cpu_time_s": probe.cpu_time_s, "cpu_util": probe.starvation.cpu_util, **extra}
    if probe.counters is not None:
        engine: dict[str, float | None] = {k: float(v) for k, v in probe.counters.items()}
        engine.update(rates(probe.counters))
    else:   # an engine that cannot count: null, never 0
        engine = dict.fromkeys((*COUNTER_METRICS, "hit_rate", "byte_hit_rate"))
    if timeline is None:
        engine.update(dict.fromkeys(OVERLAP_METRICS))
    else:
        timeline.collect()
        t0, t1 = probe.t_start, probe.t_end
        engine.update(overlap_metrics(timeline.intervals("copy", t0, t1), timeline.compute_intervals(t0, t1),
                                      h2d_bytes=engine.get("h2d_bytes"), emulated=emulated))
    starved = {"starved": probe.starvation.starved, "starved_reason": probe.starvation.reason}
    return PhaseResult(name, client, engine, columns=starved)


def prime_expert_cache(eng: Adapter, sample: WorkloadSample, gen_tokens: int) -> None:
    """Leave the expert cache as one turn of *another* session leaves it: prefill its context and
    decode `gen_tokens - 1` steps, then drop that session (its KV, never its expert state)."""
    sess = eng.new_session(len(sample.contexts))
    with closing_session(eng, sess):
        tok = eng.prefill(sess, sample.contexts).tokens
        for _ in eng.decode(sess, tok, gen_tokens - 1):
            pass


@contextmanager
def closing_session(eng: Adapter, sess: Any) -> Iterator[None]:
    """Close `sess` after the block; when the block failed, a failing close (a dead server's) is
    logged and the block's own error is the one raised. An engine that is no longer alive (a
    server killed after a stall) gets no close at all: no request goes to it."""
    try:
        yield
    except BaseException:
        if not eng.alive():
            log.debug("not closing the session: the engine is gone")
            raise
        try:
            eng.close_session(sess)
        except Exception as exc:  # noqa: BLE001 -- the first error says what went wrong
            log.warning("closing the session after a failure failed too: %s: %s", type(exc).__name__, exc)
        raise
    eng.close_session(sess)


def run_repeat(eng: Adapter, sample: WorkloadSample, gen_tokens: int, keep_logits: bool,
               timeline: Timeline | None = None, warm_with: WorkloadSample | None = None,
               before_phase: PhaseHook | None = None) -> RepeatResult:
    """One pass through every phase, from a cold expert cache -- or, with `warm_with`, from the
    state a turn of that other session left. With a `timeline` (already set on the engine), each
    phase also gets copy/compute overlap metrics from its time window. With `keep_logits`, each
    phase keeps the logits that chose its tokens (host fp32 copies) for `check_phase`."""
    kind, counters = eng.device_kind, eng.counters if eng.counters() is not None else None
    cached = eng.has_expert_cache
    batch = len(sample.contexts)
    eng.reset()
    if warm_with is not None:
        prime_expert_cache(eng, warm_with, gen_tokens)
    state = ("warm" if warm_with is not None else "cold") if cached else None
    sess = eng.new_session(batch)
    result = RepeatResult([])
    span = eng.instrument.span

    def measured(name: str, body: Callable[[], tuple[int | None, dict]], start_state: str | None) -> PhaseResult:
        if before_phase is not None:
            before_phase(name, eng, sess)
        eng.reset_device_peak()
        with span("phase", phase=name), PhaseProbe(kind, counters, eng.allocates_here, cpu_pid=eng.worker_pid(),
                                                   threads=eng.worker_threads()) as p:
            tokens, extra = body()
        res = _phase(name, p, tokens, extra, timeline, eng.emulated)
        res.engine["emulated_device_peak_bytes"] = eng.device_peak()
        res.engine.update(eng.phase_metrics())
        res.expert_cache = start_state
        result.phases.append(res)
        result.windows.append((name, p.t_start, p.t_end))
        return res

    with closing_session(eng, sess):
        produced: list[Produced] = []

        def fresh() -> tuple[int, dict]:
            out = eng.prefill(sess, sample.contexts)
            produced[:] = [out]
            return batch * len(sample.contexts[0]), {"reused_tokens": 0.0}

        ph = measured("prefill_fresh", fresh, state)
        ph.client["ttft_s"] = ph.client["time_s"]
        tok = _note(ph, produced[0], keep_logits, eng)
        ctx_len = len(sample.contexts[0])
        if gen_tokens > 1:
            logits_of_steps: list[torch.Tensor] = []
            step_tokens: list[list[int]] = []
            step_probs: list[list[dict[int, float] | None]] = []

            def decode() -> tuple[int, dict]:
                nonlocal tok
                steps = eng.decode(sess, tok, gen_tokens - 1)
                t0 = time.perf_counter()
                for out in steps:                 # each step timed from the end of the previous one
                    t1 = time.perf_counter()
                    result.steps.append(t1 - t0)
                    check_received(eng, out, "decode", len(step_tokens) + 1)     # after the step's time
                    tok = out.tokens
                    step_tokens.append(tok)
                    if keep_logits and out.logits is not None:
                        logits_of_steps.append(_host(out.logits))
                    if keep_logits and out.top_logprobs is not None:
                        step_probs.append(out.top_logprobs)
                    t0 = time.perf_counter()
                return batch * len(step_tokens), {"tpot_s_p50": percentile(result.steps, 50),
                                                  "tpot_s_p90": percentile(result.steps, 90),
                                                  "tpot_s_p99": percentile(result.steps, 99)}

            ph = measured("decode", decode, "warm" if cached else None)
            ph.tokens, ph.logits, ph.top_logprobs = step_tokens, logits_of_steps, step_probs
        for name in ("prefill_continuation", "prefill_restored"):
            reused = ctx_len + gen_tokens - 1 + (len(sample.continuations[0]) + 1 if name == "prefill_restored" else 0)
            rows = [[t, *c] for t, c in zip(tok, sample.continuations)]
            if name == "prefill_restored":
                def offload() -> tuple[int, dict]:
                    eng.offload(sess)
                    return None, {"reused_tokens": None}
                measured(OFFLOAD_PHASE, offload, "warm" if cached else None)

            def turn(name: str = name, rows: list = rows, reused: int = reused) -> tuple[int, dict]:
                extra: dict[str, float | None] = {"reused_tokens": float(reused)}
                if name == "prefill_restored":
                    t0 = time.perf_counter()
                    eng.restore(sess)
                    extra["restore_s"] = time.perf_counter() - t0   # restore() synchronises
                produced[:] = [eng.prefill(sess, rows)]
                return batch * len(rows[0]), extra

            ph = measured(name, turn, "warm" if cached else None)
            ph.client["ttft_s"] = ph.client["time_s"]
            tok = _note(ph, produced[0], keep_logits, eng)
    return result


def check_received(eng: Adapter, out: Produced, phase: str, step: int | None = None) -> None:
    """Refuse what an engine that does not check its own outputs (`checks_finite`) returned with
    NaN or inf in it: logits, or -- where it reports top-k logprobs instead (llama-server, which
    writes a NaN as null) -- a logprob that is missing or non-finite. One line naming the engine,
    the phase and the step; never a TypeError further on."""
    if eng.checks_finite:
        return
    said = f"engine={eng.name} returned"
    where = f"in phase {phase}" + ("" if step is None else f", step {step}")
    if out.logits is not None and (n := nonfinite_count(out.logits)):
        raise NonFiniteError(f"{said} {n} of {out.logits.numel()} logits NaN or inf {where} (the model computed "
                             "no number there; no token it chose is a measurement)")
    for row, probs in enumerate(out.top_logprobs or ()):
        if not probs:
            raise NonFiniteError(f"{said} no logprobs {where} for token {out.tokens[row]} of row {row} (its top-k "
                                 "were asked for; a server that computed NaN sends none)")
        bad = {i: v for i, v in probs.items() if v is None or not math.isfinite(v)}
        if bad:
            raise NonFiniteError(f"{said} {len(bad)} of {len(probs)} top logprobs NaN or inf {where} for token "
                                 f"{out.tokens[row]} of row {row} (ids {sorted(bad)}; the server writes NaN as null)")


def _note(ph: PhaseResult, out: Produced, keep_logits: bool, eng: Adapter) -> list[int]:
    """Record the token a prefill phase produced (and its logits), once checked; returns it."""
    check_received(eng, out, ph.phase)
    ph.tokens = [out.tokens]
    if keep_logits and out.logits is not None:
        ph.logits = [_host(out.logits)]
    if keep_logits and out.top_logprobs is not None:
        ph.top_logprobs = [out.top_logprobs]
    return out.tokens


def compare_phase(got: PhaseResult, ref: PhaseResult) -> Comparison:
    """`got` against the reference's same phase, per token the reference produced and per row
    (harness.checks judges it): |Δ logits| where the engine gave logits, else |Δ logprob| over the
    top-k ids it reported (against the reference's log-softmax), the tokens, and the reference's
    margin of its own token over the engine's."""
    if got.logits:
        metric, diffs = LOGIT, [(g - r).abs().amax(dim=-1).tolist() for g, r in zip(got.logits, ref.logits)]
    elif got.top_logprobs:
        metric, diffs = LOGPROB, [_logprob_diffs(step, r) for step, r in zip(got.top_logprobs, ref.logits)]
    else:
        metric, diffs = None, []
    rows = len(ref.tokens[0]) if ref.tokens else 0
    same, margins = [], []
    for i, want in enumerate(ref.tokens):
        have = got.tokens[i] if i < len(got.tokens) else [None] * rows
        same.append([a == b for a, b in zip(have, want)])
        margins.append([0.0 if a == b else None if a is None else (ref.logits[i][row, b] - ref.logits[i][row, a]).item()
                        for row, (a, b) in enumerate(zip(have, want))])
    diffs += [[None] * rows] * (len(ref.tokens) - len(diffs))       # steps the engine gave nothing for
    return Comparison(metric, diffs[:len(ref.tokens)], same, margins, [list(t) for t in ref.tokens])


def check_phase(got: PhaseResult, ref: PhaseResult | None) -> dict[str, float | None]:
    """max |Δ logits| over the tokens this phase produced and the fraction of equal tokens,
    against the reference's same phase (and max |Δ logprob| for an engine that reports top-k
    logprobs); nulls where there is nothing to compare."""
    if ref is None or not got.tokens or not ref.tokens:
        return dict.fromkeys(CHECK_METRICS)
    return check_metrics(compare_phase(got, ref))


def check_metrics(cmp: Comparison) -> dict[str, float | None]:
    """The check's metric rows from a comparison: one token the engine did not produce is a
    disagreement, never skipped. Only the difference the engine can give is a row: an engine that
    reports top-k logprobs (llama.cpp) has a `max_abs_logprob_diff` and no logit row -- not a null
    one that no column would explain; one that reports neither has token agreement alone."""
    same = [s for step in cmp.same for s in step]
    diffs = [d for step in cmp.diffs for d in step if d is not None]
    out: dict[str, float | None] = {"token_agreement": sum(same) / len(same) if same else None}
    if cmp.metric is not None and diffs:
        out[cmp.metric] = max(diffs)
    return out


def _logprob_diffs(step: list[dict[int, float] | None], logits: torch.Tensor) -> list[float | None]:
    """Per row: max |logprob - reference log-softmax| over the ids the engine reported (its top-k);
    None for a row it reported none for."""
    lp = torch.log_softmax(logits.double(), dim=-1)                      # [B, V]
    return [max((abs(v - lp[row, i].item()) for i, v in probs.items()), default=None) if probs else None
            for row, probs in enumerate(step)]
