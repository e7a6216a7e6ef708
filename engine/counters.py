"""Exact traffic and cache counters, per layer and cumulative (DESIGN.md §5 names).

Owns: integer accumulation of bytes and lookups. Does not own: deciding what to count
(the cache, placements and KV code call `add`), rates or per-phase splits (the harness
diffs snapshots).

    c = Counters(n_layers=4)
    c.add("h2d_bytes", 1024, layer=2)
    c.totals()["h2d_bytes"]  -> 1024
"""
from __future__ import annotations

METRICS = ("h2d_bytes", "d2h_bytes", "expert_hits", "expert_misses", "expert_hit_bytes", "expert_miss_bytes",
           "prefetch_issued", "prefetch_used", "prefetch_wasted_bytes")
NO_LAYER = -1  # traffic that belongs to no layer (e.g. embeddings); kept apart, still in the totals


class Counters:
    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.reset()

    def reset(self) -> None:
        self._per_layer: dict[int, dict[str, int]] = {
            layer: dict.fromkeys(METRICS, 0) for layer in [*range(self.n_layers), NO_LAYER]}

    def add(self, metric: str, value: int, layer: int = NO_LAYER) -> None:
        self._per_layer[layer][metric] += int(value)

    def lookup(self, layer: int, hit: bool, nbytes: int) -> None:
        """One device-cache lookup: a hit or a miss of an expert of `nbytes`."""
        row = self._per_layer[layer]
        if hit:
            row["expert_hits"] += 1
            row["expert_hit_bytes"] += nbytes
        else:
            row["expert_misses"] += 1
            row["expert_miss_bytes"] += nbytes

    def totals(self) -> dict[str, int]:
        return {m: sum(row[m] for row in self._per_layer.values()) for m in METRICS}

    def by_layer(self) -> dict[int, dict[str, int]]:
        """Per layer (and NO_LAYER = -1 for traffic outside the layers), copies."""
        return {layer: dict(row) for layer, row in self._per_layer.items()}
