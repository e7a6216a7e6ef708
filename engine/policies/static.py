"""Static pinning by offline popularity, FIFO for the rest.

Owns: the choice of pinned experts for one layer and the FIFO order of the unpinned
residents. Does not own: where popularity comes from (a profiling trace, computed by the
caller) or the slots (`engine.cache`).

The `pinned` most popular experts (ties: lower expert id first) are never chosen as
victims. They are *not* preloaded: like any other expert they become resident on their
first miss, and from then on stay. Victims are the unpinned residents in insertion (FIFO)
order, so at least one slot must stay unpinned: `pinned <= capacity - 1`, default
`capacity - 1`.

    Static(capacity=4, n_experts=8, layer=3, popularity=counts)   # counts: [8] or [L, 8]
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.policies.base import OrderedPolicy, layer_row


@dataclass(frozen=True)
class StaticOptions:
    popularity: str | None = None   # a table file (.json/.csv/.npy): [moe layers][experts] counts
    trace: str | None = None        # or a routing trace (.npz): its expert counts
    pinned: int | None = None       # experts pinned per layer (default capacity - 1)


class Static(OrderedPolicy):
    name = "static"
    Options = StaticOptions

    @classmethod
    def prepare(cls, options: StaticOptions, cfg: Any) -> dict[str, Any]:
        from engine.trace import expert_counts, popularity_table, trace_for_model
        if options.popularity and options.trace:
            raise ValueError("give static one source of popularity: popularity=FILE or trace=FILE, not both")
        if options.popularity:
            table = popularity_table(options.popularity, cfg)
        elif options.trace:
            tr = trace_for_model(options.trace, cfg)
            table = dict(zip(tr.moe_layers, expert_counts(tr).tolist()))
        else:
            raise ValueError("static pins by popularity and needs popularity=FILE (.json/.csv/.npy, [moe layers]"
                             "[experts] counts) or trace=FILE (a routing trace, run.record_trace=true writes one)")
        return {"popularity": table, **({"pinned": options.pinned} if options.pinned is not None else {})}

    def __init__(
        self,
        capacity: int,
        n_experts: int,
        layer: int = 0,
        *,
        popularity: Sequence[float] | Sequence[Sequence[float]] | Any,
        pinned: int | None = None,
    ) -> None:
        super().__init__(capacity, n_experts, layer)
        counts = layer_row(popularity, layer, "static popularity")
        if len(counts) != n_experts:
            raise ValueError(
                f"static popularity for layer {layer} must have one count per expert "
                f"(n_experts={n_experts}), got {len(counts)} counts"
            )
        if pinned is None:
            pinned = capacity - 1
        if not 0 <= pinned <= capacity - 1:
            raise ValueError(
                f"static pinned must be in [0, capacity-1] = [0, {capacity - 1}] so one slot "
                f"stays evictable, got pinned={pinned}"
            )
        ranked = sorted(range(n_experts), key=lambda e: (-counts[e], e))
        self.pinned: frozenset[int] = frozenset(ranked[:pinned])

    def evictable(self) -> set[int]:
        return self.resident - self.pinned

    def on_insert(self, expert: int, t: int) -> None:
        """Pinned experts never enter the eviction order: only unpinned ones are victims (FIFO)."""
        if expert in self.pinned:
            self.resident.add(expert)
        else:
            super().on_insert(expert, t)
