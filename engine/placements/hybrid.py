"""`hybrid`: the experts of N layers run on the CPU, the rest are resident on the device.

Which N is `cpu_layers`: `first_n`, layers [0, N) -- llama.cpp's `--n-cpu-moe N`, counting
every layer as it does; `last_n`, the last N layers (ik_llama.cpp's choice: later layers route a
batch to fewer distinct experts, so their experts cost the CPU less in prefill); or
`by_working_set`, the N MoE layers whose prefill passes route to the fewest distinct experts in a
routing trace (`working_set_trace`: recorded with run.record_trace or imported). `cpu_layer_set`
is the one answer every caller (the engine, the planner, the cost model, llama.cpp's `-ot` list,
the `placement_map` column) asks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from engine.config import ModelConfig
from engine.lazy import lazy_module
from engine.placements.base import Placement, PlacementTraits

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


CPU_LAYER_ORDERS = ("first_n", "last_n", "by_working_set")


@dataclass(frozen=True)
class HybridOptions:
    n_cpu_layers: int = 1                 # how many layers keep their experts on the CPU
    cpu_layers: str = "first_n"           # which: CPU_LAYER_ORDERS (module docstring)
    working_set_trace: Optional[str] = None   # by_working_set: the routing trace (.npz) to rank layers by

    def __post_init__(self) -> None:
        if self.n_cpu_layers < 0:
            raise ValueError(f"n_cpu_layers must be >= 0, got {self.n_cpu_layers}")
        if self.cpu_layers not in CPU_LAYER_ORDERS:
            raise ValueError(f"cpu_layers: allowed {', '.join(CPU_LAYER_ORDERS)}, got {self.cpu_layers!r}")
        if (self.cpu_layers == "by_working_set") != (self.working_set_trace is not None):
            raise ValueError("cpu_layers=by_working_set needs working_set_trace (a routing trace .npz), and only it "
                             f"does; got cpu_layers={self.cpu_layers!r}, working_set_trace={self.working_set_trace!r}")


def cpu_layer_set(cfg: ModelConfig, options: HybridOptions) -> frozenset[int]:
    """The layers whose experts run on the CPU under these options."""
    n = options.n_cpu_layers
    if options.cpu_layers == "first_n":
        return frozenset(range(min(n, cfg.num_layers)))
    if options.cpu_layers == "last_n":
        return frozenset(range(max(cfg.num_layers - n, 0), cfg.num_layers))
    ranked = working_set_ranking(cfg, options.working_set_trace)
    return frozenset(ranked[:n])


def working_set_ranking(cfg: ModelConfig, path: str) -> list[int]:
    """The model's MoE layers, fewest distinct experts per prefill pass first (decode steps where the
    trace has no prefill pass; ties by layer), from the routing trace at `path`."""
    import numpy as np

    from engine.trace import distinct_per_pass, load_trace, require_order
    trace = load_trace(path)
    require_order(trace, "cpu_layers=by_working_set (distinct experts per pass)")
    if list(trace.moe_layers) != list(cfg.moe_layers) or trace.n_experts != cfg.n_experts:
        raise ValueError(f"working_set_trace {path}: its MoE layers {list(trace.moe_layers)} / {trace.n_experts} "
                         f"experts are not the model's ({list(cfg.moe_layers)} / {cfg.n_experts})")
    decode, prefill = distinct_per_pass(trace)
    size = np.where(np.isnan(prefill), decode, prefill)
    return [layer for _, layer in sorted(zip(size.tolist(), cfg.moe_layers))]


class Hybrid(Placement):
    name = "hybrid"
    Options = HybridOptions
    added_options = {"cpu_layers": "first_n", "working_set_trace": None}

    def __init__(self, ctx: Any, **options: Any) -> None:
        super().__init__(ctx, **options)
        self.cpu_layers = cpu_layer_set(ctx.cfg, self.options)

    def expert_on_device(self, layer: int) -> bool:
        return layer not in self.cpu_layers

    @classmethod
    def traits(cls, cfg: ModelConfig, options: dict[str, Any]) -> PlacementTraits:
        cpu = cpu_layer_set(cfg, cls.parse_options(options))
        return PlacementTraits(cpu_layers=frozenset(l for l in cfg.moe_layers if l in cpu))

    @classmethod
    def invariant_cases(cls, cfg: ModelConfig) -> list[dict[str, Any]]:
        """Half the layers on the CPU (the first half and the last), none, and all of them."""
        L = cfg.num_layers
        return [*({"n_cpu_layers": n} for n in dict.fromkeys((L // 2, 0, L))),
                {"n_cpu_layers": L // 2, "cpu_layers": "last_n"}]

    @classmethod
    def describe(cls, options: dict[str, Any]) -> str:
        opts = cls.parse_options(options)
        which = "" if opts.cpu_layers == "first_n" else f", {opts.cpu_layers}"
        return f"{opts.n_cpu_layers} CPU layer{'' if opts.n_cpu_layers == 1 else 's'}{which}"

    @classmethod
    def check_model(cls, cfg: ModelConfig, options: dict[str, Any]) -> None:
        opts = cls.parse_options(options)
        if opts.n_cpu_layers > cfg.n_moe_layers:
            raise ValueError(f"n_cpu_layers: allowed 0..{cfg.n_moe_layers} (the model's MoE layers), "
                             f"got {opts.n_cpu_layers}")
        if opts.working_set_trace is not None:
            working_set_ranking(cfg, opts.working_set_trace)      # a wrong or foreign trace, before any weight

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        cpu = cpu_layer_set(cfg, cls.parse_options(options))
        return sum(1 for l in cfg.moe_layers if l not in cpu) * cfg.n_experts * expert_bytes

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.expert_on_device(layer):
            return self.run_resident(layer, h, ids, weights)
        return self.run_on_cpu(layer, h, ids, weights)
