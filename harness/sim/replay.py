"""Replay a routing trace through eviction policies and cache sizes: tidy hit/miss tables.

Owns: `replay` (policies x capacities x layers, optional oracle-prefetch accounting) and
`lru_curve` (the LRU curve for every capacity in one pass), both returning tidy rows with
the same columns, and `profile_transfer` (a hot-expert profile from one trace serving another).
Does not own: the policies -- replay builds THE SAME classes the engine's
device cache uses (`engine.policies.make_policy`) and drives them through the engine's
reference loop (`engine.policies.simulate.simulate`) over the exact lookup order the engine
produces (`engine.trace.lookup_arrays`) with the engine's step-protection rule (a miss never
evicts an expert its step still has to look up: `engine.policies.base.still_needed`, applied
by `simulate(..., steps=)`), so a replay equals the engine's `counters_by_layer` for the
same trace, policy and capacity. The two fast paths
(`harness.sim.kernels`: stack distances for LRU, lane-vectorised Belady) are checked against
those classes by tests/sim.

    df = replay(tr, ["lru", "belady"], [2, 4])              # rows per policy, capacity, layer + "all"
    df = replay(tr, ["lru"], [4], prefetch="oracle")        # + hidden_misses / exposed_misses
    curve = lru_curve(tr)                                   # lru at capacity top_k..n_experts
    tf = profile_transfer(chat, agent, [2, 4])              # static pinned by agent's profile, on chat

Row columns (ROW_COLUMNS): policy, capacity, prefetch ("none" | "oracle"), layer (the
model's layer index from meta `moe_layers`, or "all" for the sum), lookups, hits, misses,
hit_bytes, miss_bytes, hit_rate, hidden_misses, exposed_misses (= misses - hidden_misses).

Options per policy (`options={"static": {"pinned": 2}}`) go to the policy constructor;
defaults: belady gets `future=` the layer's lookup sequence, static gets `popularity=` the
layer's token-routing counts (`engine.trace.expert_counts`). Per-layer tables given in
`options` are indexed by model layer, as in the engine.

Prefetch
--------
`"oracle"` is an upper-bound accounting of one-step-lookahead prefetch, replayable from ids
alone. During step s the prefetcher knows U[s+1], the experts step s+1 will look up, and may
copy them into slots that hold neither an expert of step s (in use by the running step) nor
one that step s+1 finds resident anyway (H[s+1], its hits). A demand miss of step s+1 is
*hidden* -- its copy can overlap step s's compute -- while such slots remain:

    hidden[s+1] = min(misses[s+1], max(0, capacity - |U[s] ∪ H[s+1]|)),  hidden[0] = 0

Misses, bytes and eviction decisions are the demand replay's: prefetch moves copies off the
critical path, it does not re-simulate what the extra early evictions would change.
`"next_layer_gate"` (guess layer l+1's experts by running its router on layer l's hidden
state) is *not* replayable: it needs hidden states / router logits, which a trace does not
store, so it raises ValueError.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from engine.planner import check_capacity
from engine.policies import make_policy
from engine.policies.simulate import simulate
from engine.registry import POLICIES
from engine.trace import RoutingTrace, expert_counts, lookup_arrays
from harness.sim.kernels import belady_hits, lru_hits_by_capacity

log = logging.getLogger(__name__)

__all__ = ["replay", "lru_curve", "profile_transfer", "oracle_hidden", "ROW_COLUMNS", "PREFETCH"]

ROW_COLUMNS = ("policy", "capacity", "prefetch", "layer", "lookups", "hits", "misses", "hit_bytes",
               "miss_bytes", "hit_rate", "hidden_misses", "exposed_misses")
PREFETCH = ("none", "oracle")
NOT_REPLAYABLE = {
    "next_layer_gate": "it predicts layer l+1's experts by applying layer l+1's router to layer l's hidden "
                       "state, which needs hidden states / router logits that a routing trace does not store; "
                       "measure it in the engine instead",
}


def replay(trace: RoutingTrace, policies: Sequence[str] | str = ("lru", "lfu", "fifo", "static", "belady"),
           capacities: Sequence[int] | int = (2, 4), prefetch: str | None = None, *,
           options: Mapping[str, Mapping[str, Any]] | None = None, fast: bool = True) -> pd.DataFrame:
    """Replay `trace` through each policy at each capacity, per layer; tidy rows (ROW_COLUMNS).

    `fast=False` runs belady through the engine's `Belady` class instead of the vectorised
    kernel (same counts, much slower: the reference path). Raises ValueError for a capacity
    outside [top_k, n_experts], an unknown or non-replayable prefetch, and the registry's error
    (listing known names) for an unknown policy.
    """
    trace.validate()
    policies = _as_list(policies, str)
    caps = _check_capacities(_as_list(capacities, int), trace.n_experts, trace.top_k)
    pf = _check_prefetch(prefetch)
    options = dict(options or {})
    unknown_opts = [n for n in options if n not in policies]
    if unknown_opts:
        raise ValueError(f"options given for policies {unknown_opts} that are not being replayed; "
                         f"replayed policies: {policies}")
    for name in policies:
        POLICIES.get(name)                                   # unknown name: error listing known ones
    layers = lookup_arrays(trace)                            # per layer: (ids [M], step [M])
    counts = expert_counts(trace)                            # [L, E]
    model_layers = trace.moe_layers
    rows: list[dict[str, Any]] = []
    for name in policies:
        user = dict(options.get(name, {}))
        if name == "belady" and fast and not user:
            hits, flags = belady_hits([ids for ids, _ in layers], trace.n_experts, caps, record=pf == "oracle")
            for ci, c in enumerate(caps):
                for l, (ids, steps) in enumerate(layers):
                    hidden = oracle_hidden(ids, steps, flags[l][ci], c) if flags is not None else 0
                    rows.append(_row(name, c, pf, model_layers[l], len(ids), int(hits[l, ci]), hidden, trace))
            continue
        for l, (ids, steps) in enumerate(layers):        # layer-major: one layer's Python list alive at a time
            ref, step_list = ids.tolist(), steps.tolist()
            for c in caps:
                opts = _default_options(name, ref, counts[l])
                opts.update(user)
                policy = make_policy(name, c, trace.n_experts, model_layers[l], **opts)
                flags = np.fromiter(simulate(policy, ref, steps=step_list), dtype=bool, count=len(ids))
                hidden = oracle_hidden(ids, steps, flags, c) if pf == "oracle" else 0
                rows.append(_row(name, c, pf, model_layers[l], len(ids), int(flags.sum()), hidden, trace))
    return _with_totals(rows)


def profile_transfer(trace: RoutingTrace, profile: RoutingTrace, capacities: Sequence[int] | int) -> pd.DataFrame:
    """How well a hot-expert profile recorded on one workload serves another: `static` replayed on
    `trace` pinning by `profile`'s expert counts (a recorded, imported or count-only trace) against
    pinning by `trace`'s own (the in-sample best static can do). Rows per capacity and layer (+ "all"):
    capacity, layer, own_hit_rate, profile_hit_rate, transfer = profile_hit_rate / own_hit_rate
    (1: the profile serves as well as the trace's own; null where the own rate is 0)."""
    if profile.n_experts != trace.n_experts or list(profile.moe_layers) != list(trace.moe_layers):
        raise ValueError(f"the profile routes {profile.n_experts} experts in MoE layers "
                         f"{list(profile.moe_layers)}; the trace {trace.n_experts} in {list(trace.moe_layers)}: "
                         "a profile must come from the same model")
    counts = dict(zip(profile.moe_layers, expert_counts(profile).tolist()))
    key = ["capacity", "layer"]
    own = replay(trace, "static", capacities).set_index(key)["hit_rate"]
    got = replay(trace, "static", capacities, options={"static": {"popularity": counts}}).set_index(key)["hit_rate"]
    out = pd.DataFrame({"own_hit_rate": own, "profile_hit_rate": got}).reset_index()
    out["transfer"] = [g / o if o else None for g, o in zip(out["profile_hit_rate"], out["own_hit_rate"])]
    return out


def lru_curve(trace: RoutingTrace) -> pd.DataFrame:
    """LRU hits/misses at every capacity the engine can run, top_k..n_experts, per layer and "all",
    from one stack-distance pass per layer (equal to `replay(trace, ["lru"], range(k, E+1))`)."""
    trace.validate()
    E = trace.n_experts
    rows = []
    for l, (ids, steps) in enumerate(lookup_arrays(trace)):
        hits = lru_hits_by_capacity(ids, E, steps)           # [E+1], index = capacity
        for c in range(trace.top_k, E + 1):
            rows.append(_row("lru", c, "none", trace.moe_layers[l], len(ids), int(hits[c]), 0, trace))
    return _with_totals(rows)


def oracle_hidden(ids: np.ndarray, steps: np.ndarray, hit: np.ndarray, capacity: int) -> int:
    """Misses an oracle one-step-lookahead prefetch could hide (see the module docstring).

    ids, steps, hit: [M] lookups of one layer in order, their dense step index, hit flags."""
    if len(ids) == 0:
        return 0
    n_steps = int(steps[-1]) + 1
    E = int(ids.max()) + 1
    size = np.bincount(steps, minlength=n_steps)                             # |U[s]|
    miss = np.bincount(steps, weights=~hit, minlength=n_steps).astype(np.int64)   # misses[s]
    key = steps * E + ids                                                    # (step, expert), sorted
    prev_key = (steps - 1) * E + ids                                         # same expert, previous step
    pos = np.searchsorted(key, prev_key)
    in_prev = (pos < len(key)) & (key[np.minimum(pos, len(key) - 1)] == prev_key)
    extra = np.bincount(steps, weights=hit & ~in_prev, minlength=n_steps)  # |H[s+1] \ U[s]| at s+1
    free = np.zeros(n_steps, dtype=np.int64)
    free[1:] = capacity - size[:-1] - extra[1:].astype(np.int64)
    return int(np.minimum(miss, np.maximum(free, 0))[1:].sum())


# --- helpers ----------------------------------------------------------------------------------
def _default_options(name: str, refs: list[int], counts: np.ndarray) -> dict[str, Any]:
    if name == "belady":
        return {"future": refs}
    if name == "static":
        return {"popularity": counts.tolist()}
    return {}


def _row(policy: str, capacity: int, prefetch: str, layer: int | str, lookups: int, hits: int, hidden: int,
         trace: RoutingTrace) -> dict[str, Any]:
    misses = lookups - hits
    # one size for every expert, unless the trace says they vary (a mixed treatment): then the
    # bytes are not known per hit and miss here, and are null rather than counts x the slot size
    b = None if trace.meta.get("expert_bytes_vary") else trace.expert_bytes
    return {"policy": policy, "capacity": int(capacity), "prefetch": prefetch, "layer": layer,
            "lookups": lookups, "hits": hits, "misses": misses,
            "hit_bytes": None if b is None else hits * b, "miss_bytes": None if b is None else misses * b,
            "hit_rate": hits / lookups if lookups else float("nan"),
            "hidden_misses": int(hidden), "exposed_misses": misses - int(hidden)}


def _with_totals(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Per-layer rows, each (policy, capacity, prefetch) group followed by its layer="all" row."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["capacity"], r["prefetch"]), []).append(r)
    out: list[dict[str, Any]] = []
    for (policy, capacity, prefetch), rs in groups.items():
        out += rs
        tot = {k: None if any(r[k] is None for r in rs) else sum(r[k] for r in rs) for k in _SUMS}
        tot.update(policy=policy, capacity=capacity, prefetch=prefetch, layer="all",
                   hit_rate=tot["hits"] / tot["lookups"] if tot["lookups"] else float("nan"))
        out.append(tot)
    return pd.DataFrame(out, columns=list(ROW_COLUMNS)).astype({"layer": object})


_SUMS = ("lookups", "hits", "misses", "hit_bytes", "miss_bytes", "hidden_misses", "exposed_misses")


def _as_list(value: Any, kind: type) -> list:
    if isinstance(value, (str, int, np.integer)):
        value = [value]
    out = list(value)
    if kind is str:
        return [str(v).strip() for v in out]
    for v in out:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"capacities must be integers, got {v!r}")
    return [int(v) for v in out]


def _check_capacities(caps: list[int], n_experts: int, top_k: int) -> list[int]:
    """The engine's range (engine.planner.check_capacity), and at least one capacity."""
    if not caps:
        raise ValueError("give at least one cache capacity")
    for c in caps:
        check_capacity(c, top_k, n_experts)
    return list(dict.fromkeys(caps))


def _check_prefetch(prefetch: str | None) -> str:
    pf = "none" if prefetch is None else str(prefetch)
    if pf in NOT_REPLAYABLE:
        raise ValueError(f"prefetch {pf!r} cannot be replayed from a routing trace: {NOT_REPLAYABLE[pf]}; "
                         f"replayable: {', '.join(PREFETCH)}")
    if pf not in PREFETCH:
        raise ValueError(f"unknown prefetch {pf!r}; replayable: {', '.join(PREFETCH)} "
                         f"(not replayable: {', '.join(NOT_REPLAYABLE)})")
    return pf
