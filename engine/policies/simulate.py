"""Reference replay driver: feeds a reference string through one policy.

Owns: the plain, obvious loop that applies the protocol of `engine.policies.base` to a
sequence of expert ids, keeping its own resident set, and checks every victim the policy
returns. Does not own: timing, bytes or multi-layer traces (the simulator and
`engine.cache` build on this).

    hits = simulate(make_policy("lru", 3, 8), [7, 0, 1, 2, 0])   # [False, False, False, False, True]
    count_faults("belady", refs, capacity=3, future=refs)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import Any

from engine.policies import make_policy
from engine.policies.base import EvictionPolicy


def simulate(
    policy: EvictionPolicy,
    refs: Sequence[int],
    protected_fn: Callable[[int], Set[int]] | None = None,
) -> list[bool]:
    """Replay `refs` (lookup t is `refs[t]`) through `policy`; return one hit flag per lookup.

    `protected_fn(t)` gives the residents that must not be evicted on a miss at time `t`
    (default: none). Raises RuntimeError if the policy names a victim that is not resident
    or is protected.
    """
    capacity = policy.capacity
    resident: set[int] = set()
    hits: list[bool] = []
    # bound methods hoisted: the loop is the replay hot path
    on_hit, on_insert, on_evict, victim = policy.on_hit, policy.on_insert, policy.on_evict, policy.victim
    for t, e in enumerate(refs):
        if e in resident:
            on_hit(e, t)
            hits.append(True)
            continue
        if len(resident) >= capacity:
            protected = protected_fn(t) if protected_fn is not None else frozenset()
            v = victim(t, protected)
            if v not in resident or v in protected:
                raise RuntimeError(
                    f"policy {policy.name!r} chose victim {v} at t={t}, but victims must be "
                    f"resident and unprotected (resident={sorted(resident)}, protected={sorted(protected)})"
                )
            resident.remove(v)
            on_evict(v)
        on_insert(e, t)
        resident.add(e)
        hits.append(False)
    return hits


def count_faults(
    name: str, refs: Sequence[int], capacity: int, *, n_experts: int | None = None, layer: int = 0,
    **options: Any,
) -> int:
    """Misses (page faults, compulsory ones included) of policy `name` on `refs`.

    `n_experts` defaults to max(refs) + 1; other options go to the policy
    (e.g. `future=refs` for belady, `popularity=...` for static).
    """
    refs = list(refs)
    if n_experts is None:
        n_experts = max(refs, default=0) + 1
    policy = make_policy(name, capacity, n_experts, layer, **options)
    return simulate(policy, refs).count(False)
