"""Least-frequently-used eviction ("perfect LFU").

Owns: the victim choice over every resident. Does not own: the reference counts and last-use
times (`engine.policies.base.FrequencyPolicy`, shared with `lfru`) or the slots (`engine.cache`).

The victim is the resident, unprotected expert with the fewest references, ties broken by
least recent use. Counts are *perfect*: they cover every reference since the policy was
created and persist when an expert is evicted, so an expert that was popular earlier
returns with its history (in-cache LFU would reset it to 1 on re-insertion). The cost is
one count per expert ever seen, at most `n_experts` entries.
"""
from __future__ import annotations

from collections.abc import Set

from engine.policies.base import FrequencyPolicy


class LFU(FrequencyPolicy):
    name = "lfu"

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        return self.least_frequent(self._key, protected)
