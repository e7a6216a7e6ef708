"""Reference replay driver: feeds a reference string through one policy.

Owns: the plain, obvious loop that applies the protocol of `engine.policies.base` to a
sequence of expert ids, keeping its own resident set, and checks every victim the policy
returns; with `steps`, the step-protection rule of `engine.policies.base.still_needed`,
exactly as the engine's device cache applies it. Does not own: timing, bytes or
multi-layer traces (the simulator and `engine.cache` build on this).

    hits = simulate(make_policy("lru", 3, 8), [7, 0, 1, 2, 0])   # [False, False, False, False, True]
    hits = simulate(policy, refs, steps=steps)     # steps[t]: the forward pass of lookup t
    count_faults("belady", refs, capacity=3, future=refs)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import Any

from engine.policies import make_policy
from engine.policies.base import EvictionPolicy, still_needed


def step_protection(refs: Sequence[int], steps: Sequence[int],
                    policy: EvictionPolicy) -> Callable[[int], Set[int]]:
    """protected(t) for lookups `refs` grouped into steps (`steps[t]`, non-decreasing):
    the step-protection rule of engine.policies.base.still_needed, for `policy`'s residents."""
    refs, steps = list(refs), list(steps)
    if len(steps) != len(refs):
        raise ValueError(f"steps must give one step per lookup: {len(steps)} steps for {len(refs)} lookups")
    end = [0] * len(refs)                      # end[t]: one past the last lookup of t's step
    for t in range(len(refs) - 1, -1, -1):
        end[t] = end[t + 1] if t + 1 < len(refs) and steps[t + 1] == steps[t] else t + 1

    def protected(t: int) -> Set[int]:
        stop = end[t]
        return frozenset() if stop == t + 1 else still_needed(set(refs[t + 1:stop]), policy)   # last of its step
    return protected


def simulate(
    policy: EvictionPolicy,
    refs: Sequence[int],
    protected_fn: Callable[[int], Set[int]] | None = None,
    steps: Sequence[int] | None = None,
) -> list[bool]:
    """Replay `refs` (lookup t is `refs[t]`) through `policy`; return one hit flag per lookup.

    `steps[t]` is the step (forward pass) of lookup t: a miss then protects the experts its
    step still has to look up (the engine's rule, engine.policies.base.still_needed).
    `protected_fn(t)` instead gives the residents that must not be evicted on a miss at
    time `t` (default: none). Raises RuntimeError if the policy names a victim that is not
    resident or is protected.
    """
    if steps is not None and protected_fn is not None:
        raise ValueError("give steps (the engine's protection rule) or protected_fn, not both")
    if steps is not None:
        protected_fn = step_protection(refs, steps, policy)
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
    steps: Sequence[int] | None = None, **options: Any,
) -> int:
    """Misses (page faults, compulsory ones included) of policy `name` on `refs`.

    `n_experts` defaults to max(refs) + 1; `steps` as in `simulate`; other options go to the
    policy (e.g. `future=refs` for belady, `popularity=...` for static).
    """
    refs = list(refs)
    if n_experts is None:
        n_experts = max(refs, default=0) + 1
    policy = make_policy(name, capacity, n_experts, layer, **options)
    return simulate(policy, refs, steps=steps).count(False)
