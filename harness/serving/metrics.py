"""Serving metrics from client-side request timelines, named the way `vllm bench serve` names them.

Owns: what a client saw of one request (`RequestTimeline`: its arrival and the receive time of every
output token, on one monotonic clock) and that request's metrics (ttft_s, tpot_s, itl_s, e2el_s, the
per-user output rate, output-length mismatch); the run's summary over its steady-state window
(`summarize`: counts, throughputs, mean/p50/p90/p99 of each latency, the token-weighted cached prompt
fraction, goodput against an `SLO`); the SLO presets from MLPerf Inference and custom SLOs
(`slo_of`); the data dictionaries (`METRICS`, `REQUEST_METRICS`: unit, meaning, other tools' names);
tidy rows (`summary_rows`, `request_rows`). Does not own: sending requests or timing them (the load
generator), choosing the steady-state window, storing rows (harness.results).

Conventions: seconds throughout (the other tools print ms, LoadGen ns); percentiles are numpy's
default linear interpolation (`np.percentile(values, p)`); what was not measured is None, never 0.

    from harness.serving.metrics import RequestTimeline, summarize, summary_rows
    t = RequestTimeline("r0", arrival_s=0.0, token_times_s=(0.5, 0.625, 0.75), prompt_tokens=100,
                        output_tokens_asked=3)
    t.ttft_s, t.tpot_s, t.itl_s           # 0.5, 0.125, (0.125, 0.125)
    s = summarize([t], window=(0.0, 10.0), slo="mixtral-8x7b")
    s.ttft_s.p99, s.request_goodput, s.slo_met      # 0.5, 0.1, True
    summary_rows(s)[0]                    # {'metric': 'requests', 'value': 1.0, 'unit': 'count'}
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

STATS = ("mean", "p50", "p90", "p99")
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}


# --- one request -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestTimeline:
    """One request as the client saw it. A stream chunk carrying k tokens gives k equal token times
    (k - 1 zero gaps): the times are per token, not per chunk."""
    request_id: str
    arrival_s: float                        # when the client sent it
    token_times_s: tuple[float, ...]        # client receive time of every output token, in order
    prompt_tokens: int
    output_tokens_asked: int
    cached_prompt_tokens: int | None = None  # the engine's count of prompt tokens from its prefix cache
    error: str | None = None                 # set: the request failed
    warmup: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times_s", tuple(float(x) for x in self.token_times_s))
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"RequestTimeline.arrival_s must be a finite time in seconds; got {self.arrival_s!r}")
        previous, what = self.arrival_s, "arrival_s"
        for i, t in enumerate(self.token_times_s):
            if not (math.isfinite(t) and t >= previous):
                raise ValueError(f"RequestTimeline.token_times_s must be finite, non-decreasing and not before "
                                 f"arrival_s; token {i} at {t!r} comes before {what}={previous!r}")
            previous, what = t, f"token {i}"
        for name in ("prompt_tokens", "output_tokens_asked", "cached_prompt_tokens"):
            value = getattr(self, name)
            if value is None and name == "cached_prompt_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RequestTimeline.{name} must be a non-negative int; got {value!r}")
        if self.cached_prompt_tokens is not None and self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError(f"RequestTimeline.cached_prompt_tokens must be at most prompt_tokens="
                             f"{self.prompt_tokens}; got {self.cached_prompt_tokens}")

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        """First token's receive time - arrival; None without a token."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def e2el_s(self) -> float | None:
        """Last token's receive time - arrival; None without a token."""
        return self.token_times_s[-1] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(e2el - ttft) / (out - 1); None below two tokens (one token has no time per output token)."""
        if self.output_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Every gap between consecutive tokens, kept raw (a stall shows here, averaged away in tpot)."""
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def output_tok_per_s_per_user(self) -> float | None:
        """(out - 1) / (e2el - ttft): the decode rate this user saw; None below two tokens or when
        every token arrived at once."""
        decode_s = self.token_times_s[-1] - self.token_times_s[0] if self.output_tokens >= 2 else 0.0
        return (self.output_tokens - 1) / decode_s if decode_s > 0 else None

    @property
    def output_mismatch(self) -> bool:
        return self.output_tokens != self.output_tokens_asked


# --- service-level objectives ----------------------------------------------------------------------

MLPERF_CONF = ("https://github.com/mlcommons/inference/blob/001712e9daf80386e0dda43f97b8f36981d792c4/"
               "loadgen/mlperf.conf")


@dataclass(frozen=True)
class SLO:
    """Latency bounds a run must meet at `percentile`, in seconds."""
    name: str
    ttft_s: float
    tpot_s: float
    percentile: float = 99.0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SLO.{name} must be a positive number of seconds; got {value!r}")
        if not (isinstance(self.percentile, (int, float)) and 0 < self.percentile <= 100):
            raise ValueError(f"SLO.percentile must be in (0, 100]; got {self.percentile!r}")

    def good(self, t: RequestTimeline) -> bool:
        """Completed, first token within the TTFT bound, and TPOT within its bound; a request of fewer
        than two tokens has no TPOT and meets that bound (as `vllm bench serve` counts it)."""
        ttft, tpot = t.ttft_s, t.tpot_s
        return (not t.failed and ttft is not None and ttft <= self.ttft_s
                and (tpot is None or tpot <= self.tpot_s))


def _mlperf(name: str, ttft_ms: int, tpot_ms: int) -> SLO:
    return SLO(name, ttft_ms / 1000, tpot_ms / 1000, 99.0,
               f"MLPerf Inference LoadGen {MLPERF_CONF}: {name}.Server.ttft_latency = {ttft_ms}, "
               f"tpot_latency = {tpot_ms} (ms); *.Server.target_latency_percentile = 99")


# The Server-scenario constraints of MLPerf Inference's MoE benchmarks, as loadgen/mlperf.conf sets them.
SLO_PRESETS: dict[str, SLO] = {s.name: s for s in (
    _mlperf("mixtral-8x7b", 2000, 200),
    _mlperf("deepseek-r1", 2000, 80),
    _mlperf("deepseek-r1-interactive", 1500, 15),
)}
CUSTOM_FORM = "ttft=SECONDS,tpot=SECONDS[,percentile=P]"


def slo_of(spec: str | SLO) -> SLO:
    """A preset by name, or a custom `ttft=2.0,tpot=0.2[,percentile=99]` (seconds)."""
    if isinstance(spec, SLO):
        return spec
    if spec in SLO_PRESETS:
        return SLO_PRESETS[spec]
    refuse = (f"unknown SLO {spec!r}: give a preset ({', '.join(SLO_PRESETS)}) or {CUSTOM_FORM!r}")
    parts = [p.strip() for p in str(spec).split(",")]
    pairs = [p.partition("=") for p in parts]
    keys = [k.strip() for k, eq, _ in pairs if eq]
    if (len(keys) != len(parts) or len(set(keys)) != len(keys) or not {"ttft", "tpot"} <= set(keys)
            or not set(keys) <= {"ttft", "tpot", "percentile"}):
        raise ValueError(f"{refuse}; the keys are ttft and tpot, and optionally percentile, each once")
    try:
        values = {k.strip(): float(v) for k, _, v in pairs}
    except ValueError:
        raise ValueError(f"{refuse}; every value must be a number") from None
    try:
        return SLO(str(spec), values["ttft"], values["tpot"], values.get("percentile", 99.0), "custom")
    except ValueError as exc:
        raise ValueError(f"{refuse}; {exc}") from None


# --- the run -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stats:
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """Mean and linear-interpolated percentiles; all None for no values."""
        if not len(values):
            return cls()
        pct = np.percentile(np.asarray(values, dtype=float), list(PERCENTILES.values()))
        return cls(float(np.mean(values)), *(float(p) for p in pct))


@dataclass(frozen=True)
class ServingSummary:
    """A run over its window. Counts and rates are over the window's non-warm-up requests; latency
    statistics over the completed ones. None: not measured (no request in the window, an empty
    sample, no SLO given)."""
    window_s: tuple[float, float]
    requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int | None
    output_tokens: int | None
    request_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    ttft_s: Stats
    tpot_s: Stats
    itl_s: Stats
    e2el_s: Stats
    output_mismatch: int | None
    cached_prompt_fraction: float | None
    slo: SLO | None = None
    request_goodput: float | None = None
    good_fraction: float | None = None
    slo_met: bool | None = None


def measured(timelines: Iterable[RequestTimeline], window: tuple[float, float]) -> list[RequestTimeline]:
    """The requests a window measures: not warm-up, arrival in [start, end)."""
    start, end = _checked_window(window)
    return [t for t in timelines if not t.warmup and start <= t.arrival_s < end]


def _checked_window(window: tuple[float, float]) -> tuple[float, float]:
    start, end = window
    if not (math.isfinite(start) and math.isfinite(end) and end > start):
        raise ValueError(f"window must be (start_s, end_s), finite, with end_s > start_s; got {window!r}")
    return float(start), float(end)


def cached_prompt_fraction(timelines: Iterable[RequestTimeline]) -> float | None:
    """Sum of cached prompt tokens / sum of prompt tokens over the requests whose engine reported a
    count: weighted by tokens, never a mean of per-request ratios. None when none reported."""
    reported = [t for t in timelines if t.cached_prompt_tokens is not None]
    prompt = sum(t.prompt_tokens for t in reported)
    return sum(t.cached_prompt_tokens for t in reported) / prompt if prompt else None


def _slo_met(slo: SLO, done: list[RequestTimeline], failed: int) -> bool:
    """The p-th percentile of ttft and of tpot within the bounds. A failed request, or a completed one
    without a token, fails the run: percentiles over the survivors would hide it."""
    ttfts = [t.ttft_s for t in done]
    if failed or None in ttfts:
        return False
    tpots = [t.tpot_s for t in done if t.tpot_s is not None]
    return bool(np.percentile(ttfts, slo.percentile) <= slo.ttft_s
                and (not tpots or np.percentile(tpots, slo.percentile) <= slo.tpot_s))


def summarize(timelines: Iterable[RequestTimeline], window: tuple[float, float],
              slo: str | SLO | None = None) -> ServingSummary:
    """The run's metrics over `window` = (start_s, end_s), its steady state on the timelines' clock.

    Requests: arrival in [start, end), warm-up excluded. Failed requests count as failures and stay
    out of every latency and token total (as vLLM and SGLang count them). Rates divide by the window's
    length; with no request in the window they are None, not 0."""
    start, end = _checked_window(window)
    slo = slo_of(slo) if slo is not None else None
    included = measured(timelines, (start, end))
    done = [t for t in included if not t.failed]
    duration = end - start
    any_request = bool(included)
    prompt = sum(t.prompt_tokens for t in done)
    output = sum(t.output_tokens for t in done)

    def rate(n: float) -> float | None:
        return n / duration if any_request else None

    good = sum(slo.good(t) for t in included) if slo else 0
    return ServingSummary(
        window_s=(start, end), requests=len(included), completed=len(done), failed=len(included) - len(done),
        duration_s=duration,
        prompt_tokens=prompt if any_request else None, output_tokens=output if any_request else None,
        request_throughput=rate(len(done)), output_throughput=rate(output),
        total_token_throughput=rate(prompt + output),
        ttft_s=Stats.of([t.ttft_s for t in done if t.ttft_s is not None]),
        tpot_s=Stats.of([t.tpot_s for t in done if t.tpot_s is not None]),
        itl_s=Stats.of([gap for t in done for gap in t.itl_s]),
        e2el_s=Stats.of([t.e2el_s for t in done if t.e2el_s is not None]),
        output_mismatch=sum(t.output_mismatch for t in done) if done else None,
        cached_prompt_fraction=cached_prompt_fraction(done),
        slo=slo,
        request_goodput=rate(good) if slo else None,
        good_fraction=good / len(included) if slo and any_request else None,
        slo_met=_slo_met(slo, done, len(included) - len(done)) if slo and any_request else None,
    )


def _flat(s: ServingSummary) -> dict[str, float | None]:
    """The summary as METRICS names -> float or None."""
    def num(v: float | int | bool | None) -> float | None:
        return None if v is None else float(v)
    out = {name: num(getattr(s, name)) for name in _SCALARS}
    for base in LATENCIES:
        stats: Stats = getattr(s, base)
        out.update({f"{base}_{stat}": getattr(stats, stat) for stat in STATS})
    out.update({name: num(getattr(s, name)) for name in _SLO_SCALARS})
    return {name: out[name] for name in METRICS}


# --- the data dictionaries -----------------------------------------------------------------------------
# Other tools' names, as read in their source (docs/serving.md links each file). Their units differ from
# ours: vLLM and SGLang print ms, AIPerf's JSON gives ms (`<tag>.<stat>`), MLPerf LoadGen logs ns.

VLLM, SGLANG, AIPERF, LOADGEN, BENCHY = ("vllm bench serve", "sglang.bench_serving", "aiperf",
                                         "mlperf loadgen", "llama-benchy")
Names = dict[str, str]
Entry = tuple[str, str, Names]

# latency -> (meaning, vLLM key, SGLang key, AIPerf tag, LoadGen (mean name, percentile name with {p}))
LATENCIES: dict[str, tuple[str, str, str, str, tuple[str, str] | None]] = {
    "ttft_s": ("time to first token: the first token's receive time - arrival", "ttft", "ttft",
               "time_to_first_token",
               ("result_first_token_mean_latency_ns", "result_first_token_{p}.00_percentile_latency_ns")),
    "tpot_s": ("time per output token after the first: (e2el - ttft) / (out - 1), per request; requests "
               "under two tokens have none. AIPerf calls this inter_token_latency", "tpot", "tpot",
               "inter_token_latency",
               ("result_time_to_output_token_mean", "result_time_per_output_token_{p}.00_percentile_ns")),
    "itl_s": ("inter-token latency: every gap between consecutive tokens of every request, pooled. AIPerf "
              "calls this inter_chunk_latency (per chunk)", "itl", "itl", "inter_chunk_latency", None),
    "e2el_s": ("end-to-end latency: the last token's receive time - arrival", "e2el", "e2e_latency",
               "request_latency", ("result_mean_latency_ns", "result_{p}.00_percentile_latency_ns")),
}


def _stat_names(base: str, stat: str) -> Names:
    _, vllm, sglang, aiperf, loadgen = LATENCIES[base]
    word = {"mean": "mean", "p50": "median"}.get(stat, stat)
    names = {VLLM: f"{word}_{vllm}_ms", AIPERF: f"{aiperf}.{'avg' if stat == 'mean' else stat}"}
    if stat != "p90":                # SGLang reports mean, median and p99 (p95 too for ITL), no p90
        names[SGLANG] = f"{word}_{sglang}_ms"
    if loadgen:
        names[LOADGEN] = loadgen[0] if stat == "mean" else loadgen[1].format(p=stat[1:])
    if base == "ttft_s" and stat == "mean":
        names[BENCHY] = "e2e_ttft (ms), mean over --runs"
    return names


_SCALARS: dict[str, Entry] = {
    "requests": ("count", "non-warm-up requests arriving in the window, completed or failed", {}),
    "completed": ("count", "requests of the window that completed",
                  {VLLM: "completed", SGLANG: "completed", AIPERF: "request_count.avg (successful requests only)"}),
    "failed": ("count", "requests of the window that failed", {VLLM: "failed", AIPERF: "error_request_count.avg"}),
    "duration_s": ("s", "the window's length: end_s - start_s", {VLLM: "duration", SGLANG: "duration"}),
    "prompt_tokens": ("tok", "prompt tokens of the completed requests",
                      {VLLM: "total_input_tokens", SGLANG: "total_input_tokens"}),
    "output_tokens": ("tok", "output tokens received by the completed requests",
                      {VLLM: "total_output_tokens", SGLANG: "total_output_tokens"}),
    "request_throughput": ("req/s", "completed / duration_s",
                           {VLLM: "request_throughput", SGLANG: "request_throughput",
                            AIPERF: "request_throughput.avg",
                            LOADGEN: "result_completed_samples_per_sec (counts n - 1)"}),
    "output_throughput": ("tok/s", "output_tokens / duration_s",
                          {VLLM: "output_throughput", SGLANG: "output_throughput",
                           AIPERF: "output_token_throughput.avg", LOADGEN: "result_completed_tokens_per_second"}),
    "total_token_throughput": ("tok/s", "(prompt_tokens + output_tokens) / duration_s",
                               {VLLM: "total_token_throughput", SGLANG: "total_throughput",
                                AIPERF: "total_token_throughput.avg"}),
}
_LATENCY_ENTRIES: dict[str, Entry] = {
    f"{base}_{stat}": ("s", f"{'mean' if stat == 'mean' else stat + ' (numpy linear)'} of {meaning}",
                       _stat_names(base, stat))
    for base, (meaning, *_) in LATENCIES.items() for stat in STATS}
_SLO_SCALARS: dict[str, Entry] = {
    "output_mismatch": ("count", "completed requests whose output length differs from the length asked", {}),
    "cached_prompt_fraction": ("ratio", "sum of cached prompt tokens / sum of prompt tokens over the completed "
                               "requests whose engine reported a count (token-weighted)",
                               {"vllm server": "vllm:prefix_cache_hits / vllm:prefix_cache_queries (Prometheus "
                                               "counters, whole server)"}),
    "request_goodput": ("req/s", "requests meeting the SLO (completed, ttft and tpot within bounds) / duration_s",
                        {VLLM: "request_goodput", AIPERF: "goodput.avg"}),
    "good_fraction": ("ratio", "requests meeting the SLO / requests", {}),
    "slo_met": ("count", "1 when the SLO's percentile of ttft_s and of tpot_s are within its bounds and no "
                "request failed, else 0",
                {LOADGEN: "result_perf_constraints_met (Server scenario)"}),
}
METRICS: dict[str, Entry] = {**_SCALARS, **_LATENCY_ENTRIES, **_SLO_SCALARS}

REQUEST_METRICS: dict[str, Entry] = {
    "ttft_s": ("s", LATENCIES["ttft_s"][0], {AIPERF: "time_to_first_token", BENCHY: "e2e_ttft (ms)"}),
    "tpot_s": ("s", "(e2el - ttft) / (out - 1); None below two tokens", {AIPERF: "inter_token_latency"}),
    "e2el_s": ("s", LATENCIES["e2el_s"][0], {AIPERF: "request_latency"}),
    "itl_s_max": ("s", "the request's longest gap between consecutive tokens", {}),
    "output_tok_per_s_per_user": ("tok/s", "(out - 1) / (e2el - ttft); None below two tokens",
                                  {AIPERF: "output_token_throughput_per_user", BENCHY: "t/s of a tg row"}),
    "prompt_tokens": ("tok", "prompt tokens", {AIPERF: "input_sequence_length"}),
    "output_tokens": ("tok", "output tokens received", {AIPERF: "output_sequence_length"}),
    "output_tokens_asked": ("tok", "output tokens the request asked for", {}),
    "cached_prompt_tokens": ("tok", "prompt tokens the engine served from its prefix cache, as it reported",
                             {"openai api": "usage.prompt_tokens_details.cached_tokens"}),
    "output_mismatch": ("count", "1 when output_tokens differs from output_tokens_asked", {}),
    "failed": ("count", "1 when the request failed", {}),
    "warmup": ("count", "1 for a warm-up request", {}),
}


# --- tidy rows ----------------------------------------------------------------------------------------

def summary_rows(summary: ServingSummary) -> list[dict]:
    """One {"metric", "value", "unit"} per METRICS entry; value None where not measured."""
    values = _flat(summary)
    return [{"metric": name, "value": values[name], "unit": METRICS[name][0]} for name in METRICS]


def _request_values(t: RequestTimeline) -> dict[str, float | None]:
    def num(v: float | int | bool | None) -> float | None:
        return None if v is None else float(v)
    return {"ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "e2el_s": t.e2el_s,
            "itl_s_max": max(t.itl_s) if t.itl_s else None,
            "output_tok_per_s_per_user": t.output_tok_per_s_per_user,
            "prompt_tokens": num(t.prompt_tokens), "output_tokens": num(t.output_tokens),
            "output_tokens_asked": num(t.output_tokens_asked), "cached_prompt_tokens": num(t.cached_prompt_tokens),
            "output_mismatch": num(t.output_mismatch), "failed": num(t.failed), "warmup": num(t.warmup)}


def request_rows(timelines: Iterable[RequestTimeline]) -> list[dict]:
    """One {"request_id", "metric", "value", "unit"} per request and REQUEST_METRICS entry, for every
    timeline given (filter with `measured` first for a window's requests)."""
    return [{"request_id": t.request_id, "metric": name, "value": value, "unit": REQUEST_METRICS[name][0]}
            for t in timelines for name, value in _request_values(t).items()]
