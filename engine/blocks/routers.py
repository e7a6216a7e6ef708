"""Routers: which top-k experts each row goes to, with what weights.

Owns: the `Router` interface (`route(h) -> (ids, weights)`, also what the next_layer_gate
prefetcher applies to guess the next layer) and `SoftmaxTopK`, transformers' TopKRouter:
softmax in fp32, top-k, optional renormalisation, weights kept in fp32 (Mixtral) or cast back
(Qwen, OLMoE). Does not own: what happens to the routing (engine.blocks.mlp.MoEBlock hands
it to the model, which tells the hooks and the placement).

Routers to come subclass Router: sigmoid scores plus a correction bias with group-limited
top-k and a scaling factor (DeepSeek-V3, GLM-4.5), a biased linear with softmax over the top-k
(GPT-OSS), a normed and scaled input with per-expert scales (Gemma 4).

Dimension legend: N=rows, D=hidden, E=experts, k=top-k.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.blocks.base import Block, TensorSpec
from engine.layers import route


class Router(Block, ABC):
    def __init__(self, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.hidden, self.n_experts, self.top_k = hidden, n_experts, top_k

    @abstractmethod
    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, D] -> (expert ids [N, k] int64, weights [N, k])."""

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        """Transient bytes of `route` (logits and their fp32 softmax), top-k outputs apart."""
        return rows * self.n_experts * (dtype_bytes + 4)


class SoftmaxTopK(Router):
    def __init__(self, name: str, hidden: int, n_experts: int, top_k: int, norm_topk: bool,
                 keep_fp32_weights: bool) -> None:
        super().__init__(hidden, n_experts, top_k)
        self.name, self.norm_topk, self.keep_fp32 = name, norm_topk, keep_fp32_weights

    def tensors(self) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(self.name, (self.n_experts, self.hidden), "router")}

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, self.w["weight"], self.top_k, self.norm_topk, self.keep_fp32)
