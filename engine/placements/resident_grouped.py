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

Option `cuda_graph` (default false): decode steps of fixed shape (engine.static_decode) --
captured as a CUDA graph per key bucket on CUDA and replayed, run eagerly (the same kernels)
elsewhere; for models whose every layer keeps a full KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import static_decode
from engine.config import ModelConfig
from engine.lazy import lazy_module
from engine.placements.base import AllExpertsResident
from engine.registry import require_bool

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class ResidentGroupedOptions:
    cuda_graph: bool = False   # decode steps of fixed shape: a CUDA graph replayed on CUDA (engine.static_decode)

    def __post_init__(self) -> None:
        require_bool("cuda_graph", self.cuda_graph)


class ResidentGrouped(AllExpertsResident):
    name = "resident_grouped"
    Options = ResidentGroupedOptions

    @property
    def static_decode(self) -> bool:
        return self.options.cuda_graph

    @classmethod
    def check_model(cls, cfg: ModelConfig, options: dict[str, Any]) -> None:
        if cls.parse_options(options).cuda_graph:
            static_decode.check_model(cfg.architecture())

    @classmethod
    def invariant_cases(cls, cfg: ModelConfig) -> list[dict[str, Any]]:
        """Its default options where the model's expert layout has a grouped kernel on the CPU in
        fp32 (`setup` refuses it otherwise: MXFP4 experts have none). `cuda_graph=true` is checked
        against the eager engine by tests/engine/test_static_decode.py."""
        return [{}] if cfg.architecture().experts.grouped_supported(torch.float32, torch.device("cpu")) else []

    def setup(self) -> None:
        if self.options.cuda_graph:
            static_decode.check_model(self.ctx.cfg.architecture())
        store, device = self.ctx.store, self.ctx.device.torch_device
        if not store.layout.grouped_supported(store.dtype, device):
            raise ValueError(f"placement 'resident_grouped' needs a grouped expert kernel; "
                             f"{type(store.layout).__name__} at {store.dtype} on {device.type} has none "
                             "(SwiGLU experts: any float dtype on cpu, bfloat16 on cuda); use 'resident'")

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.combine_grouped(layer, h, ids, weights, self.ctx.store.rows[layer])
