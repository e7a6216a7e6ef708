"""`resident`: every expert lives on the device; nothing moves after load."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_module
from engine.placements.base import AllExpertsResident

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


class Resident(AllExpertsResident):
    name = "resident"

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.run_resident(layer, h, ids, weights)
