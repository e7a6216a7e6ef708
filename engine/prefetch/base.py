"""Prefetcher interface.

Owns: predicting which experts the next MoE layer will look up in this forward pass.
Does not own: slots, copies or counters -- it calls `ExpertCache.prefetch(layer, experts)`,
which moves the bytes on the copy stream / worker and counts prefetch_issued,
prefetch_used and prefetch_wasted_bytes. Prefetching never changes what is computed:
an expert is always looked up and waited for before use.

The engine calls `begin_forward()` once per forward pass and `after_route(layer, h, ids)`
after each MoE layer's router, before its experts run, so the copies overlap that
layer's expert compute.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from engine.blocks.routers import Router
from engine.cache import ExpertCache
from engine.config import ModelConfig
from engine.lazy import lazy_module
from engine.registry import NoOptions

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass
class PrefetchContext:
    cfg: ModelConfig
    cache: ExpertCache
    routers: dict[int, Router]            # MoE layer -> its router (engine.blocks.routers)


class Prefetcher(ABC):
    """`Options` is the prefetcher's configuration (Hydra: `prefetch.options`), passed to the
    constructor as keyword arguments; data from the run itself (trace_oracle's `steps`) is too."""

    name: str = ""
    Options: ClassVar[type] = NoOptions

    def __init__(self, ctx: PrefetchContext, **options: Any) -> None:
        if options:
            raise TypeError(f"prefetch {self.name!r} got unknown option(s) {sorted(options)}; allowed: none")
        self.ctx = ctx
        layers = list(ctx.cfg.moe_layers)
        self.next_layer = {a: b for a, b in zip(layers, layers[1:])}
        self.step = -1

    def begin_forward(self) -> None:
        self.step += 1

    def reset(self) -> None:
        self.step = -1

    @abstractmethod
    def after_route(self, layer: int, h: torch.Tensor, ids: torch.Tensor) -> None:
        """Layer `layer` routed rows h [N, D] to ids [N, k]; maybe prefetch for the next layer."""
