"""`cpu`: experts stay in host RAM and run on the CPU; activations cross the link instead
(Fiddler-style). Attention and everything else stays on the device."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.lazy import lazy_module
from engine.placements.base import Placement, PlacementTraits

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


class CPUExperts(Placement):
    name = "cpu"

    @classmethod
    def traits(cls, cfg: ModelConfig, options: dict[str, Any]) -> PlacementTraits:
        return PlacementTraits(cpu_layers=frozenset(cfg.moe_layers))

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.run_on_cpu(layer, h, ids, weights)
