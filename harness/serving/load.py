"""The load spec: what a serving run offers the server -- when each request arrives and how long
its prompt and its reply are -- and the request schedule it makes.

Owns: `LoadConf` (the `load` group's schema), `check_load` (every refusal one line: the key, what
is allowed, what was given), `schedule` (the seeded list of `RequestPlan`s), `steady_window` (the
measured window) and `describe` (a one-line label for table headers). Does not own: reading trace
and length-dataset files (harness.serving.trace_files, re-exported here), sending requests or
timing them, the serving metrics (harness.serving.metrics), registering the group in the
ConfigStore (harness.config.schema).
Pure Python and numpy: no torch, no Hydra.

Arrivals in seconds from the start, the first at 0 (r = `rate`, b = `burstiness`): constant
t_i = i/r; poisson, exponential gaps of mean 1/r; gamma, Gamma(shape=b, scale=1/(r*b)) gaps (mean
1/r, CV 1/sqrt(b): vLLM `bench serve`'s burstiness); trace, a file's timestamps shifted to 0; rate
null, all at 0 (a closed loop that max_concurrency limits). Lengths are fixed, uniform (vLLM's
`--random-range-ratio`), normal, or a length dataset's rows (a file of input and output lengths
without arrival times, its rows drawn in a seeded order, a request's two lengths from one row).
Arrivals, input and output lengths and the dataset's rows draw from their own children of
`SeedSequence(seed)`. docs/serving_load.md has every key, the formulas, the steady window and
the file formats.

    from harness.serving.load import LoadConf, describe, schedule, steady_window
    conf = LoadConf(name="poisson", rate=4.0, requests=32, warmup_requests=2, max_concurrency=4)
    plans = schedule(conf)             # 32 RequestPlan: plans[0].arrival_s == 0.0, the first 2 warm-up
    start, end = steady_window(plans, conf)
    print(describe(conf))
    # poisson 4 req/s, 32 requests (2 warm-up), max 4 concurrent, in 256 fixed, out 64 fixed, seed 0
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np

from harness.serving.trace_files import SIDES, SUFFIXES, Trace, read_dataset, read_trace

__all__ = ["LoadConf", "RequestPlan", "Trace", "check_load", "schedule", "read_trace", "read_dataset",
           "steady_window", "describe", "NAMES", "LENGTH_DISTS"]

NAMES = ("none", "constant", "poisson", "gamma", "trace")
DATASET = "dataset"                        # the length "distribution" that is a file's rows
LENGTH_DISTS = ("fixed", "uniform", "normal", DATASET)


@dataclass
class LoadConf:
    name: str = "none"                     # none | constant | poisson | gamma | trace; none: the single-session phases
    rate: Optional[float] = None           # requests/s; null: every request at once, a closed loop at max_concurrency
    burstiness: float = 1.0                # gamma's shape: 1 is poisson, < 1 burstier, > 1 more even
    max_concurrency: Optional[int] = None  # requests in flight at most; null: unlimited (needs a rate)
    requests: Optional[int] = None         # how many requests, warm-up included ...
    duration_s: Optional[float] = None     # ... or every arrival before this many seconds (one of the two)
    warmup_requests: int = 0               # the schedule's first N: sent and marked, never measured
    ramp_s: float = 0.0                    # the steady window starts this long after the first measured arrival ...
    drain_s: float = 0.0                   # ... and ends this long before the last one
    input_len: int = 256                   # prompt tokens (the mean of a distribution)
    output_len: int = 64                   # generated tokens (the mean of a distribution)
    input_dist: str = "fixed"              # fixed | uniform | normal | dataset (dataset_file's rows)
    output_dist: str = "fixed"
    input_ratio: float = 0.0               # uniform: integers in [len*(1-ratio), len*(1+ratio)], 0 < ratio < 1
    output_ratio: float = 0.0
    input_std: float = 0.0                 # normal: the standard deviation in tokens (rounded, clipped to >= 1)
    output_std: float = 0.0
    trace_file: Optional[str] = None       # trace: a .jsonl or .csv of arrivals and, optionally, lengths
    dataset_file: Optional[str] = None     # *_dist=dataset: a .jsonl or .csv of (input, output) lengths, no times
    seed: int = 0                          # arrivals, each length draw and a dataset's rows: a child of it each
    ignore_eos: bool = True                # generate exactly the planned output length, past any end-of-sequence
    slo: Optional[str] = None              # goodput's bound: a preset (harness.serving.metrics.SLO_PRESETS) or
                                           # "ttft=2.0,tpot=0.2[,percentile=99]"; null: no goodput
    shared_prefix: int = 0                 # tokens the sharing requests' prompts begin with alike (the agent case:
                                           # one system prompt and tool schemas); 0: none
    share_ratio: float = 1.0               # the share of requests that begin with it (a seeded draw)
    prefix_cache: str = "cold"             # cold: the first sharing request computes the prefix, later ones may
                                           # reuse it; primed: it is computed before the first request;
                                           # isolated: no request reuses another's KV


@dataclass(frozen=True)
class RequestPlan:
    """One request of a schedule. A closed loop's arrivals are all 0: each is sent when a slot frees."""

    index: int          # position in the schedule, which is arrival order
    arrival_s: float    # when it is sent, seconds from the start (the first request at 0)
    input_len: int      # prompt tokens
    output_len: int     # tokens to generate
    warmup: bool        # one of the first `warmup_requests`: sent, not measured
    shares_prefix: bool = False   # its prompt begins with the load's shared prefix


# --- checking ----------------------------------------------------------------------------------
def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def _refusal(key: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"load.{key}: allowed {allowed}, got {_shown(value)}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_positive(v: Any) -> bool:
    return _is_number(v) and v > 0


def _is_int_from(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _closed_loop(conf: LoadConf) -> bool:
    return conf.rate is None and conf.name != "trace"


def _check_unused(conf: LoadConf) -> None:
    """load=none runs today's single-session phases: a load key set beside it is a mistake."""
    default = LoadConf()
    for f in fields(LoadConf):
        if f.name != "name" and getattr(conf, f.name) != getattr(default, f.name):
            raise _refusal(f.name, f"{_shown(getattr(default, f.name))} with load=none (the single-session phases; "
                                   "choose load=constant|poisson|gamma|trace for a load)", getattr(conf, f.name))


def _check_arrivals(conf: LoadConf) -> None:
    if conf.name == "trace":
        if conf.rate is not None:
            raise _refusal("rate", "null with load=trace (the file's timestamps are the arrivals)", conf.rate)
    elif conf.rate is not None and not _is_positive(conf.rate):
        raise _refusal("rate", "a positive number or null", conf.rate)
    if conf.name == "gamma":
        if not _is_positive(conf.burstiness):
            raise _refusal("burstiness", "a positive number with load=gamma (1 is poisson, < 1 burstier)",
                           conf.burstiness)
    elif conf.burstiness != 1.0:
        raise _refusal("burstiness", "1.0 unless load=gamma", conf.burstiness)
    if conf.max_concurrency is not None and not _is_int_from(conf.max_concurrency, 1):
        raise _refusal("max_concurrency", "an integer >= 1 or null", conf.max_concurrency)
    if _closed_loop(conf) and conf.max_concurrency is None:
        raise _refusal("max_concurrency", "an integer >= 1 when load.rate is null (a closed loop)", None)
    for key in ("ramp_s", "drain_s"):
        v = getattr(conf, key)
        if not _is_number(v) or v < 0:
            raise _refusal(key, "a number >= 0", v)
        if _closed_loop(conf) and v != 0:
            raise _refusal(key, "0 when load.rate is null (every arrival is at 0)", v)


def _check_count(conf: LoadConf) -> None:
    req, dur = conf.requests, conf.duration_s
    if req is not None and dur is not None:
        raise ValueError(f"load.requests, load.duration_s: allowed one of them, got both ({req} and {dur})")
    if req is None and dur is None and conf.name != "trace":
        raise ValueError(f"load.requests, load.duration_s: allowed one of them with load={conf.name} "
                         "(only load=trace may leave both null: every row), got neither")
    if req is not None and not _is_int_from(req, 1):
        raise _refusal("requests", "an integer >= 1 or null", req)
    if dur is not None and not _is_positive(dur):
        raise _refusal("duration_s", "a positive number or null", dur)
    if dur is not None and _closed_loop(conf):
        raise _refusal("duration_s", "null when load.rate is null (a closed loop has no arrival times: "
                                     "give load.requests)", dur)
    if not _is_int_from(conf.warmup_requests, 0):
        raise _refusal("warmup_requests", "an integer >= 0", conf.warmup_requests)
    if req is not None and conf.warmup_requests >= req:
        raise _refusal("warmup_requests", f"0 to {req - 1} (fewer than load.requests={req})", conf.warmup_requests)


# --- lengths -----------------------------------------------------------------------------------
def _draw_fixed(rng: np.random.Generator, mean: int, spread: float, n: int) -> np.ndarray:
    return np.full(n, mean, dtype=np.int64)


def _draw_uniform(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    # vLLM's random dataset: integers in [floor(mean*(1-r)), ceil(mean*(1+r))], both ends included;
    # rounded to 9 places first, so that 100*(1+0.1) = 110.00000000000001 bounds at 110, not 111
    low = max(1, math.floor(round(mean * (1 - ratio), 9)))
    high = math.ceil(round(mean * (1 + ratio), 9))
    return rng.integers(low, high, size=n, endpoint=True, dtype=np.int64)


def _draw_normal(rng: np.random.Generator, mean: int, std: float, n: int) -> np.ndarray:
    return np.maximum(np.rint(rng.normal(mean, std, size=n)), 1).astype(np.int64)


@dataclass(frozen=True)
class _Dist:
    spread: Optional[str]       # the key suffix of its spread (ratio | std), None: none
    # n lengths from (rng, *_len, spread, n); None: the lengths are a dataset's rows, not drawn around *_len
    draw: Optional[Callable[[np.random.Generator, int, float, int], np.ndarray]]


DISTS: dict[str, _Dist] = {"fixed": _Dist(None, _draw_fixed), "uniform": _Dist("ratio", _draw_uniform),
                           "normal": _Dist("std", _draw_normal), DATASET: _Dist(None, None)}
# what a distribution's spread may be (any other distribution leaves the key at 0)
SPREADS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "ratio": ("a number in (0, 1)", lambda v: 0 < v < 1),
    "std": ("a positive number", lambda v: v > 0),
}


PREFIX_CACHE_MODES = ("cold", "primed", "isolated")


def _check_prefix(conf: LoadConf) -> None:
    if not _is_int_from(conf.shared_prefix, 0):
        raise _refusal("shared_prefix", "an integer >= 0 (tokens)", conf.shared_prefix)
    if not (_is_number(conf.share_ratio) and 0 < conf.share_ratio <= 1):
        raise _refusal("share_ratio", "a fraction in (0, 1]", conf.share_ratio)
    if conf.prefix_cache not in PREFIX_CACHE_MODES:
        raise _refusal("prefix_cache", ", ".join(PREFIX_CACHE_MODES), conf.prefix_cache)
    if conf.shared_prefix and (conf.input_dist != "fixed" or conf.input_len <= conf.shared_prefix):
        raise _refusal("shared_prefix", f"fewer tokens than every prompt (load.input_len={conf.input_len}, "
                       f"input_dist fixed)", conf.shared_prefix)


def _check_lengths(conf: LoadConf) -> None:
    default = LoadConf()
    for side in SIDES:
        key, dist = f"{side}_len", getattr(conf, f"{side}_dist")
        if dist not in DISTS:
            raise _refusal(f"{side}_dist", ", ".join(LENGTH_DISTS), dist)
        if dist == DATASET:                        # the file's rows are the lengths: *_len does nothing
            if getattr(conf, key) != getattr(default, key):
                raise _refusal(key, f"the default {getattr(default, key)} with load.{side}_dist={dist} (the lengths "
                                    "are load.dataset_file's)", getattr(conf, key))
        elif not _is_int_from(getattr(conf, key), 1):
            raise _refusal(key, "an integer >= 1", getattr(conf, key))
        for spread, (allowed, ok) in SPREADS.items():
            key = f"{side}_{spread}"
            v = getattr(conf, key)
            if DISTS[dist].spread == spread:
                if not (_is_number(v) and ok(v)):
                    raise _refusal(key, f"{allowed} with load.{side}_dist={dist}", v)
            elif v != 0:
                raise _refusal(key, f"0 with load.{side}_dist={dist}", v)


def _check_file(key: str, f: Any, needed_with: str) -> None:
    """A trace or length-dataset file: a .jsonl or .csv path, relative to the working directory,
    that exists. Its rows are read (and checked) by `schedule`."""
    if not isinstance(f, str) or Path(f).suffix.lower() not in SUFFIXES:
        raise _refusal(key, f"a .jsonl or .csv file with {needed_with}", f)
    if not Path(f).is_file():
        raise ValueError(f"load.{key}: allowed an existing .jsonl or .csv file, got {f!r} (no such file)")


def _check_trace(conf: LoadConf) -> None:
    if conf.name != "trace":
        if conf.trace_file is not None:
            raise _refusal("trace_file", "null unless load=trace", conf.trace_file)
        return
    _check_file("trace_file", conf.trace_file, "load=trace")


def _dataset_sides(conf: LoadConf) -> list[str]:
    return [side for side in SIDES if getattr(conf, f"{side}_dist") == DATASET]


def _check_dataset(conf: LoadConf) -> None:
    sides = _dataset_sides(conf)
    if not sides:
        if conf.dataset_file is not None:
            raise _refusal("dataset_file", f"null unless load.input_dist or load.output_dist is {DATASET}",
                           conf.dataset_file)
        return
    _check_file("dataset_file", conf.dataset_file, f"load.{sides[0]}_dist={DATASET}")


def check_load(conf: LoadConf) -> LoadConf:
    """`conf`, unchanged, if it describes a load; else a ValueError of one line naming the key,
    what is allowed and what was given. Reads nothing but whether a trace or dataset file exists:
    its rows are checked when `schedule` reads them."""
    if conf.name not in NAMES:
        raise _refusal("name", ", ".join(NAMES), conf.name)
    if conf.name == "none":
        _check_unused(conf)
        return conf
    _check_arrivals(conf)
    _check_count(conf)
    _check_lengths(conf)
    _check_trace(conf)
    _check_dataset(conf)
    if not _is_int_from(conf.seed, 0):
        raise _refusal("seed", "an integer >= 0", conf.seed)
    _check_prefix(conf)
    if conf.ignore_eos is not True:
        raise _refusal("ignore_eos", "true (output lengths are enforced: every request generates its planned "
                       "length, and a shorter one counts as a mismatch)", conf.ignore_eos)
    if conf.slo is not None:
        from harness.serving.metrics import slo_of
        try:
            slo_of(conf.slo)
        except ValueError as exc:
            raise ValueError(f"load.slo: {exc}") from None
    return conf


# --- the schedule ------------------------------------------------------------------------------
def _constant(rng: np.random.Generator, conf: LoadConf, n: int) -> np.ndarray:
    return np.arange(n) / conf.rate               # i / rate, not a running sum: exactly even


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _poisson(rng: np.random.Generator, conf: LoadConf, n: int) -> np.ndarray:
    return _from_gaps(rng.exponential(1.0 / conf.rate, size=n - 1))


def _gamma(rng: np.random.Generator, conf: LoadConf, n: int) -> np.ndarray:
    b = conf.burstiness
    return _from_gaps(rng.gamma(shape=b, scale=1.0 / (conf.rate * b), size=n - 1))


# name -> n arrivals from 0 (float64 [n]); a process draws sequentially, so n arrivals are the
# first n of any longer draw from the same seed
PROCESSES: dict[str, Callable[[np.random.Generator, LoadConf, int], np.ndarray]] = {
    "constant": _constant, "poisson": _poisson, "gamma": _gamma}


def _synthetic_arrivals(conf: LoadConf, stream: np.random.SeedSequence) -> np.ndarray:
    if conf.rate is None:                          # closed loop: all at once, max_concurrency limits
        return np.zeros(conf.requests)
    process = PROCESSES[conf.name]
    if conf.requests is not None:
        return process(np.random.default_rng(stream), conf, conf.requests)
    n = math.ceil(conf.rate * conf.duration_s * 1.25) + 16
    while True:                                    # the same arrivals as requests=N, cut at the duration
        t = process(np.random.default_rng(stream), conf, n)
        if t[-1] >= conf.duration_s:
            return t[t < conf.duration_s]
        n *= 2


def _trace_requests(conf: LoadConf) -> Trace:
    trace = read_trace(conf.trace_file)
    n = len(trace.arrival_s)
    if conf.requests is not None and conf.requests > n:
        raise _refusal("requests", f"at most {n} (the requests in {Path(conf.trace_file).name}) or null",
                       conf.requests)
    keep = (conf.requests if conf.requests is not None
            else int(np.searchsorted(trace.arrival_s, conf.duration_s, side="left")) if conf.duration_s is not None
            else n)
    cut = [None if a is None else a[:keep] for a in (trace.input_len, trace.output_len)]
    return Trace(trace.arrival_s[:keep], *cut)


def _drawn_lengths(conf: LoadConf, side: str, n: int, stream: np.random.SeedSequence) -> np.ndarray:
    dist = DISTS[getattr(conf, f"{side}_dist")]
    spread = getattr(conf, f"{side}_{dist.spread}") if dist.spread else 0.0
    return dist.draw(np.random.default_rng(stream), getattr(conf, f"{side}_len"), spread, n)


def _dataset_rows(rows: int, n: int, stream: np.random.SeedSequence) -> np.ndarray:
    """Which of a dataset's `rows` each of `n` requests takes (int64 [n]): the rows in a seeded random
    order, each once before any is taken again -- a new order for each pass over the file. As vLLM's
    datasets (shuffled with the seed, the first n taken) where n <= rows; the first n of any longer
    draw from the same stream."""
    rng = np.random.default_rng(stream)
    return np.concatenate([rng.permutation(rows) for _ in range(-(-n // rows))])[:n]


def _dataset_lengths(conf: LoadConf, n: int, stream: np.random.SeedSequence) -> dict[str, np.ndarray]:
    """side -> int64 [n] for the sides whose distribution is the dataset: both from one row per request."""
    sides = _dataset_sides(conf)
    if not sides:
        return {}
    table = read_dataset(conf.dataset_file, sides)
    pick = _dataset_rows(len(table[sides[0]]), n, stream)
    return {side: column[pick] for side, column in table.items()}


def schedule(conf: LoadConf) -> list[RequestPlan]:
    """The requests `conf` offers, in arrival order; the same list for the same conf and seed.

    Arrivals, input lengths, output lengths, which requests share the prefix and which row of a
    length dataset each request takes draw from the children of `np.random.SeedSequence(seed).spawn(5)`,
    in that order (the first three are what `default_rng(seed).spawn(3)` holds). With duration_s: the
    arrivals before it (t < duration_s). A trace's own lengths come before any distribution's.
    load=none: no requests."""
    check_load(conf)
    if conf.name == "none":
        return []
    arrivals_seq, input_seq, output_seq, share_seq, rows_seq = np.random.SeedSequence(conf.seed).spawn(5)
    if conf.name == "trace":
        trace = _trace_requests(conf)
    else:
        trace = Trace(_synthetic_arrivals(conf, arrivals_seq), None, None)
    n = len(trace.arrival_s)
    if conf.warmup_requests >= n:
        raise _refusal("warmup_requests", f"fewer than the {n} requests of the schedule", conf.warmup_requests)
    from_file = _dataset_lengths(conf, n, rows_seq)
    sides = (("input", trace.input_len, input_seq), ("output", trace.output_len, output_seq))
    lengths = [given if given is not None else from_file[side] if side in from_file
               else _drawn_lengths(conf, side, n, seq) for side, given, seq in sides]
    shares = (np.random.default_rng(share_seq).random(n) < conf.share_ratio if conf.shared_prefix
              else np.zeros(n, dtype=bool))
    return [RequestPlan(index=i, arrival_s=float(trace.arrival_s[i]), input_len=int(lengths[0][i]),
                        output_len=int(lengths[1][i]), warmup=i < conf.warmup_requests,
                        shares_prefix=bool(shares[i])) for i in range(n)]


def steady_window(plans: Sequence[RequestPlan], conf: LoadConf) -> tuple[float, float]:
    """(start, end), seconds from the start: the steady-state window over the measured arrivals.

    start = the first measured (non-warm-up) arrival + ramp_s; end = the last measured arrival -
    drain_s. A measured request is in the steady state when start <= arrival_s <= end (both ends
    included); with ramp_s = drain_s = 0 that is every measured request. A closed loop's window
    is (0, 0): all of its measured requests."""
    measured = [p.arrival_s for p in plans if not p.warmup]
    if not measured:
        raise _refusal("warmup_requests", f"fewer than the {len(plans)} requests of the schedule",
                       conf.warmup_requests)
    first, last = min(measured), max(measured)
    start, end = first + conf.ramp_s, last - conf.drain_s
    if start > end:
        raise ValueError(f"load.ramp_s + load.drain_s: allowed at most the measured arrivals' span {last - first:g} s, "
                         f"got {conf.ramp_s:g} + {conf.drain_s:g}")
    return start, end


# --- labels ------------------------------------------------------------------------------------
def _length_label(conf: LoadConf, side: str) -> str:
    mean, dist = getattr(conf, f"{side}_len"), getattr(conf, f"{side}_dist")
    if dist == DATASET:
        return f"{dist} {Path(conf.dataset_file or '').name}"
    spread = {"uniform": lambda: f" ±{getattr(conf, f'{side}_ratio') * 100:g}%",
              "normal": lambda: f" sd {getattr(conf, f'{side}_std'):g}"}.get(dist, lambda: "")()
    return f"{mean} {dist}{spread}"


def describe(conf: LoadConf) -> str:
    """One line for table headers, e.g. `poisson 4 req/s, 32 requests (2 warm-up), max 4 concurrent,
    in 256 fixed, out 64 fixed, seed 0`."""
    if conf.name == "none":
        return "no load (single-session phases)"
    arrivals = (f"trace {Path(conf.trace_file or '').name}" if conf.name == "trace"
                else "closed loop" if conf.rate is None
                else f"{conf.name} {conf.rate:g} req/s" + (f" burstiness {conf.burstiness:g}" if conf.name == "gamma"
                                                           else ""))
    count = (f"{conf.requests} requests" if conf.requests is not None
             else f"{conf.duration_s:g} s of arrivals" if conf.duration_s is not None else "every request")
    if conf.warmup_requests:
        count += f" ({conf.warmup_requests} warm-up)"
    parts = [arrivals, count, f"max {conf.max_concurrency} concurrent" if conf.max_concurrency is not None
             else "unlimited concurrency"]
    if conf.ramp_s or conf.drain_s:
        parts.append(f"steady window +{conf.ramp_s:g} s / -{conf.drain_s:g} s")
    parts += [f"in {_length_label(conf, 'input')}", f"out {_length_label(conf, 'output')}"
              + (" where the file has none" if conf.name == "trace" else "")]
    if conf.shared_prefix:
        parts.append(f"{conf.share_ratio:g} of prompts begin with a shared {conf.shared_prefix}-token prefix "
                     f"(cache {conf.prefix_cache})")
    parts.append(f"seed {conf.seed}")
    return ", ".join(parts)
