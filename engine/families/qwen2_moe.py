"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): q/k/v biases, a sigmoid-gated shared expert
beside the routed experts, dense layers by `mlp_only_layers` / `decoder_sparse_step`."""
from __future__ import annotations

from typing import Any, ClassVar

from engine.config import ModelConfig
from engine.families.gqa import SparseStepFamily


class Qwen2Moe(SparseStepFamily):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    hf_keys: ClassVar[dict[str, tuple[str, Any]]] = {
        "norm_topk_prob": ("norm_topk_prob", False), "qkv_bias": ("qkv_bias", True),
        "shared_expert_intermediate_size": ("shared_expert_intermediate_size", 0)}

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        return {"qwen1.5-moe-a2.7b": ModelConfig.of(
            cls.name, name="qwen1.5-moe-a2.7b", vocab_size=151936, hidden_size=2048, num_layers=24, num_heads=16,
            num_kv_heads=16, head_dim=128, n_experts=60, top_k=4, moe_intermediate_size=1408, intermediate_size=5632,
            max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=False, qkv_bias=True,
            shared_expert_intermediate_size=5632, torch_dtype="bfloat16")}
