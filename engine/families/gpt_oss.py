"""GPT-OSS (GptOssForCausalLM): OpenAI's open-weight MoE.

Grouped-query attention with biases on every projection, a learned sink logit per head
(engine.blocks.sinks), YaRN rope (`truncate: false`), and `layer_types` alternating a sliding
window (128 tokens: a bounded SlidingKV state) with full attention, starting with sliding. Its
router is a biased linear with the softmax over the top-k logits only; its experts a clamped
SwiGLU with biases (alpha 1.702, `swiglu_limit`), gate and up interleaved in the Hub's stacked
`gate_up_proj` (engine.blocks.clamped_experts). fp32-scaled RMSNorms; no shared expert, every
layer MoE.

The published checkpoints store the experts in MXFP4 (`*_blocks` uint8 + `*_scales` E8M0 per
32 values, `quantization_config.quant_method: mxfp4`); `expert_format` follows the checkpoint:
"mxfp4" keeps them packed (one uint8 buffer per expert, dequantised by the expert kernel, so
expert bytes in every counter and plan are the stored bytes), "dense" holds them in the model's
dtype (a dense checkpoint, or an MXFP4 one dequantised at load with
`model_overrides={"expert_format": "dense"}`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.blocks.decoder import DecoderLayer
from engine.blocks.clamped_experts import ClampedSwiGLUExperts, MXFP4Experts
from engine.blocks.mlp import MoEBlock
from engine.blocks.norms import RMSNorm
from engine.blocks.rope import Yarn
from engine.blocks.sinks import SinkAttention
from engine.blocks.topk_routers import TopKThenSoftmax
from engine.config import ModelConfig, UnsupportedModelError
from engine.families.base import Family, require_multiple, require_supported

LAYER_TYPES = ("sliding_attention", "full_attention")
EXPERT_FORMATS = ("dense", "mxfp4")
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}       # transformers' GptOssConfig when config.json has none
MXFP4_QUANTIZATION = {"quant_method": "mxfp4",                       # what the published config.json carries
                      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                 "model.embed_tokens", "lm_head"]}


@dataclass(frozen=True)
class GptOssConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]                 # per layer: sliding_attention | full_attention
    sliding_window: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    yarn_factor: float = 32.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = False
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    expert_format: str = "dense"                  # dense | mxfp4

    def __post_init__(self) -> None:
        require_supported("layer_types", self.layer_types, LAYER_TYPES)
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        require_multiple("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    Config = GptOssConfig

    # --- config.json --------------------------------------------------------------------
    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        n = d["num_hidden_layers"]
        types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or DEFAULT_ROPE
        kind = rope.get("rope_type", rope.get("type", "yarn"))
        if kind != "yarn":
            raise UnsupportedModelError(f"{cls.name}: rope_type {kind!r} is not supported; supported: yarn")
        if rope.get("attention_factor") is not None:
            raise UnsupportedModelError(f"{cls.name}: a given yarn attention_factor is not supported")
        quant = d.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "mxfp4":
            raise UnsupportedModelError(f"{cls.name}: quantization {quant.get('quant_method')!r} is not supported; "
                                        f"supported: mxfp4 (the published checkpoints)")
        H = d["num_attention_heads"]
        own = dict(num_heads=H, num_kv_heads=d.get("num_key_value_heads") or H,
                   head_dim=d.get("head_dim") or d["hidden_size"] // H, layer_types=tuple(types[:n]),
                   sliding_window=d.get("sliding_window") or 128, rms_norm_eps=d.get("rms_norm_eps", 1e-5),
                   rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 150000.0))),
                   yarn_factor=float(rope.get("factor", 32.0)),
                   yarn_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
                   yarn_beta_fast=float(rope.get("beta_fast", 32.0)), yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
                   yarn_truncate=bool(rope.get("truncate", True)), swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                   attention_bias=bool(d.get("attention_bias", True)), expert_format="mxfp4" if quant else "dense")
        common = cls.hf_common(d, moe_intermediate_size=d["intermediate_size"], moe_layers=tuple(range(n)))
        return ModelConfig(family=cls.name, arch=GptOssConfig(**own), name=name, **common)

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        a = cfg.arch
        out = {**cls.hf_common_config(cfg), "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
               "head_dim": a.head_dim, "layer_types": list(a.layer_types[:cfg.num_layers]),
               "sliding_window": a.sliding_window, "rms_norm_eps": a.rms_norm_eps,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": a.yarn_factor,
                                   "original_max_position_embeddings": a.yarn_original_max_position_embeddings,
                                   "beta_fast": a.yarn_beta_fast, "beta_slow": a.yarn_beta_slow,
                                   "truncate": a.yarn_truncate},
               "swiglu_limit": a.swiglu_limit, "attention_bias": a.attention_bias,
               "num_local_experts": cfg.n_experts, "intermediate_size": cfg.moe_intermediate_size}
        if a.expert_format == "mxfp4":
            out["quantization_config"] = dict(MXFP4_QUANTIZATION)
        return out

    # --- blocks -------------------------------------------------------------------------------
    @classmethod
    def norm(cls, cfg: ModelConfig, name: str) -> RMSNorm:
        return RMSNorm(name, cfg.hidden_size, cfg.arch.rms_norm_eps, weight_in_fp32=True)

    @classmethod
    def layer(cls, cfg: ModelConfig, i: int) -> DecoderLayer:
        a, p = cfg.arch, f"model.layers.{i}."
        rope = Yarn(a.head_dim, a.rope_theta, factor=a.yarn_factor,
                    original_max_position_embeddings=a.yarn_original_max_position_embeddings,
                    beta_fast=a.yarn_beta_fast, beta_slow=a.yarn_beta_slow, truncate=a.yarn_truncate)
        window = a.sliding_window if a.layer_types[i] == "sliding_attention" else None
        attention = SinkAttention(i, p + "self_attn.", cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, rope,
                                  a.rms_norm_eps, qkv_bias=a.attention_bias, o_bias=a.attention_bias, window=window)
        router = TopKThenSoftmax(p + "mlp.router.", cfg.hidden_size, cfg.n_experts, cfg.top_k)
        return cls.pre_norm_layer(cfg, i, attention, MoEBlock(i, router, cls.routed_experts(cfg)))

    @classmethod
    def experts(cls, cfg: ModelConfig) -> ClampedSwiGLUExperts:
        layout = MXFP4Experts if cfg.arch.expert_format == "mxfp4" else ClampedSwiGLUExperts
        return layout(cfg.hidden_size, cfg.moe_intermediate_size, cfg.arch.swiglu_limit)

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        alternating = lambda n: ("sliding_attention", "full_attention") * (n // 2)   # noqa: E731
        # openai/gpt-oss-20b and openai/gpt-oss-120b config.json: experts MXFP4 as published
        big = dict(vocab_size=201088, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64, top_k=4,
                   moe_intermediate_size=2880, sliding_window=128, max_position_embeddings=131072, rope_theta=150000.0,
                   yarn_factor=32.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
                   yarn_beta_slow=1.0, yarn_truncate=False, swiglu_limit=7.0, rms_norm_eps=1e-5, attention_bias=True,
                   expert_format="mxfp4", torch_dtype="bfloat16")
        return {
            # CI-sized, sliding window shorter than the test prompts; MXFP4 experts like the published ones
            "tiny-gpt-oss": ModelConfig.of(
                cls.name, name="tiny-gpt-oss", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=16, layer_types=alternating(4), sliding_window=8, n_experts=8, top_k=2,
                moe_intermediate_size=64, max_position_embeddings=8192, expert_format="mxfp4"),
            "gpt-oss-20b": ModelConfig.of(cls.name, name="gpt-oss-20b", num_layers=24, layer_types=alternating(24),
                                          n_experts=32, **big),
            "gpt-oss-120b": ModelConfig.of(cls.name, name="gpt-oss-120b", num_layers=36, layer_types=alternating(36),
                                           n_experts=128, **big),
        }
