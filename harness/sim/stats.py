"""Routing statistics of a trace: popularity skew, temporal reuse and entropy, per layer.

Owns: `trace_stats` (one tidy row per trace layer), `format_stats` (a CLI-printable
report) and `popularity` (the hot-expert table, the one analysis a count-only trace supports).
Does not own: reading traces (`engine.trace`) or generating them
(`harness.sim.synthetic`, whose presets are calibrated against these numbers).

Definitions (N tokens, E experts, k = top-k; S_t = the set of token t's experts in a layer):

* "previous token" of t is the previous token *of the same sequence* when the trace has a
  `sequence` array, else the previous row of the trace. Only tokens that have one count.
* `reuse_rate` = mean over tokens of |S_t ∩ S_prev| / k: the fraction of a token's experts
  that the previous token also used. Independent uniform routing gives k/E (`reuse_random`).
* `first_same` = fraction of tokens whose first-choice expert equals the previous token's
  first choice -- the Mixtral paper's (Jiang et al. 2024, §5, Table 5) "first choice"
  repetition. The first choice is the highest weight when the trace has weights, else slot 0
  (the engine records top-k in descending weight). Random: 1/E (12.5% for 8 experts).
* `any_overlap` = fraction of tokens sharing at least one expert with the previous token --
  the paper's "first or second choice" column for top-2. Random: 1 - C(E-k, k) / C(E, k)
  (46.4% for top-2 of 8).
* popularity: `top_rate` = fraction of tokens routed to the most popular expert (uniform:
  k/E), `top_share` = its share of all N*k assignments, `max_min` = most / least used count
  (inf if some expert is never used), `gini` = Gini coefficient of the per-expert counts
  (0 = perfectly balanced).
* `entropy_bits` = Shannon entropy of the per-expert assignment shares; `max_entropy_bits`
  = log2(E), the uniform maximum; `entropy_ratio` = their quotient.
* `jaccard` = mean over tokens of |S_t ∩ S_prev| / |S_t ∪ S_prev|, the adjacent-token overlap
  as a set similarity. Random: E[c / (2k - c)] for c hypergeometric (`jaccard_random`).
* `distinct_decode` / `distinct_prefill` = the mean number of distinct experts a forward pass
  routes to, over passes where every sequence has one token (decode steps) / more than one (a
  prefill micro-batch): what one step reads from wherever experts live. Needs the trace's
  `step` array (a trace without it: every token its own step, so no prefill pass, and
  `distinct_decode` counts single tokens); NaN where no pass is of that kind.

`route_digest` is a hash of every token's (layer, position in its sequence, sorted expert ids):
two runs or two engines routed the same tokens identically exactly when their digests match.

* `popularity` (per layer and capacity c): `top_c_share` = the share of all routings that go
  to the c most popular experts of the layer -- the hit rate of pinning exactly those experts
  for the whole trace (the misses that first fill the slots not counted): static's bound, and
  a figure that needs counts only, no token order.

    df = trace_stats(load_trace("run.npz")); print(format_stats(df))
    pop = popularity(load_trace("sglang_stat.npz"), [2, 4])      # count-only traces too
"""
from __future__ import annotations

from math import comb, log2

import numpy as np
import pandas as pd

from engine.trace import RoutingTrace, distinct_per_pass, expert_counts, require_order

__all__ = ["trace_stats", "format_stats", "previous_token", "popularity", "route_digest", "STAT_COLUMNS",
           "POPULARITY_COLUMNS"]

STAT_COLUMNS = ("layer", "tokens", "n_experts", "top_k", "top_rate", "uniform_rate", "top_share", "max_min",
                "gini", "entropy_bits", "max_entropy_bits", "entropy_ratio", "reuse_rate", "reuse_random",
                "first_same", "first_same_random", "any_overlap", "any_overlap_random", "jaccard", "jaccard_random",
                "distinct_decode", "distinct_prefill")


def previous_token(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """(cur, prev) int64 [P]: index pairs of each token that has a previous token and that token."""
    n = trace.n_tokens
    if trace.sequence is None:
        cur = np.arange(1, n, dtype=np.int64)
        return cur, cur - 1
    order = np.argsort(trace.sequence, kind="stable")                 # by sequence, trace order within
    same = trace.sequence[order[1:]] == trace.sequence[order[:-1]]
    return order[1:][same].astype(np.int64), order[:-1][same].astype(np.int64)


def trace_stats(trace: RoutingTrace) -> pd.DataFrame:
    """One row per trace layer with the columns of STAT_COLUMNS (see the module docstring)."""
    trace.validate()
    require_order(trace, "routing statistics (reuse between consecutive tokens)")
    N, L, k, E = trace.n_tokens, trace.n_layers, trace.top_k, trace.n_experts
    counts = expert_counts(trace).astype(np.float64)                   # [L, E]
    cur, prev = previous_token(trace)                                  # [P], [P]
    if trace.weights is not None:                                      # first choice = heaviest slot
        first_slot = trace.weights.argmax(axis=2)                      # [N, L]
        first = np.take_along_axis(trace.experts, first_slot[..., None], axis=2)[..., 0]   # [N, L]
    else:
        first = trace.experts[:, :, 0]                                 # [N, L]
    decode, prefill = distinct_per_pass(trace)                         # [L] each
    rows = []
    for l in range(L):
        c = counts[l]                                                  # [E]
        share = c / c.sum() if c.sum() else c
        nz = share[share > 0]
        a, b = trace.experts[cur, l, :], trace.experts[prev, l, :]    # [P, k] each
        common = (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)   # [P] |S_t ∩ S_prev|
        P = len(cur)
        rows.append({
            "layer": trace.moe_layers[l], "tokens": N, "n_experts": E, "top_k": k,
            "top_rate": c.max() / N if N else np.nan, "uniform_rate": k / E,
            "top_share": share.max() if N else np.nan,
            "max_min": (c.max() / c.min() if c.min() > 0 else np.inf) if N else np.nan,
            "gini": gini(c),
            "entropy_bits": float(-(nz * np.log2(nz)).sum()), "max_entropy_bits": log2(E),
            "entropy_ratio": float(-(nz * np.log2(nz)).sum()) / log2(E) if E > 1 else 1.0,
            "reuse_rate": common.mean() / k if P else np.nan, "reuse_random": k / E,
            "first_same": float((first[cur, l] == first[prev, l]).mean()) if P else np.nan,
            "first_same_random": 1 / E,
            "any_overlap": float((common > 0).mean()) if P else np.nan,
            "any_overlap_random": 1 - comb(E - k, k) / comb(E, k),
            "jaccard": float((common / (2 * k - common)).mean()) if P else np.nan,
            "jaccard_random": _jaccard_random(E, k),
            "distinct_decode": decode[l], "distinct_prefill": prefill[l],
        })
    return pd.DataFrame(rows, columns=list(STAT_COLUMNS))


def _jaccard_random(E: int, k: int) -> float:
    """E[c / (2k - c)], c = |S ∩ S'| of two independent uniform k-subsets of E (hypergeometric)."""
    return sum(comb(k, c) * comb(E - k, k - c) / comb(E, k) * c / (2 * k - c) for c in range(k + 1))


def route_digest(trace: RoutingTrace) -> str:
    """16 hex digits over every token's (layer, position in its sequence, sorted expert ids)."""
    import hashlib
    require_order(trace, "a route digest (positions)")
    N = trace.n_tokens
    seq = trace.sequence if trace.sequence is not None else np.zeros(N, dtype=np.int64)
    order = np.lexsort((np.arange(N), seq))                           # by sequence, then trace order
    pos = np.empty(N, dtype=np.int64)
    s_sorted = seq[order]
    starts = np.r_[0, np.flatnonzero(np.diff(s_sorted)) + 1]
    pos[order] = np.arange(N) - np.repeat(starts, np.diff(np.r_[starts, N]))
    h = hashlib.sha256()
    h.update(np.asarray(trace.moe_layers, dtype=np.int64).tobytes())
    key = np.lexsort((pos, seq))                                       # tokens by (sequence, position)
    h.update(np.stack([seq[key], pos[key]], axis=1).astype(np.int64).tobytes())
    h.update(np.sort(trace.experts[key], axis=2).astype(np.int32).tobytes())
    return h.hexdigest()[:16]


POPULARITY_COLUMNS = ("layer", "capacity", "routings", "top_c_share")


def popularity(trace: RoutingTrace, capacities: list[int]) -> pd.DataFrame:
    """Per layer (and "all") and capacity c: the share of routings to the layer's c most popular
    experts (module docstring). Counts only, so a count-only trace is accepted."""
    trace.validate()
    counts = np.sort(expert_counts(trace), axis=1)[:, ::-1]                  # [L, E], most popular first
    top = np.cumsum(counts, axis=1)                                          # [L, E]: top-c totals at c-1
    total = counts.sum(axis=1)                                               # [L]
    rows = []
    for c in capacities:
        if not 1 <= c <= trace.n_experts:
            raise ValueError(f"capacity {c} is outside [1, n_experts={trace.n_experts}]")
        for l, layer in enumerate(trace.moe_layers):
            rows.append({"layer": layer, "capacity": c, "routings": int(total[l]),
                         "top_c_share": top[l, c - 1] / total[l] if total[l] else np.nan})
        all_total = int(total.sum())
        rows.append({"layer": "all", "capacity": c, "routings": all_total,
                     "top_c_share": top[:, c - 1].sum() / all_total if all_total else np.nan})
    return pd.DataFrame(rows, columns=list(POPULARITY_COLUMNS)).astype({"layer": object})


def gini(counts: np.ndarray) -> float:
    """Gini coefficient of non-negative counts (0: all equal; -> 1: one takes all)."""
    x = np.sort(np.asarray(counts, dtype=np.float64))
    n, total = len(x), x.sum()
    if n == 0 or total == 0:
        return 0.0
    return float((2 * np.arange(1, n + 1) - n - 1) @ x / (n * total))


def format_stats(df: pd.DataFrame) -> str:
    """A fixed-width report: one line per layer, rates in percent, random baselines in the header."""
    if df.empty:
        return "(empty trace)"
    r0 = df.iloc[0]
    head = (f"{int(r0.tokens)} tokens, {int(r0.n_experts)} experts, top-{int(r0.top_k)}; random baselines: "
            f"reuse {100 * r0.reuse_random:.1f}%, first-choice same {100 * r0.first_same_random:.1f}%, "
            f"any overlap {100 * r0.any_overlap_random:.1f}%, top-expert rate {100 * r0.uniform_rate:.1f}%, "
            f"entropy {r0.max_entropy_bits:.2f} bits")
    cols = {"layer": "layer", "top_rate": "top rate %", "max_min": "max/min", "gini": "gini",
            "entropy_bits": "entropy b", "reuse_rate": "reuse %", "first_same": "1st same %",
            "any_overlap": "overlap %"}
    t = df[list(cols)].copy()
    for c in ("top_rate", "reuse_rate", "first_same", "any_overlap"):
        t[c] = 100 * t[c]
    body = t.rename(columns=cols).to_string(index=False, float_format=lambda v: f"{v:.2f}")
    return f"{head}\n{body}"
