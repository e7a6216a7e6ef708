"""Belady's optimal (OPT / MIN) eviction, for replay only.

Owns: the next-use lookup over a known future. Does not own: producing that future (a
recorded routing trace) or the slots (`engine.cache`).

The victim at time `t` is the resident, unprotected expert whose next use after `t` is
farthest away; experts never used again count as infinitely far, ties among them go to the
lowest expert id. Without protection this gives the minimum possible number of misses for
the given reference string, so it is the lower bound other policies are compared against.

`future` is the complete sequence of expert ids this cache will be asked for, in lookup
order (the page reference string), `future[t]` being the lookup at logical time `t`. It is
accepted as
  * a 1-D sequence / array / tensor of expert ids for this layer, or
  * a per-layer table: a mapping {layer: sequence} or a list of sequences (or a 2-D
    array), from which `future[layer]` is taken.
Every `on_hit`/`on_insert` checks that the lookup matches `future[t]` and raises
`ValueError` otherwise, so a trace from another run or layer is caught at once rather than
silently producing a wrong "optimum".
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

from engine.policies.base import EvictionPolicy, layer_row


@dataclass(frozen=True)
class BeladyOptions:
    trace: str | None = None        # a routing trace (.npz) of the same job: the future lookups


class Belady(EvictionPolicy):
    name = "belady"
    Options = BeladyOptions

    @classmethod
    def prepare(cls, options: BeladyOptions, cfg: Any) -> dict[str, Any]:
        from engine.trace import lookup_sequences, trace_for_model
        if not options.trace:
            raise ValueError("belady evicts by the known future and needs trace=FILE: a routing trace of the same "
                             "job (run.record_trace=true writes <job dir>/routing.npz)")
        return {"future": lookup_sequences(trace_for_model(options.trace, cfg), model_layers=True)}

    def __init__(
        self,
        capacity: int,
        n_experts: int,
        layer: int = 0,
        *,
        future: Sequence[int] | Sequence[Sequence[int]] | Any,
    ) -> None:
        super().__init__(capacity, n_experts, layer)
        refs = layer_row(future, layer, "belady future")
        n = len(refs)
        self._future = array("q", refs)
        # next_occ[t] = index of the next lookup of future[t] after t, or n ("never").
        # Because every lookup is checked against future[t], the next use of an expert
        # referenced at t is next_occ[t]: victim() is a max over residents with no search.
        next_occ = array("q", [n]) * n
        last: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            e = refs[i]
            if e in last:
                next_occ[i] = last[e]
            last[e] = i
        self._next_occ = next_occ
        # resident -> next use, negated with the id so max() breaks ties to the lowest id
        self._next: dict[int, tuple[int, int]] = {}

    def _check(self, expert: int, t: int) -> None:
        fut = self._future
        if t >= len(fut) or t < 0:
            raise ValueError(
                f"belady future does not match the actual lookups: lookup of expert {expert} "
                f"at position {t}, but the future has only {len(fut)} entries (layer {self.layer})"
            )
        if fut[t] != expert:
            raise ValueError(
                f"belady future does not match the actual lookups: at position {t} "
                f"expected expert {fut[t]}, got {expert} (layer {self.layer}); "
                f"was the trace recorded for another run or layer?"
            )

    def on_hit(self, expert: int, t: int) -> None:
        self._check(expert, t)
        self._next[expert] = (self._next_occ[t], -expert)

    def on_insert(self, expert: int, t: int) -> None:
        self._check(expert, t)
        self.resident.add(expert)
        self._next[expert] = (self._next_occ[t], -expert)

    def on_prefetch(self, expert: int, t: int) -> None:
        """Prefetched ahead of its lookup: its next use is its first lookup at or after t."""
        if not hasattr(self, "_positions"):
            self._positions: dict[int, list[int]] = {}
            for i, e in enumerate(self._future):
                self._positions.setdefault(e, []).append(i)
        pos = self._positions.get(expert, [])
        i = bisect_left(pos, t)
        self.resident.add(expert)
        self._next[expert] = (pos[i] if i < len(pos) else len(self._future), -expert)

    def on_evict(self, expert: int) -> None:
        self.resident.discard(expert)
        self._next.pop(expert, None)

    def next_use(self, expert: int) -> int:
        """Time of the next lookup of resident `expert`; len(future) means never."""
        return self._next[expert][0]

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        nxt = self._next
        cands = self._candidates(protected) if protected else nxt
        if not cands:
            raise self._no_victim(protected)
        return max(cands, key=nxt.__getitem__)
