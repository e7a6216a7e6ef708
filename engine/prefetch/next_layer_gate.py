"""`next_layer_gate`: apply the next MoE layer's router to this layer's hidden state and
prefetch the experts it picks (speculative: the next layer's real input differs by one
attention block, so some predictions miss -- prefetch_wasted_bytes shows how many)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.prefetch.base import Prefetcher


class NextLayerGate(Prefetcher):
    name = "next_layer_gate"

    def after_route(self, layer: int, h: torch.Tensor, ids: torch.Tensor) -> None:
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return
        logits = F.linear(h, self.ctx.routers[nxt])                      # [N, E]
        guess = logits.topk(self.ctx.cfg.top_k, dim=-1).indices          # [N, k]
        # most-voted first, so a small cache keeps the likeliest experts
        counts = torch.bincount(guess.flatten(), minlength=self.ctx.cfg.n_experts)
        order = torch.argsort(counts, descending=True, stable=True)
        experts = [e for e in order.tolist() if counts[e] > 0]
        self.ctx.cache.prefetch(nxt, experts)
