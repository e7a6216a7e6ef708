"""Gemma 4's MoE text model (Gemma4ForCausalLM, `gemma4_text` with `enable_moe_block`).

Sliding-window layers (`sliding_window`, default rope at theta 1e4, 256-dim heads and
`num_key_value_heads`) interleave with global layers (the last layer always global: 512-dim heads
`global_head_dim`, `num_global_key_value_heads` with `attention_k_eq_v`, proportional rope at
theta 1e6 rotating a quarter of the head), in `layer_types` (default five sliding per global);
per-layer head shapes as transformers resolves them (`per_layer_config`, or the global keys).
Every layer runs a dense GELU MLP *and* a MoE block beside it, sandwich-normed
(engine.blocks.gemma4.Gemma4Layer; the dense MLP's weights count as non-expert weights); the
router normalises its input, scales it per channel and by hidden^-1/2, renormalises its top-k
and scales each weight per expert (engine.blocks.topk_routers.ScaledInputRouter); the experts
are fused gate/up GELU SwiGLUs stored stacked on the Hub. The embedding is scaled by sqrt(hidden)
and, where `hidden_size_per_layer_input` > 0, feeds every layer a per-layer input; the head is
tied and soft-capped (`final_logit_softcapping`). Norms are Gemma's `pow` form.

Refused with UnsupportedModelError: KV shared across layers (`num_kv_shared_layers` > 0; the
published MoE model has none), bidirectional attention over all tokens, a config without the MoE
block, rope types other than default/proportional, and the multimodal
Gemma4ForConditionalGeneration layout (its text tensors live under `model.language_model.`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.blocks.decoder import LMHead
from engine.blocks.experts import SwiGLUExperts
from engine.blocks.gemma4 import Gemma4Attention, Gemma4Embedding, Gemma4Layer, PerLayerInput
from engine.blocks.mlp import DenseMLP, MoEBlock
from engine.blocks.norms import PowRMSNorm
from engine.blocks.rope import Proportional, Rope
from engine.blocks.topk_routers import ScaledInputRouter
from engine.config import ModelConfig, UnsupportedModelError
from engine.families.base import Family, require_multiple, require_supported
from engine.layers import ACT

LAYER_TYPES = ("sliding_attention", "full_attention")
GLOBAL_ROPES = ("proportional", "default")
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}            # transformers' Gemma4TextConfig


@dataclass(frozen=True)
class Gemma4Config:
    num_heads: int
    num_kv_heads: int                          # sliding layers
    head_dim: int                              # sliding layers
    layer_types: tuple[str, ...]               # per layer: sliding_attention | full_attention
    global_head_dim: int = 512
    num_global_kv_heads: int = 2
    attention_k_eq_v: bool = False             # global layers: v is the k projection
    sliding_window: int = 512
    rope_theta: float = 10_000.0               # sliding layers (default rope)
    global_rope_theta: float = 1_000_000.0
    global_rope_type: str = "proportional"     # proportional | default
    global_partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 0                 # the dense MLP beside the experts
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0       # per-layer inputs (0: none)
    vocab_size_per_layer_input: int = 0
    attention_bias: bool = False

    def __post_init__(self) -> None:
        require_supported("layer_types", self.layer_types, LAYER_TYPES)
        require_supported("full_attention rope_type", (self.global_rope_type,), GLOBAL_ROPES)
        require_supported("hidden_activation", (self.hidden_act,), tuple(ACT))
        require_multiple("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        require_multiple("num_heads", self.num_heads, "num_global_key_value_heads", self.num_global_kv_heads)

    def shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of `layer`."""
        if self.layer_types[layer] == "full_attention":
            return self.num_global_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim


def _refuse(d: dict[str, Any]) -> None:
    if "text_config" in d:
        raise UnsupportedModelError("gemma4: the multimodal Gemma4ForConditionalGeneration layout (text tensors under "
                                    "model.language_model.) is not supported; load a Gemma4ForCausalLM text checkpoint")
    if d.get("num_kv_shared_layers", 0):
        raise UnsupportedModelError(f"gemma4: num_kv_shared_layers={d['num_kv_shared_layers']} (KV shared across "
                                    f"layers) is not supported; Gemma 4's MoE model shares none")
    if d.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("gemma4: use_bidirectional_attention='all' is not supported (causal decoding only)")
    if not d.get("enable_moe_block"):
        raise UnsupportedModelError("gemma4: enable_moe_block is false: a dense Gemma 4 has no routed experts")


def _global_shape(d: dict[str, Any], types: list[str]) -> tuple[int, int]:
    """(head dim, kv heads) of the global layers, as transformers' Gemma4TextConfig resolves them:
    `per_layer_config` when config.json has one, else `global_head_dim` (default 512) and, with
    `attention_k_eq_v`, `num_global_key_value_heads`."""
    kv = d.get("num_key_value_heads") or d["num_attention_heads"]
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        heads = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v", False) else None
        return d.get("global_head_dim", 512), heads or kv
    overrides = {int(k): v for k, v in per_layer.items()}
    shapes = set()
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        if set(o) - {"head_dim", "num_key_value_heads"} or (t == "sliding_attention" and o):
            raise UnsupportedModelError(f"gemma4: per_layer_config for layer {i} ({t}) overrides {sorted(o)}; "
                                        f"supported: head_dim and num_key_value_heads of the full_attention layers")
        if t == "full_attention":
            shapes.add((o.get("head_dim", d.get("head_dim", 256)), o.get("num_key_value_heads", kv)))
    if len(shapes) > 1:
        raise UnsupportedModelError(f"gemma4: full_attention layers of different shapes {sorted(shapes)} are not supported")
    return shapes.pop() if shapes else (d.get("head_dim", 256), kv)


class Gemma4(Family):
    name = "gemma4"
    architectures = ("Gemma4ForCausalLM",)
    model_types = ("gemma4_text",)
    Config = Gemma4Config

    # --- config.json --------------------------------------------------------------------
    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        _refuse(d)
        n = d["num_hidden_layers"]
        types = list(d.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                              for i in range(n)])[:n]
        types[-1] = "full_attention"                         # transformers forces the last layer global
        rope = d.get("rope_parameters") or DEFAULT_ROPE
        local, glob = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
        if local.get("rope_type", "default") != "default" or local.get("factor", 1.0) != 1.0 \
                or glob.get("factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"gemma4: rope_parameters {rope} not supported; supported: default rope on "
                                        f"sliding layers, default or proportional (unscaled) on full layers")
        head_dim, kv = _global_shape(d, types)
        H = d["num_attention_heads"]
        own = dict(num_heads=H, num_kv_heads=d.get("num_key_value_heads") or H, head_dim=d.get("head_dim", 256),
                   layer_types=tuple(types), global_head_dim=head_dim, num_global_kv_heads=kv,
                   attention_k_eq_v=bool(d.get("attention_k_eq_v", False)), sliding_window=d.get("sliding_window", 512),
                   rope_theta=float(local.get("rope_theta", 10_000.0)),
                   global_rope_theta=float(glob.get("rope_theta", 1_000_000.0)),
                   global_rope_type=glob.get("rope_type", "default"),
                   global_partial_rotary_factor=float(glob.get("partial_rotary_factor", 1.0)),
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), hidden_act=d.get("hidden_activation", "gelu_pytorch_tanh"),
                   intermediate_size=d["intermediate_size"], final_logit_softcapping=d.get("final_logit_softcapping"),
                   hidden_size_per_layer_input=d.get("hidden_size_per_layer_input", 256) or 0,
                   vocab_size_per_layer_input=d.get("vocab_size_per_layer_input", 262_144),
                   attention_bias=bool(d.get("attention_bias", False)))
        common = cls.hf_common({**d, "num_experts_per_tok": d["top_k_experts"],
                                "tie_word_embeddings": d.get("tie_word_embeddings", True)},
                               moe_intermediate_size=d["moe_intermediate_size"], moe_layers=tuple(range(n)))
        return ModelConfig(family=cls.name, arch=Gemma4Config(**own), name=name, **common)

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        a = cfg.arch
        types = list(a.layer_types[:cfg.num_layers])
        glob = {"rope_type": a.global_rope_type, "rope_theta": a.global_rope_theta}
        if a.global_rope_type == "proportional":
            glob["partial_rotary_factor"] = a.global_partial_rotary_factor
        return {**cls.hf_common_config(cfg), "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
                "head_dim": a.head_dim, "layer_types": types,
                "per_layer_config": {str(i): {"head_dim": a.global_head_dim, "num_key_value_heads": a.num_global_kv_heads}
                                     for i, t in enumerate(types) if t == "full_attention"},
                "attention_k_eq_v": a.attention_k_eq_v, "sliding_window": a.sliding_window,
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": a.rope_theta},
                                    "full_attention": glob},
                "rms_norm_eps": a.rms_norm_eps, "hidden_activation": a.hidden_act,
                "intermediate_size": a.intermediate_size, "final_logit_softcapping": a.final_logit_softcapping,
                "hidden_size_per_layer_input": a.hidden_size_per_layer_input,
                "vocab_size_per_layer_input": a.vocab_size_per_layer_input, "attention_bias": a.attention_bias,
                "enable_moe_block": True, "num_experts": cfg.n_experts, "top_k_experts": cfg.top_k,
                "moe_intermediate_size": cfg.moe_intermediate_size, "num_kv_shared_layers": 0}

    # --- blocks -------------------------------------------------------------------------------
    @classmethod
    def norm(cls, cfg: ModelConfig, name: str) -> PowRMSNorm:
        return PowRMSNorm(name, cfg.hidden_size, cfg.arch.rms_norm_eps)

    @classmethod
    def embedding(cls, cfg: ModelConfig) -> Gemma4Embedding:
        a = cfg.arch
        return Gemma4Embedding(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, a.hidden_size_per_layer_input,
                               a.vocab_size_per_layer_input, a.rms_norm_eps)

    @classmethod
    def head(cls, cfg: ModelConfig) -> LMHead:
        return LMHead(cls.norm(cfg, "model.norm.weight"), cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings,
                      softcap=cfg.arch.final_logit_softcapping)

    @classmethod
    def rope(cls, cfg: ModelConfig, i: int) -> Rope:
        a = cfg.arch
        if a.layer_types[i] == "sliding_attention":
            return Rope(a.head_dim, a.rope_theta)
        if a.global_rope_type == "proportional":
            return Proportional(a.global_head_dim, a.global_rope_theta, fraction=a.global_partial_rotary_factor)
        return Rope(a.global_head_dim, a.global_rope_theta)

    @classmethod
    def layer(cls, cfg: ModelConfig, i: int) -> Gemma4Layer:
        a, p, D = cfg.arch, f"model.layers.{i}.", cfg.hidden_size
        kv, hd = a.shape(i)
        sliding = a.layer_types[i] == "sliding_attention"
        attention = Gemma4Attention(i, p + "self_attn.", D, a.num_heads, kv, hd, cls.rope(cfg, i), a.rms_norm_eps,
                                    qkv_bias=a.attention_bias, o_bias=a.attention_bias,
                                    window=a.sliding_window if sliding else None, k_eq_v=a.attention_k_eq_v and not sliding)
        router = ScaledInputRouter(p + "router.", D, cfg.n_experts, cfg.top_k, PowRMSNorm(None, D, a.rms_norm_eps))
        per_layer = PerLayerInput(p, D, a.hidden_size_per_layer_input, cfg.num_layers, a.hidden_act,
                                  cls.norm(cfg, p + "post_per_layer_input_norm.weight")) \
            if a.hidden_size_per_layer_input else None
        return Gemma4Layer(i, p, attention, DenseMLP(p + "mlp.", D, a.intermediate_size, a.hidden_act),
                           MoEBlock(i, router, cls.routed_experts(cfg)), D, a.rms_norm_eps, per_layer)

    @classmethod
    def experts(cls, cfg: ModelConfig) -> SwiGLUExperts:
        return SwiGLUExperts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.arch.hidden_act, "model.layers.{layer}",
                             fused_on_hub=True)

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        five_to_one = lambda n: (("sliding_attention",) * 5 + ("full_attention",)) * (n // 6)   # noqa: E731
        return {
            # CI-sized: a 4-token sliding window, two global layers with their own head shape
            "tiny-gemma4": ModelConfig.of(
                cls.name, name="tiny-gemma4", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=16, layer_types=("sliding_attention", "full_attention") * 2,
                global_head_dim=32, num_global_kv_heads=1, attention_k_eq_v=True, sliding_window=8,
                intermediate_size=96, n_experts=8, top_k=2, moe_intermediate_size=64, final_logit_softcapping=30.0,
                max_position_embeddings=8192, tie_word_embeddings=True),
            # google/gemma-4-26B-A4B: text_config values as copied from its config.json by third parties
            # (engine/families/README.md: sources and which values are unconfirmed)
            "gemma-4-26b-a4b": ModelConfig.of(
                cls.name, name="gemma-4-26b-a4b", vocab_size=262144, hidden_size=2816, num_layers=30, num_heads=16,
                num_kv_heads=8, head_dim=256, layer_types=five_to_one(30), global_head_dim=512, num_global_kv_heads=2,
                attention_k_eq_v=True, sliding_window=1024, rope_theta=10_000.0, global_rope_theta=1_000_000.0,
                global_partial_rotary_factor=0.25, intermediate_size=2112, n_experts=128, top_k=8,
                moe_intermediate_size=704, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                max_position_embeddings=262144, tie_word_embeddings=True, torch_dtype="bfloat16"),
        }
