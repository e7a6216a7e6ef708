"""`resident`: every expert lives on the device; nothing moves after load."""
from __future__ import annotations

import torch

from engine.placements.base import AllExpertsResident


class Resident(AllExpertsResident):
    name = "resident"

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.run_resident(layer, h, ids, weights)
