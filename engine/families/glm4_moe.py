"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): grouped-query attention with partial rotary
(`partial_rotary_factor`, half the head by default), optional per-head q/k RMSNorm
(`use_qk_norm`), biases on q/k/v (`attention_bias`; never on o_proj), and DeepSeek-V3's MoE
layers (engine.families.sigmoid_moe: sigmoid routing with a selection-only correction bias,
group-limited top-k, shared experts, dense first layers; the MTP layers ignored).

Presets (seeded random weights, bf16; values from each model's Hugging Face config.json,
docs/engines.md, "Model families and presets"): glm-4.5, glm-4.5-air; tiny-glm for tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from engine.blocks.rope import Rope
from engine.config import ModelConfig
from engine.families.gqa import GQAConfig, GQAFamily
from engine.families.sigmoid_moe import ROUTING_KEYS, SigmoidMoEFamily, SigmoidRouting


@dataclass(frozen=True)
class Glm4MoeConfig(GQAConfig, SigmoidRouting):
    partial_rotary_factor: float = 0.5


class Glm4Moe(SigmoidMoEFamily, GQAFamily):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    Config = Glm4MoeConfig
    expert_keys = ("n_routed_experts", "moe_intermediate_size")
    hf_keys: ClassVar[dict[str, tuple[str, Any]]] = {
        **ROUTING_KEYS, "norm_topk_prob": ("norm_topk_prob", True), "qkv_bias": ("attention_bias", False),
        "partial_rotary_factor": ("partial_rotary_factor", 0.5), "qk_norm": ("qk_norm", "none")}
    dense_layers_default = 1                       # transformers' Glm4MoeConfig default

    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        cls.check_hf(d, name)
        rope = d.get("rope_parameters") or {}
        return super().parse({**d, "qk_norm": "head" if d.get("use_qk_norm") else "none",
                              "partial_rotary_factor": rope.get("partial_rotary_factor",
                                                                d.get("partial_rotary_factor", 0.5))}, name)

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        out = {**super().hf_config(cfg), **cls.routing_hf_config(cfg), "use_qk_norm": cfg.qk_norm == "head"}
        del out["qk_norm"]
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
        return out

    @classmethod
    def rope(cls, cfg: ModelConfig) -> Rope:
        a = cfg.arch
        return Rope(int(a.head_dim * a.partial_rotary_factor), a.rope_theta, a.rope_scaling_factor)

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        # zai-org/GLM-4.5 config.json; GLM-4.5-Air differs where it says
        glm45 = dict(vocab_size=151552, hidden_size=5120, num_layers=92, num_heads=96, num_kv_heads=8, head_dim=128,
                     partial_rotary_factor=0.5, n_experts=160, top_k=8, moe_intermediate_size=1536,
                     intermediate_size=12288, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, qk_norm="head", qkv_bias=True, max_position_embeddings=131072,
                     rope_theta=1e6, rms_norm_eps=1e-5, num_mtp_layers=1, torch_dtype="bfloat16")
        air = {**glm45, "hidden_size": 4096, "num_layers": 46, "n_experts": 128, "moe_intermediate_size": 1408,
               "intermediate_size": 10944, "qk_norm": "none", "routed_scaling_factor": 1.0}

        def of(name: str, moe_from: int, fields: dict[str, Any]) -> ModelConfig:
            return ModelConfig.of(cls.name, name=name, moe_layers=tuple(range(moe_from, fields["num_layers"])), **fields)

        return {
            "glm-4.5": of("glm-4.5", 3, glm45),
            "glm-4.5-air": of("glm-4.5-air", 1, air),
            # CI-sized: q/k norm, biases, partial rotary, 2 of 4 groups, one dense layer, a shared expert
            "tiny-glm": of("tiny-glm", 1, {**glm45, "vocab_size": 512, "hidden_size": 64, "num_layers": 4,
                                            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "n_experts": 8,
                                            "top_k": 2, "moe_intermediate_size": 64, "intermediate_size": 128,
                                            "n_group": 4, "topk_group": 2, "max_position_embeddings": 8192,
                                            "torch_dtype": "float32"}),
        }
