"""Least-recently-used eviction.

Owns: recency order of the resident experts. Does not own: the slots themselves
(`engine.cache`). The victim is the least recently referenced resident that is not
protected; a hit moves an expert to the most-recent end.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from engine.policies.base import EvictionPolicy


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int, n_experts: int, layer: int = 0) -> None:
        super().__init__(capacity, n_experts, layer)
        # oldest reference first; OrderedDict gives O(1) move_to_end / delete
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_hit(self, expert: int, t: int) -> None:
        self._order.move_to_end(expert)

    def on_insert(self, expert: int, t: int) -> None:
        self.resident.add(expert)
        self._order[expert] = None

    def on_evict(self, expert: int) -> None:
        self.resident.discard(expert)
        self._order.pop(expert, None)

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        return self._first_unprotected(self._order, protected)
