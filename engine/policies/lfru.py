"""Least-frequently-recently-used eviction (LFRU): a privileged LRU partition, an LFU rest.

Owns: the split of the resident experts into a *privileged* partition -- the `privileged`
most recently referenced residents -- and an *unprivileged* one (everyone else), and the
victim choice: the least frequently used unprivileged resident, ties broken by least recent
use. Does not own: the slots (`engine.cache`) or the reference counts, which are `lfu`'s
perfect counts (every reference since the policy was created, kept across evictions:
`engine.policies.base.FrequencyPolicy`).

This is the LFRU of Bilal & Kang (2017), as the cache-replacement literature describes it:
a new expert enters the privileged partition (managed by recency); the privileged
partition's least recent member, pushed out by a newer one, moves to the unprivileged
partition (managed by frequency), and victims leave from there. A hit makes an expert the
most recent, so it rejoins the privileged partition. The partitions are bookkeeping only:
no expert moves between slots.

The two ends are the parent policies: `privileged=0` is `lfu` (every resident is a
candidate), `privileged=capacity-1` is `lru` (the one unprivileged resident is the least
recent). In between, a recently used expert cannot be evicted for being rare, and a burst
of one-off experts (a scan) cannot push out an expert with a long history -- the property
that lets a small LFRU cache beat a larger LRU one on skewed MoE routing.

When every unprivileged resident is protected (the step still needs it), the victim is the
least frequently used unprotected privileged resident, so a step never stalls while an
expert remains evictable.

    LFRU(capacity=4, n_experts=8)                   # privileged = capacity // 2
    make_policy("lfru", 4, 8, privileged=1)         # cache.policy=lfru cache.policy_options.privileged=1
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
from dataclasses import dataclass
from itertools import islice

from engine.policies.base import FrequencyPolicy


@dataclass(frozen=True)
class LFRUOptions:
    privileged: int | None = None   # slots of the recency-managed partition (default capacity // 2)


class LFRU(FrequencyPolicy):
    name = "lfru"
    Options = LFRUOptions

    def __init__(self, capacity: int, n_experts: int, layer: int = 0, *, privileged: int | None = None) -> None:
        super().__init__(capacity, n_experts, layer)
        if privileged is None:
            privileged = capacity // 2
        if isinstance(privileged, bool) or not isinstance(privileged, int) or not 0 <= privileged <= capacity - 1:
            raise ValueError(f"lfru privileged must be an integer in [0, capacity-1] = [0, {capacity - 1}] so one "
                             f"slot stays in the frequency-managed partition, got privileged={privileged!r}")
        self.privileged = privileged
        self._recency: OrderedDict[int, None] = OrderedDict()   # residents, least recent first

    def privileged_set(self) -> set[int]:
        """The residents in the privileged partition: the `privileged` most recently referenced."""
        return set(islice(reversed(self._recency), self.privileged))

    def on_hit(self, expert: int, t: int) -> None:
        super().on_hit(expert, t)
        self._recency.move_to_end(expert)

    def on_insert(self, expert: int, t: int) -> None:
        super().on_insert(expert, t)
        self._recency[expert] = None

    def on_prefetch(self, expert: int, t: int) -> None:
        super().on_prefetch(expert, t)
        self._recency[expert] = None

    def on_evict(self, expert: int) -> None:
        super().on_evict(expert)
        self._recency.pop(expert, None)

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        privileged = self.privileged_set()
        rest = [e for e in self._recency if e not in privileged and e not in protected]
        if rest:
            return self.least_frequent(rest, frozenset())
        return self.least_frequent(privileged, protected)   # every unprivileged resident is still needed
