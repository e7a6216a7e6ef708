"""Least-frequently-used eviction ("perfect LFU").

Owns: reference counts and last-use times. Does not own: the slots (`engine.cache`).

The victim is the resident, unprotected expert with the fewest references, ties broken by
least recent use. Counts are *perfect*: they cover every reference since the policy was
created and persist when an expert is evicted, so an expert that was popular earlier
returns with its history (in-cache LFU would reset it to 1 on re-insertion). The cost is
one count per expert ever seen, at most `n_experts` entries.
"""
from __future__ import annotations

from collections.abc import Set

from engine.policies.base import EvictionPolicy


class LFU(EvictionPolicy):
    name = "lfu"

    def __init__(self, capacity: int, n_experts: int, layer: int = 0) -> None:
        super().__init__(capacity, n_experts, layer)
        self._count: dict[int, int] = {}
        # (count, last use) of each resident: min() over these tuples picks the LFU
        # victim with the LRU tie-break in one C-level comparison per candidate
        self._key: dict[int, tuple[int, int]] = {}

    def count(self, expert: int) -> int:
        """References to `expert` so far (persisting across evictions)."""
        return self._count.get(expert, 0)

    def on_hit(self, expert: int, t: int) -> None:
        c = self._count.get(expert, 0) + 1   # a prefetched expert's first lookup is a hit
        self._count[expert] = c
        self._key[expert] = (c, t)

    def on_insert(self, expert: int, t: int) -> None:
        self.resident.add(expert)
        c = self._count.get(expert, 0) + 1
        self._count[expert] = c
        self._key[expert] = (c, t)

    def on_prefetch(self, expert: int, t: int) -> None:
        """Resident ahead of its lookup: not a reference, so its count does not change."""
        self.resident.add(expert)
        self._key[expert] = (self._count.get(expert, 0), t)

    def on_evict(self, expert: int) -> None:
        self.resident.discard(expert)
        self._key.pop(expert, None)

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        key = self._key
        cands = self._candidates(protected) if protected else key
        if not cands:
            raise self._no_victim(protected)
        return min(cands, key=key.__getitem__)
