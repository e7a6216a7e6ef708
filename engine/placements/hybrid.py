"""`hybrid`: the experts of the first N layers run on the CPU, the rest are resident on
the device -- llama.cpp's `--n-cpu-moe N`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.lazy import lazy_module
from engine.placements.base import Placement, PlacementTraits

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class HybridOptions:
    n_cpu_layers: int = 1   # layers [0, N) keep their experts on the CPU

    def __post_init__(self) -> None:
        if self.n_cpu_layers < 0:
            raise ValueError(f"n_cpu_layers must be >= 0, got {self.n_cpu_layers}")


class Hybrid(Placement):
    name = "hybrid"
    Options = HybridOptions

    def expert_on_device(self, layer: int) -> bool:
        return layer >= self.options.n_cpu_layers

    @classmethod
    def traits(cls, cfg: ModelConfig, options: dict[str, Any]) -> PlacementTraits:
        n_cpu = cls.parse_options(options).n_cpu_layers
        return PlacementTraits(cpu_layers=frozenset(l for l in cfg.moe_layers if l < n_cpu))

    @classmethod
    def invariant_cases(cls, cfg: ModelConfig) -> list[dict[str, Any]]:
        """Half the layers on the CPU, none, and all of them."""
        L = cfg.num_layers
        return [{"n_cpu_layers": n} for n in dict.fromkeys((L // 2, 0, L))]

    @classmethod
    def describe(cls, options: dict[str, Any]) -> str:
        n_cpu = cls.parse_options(options).n_cpu_layers
        return f"{n_cpu} CPU layer{'' if n_cpu == 1 else 's'}"

    @classmethod
    def check_model(cls, cfg: ModelConfig, options: dict[str, Any]) -> None:
        n_cpu = cls.parse_options(options).n_cpu_layers
        if n_cpu > cfg.n_moe_layers:
            raise ValueError(f"n_cpu_layers: allowed 0..{cfg.n_moe_layers} (the model's MoE layers), got {n_cpu}")

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        n_cpu = cls.parse_options(options).n_cpu_layers
        return sum(1 for l in cfg.moe_layers if l >= n_cpu) * cfg.n_experts * expert_bytes

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.expert_on_device(layer):
            return self.run_resident(layer, h, ids, weights)
        return self.run_on_cpu(layer, h, ids, weights)
