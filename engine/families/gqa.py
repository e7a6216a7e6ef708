"""The first wave's shape: pre-norm layers of grouped-query attention and a softmax-routed
MoE MLP (or a dense one), SwiGLU experts -- Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Owns: `GQAConfig` (the fields these families add to ModelConfig), `GQAFamily` (parse and
write config.json through a table of directly mapped keys, build layers from GQAAttention,
SoftmaxTopK, SwiGLUExperts, DenseMLP and an optional gated shared expert) and
`SparseStepFamily` (Qwen's dense-layer pattern). A family of this shape is a subclass
naming its tensors and its config keys (engine/families/mixtral.py), overriding a hook --
`rope`, `router`, `attention`, `beside`, `mlp`, `moe_layers` -- where it differs.
Does not own: the blocks (engine.blocks) or any one family's choices (its module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from engine.blocks.attention import QK_NORMS, GQAAttention
from engine.blocks.base import Block
from engine.blocks.decoder import DecoderLayer
from engine.blocks.experts import SwiGLUExperts
from engine.blocks.mlp import DenseMLP, GatedMLP
from engine.blocks.norms import RMSNorm
from engine.blocks.rope import Rope
from engine.blocks.routers import Router, SoftmaxTopK
from engine.config import ModelConfig, UnsupportedModelError
from engine.families.base import Family, rope_from_hf
from engine.layers import ACT


@dataclass(frozen=True)
class GQAConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0       # dense MLP layers (Qwen mlp_only_layers / sparse step)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # "linear" rope scaling; 1.0 = none
    hidden_act: str = "silu"
    norm_topk_prob: bool = True
    qkv_bias: bool = False           # bias on q/k/v projections
    o_bias: bool = False             # bias on the output projection
    qk_norm: str = "none"            # none | head (Qwen3, per head) | full (OLMoE, whole projection)
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated shared expert (0 = none)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_act not in ACT:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} not supported; supported: {tuple(ACT)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")


class GQAFamily(Family):
    Config = GQAConfig
    moe_prefix: ClassVar[str] = "mlp"                                   # model.layers.{i}.<moe_prefix>.gate / experts
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    expert_keys: ClassVar[tuple[str, str]] = ("num_experts", "moe_intermediate_size")   # config.json keys
    router_keeps_fp32: ClassVar[bool] = False                           # routing weights stay fp32 (Mixtral)
    hf_keys: ClassVar[dict[str, tuple[str, Any]]] = {}                  # GQAConfig field -> (config.json key, default)
    fixed: ClassVar[dict[str, Any]] = {}                                # GQAConfig fields the family always sets

    # --- config.json --------------------------------------------------------------------
    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        D, H = d["hidden_size"], d["num_attention_heads"]
        inter = d.get("intermediate_size", 0)
        theta, factor = rope_from_hf(d)
        own = dict(num_heads=H, num_kv_heads=d.get("num_key_value_heads") or H, head_dim=d.get("head_dim") or D // H,
                   intermediate_size=inter, rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta,
                   rope_scaling_factor=factor, hidden_act=d.get("hidden_act", "silu"),
                   **{f: d.get(key, default) for f, (key, default) in cls.hf_keys.items()}, **cls.fixed)
        for f in ("norm_topk_prob", "qkv_bias", "o_bias"):
            if f in own:
                own[f] = bool(own[f])
        common = cls.hf_common(d, moe_intermediate_size=d.get("moe_intermediate_size") or inter,
                               moe_layers=cls.moe_layers(d, d["num_hidden_layers"]))
        return ModelConfig(family=cls.name, arch=cls.Config(**own), name=name, **common)

    @classmethod
    def moe_layers(cls, d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
        """Which layers config.json makes MoE layers (all, unless the family says otherwise)."""
        return tuple(range(n_layers))

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        n_key, size_key = cls.expert_keys
        return {**cls.hf_common_config(cfg), "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
                "hidden_act": cfg.hidden_act, "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
                n_key: cfg.n_experts, size_key: cfg.moe_intermediate_size,
                **{key: getattr(cfg, f) for f, (key, _) in cls.hf_keys.items()}}

    # --- blocks -------------------------------------------------------------------------------
    @classmethod
    def norm(cls, cfg: ModelConfig, name: str) -> RMSNorm:
        return RMSNorm(name, cfg.hidden_size, cfg.rms_norm_eps)

    @classmethod
    def layer(cls, cfg: ModelConfig, i: int) -> DecoderLayer:
        return cls.pre_norm_layer(cfg, i, cls.attention(cfg, i), cls.mlp(cfg, i))

    @classmethod
    def attention(cls, cfg: ModelConfig, i: int) -> GQAAttention:
        a = cfg.arch
        return GQAAttention(i, f"model.layers.{i}.self_attn.", cfg.hidden_size, a.num_heads, a.num_kv_heads,
                            a.head_dim, cls.rope(cfg), a.rms_norm_eps, qkv_bias=a.qkv_bias, o_bias=a.o_bias,
                            qk_norm=a.qk_norm, clip_qkv=a.clip_qkv, window=a.sliding_window)

    @classmethod
    def rope(cls, cfg: ModelConfig) -> Rope:
        """The rotary embedding (a family with partial rotary or another scaling overrides this)."""
        return Rope(cfg.arch.head_dim, cfg.arch.rope_theta, cfg.arch.rope_scaling_factor)

    @classmethod
    def router(cls, cfg: ModelConfig, i: int) -> Router:
        """MoE layer i's router (a family with another routing rule overrides this)."""
        return SoftmaxTopK(f"model.layers.{i}.{cls.moe_prefix}.gate.weight", cfg.hidden_size, cfg.n_experts,
                           cfg.top_k, cfg.arch.norm_topk_prob, cls.router_keeps_fp32)

    @classmethod
    def beside(cls, cfg: ModelConfig, i: int) -> tuple[Block, ...]:
        """MLPs beside the routed experts of MoE layer i: the gated shared expert, if any."""
        return gated_shared_expert(cfg, i, cls.moe_prefix)

    @classmethod
    def experts(cls, cfg: ModelConfig) -> SwiGLUExperts:
        return SwiGLUExperts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.arch.hidden_act,
                             "model.layers.{layer}." + cls.moe_prefix, cls.expert_names)


class SparseStepFamily(GQAFamily):
    """Qwen's layer pattern: MoE every `decoder_sparse_step` layers except `mlp_only_layers`;
    sliding-window attention refused (transformers' Qwen MoE models apply it to no layer we read)."""

    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(f"{cls.name}: use_sliding_window=true is not supported")
        return super().parse(d, name)

    @classmethod
    def moe_layers(cls, d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
        step = d.get("decoder_sparse_step", 1) or 1
        dense = set(d.get("mlp_only_layers") or [])
        return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        dense = [l for l in range(cfg.num_layers) if not cfg.is_moe_layer(l)]
        return {**super().hf_config(cfg), "mlp_only_layers": dense, "decoder_sparse_step": 1,
                "use_sliding_window": False}


def gated_shared_expert(cfg: ModelConfig, i: int, moe_prefix: str = "mlp") -> tuple[Block, ...]:
    """Qwen's shared expert beside layer i's routed experts: a dense MLP scaled by a sigmoid gate
    (`shared_expert` / `shared_expert_gate`), or none when `shared_expert_intermediate_size` is 0."""
    S = cfg.arch.shared_expert_intermediate_size
    if not S:
        return ()
    m = f"model.layers.{i}.{moe_prefix}."
    return (GatedMLP(DenseMLP(m + "shared_expert.", cfg.hidden_size, S, cfg.arch.hidden_act),
                     m + "shared_expert_gate.weight"),)
