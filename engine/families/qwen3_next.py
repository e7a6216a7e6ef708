"""Qwen3-Next (Qwen3NextForCausalLM; Qwen3-Coder-Next has its shape) and the Qwen3.5-MoE text
model (Qwen3_5MoeForCausalLM): a hybrid layer stack.

`layer_types` mixes linear-attention layers -- gated DeltaNet with a short causal conv, a fixed
recurrent state per sequence (engine.blocks.deltanet) -- with full-attention layers -- output
gate, zero-centred `1 + w` per-head q/k norms, partial rotary (engine.blocks.gated_attention);
the published models put three linear layers before each full one (`full_attention_interval` 4).
Every MoE layer routes softmax top-k over many small SwiGLU experts (512, 10 per token) beside
a sigmoid-gated shared expert; `mlp_only_layers` / `decoder_sparse_step` make dense layers. All
hidden-size norms are `1 + w` in fp32. Qwen3.5-MoE's text stack is the same but for the
DeltaNet's input projections (separate `in_proj_qkv/z/b/a` instead of the fused, per-key-head
grouped `in_proj_qkvz` / `in_proj_ba`) and having no dense layers; its multimodal rope
(`mrope_section`) reduces to plain rope for text, where every section has the same position.

The published checkpoints' multi-token-prediction module (`mtp.*`) is not read (`skipped`).

The planner counts the linear layers' state as a fixed per-sequence term (conv inputs + the
delta-rule state, whatever the context) and KV per token only for the full layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from engine.blocks.attention import AttentionBlock
from engine.blocks.base import Block
from engine.blocks.decoder import DecoderLayer
from engine.blocks.deltanet import GatedDeltaNet
from engine.blocks.experts import SwiGLUExperts
from engine.blocks.gated_attention import GatedAttention
from engine.blocks.norms import RMSNorm
from engine.blocks.rope import Rope
from engine.blocks.routers import SoftmaxTopK
from engine.config import ModelConfig, UnsupportedModelError
from engine.families.base import Family, require_multiple, require_supported, rope_from_hf
from engine.families.gqa import SparseStepFamily, gated_shared_expert
from engine.layers import ACT

LAYER_TYPES = ("linear_attention", "full_attention")
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}   # transformers' remap


@dataclass(frozen=True)
class Qwen3NextConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]                  # per layer: linear_attention | full_attention
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    intermediate_size: int = 0                    # dense (mlp_only) layers
    shared_expert_intermediate_size: int = 0      # the sigmoid-gated shared expert (0 = none)
    norm_topk_prob: bool = True
    attention_bias: bool = False

    def __post_init__(self) -> None:
        require_supported("layer_types", self.layer_types, LAYER_TYPES)
        require_supported("hidden_act", (self.hidden_act,), tuple(ACT))
        require_multiple("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        require_multiple("linear_num_value_heads", self.linear_num_value_heads, "linear_num_key_heads",
                         self.linear_num_key_heads)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def hybrid_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types` from config.json, or three linear layers per full one (`full_attention_interval`)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        every = d.get("full_attention_interval", 4)
        return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n))
    if len(types) < n:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
    return tuple(LEGACY_LAYER_TYPES.get(t, t) for t in types[:n])


class Qwen3Next(Family):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    Config = Qwen3NextConfig
    projections: ClassVar[str] = "qkvz"           # the DeltaNet's input projections (engine.blocks.deltanet)

    # --- config.json --------------------------------------------------------------------
    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        theta, factor = rope_from_hf(d)
        if factor != 1.0:
            raise UnsupportedModelError(f"{cls.name}: rope scaling is not supported (factor {factor})")
        rope = d.get("rope_parameters") or {}
        H = d["num_attention_heads"]
        own = dict(num_heads=H, num_kv_heads=d.get("num_key_value_heads") or H,
                   head_dim=d.get("head_dim") or d["hidden_size"] // H, layer_types=hybrid_layer_types(d),
                   partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
                   rope_theta=theta, rms_norm_eps=d.get("rms_norm_eps", 1e-6), hidden_act=d.get("hidden_act", "silu"),
                   intermediate_size=d.get("intermediate_size", 0),
                   shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0),
                   norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                   attention_bias=bool(d.get("attention_bias", False)),
                   **{f: d[f] for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim", "linear_conv_kernel_dim") if f in d})
        common = cls.hf_common(d, moe_intermediate_size=d["moe_intermediate_size"],
                               moe_layers=cls.moe_layers(d, d["num_hidden_layers"]))
        return ModelConfig(family=cls.name, arch=Qwen3NextConfig(**own), name=name, **common)

    @classmethod
    def moe_layers(cls, d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
        return SparseStepFamily.moe_layers(d, n_layers)

    @classmethod
    def skipped(cls, cfg: ModelConfig) -> tuple[str, ...]:
        """The multi-token-prediction module too (`mtp.*`, published beside the layers): generation
        is next-token decoding, as transformers', which skips it the same way."""
        return (*super().skipped(cfg), r"^mtp\.")

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        a = cfg.arch
        return {**cls.hf_common_config(cfg), "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
                "head_dim": a.head_dim, "layer_types": list(a.layer_types[:cfg.num_layers]),
                "linear_num_key_heads": a.linear_num_key_heads, "linear_num_value_heads": a.linear_num_value_heads,
                "linear_key_head_dim": a.linear_key_head_dim, "linear_value_head_dim": a.linear_value_head_dim,
                "linear_conv_kernel_dim": a.linear_conv_kernel_dim, "partial_rotary_factor": a.partial_rotary_factor,
                "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                                    "partial_rotary_factor": a.partial_rotary_factor},
                "rms_norm_eps": a.rms_norm_eps, "hidden_act": a.hidden_act, "intermediate_size": a.intermediate_size,
                "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
                "shared_expert_intermediate_size": a.shared_expert_intermediate_size,
                "norm_topk_prob": a.norm_topk_prob, "attention_bias": a.attention_bias,
                "mlp_only_layers": [l for l in range(cfg.num_layers) if not cfg.is_moe_layer(l)],
                "decoder_sparse_step": 1}

    # --- blocks -------------------------------------------------------------------------------
    @classmethod
    def norm(cls, cfg: ModelConfig, name: str) -> RMSNorm:
        return RMSNorm(name, cfg.hidden_size, cfg.arch.rms_norm_eps, offset=1.0)

    @classmethod
    def layer(cls, cfg: ModelConfig, i: int) -> DecoderLayer:
        return cls.pre_norm_layer(cfg, i, cls.attention(cfg, i), cls.mlp(cfg, i))

    @classmethod
    def attention(cls, cfg: ModelConfig, i: int) -> AttentionBlock:
        a, p = cfg.arch, f"model.layers.{i}."
        if a.layer_types[i] == "linear_attention":
            return GatedDeltaNet(i, p + "linear_attn.", cfg.hidden_size, a.linear_num_key_heads,
                                 a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim,
                                 a.linear_conv_kernel_dim, a.rms_norm_eps, a.hidden_act, cls.projections)
        return GatedAttention(i, p + "self_attn.", cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                              Rope(a.rotary_dim, a.rope_theta), a.rms_norm_eps, qkv_bias=a.attention_bias,
                              o_bias=a.attention_bias)

    @classmethod
    def router(cls, cfg: ModelConfig, i: int) -> SoftmaxTopK:
        return SoftmaxTopK(f"model.layers.{i}.mlp.gate.weight", cfg.hidden_size, cfg.n_experts, cfg.top_k,
                           cfg.arch.norm_topk_prob, False)

    @classmethod
    def beside(cls, cfg: ModelConfig, i: int) -> tuple[Block, ...]:
        return gated_shared_expert(cfg, i)

    @classmethod
    def experts(cls, cfg: ModelConfig) -> SwiGLUExperts:
        return SwiGLUExperts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.arch.hidden_act, "model.layers.{layer}.mlp")

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        return {
            # CI-sized: three linear-attention layers, then a full one
            "tiny-qwen3-next": ModelConfig.of(
                cls.name, name="tiny-qwen3-next", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=16, layer_types=("linear_attention",) * 3 + ("full_attention",),
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                n_experts=8, top_k=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                max_position_embeddings=8192, rope_theta=1e7),
            # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (Qwen3-Coder-Next: the same shape); every layer MoE
            "qwen3-next-80b-a3b": ModelConfig.of(
                cls.name, name="qwen3-next-80b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=16,
                num_kv_heads=2, head_dim=256, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 12,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25, n_experts=512,
                top_k=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
                max_position_embeddings=262144, rope_theta=1e7, rms_norm_eps=1e-6, torch_dtype="bfloat16"),
        }


class Qwen35Moe(Qwen3Next):
    """Qwen3.5-MoE's text model: Qwen3-Next's stack with separate DeltaNet projections, every layer MoE."""

    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForCausalLM",)
    model_types = ("qwen3_5_moe_text",)
    projections = "split"

    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(f"{cls.name}: transformers' Qwen3.5-MoE makes every layer MoE; "
                                        f"got mlp_only_layers={d.get('mlp_only_layers')}")
        return super().parse({**d, "norm_topk_prob": True}, name)      # its router always renormalises

    @classmethod
    def moe_layers(cls, d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
        return tuple(range(n_layers))

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        out = super().hf_config(cfg)
        for key in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "intermediate_size"):
            out.pop(key)
        return out

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        return {}
