"""`next_layer_gate`: apply the next MoE layer's router to this layer's hidden state and
prefetch the experts it picks (speculative: the next layer's real input differs by one
attention block, so some predictions miss -- prefetch_wasted_bytes shows how many)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.dispatch import tokens_per_expert
from engine.prefetch.base import Prefetcher

if TYPE_CHECKING:                 # annotations only: the registry lists prefetchers without torch
    import torch


class NextLayerGate(Prefetcher):
    name = "next_layer_gate"

    def after_route(self, layer: int, h: torch.Tensor, ids: torch.Tensor) -> None:
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return
        guess, _ = self.ctx.routers[nxt].route(h)                        # [N, k]: the next router's choice
        votes = tokens_per_expert(guess, self.ctx.cfg.n_experts).tolist()   # [E]: the one device->host transfer
        # most-voted first (ties: lower id first, a stable sort), so a small cache keeps the likeliest experts
        experts = sorted((e for e, n in enumerate(votes) if n > 0), key=lambda e: -votes[e])
        self.ctx.cache.prefetch(nxt, experts)
