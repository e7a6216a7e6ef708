"""First-in-first-out eviction.

Owns: insertion order of the resident experts. Does not own: the slots (`engine.cache`).
The victim is the resident inserted longest ago that is not protected; hits do not
refresh an expert's position (that is what distinguishes FIFO from LRU, and why FIFO
shows Belady's anomaly).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from engine.policies.base import EvictionPolicy


class FIFO(EvictionPolicy):
    name = "fifo"

    def __init__(self, capacity: int, n_experts: int, layer: int = 0) -> None:
        super().__init__(capacity, n_experts, layer)
        # OrderedDict, not dict: popping the front of a plain dict leaves dummies that
        # make the next `iter()` scan over them
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, expert: int, t: int) -> None:
        self.resident.add(expert)
        self._order[expert] = None

    def on_evict(self, expert: int) -> None:
        self.resident.discard(expert)
        self._order.pop(expert, None)

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        return self._first_unprotected(self._order, protected)
