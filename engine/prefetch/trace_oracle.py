"""`trace_oracle`: perfect prediction from a recorded run -- the bound for any prefetcher.

Option `steps`: per MoE layer, the sorted expert ids each forward pass looked up, in
order ({layer: [[e, ...], ...]}), e.g. `eng.step_log` of an identical earlier run made
with record_lookups=True. A run that diverges from it raises, naming the step."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any


from engine.prefetch.base import PrefetchContext, Prefetcher

if TYPE_CHECKING:                 # annotations only: the registry lists prefetchers without torch
    import torch


class TraceOracle(Prefetcher):
    name = "trace_oracle"

    def __init__(self, ctx: PrefetchContext, steps: dict[int, list[list[int]]] | None = None, **options: Any) -> None:
        super().__init__(ctx, **options)
        if steps is None:
            raise TypeError("prefetch 'trace_oracle' needs steps={layer: [[experts of pass 0], ...]} "
                            "(eng.step_log of an identical run with record_lookups=True)")
        self.steps = {int(k): v for k, v in steps.items()}

    def after_route(self, layer: int, h: torch.Tensor, ids: torch.Tensor) -> None:
        seq = self.steps.get(layer)
        if seq is not None:   # check the oracle is about this run
            if self.step >= len(seq) or sorted(set(ids.flatten().tolist())) != list(seq[self.step]):
                raise ValueError(f"trace_oracle: forward pass {self.step}, layer {layer} does not match the "
                                 "supplied steps; record them from an identical run")
        nxt = self.next_layer.get(layer)
        if nxt is None or nxt not in self.steps:
            return
        if self.step < len(self.steps[nxt]):
            self.ctx.cache.prefetch(nxt, list(self.steps[nxt][self.step]))
