"""OLMoE (OlmoeForCausalLM): q/k RMSNorm over the whole projection (before the head split),
optional q/k/v clipping, `attention_bias`; every layer is a MoE layer."""
from __future__ import annotations

from typing import Any, ClassVar

from engine.config import ModelConfig
from engine.families.gqa import GQAFamily


class Olmoe(GQAFamily):
    name = "olmoe"
    architectures = ("OlmoeForCausalLM",)
    model_types = ("olmoe",)
    hf_keys: ClassVar[dict[str, tuple[str, Any]]] = {
        "norm_topk_prob": ("norm_topk_prob", False), "qkv_bias": ("attention_bias", False),
        "o_bias": ("attention_bias", False), "clip_qkv": ("clip_qkv", None)}
    fixed: ClassVar[dict[str, Any]] = {"qk_norm": "full"}

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        return {"olmoe-1b-7b": ModelConfig.of(
            cls.name, name="olmoe-1b-7b", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16,
            num_kv_heads=16, head_dim=128, n_experts=64, top_k=8, moe_intermediate_size=1024, intermediate_size=1024,
            max_position_embeddings=4096, norm_topk_prob=False, qk_norm="full", torch_dtype="bfloat16")}
