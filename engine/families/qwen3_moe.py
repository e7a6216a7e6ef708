"""Qwen3-MoE (Qwen3MoeForCausalLM): per-head q/k RMSNorm, `attention_bias` on every projection,
no shared expert, dense layers by `mlp_only_layers` / `decoder_sparse_step`."""
from __future__ import annotations

from typing import Any, ClassVar

from engine.config import ModelConfig
from engine.families.gqa import SparseStepFamily


class Qwen3Moe(SparseStepFamily):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    hf_keys: ClassVar[dict[str, tuple[str, Any]]] = {
        "norm_topk_prob": ("norm_topk_prob", False), "qkv_bias": ("attention_bias", False),
        "o_bias": ("attention_bias", False)}
    fixed: ClassVar[dict[str, Any]] = {"qk_norm": "head"}

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        return {"qwen3-30b-a3b": ModelConfig.of(
            cls.name, name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
            num_kv_heads=4, head_dim=128, n_experts=128, top_k=8, moe_intermediate_size=768, intermediate_size=6144,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, qk_norm="head",
            torch_dtype="bfloat16")}
