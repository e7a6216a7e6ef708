"""Routers: which top-k experts each row goes to, with what weights.

Owns: the `Router` interface (`route(h) -> (ids, weights)`, also what the next_layer_gate
prefetcher applies to guess the next layer); `SoftmaxTopK`, transformers' TopKRouter:
softmax in fp32, top-k, optional renormalisation, weights kept in fp32 (Mixtral) or cast back
(Qwen, OLMoE); and `SigmoidGroupTopK`, DeepSeek-V3's (and GLM-4.5's) router: sigmoid scores
in fp32, a correction bias that chooses but never weighs, group-limited top-k, optional
renormalisation and a scaling factor. Does not own: what happens to the routing
(engine.blocks.mlp.MoEBlock hands it to the model, which tells the hooks and the placement).

Routers to come subclass Router: a biased linear with softmax over the top-k (GPT-OSS), a
normed and scaled input with per-expert scales (Gemma 4).

Dimension legend: N=rows, D=hidden, E=experts, k=top-k.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from engine.blocks.base import Block, TensorSpec
from engine.layers import route
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


ID_BYTES = 8                    # route()'s expert ids are int64


class Router(Block, ABC):
    weights_fp32: bool = True   # route()'s weights stay fp32 at any activation dtype (False: in the activation dtype)

    def __init__(self, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.hidden, self.n_experts, self.top_k = hidden, n_experts, top_k

    def slot_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one routed slot as `route` returns it when the model runs at `dtype_bytes`: its
        int64 expert id and its weight (what a CPU placement ships per row and slot)."""
        return ID_BYTES + (4 if self.weights_fp32 else dtype_bytes)

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
        self.weights_fp32 = keep_fp32_weights

    def tensors(self) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(self.name, (self.n_experts, self.hidden), "router")}

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, self.w["weight"], self.top_k, self.norm_topk, self.keep_fp32)


class SigmoidGroupTopK(Router):
    """transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter, op for op: scores = sigmoid(h @ W^T)
    in fp32; experts are chosen on scores + e_score_correction_bias (fp32), first the `topk_group`
    of `n_group` groups with the largest sum of their two best, then the top-k within them; the
    weights are the chosen experts' *unbiased* scores, renormalised (norm_topk) and multiplied by
    `scaling` (routed_scaling_factor), kept in fp32. The k slots are then put in descending weight
    (the routing-trace order, engine.trace; transformers leaves them unsorted: the expert sets and
    each expert's weight are bitwise its, and the expert sum never depends on slot order)."""

    def __init__(self, prefix: str, hidden: int, n_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk: bool, scaling: float) -> None:
        """prefix: the gate's, e.g. "model.layers.3.mlp.gate" (tensors weight, e_score_correction_bias)."""
        super().__init__(hidden, n_experts, top_k)
        if n_group < 1 or n_experts % n_group:
            raise ValueError(f"n_group must divide n_experts={n_experts}, got {n_group}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        per_group = n_experts // n_group
        if n_group > 1 and per_group < 2:
            raise ValueError(f"group-limited routing ranks groups by their two best experts: n_experts / n_group "
                             f"must be >= 2, got {n_experts} / {n_group}")
        if top_k > topk_group * per_group:
            raise ValueError(f"top_k={top_k} exceeds the {topk_group} group(s) x {per_group} experts it may choose from")
        self.prefix, self.n_group, self.topk_group = prefix, n_group, topk_group
        self.norm_topk, self.scaling = norm_topk, scaling

    def tensors(self) -> dict[str, TensorSpec]:
        p, E = self.prefix, self.n_experts
        return {"weight": TensorSpec(p + ".weight", (E, self.hidden), "fan_in"),
                "bias": TensorSpec(p + ".e_score_correction_bias", (E,), dtype="float32")}

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, E, G = h.shape[0], self.n_experts, self.n_group
        scores = F.linear(h.float(), self.w["weight"].float()).sigmoid()                 # [N, E] fp32
        choice = scores + self.w["bias"]                                                  # [N, E]: chooses only
        if self.topk_group < G:   # transformers also runs it when every group is kept, masking nothing
            group_scores = choice.view(N, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)       # [N, G]
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)         # [N, G]
            keep = group_mask.unsqueeze(-1).expand(N, G, E // G).reshape(N, E).bool()     # [N, E]
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]                  # [N, k]
        weights = scores.gather(1, ids)                                                  # [N, k] fp32
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights, order = (weights * self.scaling).sort(dim=-1, descending=True, stable=True)
        return ids.gather(1, order), weights

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        """h in fp32 (a copy unless fp32 already), logits/scores, the biased and masked choice
        scores (fp32), the group mask (bool)."""
        N, E = rows, self.n_experts
        return N * self.hidden * 4 * (dtype_bytes != 4) + 4 * N * E * 4 + N * E
