"""Mixtral (MixtralForCausalLM): the worked example of a family (engine/families/README.md).

Grouped-query attention with rope, an optional sliding-window mask, a softmax top-k router
whose weights stay in fp32 and SwiGLU experts stored per expert as w1 (gate), w3 (up) and
w2 (down) under `block_sparse_moe`; every layer is a MoE layer.
"""
from __future__ import annotations

from typing import Any, ClassVar

from engine.config import ModelConfig
from engine.families.gqa import GQAFamily


class Mixtral(GQAFamily):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    moe_prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    expert_keys = ("num_local_experts", "intermediate_size")       # config.json keys of the experts
    router_keeps_fp32 = True                                        # transformers' Mixtral keeps fp32 weights
    hf_keys: ClassVar[dict[str, tuple[str, Any]]] = {"sliding_window": ("sliding_window", None)}
    fixed: ClassVar[dict[str, Any]] = {"norm_topk_prob": True}      # Mixtral always renormalises its top-k

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        return {
            # the embedded default: small enough for CI, large enough that caching matters
            "tiny-mixtral": ModelConfig.of(
                cls.name, name="tiny-mixtral", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=16, n_experts=8, top_k=2, moe_intermediate_size=128, intermediate_size=128,
                max_position_embeddings=8192, rope_theta=1e6),
            "mixtral-8x7b": ModelConfig.of(
                cls.name, name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, n_experts=8, top_k=2, moe_intermediate_size=14336,
                intermediate_size=14336, max_position_embeddings=32768, rope_theta=1e6, torch_dtype="bfloat16"),
        }
