"""Exact traffic and cache counters, per layer and cumulative (DESIGN.md §5 names).

Owns: integer accumulation of bytes and lookups, and the split of link traffic by purpose.
Does not own: deciding what to count (the cache, placements and KV code call `transfer`,
`lookup` and `add`), rates or per-phase splits (the harness diffs snapshots).

    c = Counters(n_layers=4)
    c.transfer("h2d", "expert", 1024, layer=2)
    c.totals()["h2d_bytes"], c.totals()["h2d_expert_bytes"]   -> 1024, 1024

Bytes moved over the link are recorded once, by direction and purpose
(`{h2d,d2h}_{expert,activation,kv}_bytes`); `h2d_bytes` and `d2h_bytes` are derived as the
sum of their purposes, so the split always adds up exactly and nothing is booked twice.
Purposes: `expert` -- packed expert weights copied into device slots or stream buffers;
`activation` -- hidden states, routing ids and weights shipped to the CPU experts and their
output shipped back (cpu, hybrid); `kv` -- a session's KV displaced to host RAM and restored.
`d2h_expert_bytes` stays 0: expert weights are read-only, no placement ever writes one back;
it is kept so the d2h split has the same three purposes as h2d. Token ids fed in and sampled
tokens read out (a few bytes per token, outside the layers) are not link traffic here.
"""
from __future__ import annotations

DIRECTIONS = ("h2d", "d2h")
PURPOSES = ("expert", "activation", "kv")
BY_PURPOSE = tuple(f"{d}_{p}_bytes" for d in DIRECTIONS for p in PURPOSES)
DERIVED = ("h2d_bytes", "d2h_bytes")        # sums of their purposes, never added to directly
COUNTED = (*BY_PURPOSE, "expert_hits", "expert_misses", "expert_hit_bytes", "expert_miss_bytes",
           "prefetch_issued", "prefetch_used", "prefetch_wasted_bytes")
METRICS = (*DERIVED, *COUNTED)
NO_LAYER = -1  # traffic that belongs to no layer (e.g. embeddings); kept apart, still in the totals


class Counters:
    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.reset()

    def reset(self) -> None:
        self._per_layer: dict[int, dict[str, int]] = {
            layer: dict.fromkeys(COUNTED, 0) for layer in [*range(self.n_layers), NO_LAYER]}

    def add(self, metric: str, value: int, layer: int = NO_LAYER) -> None:
        if metric in DERIVED or metric in BY_PURPOSE:
            raise ValueError(f"link bytes are counted with Counters.transfer(direction, purpose, nbytes, layer), "
                             f"not add({metric!r}); directions {DIRECTIONS}, purposes {PURPOSES}")
        self._per_layer[layer][metric] += int(value)

    def transfer(self, direction: str, purpose: str, nbytes: int, layer: int = NO_LAYER) -> None:
        """`nbytes` moved over the link in `direction` ('h2d' | 'd2h') for `purpose`
        ('expert' | 'activation' | 'kv')."""
        if direction not in DIRECTIONS or purpose not in PURPOSES:
            raise ValueError(f"transfer direction must be one of {DIRECTIONS} and purpose one of {PURPOSES}; "
                             f"got direction={direction!r}, purpose={purpose!r}")
        self._per_layer[layer][f"{direction}_{purpose}_bytes"] += int(nbytes)

    def lookup(self, layer: int, hit: bool, nbytes: int) -> None:
        """One device-cache lookup: a hit or a miss of an expert of `nbytes`."""
        row = self._per_layer[layer]
        if hit:
            row["expert_hits"] += 1
            row["expert_hit_bytes"] += nbytes
        else:
            row["expert_misses"] += 1
            row["expert_miss_bytes"] += nbytes

    @staticmethod
    def _with_derived(row: dict[str, int]) -> dict[str, int]:
        out = {d: sum(row[f"{d}_{p}_bytes"] for p in PURPOSES) for d in DIRECTIONS}
        return {**{f"{d}_bytes": out[d] for d in DIRECTIONS}, **row}

    def totals(self) -> dict[str, int]:
        summed = {m: sum(row[m] for row in self._per_layer.values()) for m in COUNTED}
        return self._with_derived(summed)

    def by_layer(self) -> dict[int, dict[str, int]]:
        """Per layer (and NO_LAYER = -1 for traffic outside the layers), copies."""
        return {layer: self._with_derived(row) for layer, row in self._per_layer.items()}
