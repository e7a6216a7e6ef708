"""Routers of the second wave that differ from SoftmaxTopK in what they select on or scale.

Owns:
- `TopKThenSoftmax` (GPT-OSS): a biased linear, top-k on the raw logits, softmax over the k
  chosen logits only (in the activation dtype, as transformers' GptOssTopKRouter).
- `ScaledInputRouter` (Gemma 4): the input RMS-normed without a weight, times a learned
  per-channel `scale` and hidden^-1/2, then a linear, an fp32 softmax over every expert, top-k,
  renormalised, and each weight multiplied by its expert's learned `per_expert_scale` (weights
  stay fp32, as transformers' Gemma4TextRouter returns them).
Does not own: the Router interface or SoftmaxTopK (engine.blocks.routers), what is done with the
routing (engine.blocks.mlp.MoEBlock).

Dimension legend: N=rows, D=hidden, E=experts, k=top-k.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.base import TensorSpec
from engine.blocks.norms import RMSNorm
from engine.blocks.routers import Router
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


class TopKThenSoftmax(Router):
    weights_fp32 = False        # the softmax over the chosen logits runs in their (activation) dtype

    def __init__(self, prefix: str, hidden: int, n_experts: int, top_k: int) -> None:
        """prefix: e.g. "model.layers.0.mlp.router." (tensors weight [E, D], bias [E])."""
        super().__init__(hidden, n_experts, top_k)
        self.prefix = prefix

    def tensors(self) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(self.prefix + "weight", (self.n_experts, self.hidden), "router"),
                "bias": TensorSpec(self.prefix + "bias", (self.n_experts,))}

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(h, self.w["weight"], self.w["bias"])                      # [N, E]
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)                       # [N, k]
        return top_i, torch.softmax(top_v, dim=1, dtype=top_v.dtype)


class ScaledInputRouter(Router):
    def __init__(self, prefix: str, hidden: int, n_experts: int, top_k: int, norm: RMSNorm) -> None:
        """prefix: e.g. "model.layers.0.router." (tensors proj.weight [E, D], scale [D],
        per_expert_scale [E]); norm: the family's weightless RMSNorm over D."""
        super().__init__(hidden, n_experts, top_k)
        self.prefix, self.norm = prefix, norm

    def tensors(self) -> dict[str, TensorSpec]:
        p, D, E = self.prefix, self.hidden, self.n_experts
        return {"proj": TensorSpec(p + "proj.weight", (E, D), "router"), "scale": TensorSpec(p + "scale", (D,), "ones"),
                "per_expert_scale": TensorSpec(p + "per_expert_scale", (E,), "ones")}

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(h) * self.w["scale"] * self.hidden ** -0.5                    # [N, D]
        probs = torch.softmax(F.linear(x, self.w["proj"]), dim=-1, dtype=torch.float32)   # [N, E]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)                        # [N, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_i, top_w * self.w["per_expert_scale"][top_i]

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        return super().activation_bytes(rows, dtype_bytes) + 3 * rows * self.hidden * max(dtype_bytes, 4)
