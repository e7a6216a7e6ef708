"""`resident`: every expert lives on the device; nothing moves after load."""
from __future__ import annotations

from typing import Any

import torch

from engine.config import ModelConfig
from engine.placements.base import Placement


class Resident(Placement):
    name = "resident"

    def expert_on_device(self, layer: int) -> bool:
        return True

    @classmethod
    def device_expert_bytes(cls, cfg: ModelConfig, expert_bytes: int, capacity: int | None,
                            options: dict[str, Any]) -> int:
        return cfg.n_moe_layers * cfg.n_experts * expert_bytes

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.run_resident(layer, h, ids, weights)
