"""Least-recently-used eviction.

Owns: recency order of the resident experts. Does not own: the slots themselves
(`engine.cache`). The victim is the least recently referenced resident that is not
protected; a hit moves an expert to the most-recent end.
"""
from __future__ import annotations

from engine.policies.base import OrderedPolicy


class LRU(OrderedPolicy):
    name = "lru"

    def on_hit(self, expert: int, t: int) -> None:
        self._order.move_to_end(expert)
