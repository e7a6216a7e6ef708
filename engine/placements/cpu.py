"""`cpu`: experts stay in host RAM and run on the CPU; activations cross the link instead
(Fiddler-style). Attention and everything else stays on the device."""
from __future__ import annotations

import torch

from engine.placements.base import Placement


class CPUExperts(Placement):
    name = "cpu"

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.run_on_cpu(layer, h, ids, weights)
