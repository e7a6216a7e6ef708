"""`fetch`: experts live in host RAM; each is copied (one copy of its packed buffer, on
the copy stream) into a fixed-capacity per-layer device cache when first needed, and
runs on the device. Eviction is the configured policy (mixtral-offloading's scheme with
swappable policies and exact counters)."""
from __future__ import annotations

from typing import Any

import torch

from engine.cache import ExpertCache
from engine.config import ModelConfig
from engine.placements.base import Placement


class Fetch(Placement):
    name = "fetch"

    @classmethod
    def uses_cache(cls, options: dict[str, Any]) -> bool:
        return True

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        return cfg.n_moe_layers * (capacity or 0) * expert_bytes

    def setup(self) -> None:
        ctx = self.ctx
        if ctx.capacity is None or ctx.policy_factory is None:
            raise ValueError("placement 'fetch' needs cache_capacity (an int or 'auto') and a cache_policy")
        self.cache = ExpertCache(ctx.store, ctx.device, ctx.counters, ctx.capacity,
                                 list(ctx.cfg.moe_layers), ctx.policy_factory)

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        return self.combine(layer, h, ids, weights, lambda e: cache.acquire(layer, e),
                            lambda e: cache.release(layer, e))
