"""Fast numpy kernels behind the replay simulator: LRU stack distances and Belady's OPT.

Owns: the two hot loops that would be too slow through the policy classes at trace scale
(25.6M lookups): Mattson stack distances for the whole LRU hit-rate curve in one pass (with
the engine's step-protection rule), and Belady (OPT/MIN) for several layers x capacities
at once (which that rule never changes: see `belady_hits`). Does not own: turning counts into
tables (`harness.sim.replay`) or the policies' definitions -- the slow, obvious reference for
each is the engine's own class (`engine.policies.lru.LRU`, `engine.policies.belady.Belady`)
run through `engine.policies.simulate.simulate`, and tests/sim checks they agree exactly.

Inputs are per-layer lookup sequences: int arrays of expert ids in lookup order
(`engine.trace.lookup_arrays`). M = lookups of a layer, E = experts, C = capacities.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

COLD = np.iinfo(np.int32).max       # stack distance of a first reference (a miss at every capacity)


def next_use(ids: np.ndarray) -> np.ndarray:
    """int64 [M]: index of the next lookup of the same expert after each lookup, M if none."""
    m = len(ids)
    pos = np.arange(m, dtype=np.int64)
    order = np.lexsort((pos, ids))                           # by expert, then time
    nxt = np.full(m, m, dtype=np.int64)
    if m > 1:
        same = ids[order[1:]] == ids[order[:-1]]             # consecutive uses of one expert
        nxt[order[:-1][same]] = order[1:][same]
    return nxt


def prev_use(ids: np.ndarray) -> np.ndarray:
    """int64 [M]: index of the previous lookup of the same expert before each lookup, -1 if none."""
    m = len(ids)
    pos = np.arange(m, dtype=np.int64)
    order = np.lexsort((pos, ids))
    prv = np.full(m, -1, dtype=np.int64)
    if m > 1:
        same = ids[order[1:]] == ids[order[:-1]]
        prv[order[1:][same]] = order[:-1][same]
    return prv


def stack_distances(ids: np.ndarray, n_experts: int, steps: np.ndarray | None = None) -> np.ndarray:
    """int32 [M]: LRU stack distance of each lookup (1 = most recent; COLD for a first use).

    A lookup hits an LRU cache of capacity c iff its distance <= c (LRU is a stack
    algorithm, Mattson et al. 1970), so one pass gives the whole hit-rate curve.
    The distance of a lookup at t whose expert was last used at p is 1 + the number of
    *distinct* experts used in (p, t); expert f counts iff its last use before t is after p.
    With `steps` (steps[t]: the step of lookup t, non-decreasing; an expert at most once per
    step) the distance is taken in the stack as it was when t's step began: (p, start of
    the step) instead of (p, t) -- see `lru_hits_by_capacity`.
    With few experts that is one vectorised pass per expert: O(M * E) work, no Python
    loop over lookups (E=64, M=800k: about 0.3 s per layer).
    """
    ids = np.asarray(ids, dtype=np.int64)
    m = len(ids)
    dist = np.full(m, COLD, dtype=np.int32)
    if m == 0:
        return dist
    prv = prev_use(ids)
    seen = np.flatnonzero(prv >= 0)                          # lookups with an earlier use
    p = prv[seen].astype(np.int32)                           # [S] previous use
    if steps is None:
        before = (seen - 1).astype(np.int64)                 # [S] t-1 >= p >= 0
    else:
        before = (_step_start(np.asarray(steps))[seen] - 1).astype(np.int64)   # [S] start-1 >= p >= 0
    d = np.ones(len(seen), dtype=np.int32)
    pos = np.arange(m, dtype=np.int32)
    last = np.empty(m, dtype=np.int32)
    for f in np.unique(ids).tolist():
        np.copyto(last, -1)
        np.copyto(last, pos, where=ids == f)
        np.maximum.accumulate(last, out=last)                # last use of f at or before each index
        d += last[before] > p                                # f used strictly inside (p, before]
    dist[seen] = d
    return dist


def _step_start(steps: np.ndarray) -> np.ndarray:
    """int64 [M]: index of the first lookup of each lookup's step."""
    m = len(steps)
    first = np.ones(m, dtype=bool)
    first[1:] = steps[1:] != steps[:-1]
    return np.maximum.accumulate(np.where(first, np.arange(m), 0))


def lru_hits_by_capacity(ids: np.ndarray, n_experts: int, steps: np.ndarray | None = None) -> np.ndarray:
    """int64 [E+1]: LRU hits for capacity c at index c (index 0 is 0), from stack distances.

    With `steps`, LRU under the engine's step-protection rule (engine.policies.base.
    still_needed), exactly -- tests/sim check it against the LRU class run through
    engine.policies.simulate. Why a closed form exists: under the rule, the cache holds the
    top c of the plain recency stack at the start of every step (each step either keeps all
    of its resident experts, or, needing more than c, ends holding its last c), so a lookup
    hits iff its expert's position d' in the stack at its step's start is <= c -- except in
    one case: the step's first expert misses while the whole cache is the step's own later
    experts (every resident protected, so none is), when the expert at position c is
    evicted before its turn and misses too. For a step whose first lookup has position
    d'_1 and whose experts fill the top k* positions of the stack, that happens exactly at
    capacities 1 <= c <= min(d'_1 - 1, k*).
    """
    d = stack_distances(ids, n_experts, steps)
    warm = d[d != COLD]
    hist = np.bincount(warm, minlength=n_experts + 1)[: n_experts + 1]    # distances never exceed E
    hits = np.cumsum(hist)
    if steps is None or len(d) == 0:
        return hits
    steps = np.asarray(steps)
    start = _step_start(steps)
    first = start == np.arange(len(steps))                   # [M] first lookup of its step
    sid = np.cumsum(first) - 1                               # [M] dense step index
    order = np.lexsort((d, sid))                             # by step, then position
    rank = np.arange(len(d)) - start[order]                  # 0, 1, ... within each step
    fills = d[order].astype(np.int64) == rank + 1            # positions 1..k* of the stack (a prefix)
    kstar = np.bincount(sid[order][fills], minlength=int(sid[-1]) + 1)
    d1 = np.minimum(d[first].astype(np.int64), n_experts + 1)   # COLD first lookups: never resident
    span = np.minimum(d1 - 1, kstar)                         # [steps] capacities 1..span lose one hit
    lost = np.bincount(np.minimum(span, n_experts), minlength=n_experts + 1)[::-1].cumsum()[::-1]
    lost[0] = 0                                              # [E+1] lost[c] = #steps with span >= c
    return hits - lost


def belady_hits(seqs: Sequence[np.ndarray], n_experts: int, capacities: Sequence[int],
                record: bool = False, chunk: int = 8192) -> tuple[np.ndarray, list[list[np.ndarray]] | None]:
    """Belady/OPT replay of every layer at every capacity at once.

    Returns hits int64 [L, C] and, with `record`, per layer and capacity a bool [M] hit flag
    per lookup (else None).

    Exactly engine.policies.belady.Belady: on a miss into a full cache the victim is the
    resident whose next use is farthest; residents never used again count as infinitely far,
    ties among them go to the lowest expert id (np.argmax keeps the first maximum); other
    next uses are distinct times, so they never tie. The engine's step-protection rule
    (engine.policies.base.still_needed) never changes that choice: the experts it protects
    are used later in the current step, sooner than any other resident, so the farthest
    next use is never one of them unless all residents are -- and then nothing is protected. The L*C (layer, capacity) lanes advance
    one lookup per Python iteration with O(1) numpy calls each -- vectorised across lanes,
    not over time, because each eviction depends on the previous ones.

    Lane state `state[lane, e]` is the next-use time of resident expert e, -1 when e is not
    resident; column E is a dummy that padded lookups (layers shorter than the longest) hit.
    """
    L, C, E = len(seqs), len(capacities), n_experts
    lanes = L * C                                            # lane = layer * C + capacity index
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    T = int(lens.max()) if L else 0
    never = np.int64(2 ** 62)
    refs = np.full((T, L), E, dtype=np.int64)                # [T, L] padded with the dummy column
    nxt = np.zeros((T, L), dtype=np.int64)                   # [T, L] padded lookups write 0 to the dummy
    for l, s in enumerate(seqs):
        s = np.asarray(s, dtype=np.int64)
        n = len(s)
        refs[:n, l] = s
        nu = next_use(s)
        nxt[:n, l] = np.where(nu >= n, never, nu)
    lane_layer = np.repeat(np.arange(L), C)                  # [lanes]
    cap = np.tile(np.asarray(capacities, dtype=np.int64), L)   # [lanes]
    width = E + 1
    state = np.full(lanes * width, -1, dtype=np.int64)      # flat [lanes, E+1]
    state.reshape(lanes, width)[:, E] = 0                    # dummy: "resident", never a victim (0 < any next use)
    base = np.arange(lanes, dtype=np.int64) * width          # [lanes]
    used = np.zeros(lanes, dtype=np.int64)                   # occupied slots per lane
    misses = np.zeros(lanes, dtype=np.int64)
    flags = np.zeros((T, lanes), dtype=bool) if record else None   # [T, lanes] hit flags
    view = state.reshape(lanes, width)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        flat = refs[t0:t1][:, lane_layer] + base             # [t, lanes] flat state index of each lookup
        nx = nxt[t0:t1][:, lane_layer]                       # [t, lanes]
        for i in range(t1 - t0):
            idx = flat[i]
            miss = state[idx] < 0                            # [lanes]
            if record:
                flags[t0 + i] = ~miss
            full = miss & (used >= cap)
            if full.any():
                rows = np.flatnonzero(full)
                victim = view[rows].argmax(axis=1)           # farthest next use; ties -> lowest id
                view[rows, victim] = -1
            used += miss & ~full
            misses += miss
            state[idx] = nx[i]
    hits = (lens[lane_layer] - misses).reshape(L, C)
    if not record:
        return hits, None
    per = [[flags[: lens[l], l * C + c].copy() for c in range(C)] for l in range(L)]
    return hits, per
