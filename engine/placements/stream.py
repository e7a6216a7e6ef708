"""`stream`: for prefill batches above a token threshold, each layer's used experts are
streamed through a few bounded device buffers (copy of expert i+B overlaps compute of
expert i; llama.cpp op-offload, Krasis layer groups). Smaller batches (decode) use a
fallback placement (`fetch` with its cache, or `cpu`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.devices import CopyHandle
from engine.dispatch import group_by_expert
from engine.lazy import lazy_module
from engine.placements.base import Placement, PlacementContext, PlacementTraits

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

FALLBACKS = ("fetch", "cpu")


@dataclass(frozen=True)
class StreamOptions:
    stream_threshold: int = 64     # stream when a forward pass has more tokens than this
    stream_fallback: str = "fetch"  # placement below the threshold
    stream_buffers: int = 2        # device buffers experts stream through

    def __post_init__(self) -> None:
        if self.stream_fallback not in FALLBACKS:
            raise ValueError(f"stream_fallback must be one of {FALLBACKS}, got {self.stream_fallback!r}")
        if self.stream_buffers < 1:
            raise ValueError(f"stream_buffers must be >= 1, got {self.stream_buffers}")
        if self.stream_threshold < 0:
            raise ValueError(f"stream_threshold must be >= 0, got {self.stream_threshold}")


class Stream(Placement):
    name = "stream"
    Options = StreamOptions
    copies_experts = True

    def __init__(self, ctx: PlacementContext, **options: Any) -> None:
        super().__init__(ctx, **options)
        from engine.registry import PLACEMENTS
        self.fallback = PLACEMENTS.get(self.options.stream_fallback)(ctx)
        self._streaming = False

    @classmethod
    def uses_cache(cls, options: dict[str, Any]) -> bool:
        return cls.parse_options(options).stream_fallback == "fetch"

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        from engine.registry import PLACEMENTS
        o = cls.parse_options(options)
        fb = PLACEMENTS.get(o.stream_fallback).device_expert_bytes(cfg, expert_bytes, capacity, {})
        return fb + o.stream_buffers * expert_bytes

    @classmethod
    def describe(cls, options: dict[str, Any]) -> str:
        o = cls.parse_options(options)
        rest = super().describe({k: v for k, v in options.items() if k != "stream_threshold"})
        return ", ".join(p for p in (f"streams above {o.stream_threshold} tokens", rest) if p)

    @classmethod
    def invariant_cases(cls, cfg: ModelConfig) -> list[dict[str, Any]]:
        """Prefill chunks streamed and decode through either fallback: a threshold between the
        decode step and the prefill chunks, at the smallest and a larger cache; every pass
        streamed through one buffer (threshold 0); the cpu fallback with three buffers."""
        k, E = cfg.top_k, cfg.n_experts
        return [{"cache_capacity": k, "stream_threshold": 4},
                {"cache_capacity": min(k + 1, E), "stream_threshold": 8},
                {"cache_capacity": k, "stream_threshold": 0, "stream_buffers": 1},
                {"stream_fallback": "cpu", "stream_threshold": 8, "stream_buffers": 3}]

    @classmethod
    def traits(cls, cfg: ModelConfig, options: dict[str, Any]) -> PlacementTraits:
        from engine.registry import PLACEMENTS
        o = cls.parse_options(options)
        fallback = PLACEMENTS.get(o.stream_fallback).traits(cfg, {})
        return PlacementTraits(uses_cache=fallback.uses_cache, copies_experts=True, cpu_layers=fallback.cpu_layers,
                               stream_threshold=o.stream_threshold, stream_buffers=o.stream_buffers,
                               issue_ahead=fallback.issue_ahead)

    def setup(self) -> None:
        self.fallback.setup()
        self.cache = self.fallback.cache
        store = self.ctx.store
        self.buffers = self.ctx.device.empty((self.options.stream_buffers, store.packed_numel), store.dtype,
                                             "experts:stream")
        self.last_use: list[object] = [None] * self.options.stream_buffers

    def begin_forward(self, n_tokens: int) -> None:
        self._streaming = n_tokens > self.options.stream_threshold

    def prefetchable(self) -> bool:
        """No prefetch while a pass streams: its layers never look the cache up, and prefetch
        copies would only queue ahead of the streamed experts on the copy stream."""
        return not self._streaming and self.cache is not None

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if not self._streaming:
            return self.fallback.run(layer, h, ids, weights)
        dev, store, nb = self.ctx.device, self.ctx.store, self.options.stream_buffers
        routing = group_by_expert(ids, self.ctx.cfg.n_experts)        # the layer's one host sync
        experts = routing.experts
        ready: dict[int, CopyHandle] = {}

        def issue(i: int) -> None:  # copy expert i into buffer i % nb once that buffer's last reader is done
            b = i % nb
            e = experts[i]
            ready[e] = dev.copy_h2d(store.view(self.buffers[b], layer, e), store.expert(layer, e),
                                    after=self.last_use[b], info={"layer": layer, "expert": e, "stream": True})
            self.ctx.counters.transfer("h2d", "expert", store.expert_nbytes(layer, e), layer)

        for i in range(min(nb, len(experts))):
            issue(i)
        order = {e: i for i, e in enumerate(experts)}

        def weights_of(e: int) -> torch.Tensor:
            dev.wait(ready.pop(e))
            return store.view(self.buffers[order[e] % nb], layer, e)

        def release(e: int) -> None:
            i = order[e]
            self.last_use[i % nb] = dev.record_compute()
            if i + nb < len(experts):
                issue(i + nb)

        return self.combine(layer, h, routing, weights, weights_of, release)
