"""`resident_grouped`: every expert lives on the device, as in `resident`, and each MoE layer's
experts run as grouped GEMMs from routing kept on the device (`Placement.combine_grouped`), so a
forward pass reads nothing back to the host -- not even the one `.tolist()` per layer of the
expert loop -- and every tensor of the MoE block has a shape fixed by the batch and top-k (what a
CUDA-graph capture of that block needs).

Needs a layout with a grouped kernel at the model's dtype on its device (SwiGLU experts: any
float dtype on the CPU, bf16 on CUDA per torch's `F.grouped_mm`) and is refused otherwise. Same
output as `resident` (bitwise on the CPU: tests/engine/test_dispatch.py); written for CUDA but
unverified there (no GPU in this project's checks). Not the default: on the CPU the grouped GEMM
is a loop of mm, so it is no faster than `resident`, and it gives one expert span per layer
instead of one per expert.
"""
from __future__ import annotations

import torch

from engine.placements.base import AllExpertsResident


class ResidentGrouped(AllExpertsResident):
    name = "resident_grouped"

    def setup(self) -> None:
        store, device = self.ctx.store, self.ctx.device.torch_device
        if not store.layout.grouped_supported(store.dtype, device):
            raise ValueError(f"placement 'resident_grouped' needs a grouped expert kernel; "
                             f"{type(store.layout).__name__} at {store.dtype} on {device.type} has none "
                             "(SwiGLU experts: any float dtype on cpu, bfloat16 on cuda); use 'resident'")

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.combine_grouped(layer, h, ids, weights, self.ctx.store.rows[layer])
