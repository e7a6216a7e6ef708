"""Placement strategy interface: where each routed expert runs and what moves to make it so.

Owns: the contract between the MoE block and a strategy (`run(layer, h, ids, weights)`),
the shared expert loop (`combine`) that every strategy uses so the accumulation order --
and therefore the output -- never depends on placement (the expert kernel itself is the
family's, `ctx.store.layout.run`, so placements know nothing of any family), the CPU-execution path shared
by `cpu` and `hybrid`, and option validation through each strategy's `Options` dataclass.
A strategy builds its layer's dispatch once (`engine.dispatch.group_by_expert`: one host
sync per layer) and hands it to `combine`; strategies that copy experts see the whole
list of experts before the first one runs, so they can issue copies ahead.
Does not own: bytes at rest (engine.cache.ExpertStore), slot management (ExpertCache),
eviction choice (policies), memory planning arithmetic (engine.planner asks
`device_expert_bytes`).

A strategy is registered by name in engine.registry.PLACEMENTS (or the entry-point
group `moebench.placements`) and built by the engine as `cls(ctx, **options)`.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from engine.cache import ExpertCache, ExpertStore
from engine.config import ModelConfig
from engine.counters import Counters
from engine.devices import Device
from engine.dispatch import Dispatch, group_by_expert, group_on_device
from engine.hooks import Instrument
from engine.layers import cast
from engine.lazy import lazy_module
from engine.policies.base import EvictionPolicy
from engine.registry import NoOptions

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass
class PlacementContext:
    cfg: ModelConfig
    device: Device
    store: ExpertStore
    counters: Counters
    instrument: Instrument
    capacity: int | None                                    # fetch-cache slots per layer, resolved
    policy_factory: Callable[[int], EvictionPolicy] | None  # layer -> policy instance


@dataclass(frozen=True)
class PlacementTraits:
    """What a placement does, as the planner's neighbours ask it without building one: the cost
    model, the calibration fit and the plots read this instead of branching on names.

    rows: the B*T rows of one forward pass (streaming is decided per pass)."""

    uses_cache: bool = False                     # a device expert cache: takes a capacity and a policy
    copies_experts: bool = False                 # expert weights cross the link host->device
    cpu_layers: frozenset[int] = frozenset()     # MoE layers whose experts run on the CPU (when not streaming)
    stream_threshold: int | None = None          # passes of more rows stream each layer's experts; None: never
    stream_buffers: int = 0                      # device buffers streamed experts pass through
    issue_ahead: bool = True                     # a layer's misses are queued up front (overlap with compute)

    def streams(self, rows: int) -> bool:
        return self.stream_threshold is not None and rows > self.stream_threshold

    def on_cpu(self, layer: int, rows: int) -> bool:
        """Whether `layer`'s experts run on the CPU in a pass of `rows` rows."""
        return not self.streams(rows) and layer in self.cpu_layers

    @property
    def uses_cpu(self) -> bool:
        return bool(self.cpu_layers)

    def layer_map(self, cfg: ModelConfig) -> str:
        """One letter per layer, where a decode step finds its experts: `C` run on the CPU, `F`
        fetched or streamed to the device over the link, `G` resident on the device, `-` a dense
        layer (no experts). The `placement_map` column: hybrid's first_n and last_n are `CCGG` and
        `GGCC`."""
        moe = set(cfg.moe_layers)
        return "".join("-" if l not in moe else "C" if l in self.cpu_layers else "F" if self.copies_experts else "G"
                       for l in range(cfg.num_layers))


class Placement(ABC):
    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    copies_experts: ClassVar[bool] = False   # copies experts host->device (so its host store is pinned on CUDA)

    def __init__(self, ctx: PlacementContext, **options: Any) -> None:
        self.ctx = ctx
        self.options = self.parse_options(options)
        self.cache: ExpertCache | None = None

    @classmethod
    def parse_options(cls, options: dict[str, Any]) -> Any:
        allowed = [f.name for f in dataclasses.fields(cls.Options)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise TypeError(f"placement {cls.name!r} got unknown option(s) {unknown}; "
                            f"allowed: {allowed or 'none'}")
        return cls.Options(**options)

    # --- what the loader and the planner ask -------------------------------------------
    def expert_on_device(self, layer: int) -> bool:
        """Whether layer's experts are stored on the device (else in host RAM)."""
        return False

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        """Device bytes this strategy holds for routed experts (slots, resident rows, buffers)."""
        return 0

    @classmethod
    def uses_cache(cls, options: dict[str, Any]) -> bool:
        """Whether this strategy (with these options) needs a cache capacity."""
        return False

    @classmethod
    def traits(cls, cfg: ModelConfig, options: dict[str, Any]) -> PlacementTraits:
        """What this strategy does with these options on this model (see PlacementTraits)."""
        return PlacementTraits(uses_cache=cls.uses_cache(options), copies_experts=cls.copies_experts)

    @classmethod
    def check_model(cls, cfg: ModelConfig, options: dict[str, Any]) -> None:
        """Raise ValueError naming the option when these options cannot apply to this model."""

    # options added after rows first recorded this placement's options, with the default that keeps
    # the earlier behaviour: at that default they are left out of the `placement_options` column,
    # so a row of today and a baseline from before name the same configuration alike
    added_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def recorded_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The options as the `placement_options` column records them (added_options)."""
        return {k: v for k, v in options.items() if k not in cls.added_options or cls.added_options[k] != v}

    @classmethod
    def describe(cls, options: dict[str, Any]) -> str:
        """A few words for these options where a figure or a table names a configuration
        ("1 CPU layer"); "" when they add nothing to the placement's name. The default: each
        option that differs from its default, as name=value. Raises what `parse_options` raises."""
        parsed = cls.parse_options(options)
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(parsed)}
        return ", ".join(f"{name}={getattr(parsed, name)}" for name, default in defaults.items()
                         if default is dataclasses.MISSING or getattr(parsed, name) != default)

    @classmethod
    def invariant_cases(cls, cfg: ModelConfig) -> list[dict[str, Any]]:
        """The configurations of this strategy that the invariant test (tests/engine/test_invariant*)
        holds to `resident`'s tokens and logits on `cfg`, on the CPU in fp32: each a dict of
        `Engine.from_pretrained` keywords beside `placement` (its options, `cache_capacity`,
        `cache_policy`, `prefetch`). The first is its representative one (what tests that vary
        something else -- the micro-batch, a sliding window -- run); empty where it cannot run `cfg`
        there. The default: its default options, and for a strategy that keeps a cache the smallest
        (top_k) and the largest (every expert) capacity. A strategy whose options change what it
        does overrides this to cover them."""
        if not cls.uses_cache({}):
            return [{}]
        return [{"cache_capacity": c} for c in sorted({cfg.top_k, cfg.n_experts})]

    def setup(self) -> None:
        """Allocate device-side structures after the weights are loaded."""

    def begin_forward(self, n_tokens: int) -> None:
        """Called before each forward pass with the number of tokens it processes (B*T)."""

    def reset(self) -> None:
        """Return to a cold state (empty caches); weights stay loaded."""
        if self.cache is not None:
            self.cache.reset()

    static_decode: ClassVar[bool] = False   # decode steps run fixed-shape through engine.static_decode

    def prefetchable(self) -> bool:
        """Whether this forward pass looks experts up in the device cache, so copying the next
        layer's experts into it ahead can help (False: the engine skips the prefetcher)."""
        return self.cache is not None

    @abstractmethod
    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output for h [N, D] given top-k ids/weights [N, k]; returns [N, D]."""

    # --- shared pieces -----------------------------------------------------------------
    def combine(self, layer: int, h: torch.Tensor, routing: Dispatch, weights: torch.Tensor,
                weights_of: Callable[[int], torch.Tensor],
                release: Callable[[int], None] | None = None) -> torch.Tensor:
        """The one expert loop: experts in ascending id order, index_add into a zero buffer.

        N=rows, k=top-k, D=hidden, P=packed expert numel, n=rows routed to one expert.

        An expert that every row chose (decode at batch 1: each of its k experts) runs on h itself
        and adds in place: the same values and the same additions as the gather and `index_add_`,
        without them (`index_add_` on CPU enters a parallel region, ~0.5 ms per call at 2 threads
        for a single row, where `add_` of one row stays serial).
        """
        layout, span = self.ctx.store.layout, self.ctx.instrument.span
        out = torch.zeros_like(h)                                          # [N, D]
        N = h.shape[0]
        for (e, tok, _), gate in zip(routing, routing.gates(weights)):     # ascending expert id; gate [n, 1]
            w = weights_of(e)                                              # [P]; may wait for a copy
            n = tok.numel()
            with span("expert", layer=layer, expert=e, tokens=n):
                if n == N:                                                 # rows ascending and distinct: all of them
                    layout.run_add_(out, h, w, gate)                       # out += run(h) * gate: the family's kernel
                else:
                    out.index_add_(0, tok, cast(layout.run(h.index_select(0, tok), w) * gate, out.dtype))   # [n, D]
            if release is not None:
                release(e)
        return out

    def combine_grouped(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
        """`combine` over all of a layer's experts `rows` [E, P] with no host sync: rows grouped by
        expert on the device, one grouped GEMM per projection (the layout's `run_grouped`), then
        each row's k weighted outputs added into a zero buffer in ascending expert id -- the
        values and additions of `combine`, so the output is bitwise the same where the grouped
        kernel equals `run` per group (CPU: tests/engine/test_dispatch.py). One "expert" span for
        the layer (expert -1), not one per expert: which experts ran is not known on the host.

        N=rows, k=top-k, D=hidden, M=N*k (row, slot) pairs, E=experts, P=packed expert numel.
        """
        N, k = ids.shape
        r = group_on_device(ids, self.ctx.cfg.n_experts)
        with self.ctx.instrument.span("expert", layer=layer, expert=-1, tokens=N * k):
            x = h.index_select(0, r.order // k)                            # [M, D] grouped by expert
            y = self.ctx.store.layout.run_grouped(x, rows, r.offs)         # [M, D]
            y = y * weights.reshape(-1, 1)[r.order]                        # [M, D] weighted
            out = torch.zeros_like(h)                                      # [N, D]
            for s in range(k):                                             # each row's experts, ascending id
                out.add_(cast(y.index_select(0, r.accumulate[:, s]), out.dtype))
        return out

    def run_resident(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        store = self.ctx.store
        return self.combine(layer, h, group_by_expert(ids, self.ctx.cfg.n_experts), weights,
                            lambda e: store.expert(layer, e))

    def run_on_cpu(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Ship activations to the CPU, run the experts from host RAM, ship the result back.
        The device's compute stream idles meanwhile (the instrument hears `idle('host')`)."""
        dev, counters = self.ctx.device, self.ctx.counters
        info = {"layer": layer, "what": "activations"}
        with self.ctx.instrument.idle("host", layer=layer):
            h_c, ids_c, w_c = dev.to_host(h, info), dev.to_host(ids, info), dev.to_host(weights, info)
            counters.transfer("d2h", "activation", sum(t.numel() * t.element_size() for t in (h_c, ids_c, w_c)), layer)
            store = self.ctx.store
            out = self.combine(layer, h_c, group_by_expert(ids_c, self.ctx.cfg.n_experts), w_c,
                               lambda e: store.expert(layer, e))
            out_d = dev.to_device(out, info)
            counters.transfer("h2d", "activation", out.numel() * out.element_size(), layer)
        return out_d


class AllExpertsResident(Placement, ABC):
    """What placements that keep every expert on the device share (resident, resident_grouped):
    the whole expert store is device memory, nothing moves after load."""

    def expert_on_device(self, layer: int) -> bool:
        return True

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        return cfg.n_moe_layers * cfg.n_experts * expert_bytes
