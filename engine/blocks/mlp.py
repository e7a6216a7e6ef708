"""MLP blocks: rows [N, D] -> [N, D] after a layer's second norm.

Owns: `DenseMLP` (gate/up/down SwiGLU-style: dense layers, shared experts, a dense MLP beside
the experts), `GatedMLP` (an MLP scaled by a sigmoid gate: Qwen2-MoE's and Qwen3-Next's shared
expert) and `MoEBlock` -- a router, the routed experts run through the model's placement
(`Pass.run_experts`), and MLPs beside them on the same rows added in order. Does not own: the
routed experts' weights or kernel (engine.blocks.experts, engine.cache, the placement).

    MoEBlock(3, SoftmaxTopK(...), beside=(GatedMLP(DenseMLP(...), "....shared_expert_gate.weight"),))

A layer that routes one input and runs the experts on another (Gemma 4 routes the residual
and runs the experts on a separately normed copy) calls `route` and `experts` itself.

Dimension legend: N=rows (B*T), D=hidden, I=intermediate, k=top-k.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.base import Block, Pass, TensorSpec, Transient
from engine.blocks.experts import ExpertLayout
from engine.blocks.routers import Router
from engine.layers import dense_mlp
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


class DenseMLP(Block):
    def __init__(self, prefix: str, hidden: int, intermediate: int, act: str) -> None:
        """prefix: e.g. "model.layers.1.mlp." (tensors gate_proj, up_proj, down_proj)."""
        super().__init__()
        self.prefix, self.D, self.I, self.act = prefix, hidden, intermediate, act

    def tensors(self) -> dict[str, TensorSpec]:
        m, D, I = self.prefix, self.D, self.I
        return {"gate": TensorSpec(m + "gate_proj.weight", (I, D)), "up": TensorSpec(m + "up_proj.weight", (I, D)),
                "down": TensorSpec(m + "down_proj.weight", (D, I))}

    def forward(self, h: torch.Tensor, p: Pass) -> torch.Tensor:
        return dense_mlp(h, self.w["gate"], self.w["up"], self.w["down"], self.act)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        return Transient(rows * (3 * self.I + self.D) * dtype_bytes)          # gate, up, act*up; output

    __call__ = forward


class GatedMLP(Block):
    """sigmoid(h @ gate^T) * mlp(h), the gate one scalar per row."""

    def __init__(self, mlp: DenseMLP, gate: str) -> None:
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def tensors(self) -> dict[str, TensorSpec]:
        return {"gate": TensorSpec(self.gate, (1, self.mlp.D))}

    def children(self) -> tuple[Block, ...]:
        return (self.mlp,)

    def forward(self, h: torch.Tensor, p: Pass) -> torch.Tensor:
        return torch.sigmoid(F.linear(h, self.w["gate"])) * self.mlp(h, p)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        return Transient(self.mlp.activation_bytes(rows, dtype_bytes).total + rows * self.mlp.D * dtype_bytes)

    __call__ = forward


class MoEBlock(Block):
    """Routed experts (through the placement) plus the MLPs beside them, summed in order."""

    def __init__(self, layer: int, router: Router, experts: ExpertLayout, beside: tuple[Block, ...] = ()) -> None:
        """experts: the routed experts' layout (their weights live in the expert store, not here)."""
        super().__init__()
        self.layer, self.router, self.layout, self.beside = layer, router, experts, beside

    def children(self) -> tuple[Block, ...]:
        return (self.router, *self.beside)

    def route(self, h: torch.Tensor, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        with p.span("router", layer=self.layer):
            return self.router.route(h)                                    # [N, k] each

    def experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: Pass) -> torch.Tensor:
        return p.run_experts(self.layer, h, ids, weights)                  # [N, D]

    def forward(self, h: torch.Tensor, p: Pass) -> torch.Tensor:
        out = self.experts(h, *self.route(h, p), p)
        for mlp in self.beside:
            out = out + mlp(h, p)
        return out

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        N, db, r = rows, dtype_bytes, self.router
        return Transient(held=N * r.hidden * db                             # the expert sum buffer
                         + N * r.top_k * (db + 4 + 8 + 4 * 8),              # top-k weights/ids, sort, rows/slots
                         peak=max(r.activation_bytes(N, db), self.layout.activation_bytes(N, db),  # one at a time
                                  *(m.activation_bytes(N, db).total for m in self.beside)))

    __call__ = forward
