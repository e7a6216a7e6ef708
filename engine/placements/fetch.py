"""`fetch`: experts live in host RAM; each is copied (one copy of its packed buffer, on
the copy stream) into a fixed-capacity per-layer device cache when first needed, and
runs on the device. Eviction is the configured policy (mixtral-offloading's scheme with
swappable policies and exact counters).

Option `issue_ahead` (default True): queue all of a layer's misses on the copy stream as
soon as its routing is known, in compute order, so expert i computes while expert i+1
copies; False keeps the sequential copy, wait, compute per expert, so one run can compare
both (hits, misses and bytes are identical either way: see engine.cache)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.cache import ExpertCache
from engine.config import ModelConfig
from engine.dispatch import group_by_expert
from engine.lazy import lazy_module
from engine.placements.base import Placement, PlacementTraits
from engine.registry import require_bool

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class FetchOptions:
    issue_ahead: bool = True   # queue a layer's misses up front (False: one at a time, when reached)

    def __post_init__(self) -> None:
        require_bool("issue_ahead", self.issue_ahead)


class Fetch(Placement):
    name = "fetch"
    Options = FetchOptions
    copies_experts = True

    @classmethod
    def uses_cache(cls, options: dict[str, Any]) -> bool:
        return True

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        return cfg.n_moe_layers * (capacity or 0) * expert_bytes

    @classmethod
    def traits(cls, cfg: ModelConfig, options: dict[str, Any]) -> PlacementTraits:
        return PlacementTraits(uses_cache=True, copies_experts=True,
                               issue_ahead=cls.parse_options(options).issue_ahead)

    @classmethod
    def invariant_cases(cls, cfg: ModelConfig) -> list[dict[str, Any]]:
        """Every capacity from top_k to every expert under every registered eviction policy; then,
        one slot above the smallest cache, each copy schedule with every registered prefetcher (the
        default schedule without one is already among the first)."""
        from engine.registry import POLICIES, PREFETCHERS
        k, E = cfg.top_k, cfg.n_experts
        first = {"cache_capacity": min(k + 1, E), "cache_policy": "lru"}
        cases = [first] + [{"cache_capacity": c, "cache_policy": p} for c in range(k, E + 1) for p in POLICIES.names()
                           if {"cache_capacity": c, "cache_policy": p} != first]
        cases += [{"cache_capacity": first["cache_capacity"], "issue_ahead": ahead, "prefetch": pf}
                  for ahead in (True, False) for pf in PREFETCHERS.names() if (ahead, pf) != (True, "none")]
        return cases

    def setup(self) -> None:
        ctx = self.ctx
        if ctx.capacity is None or ctx.policy_factory is None:
            raise ValueError("placement 'fetch' needs cache_capacity (an int or 'auto') and a cache_policy")
        self.cache = ExpertCache(ctx.store, ctx.device, ctx.counters, ctx.capacity,
                                 list(ctx.cfg.moe_layers), ctx.policy_factory, issue_ahead=self.options.issue_ahead)

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        routing = group_by_expert(ids, self.ctx.cfg.n_experts)        # the layer's one host sync
        cache.lookup(layer, routing.experts)
        return self.combine(layer, h, routing, weights, lambda e: cache.acquire(layer, e),
                            lambda e: cache.release(layer, e))
