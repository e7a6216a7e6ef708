"""The scenario: one session driven through the measured phases, each timed directly.

Owns: the phase sequence of DESIGN.md §4 -- load, prefill_fresh, decode,
prefill_continuation (earlier KV still on the device), prefill_restored (earlier KV
displaced to host RAM, then restored) -- and the metrics each phase records.
Does not own: building engines (harness.engines), rows and files (harness.runner).

Per repeat the expert cache starts cold. Continuation and restored turns feed the
pending reply token plus `turn_tokens` new tokens on top of the whole earlier session,
so `reused_tokens` is the session length before the turn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.timeline import Timeline
from harness.engines import Adapter
from harness.measure import PhaseProbe, percentile, rates
from harness.profiling.overlap import overlap_metrics
from workloads.base import WorkloadSample

PHASES = ("load", "prefill_fresh", "decode", "prefill_continuation", "prefill_restored")
PREFIX_CACHE = {"prefill_fresh": "none", "decode": "device", "prefill_continuation": "device",
                "prefill_restored": "restored", "load": "none"}
COUNTER_METRICS = ("h2d_bytes", "d2h_bytes", "expert_hits", "expert_misses", "expert_hit_bytes", "expert_miss_bytes",
                   "prefetch_issued", "prefetch_used", "prefetch_wasted_bytes")
# need the copy/compute timeline (profiling issue); until it records them they are null, never 0
TIMELINE_METRICS = ("copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps")


@dataclass
class PhaseResult:
    phase: str
    client: dict[str, float | None] = field(default_factory=dict)   # measured around the request
    engine: dict[str, float | None] = field(default_factory=dict)   # read from the engine's counters


@dataclass
class RepeatResult:
    phases: list[PhaseResult]
    logits: list[torch.Tensor]          # fresh prefill + decode logits, for the reference check
    tokens: list[list[int]]             # generated per row
    windows: list[tuple[str, float, float]] = field(default_factory=list)   # (phase, start, end), perf_counter


def _argmax(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()   # .tolist() synchronises: the token is available on the host


def _phase(name: str, probe: PhaseProbe, tokens: int, extra: dict[str, float | None],
           timeline: Timeline | None, emulated: bool) -> PhaseResult:
    t = probe.time_s
    client = {"time_s": t, "tokens": float(tokens), "tok_per_s": tokens / t if t > 0 else None,
              "peak_device_bytes": probe.peak_device_bytes, "peak_host_rss_bytes": probe.peak_host_rss_bytes,
              **extra}
    engine: dict[str, float | None] = {}
    if probe.counters is not None:
        engine = {k: float(probe.counters[k]) for k in COUNTER_METRICS}
        engine.update(rates(probe.counters))
    else:   # an engine that cannot count: null, never 0
        engine = dict.fromkeys((*COUNTER_METRICS, "hit_rate", "byte_hit_rate"))
    if timeline is None:
        engine.update(dict.fromkeys(TIMELINE_METRICS))
    else:
        timeline.collect()
        t0, t1 = probe.t_start, probe.t_end
        engine.update(overlap_metrics(timeline.intervals("copy", t0, t1), timeline.compute_intervals(t0, t1),
                                      h2d_bytes=engine.get("h2d_bytes"), emulated=emulated))
    return PhaseResult(name, client, engine)


def run_repeat(eng: Adapter, sample: WorkloadSample, gen_tokens: int, keep_logits: bool,
               timeline: Timeline | None = None) -> RepeatResult:
    """One cold-cache pass through every phase. With a `timeline` (already set on the
    engine), each phase also gets copy/compute overlap metrics from its time window."""
    kind, counters = eng.device_kind, eng.counters if eng.counters() is not None else None
    ph = lambda name, probe, tokens, extra: _phase(name, probe, tokens, extra, timeline, eng.emulated)  # noqa: E731
    batch = len(sample.contexts)
    eng.reset()
    sess = eng.new_session(batch)
    phases, logits = [], []
    try:
        span = eng.instrument.span
        with span("phase", phase="prefill_fresh"), PhaseProbe(kind, counters) as p:
            out = eng.prefill(sess, sample.contexts)
            tok = _argmax(out)
        ctx_len = len(sample.contexts[0])
        phases.append(ph("prefill_fresh", p, batch * ctx_len, {"ttft_s": p.time_s, "reused_tokens": 0.0}))
        windows = [("prefill_fresh", p.t_start, p.t_end)]
        logits.append(out.float().cpu() if keep_logits else out)
        generated = [tok]
        if gen_tokens > 1:
            steps: list[float] = []
            with span("phase", phase="decode"), PhaseProbe(kind, counters) as p:
                for _ in range(gen_tokens - 1):
                    t0 = time.perf_counter()
                    out = eng.decode_step(sess, tok)
                    tok = _argmax(out)
                    steps.append(time.perf_counter() - t0)
                    if keep_logits:
                        logits.append(out.float().cpu())
                    generated.append(tok)
            phases.append(ph("decode", p, batch * (gen_tokens - 1), {
                "tpot_s_p50": percentile(steps, 50), "tpot_s_p90": percentile(steps, 90),
                "tpot_s_p99": percentile(steps, 99)}))
            windows.append(("decode", p.t_start, p.t_end))
        for name in ("prefill_continuation", "prefill_restored"):
            reused = ctx_len + gen_tokens - 1 + (len(sample.continuations[0]) + 1 if name == "prefill_restored" else 0)
            rows = [[t, *c] for t, c in zip(tok, sample.continuations)]
            extra: dict[str, float | None] = {"reused_tokens": float(reused)}
            if name == "prefill_restored":
                eng.offload(sess)     # displacement happens between turns; its d2h is not this phase's
            with span("phase", phase=name), PhaseProbe(kind, counters) as p:
                if name == "prefill_restored":
                    t0 = time.perf_counter()
                    eng.restore(sess)
                    extra["restore_s"] = time.perf_counter() - t0   # restore() synchronises
                tok = _argmax(eng.prefill(sess, rows))
            extra["ttft_s"] = p.time_s
            phases.append(ph(name, p, batch * len(rows[0]), extra))
            windows.append((name, p.t_start, p.t_end))
    finally:
        eng.close_session(sess)
    return RepeatResult(phases, logits, [list(col) for col in zip(*generated)], windows)


def compare(got: RepeatResult, ref: RepeatResult) -> dict[str, float]:
    """max |Δ logits| over every generated position and the fraction of equal tokens."""
    n = min(len(got.logits), len(ref.logits))
    diff = max((got.logits[i] - ref.logits[i]).abs().max().item() for i in range(n))
    pairs = [(a, b) for ga, gb in zip(got.tokens, ref.tokens) for a, b in zip(ga, gb)]
    return {"max_abs_logit_diff": diff, "token_agreement": sum(a == b for a, b in pairs) / len(pairs)}
