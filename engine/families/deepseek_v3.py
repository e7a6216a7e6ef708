"""DeepSeek-V3 (DeepseekV3ForCausalLM) and the models of its architecture: Kimi-K2, Moonlight.

Multi-head latent attention (engine.blocks.mla: queries through `q_lora_rank` or a plain
q_proj; a compressed KV latent of `kv_lora_rank` plus a decoupled `qk_rope_head_dim` rope key,
which is all a session keeps), YaRN rope (`rope_parameters` rope_type yarn; the softmax scale
corrected by mscale(factor, mscale_all_dim)^2 as transformers does), rope interleaved by default
(`rope_interleave`); DeepSeek-V3's MoE layers (engine.families.sigmoid_moe: sigmoid routing with
a selection-only correction bias, group-limited top-k, shared experts, dense first layers);
the MTP layers ignored. Reads the current (`rope_parameters`) and the Hub's older config.json
form (`rope_theta` + `rope_scaling`, `scoring_func`/`topk_method`, which must be sigmoid/noaux_tc).

Presets (seeded random weights, bf16; values from each model's Hugging Face config.json,
docs/engines.md, "Model families and presets"): deepseek-v3, kimi-k2, moonlight-16b-a3b; tiny-deepseek and
tiny-moonlight for tests and the context-pressure benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.blocks.decoder import DecoderLayer
from engine.blocks.mla import MLA_KERNELS, MLAAttention
from engine.blocks.norms import RMSNorm
from engine.blocks.rope import Rope, Yarn, yarn_mscale
from engine.config import ModelConfig, UnsupportedModelError
from engine.families.sigmoid_moe import ROUTING_KEYS, SigmoidMoEFamily, SigmoidRouting
from engine.layers import ACT

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class DeepseekV3Config(SigmoidRouting):
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None        # None: a plain q_proj
    intermediate_size: int = 0            # the dense first layers
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    norm_topk_prob: bool = True
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    yarn_factor: float = 1.0              # rope_type yarn (1.0: no rope scaling)
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    mla_kernel: str = "absorbed"          # absorbed | expanded (engine.blocks.mla; not a config.json key)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACT:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} not supported; supported: {tuple(ACT)}")
        if self.mla_kernel not in MLA_KERNELS:
            raise ValueError(f"mla_kernel must be one of {MLA_KERNELS}, got {self.mla_kernel!r}")

    @property
    def yarn(self) -> bool:
        return self.yarn_factor != 1.0


def rope_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the yarn fields from `rope_parameters` (current) or `rope_theta` + `rope_scaling` (older Hub)."""
    params = dict(d.get("rope_parameters") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or params
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "yarn":
        raise UnsupportedModelError(f"deepseek_v3: rope scaling type {kind!r} is not supported; supported: default, yarn")
    unknown = sorted(set(scaling) - {*YARN_KEYS, "rope_type", "type", "rope_theta"})
    if unknown:
        raise UnsupportedModelError(f"deepseek_v3: yarn rope parameter(s) {unknown} are not supported; "
                                    f"supported: {list(YARN_KEYS)}")
    original = scaling.get("original_max_position_embeddings") or 4096
    factor = scaling.get("factor") or d.get("max_position_embeddings", original) / original   # transformers' fallback
    opt = {k: float(scaling[k]) if scaling.get(k) is not None else None for k in ("mscale", "mscale_all_dim")}
    return {"rope_theta": float(theta), "yarn_factor": float(factor), "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(scaling.get("beta_fast") or 32), "yarn_beta_slow": float(scaling.get("beta_slow") or 1),
            "yarn_mscale": opt["mscale"], "yarn_mscale_all_dim": opt["mscale_all_dim"]}


class DeepseekV3(SigmoidMoEFamily):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3", "kimi_k2")
    Config = DeepseekV3Config
    dense_layers_default = 3                       # transformers' DeepseekV3Config default

    # --- config.json --------------------------------------------------------------------
    @classmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        cls.check_hf(d, name)
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if key in d and d[key] != want:
                raise UnsupportedModelError(f"deepseek_v3: {key}={d[key]!r} is not supported; transformers' "
                                            f"DeepseekV3ForCausalLM (and this engine) run {key}={want!r}")
        H = d["num_attention_heads"]
        if d.get("num_key_value_heads") not in (None, H):
            raise UnsupportedModelError(f"deepseek_v3: num_key_value_heads={d['num_key_value_heads']} differs from "
                                        f"num_attention_heads={H}; multi-head latent attention expands the latent to "
                                        "every head")
        own = dict(num_heads=H, q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
                   qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                   v_head_dim=d["v_head_dim"], intermediate_size=d.get("intermediate_size", 0),
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), hidden_act=d.get("hidden_act", "silu"),
                   norm_topk_prob=bool(d.get("norm_topk_prob", True)), attention_bias=bool(d.get("attention_bias", False)),
                   rope_interleave=bool(d.get("rope_interleave", True)), **rope_from_hf(d),
                   **{f: d.get(key, default) for f, (key, default) in ROUTING_KEYS.items()})
        common = cls.hf_common(d, moe_intermediate_size=d["moe_intermediate_size"],
                               moe_layers=cls.moe_layers(d, d["num_hidden_layers"]))
        return ModelConfig(family=cls.name, arch=DeepseekV3Config(**own), name=name, **common)

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        a = cfg.arch
        rope: dict[str, Any] = {"rope_theta": a.rope_theta, "rope_type": "default"}
        if a.yarn:
            rope = {"rope_theta": a.rope_theta, "rope_type": "yarn", "factor": a.yarn_factor,
                    "original_max_position_embeddings": a.yarn_original_max_position_embeddings,
                    "beta_fast": a.yarn_beta_fast, "beta_slow": a.yarn_beta_slow,
                    **{k: getattr(a, f"yarn_{k}") for k in ("mscale", "mscale_all_dim") if getattr(a, f"yarn_{k}") is not None}}
        return {**cls.hf_common_config(cfg), "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_heads,
                "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
                "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
                "intermediate_size": a.intermediate_size, "rms_norm_eps": a.rms_norm_eps, "hidden_act": a.hidden_act,
                "attention_bias": a.attention_bias, "rope_interleave": a.rope_interleave, "rope_parameters": rope,
                **cls.routing_hf_config(cfg)}

    # --- blocks -------------------------------------------------------------------------------
    @classmethod
    def norm(cls, cfg: ModelConfig, name: str) -> RMSNorm:
        return RMSNorm(name, cfg.hidden_size, cfg.arch.rms_norm_eps)

    @classmethod
    def rope(cls, cfg: ModelConfig) -> Rope:
        a = cfg.arch
        if not a.yarn:
            return Rope(a.qk_rope_head_dim, a.rope_theta)
        return Yarn(a.qk_rope_head_dim, a.rope_theta, factor=a.yarn_factor,
                    original_max_position_embeddings=a.yarn_original_max_position_embeddings,
                    beta_fast=a.yarn_beta_fast, beta_slow=a.yarn_beta_slow, mscale=a.yarn_mscale,
                    mscale_all_dim=a.yarn_mscale_all_dim)

    @classmethod
    def softmax_scale(cls, cfg: ModelConfig) -> float:
        """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
        a = cfg.arch
        scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
        if a.yarn and a.yarn_mscale_all_dim:
            scale = scale * yarn_mscale(a.yarn_factor, a.yarn_mscale_all_dim) ** 2
        return scale

    @classmethod
    def layer(cls, cfg: ModelConfig, i: int) -> DecoderLayer:
        a, p = cfg.arch, f"model.layers.{i}."
        attn = MLAAttention(i, p + "self_attn.", cfg.hidden_size, a.num_heads, a.q_lora_rank, a.kv_lora_rank,
                            a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, cls.rope(cfg), cls.softmax_scale(cfg),
                            interleave=a.rope_interleave, bias=a.attention_bias, kernel=a.mla_kernel)
        return cls.pre_norm_layer(cfg, i, attn, cls.mlp(cfg, i))

    # --- presets ---------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        # DeepSeek-V3's dims, shared with Kimi-K2 (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct config.json)
        v3_dims = dict(hidden_size=7168, num_layers=61, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128, top_k=8, moe_intermediate_size=2048, intermediate_size=18432,
                       n_shared_experts=1, norm_topk_prob=True, rms_norm_eps=1e-6, num_mtp_layers=1,
                       yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                       yarn_mscale=1.0, yarn_mscale_all_dim=1.0, torch_dtype="bfloat16")

        def of(name: str, moe_from: int, **fields: Any) -> ModelConfig:
            n = fields.get("num_layers", v3_dims["num_layers"])
            return ModelConfig.of(cls.name, name=name, moe_layers=tuple(range(moe_from, n)), **fields)

        return {
            "deepseek-v3": of("deepseek-v3", 3, **v3_dims, vocab_size=129280, num_heads=128, n_experts=256, n_group=8,
                              topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=163840,
                              rope_theta=10000.0, yarn_factor=40.0, weight_format="fp8"),   # published block-scaled FP8
            "kimi-k2": of("kimi-k2", 1, **v3_dims, vocab_size=163840, num_heads=64, n_experts=384, n_group=1,
                          topk_group=1, routed_scaling_factor=2.827, max_position_embeddings=131072,
                          rope_theta=50000.0, yarn_factor=32.0, weight_format="fp8"),
            # moonshotai/Moonlight-16B-A3B config.json: no q bottleneck, no rope scaling
            "moonlight-16b-a3b": of(
                "moonlight-16b-a3b", 1, vocab_size=163840, hidden_size=2048, num_layers=27, num_heads=16,
                q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_experts=64, top_k=6, moe_intermediate_size=1408, intermediate_size=11264, n_shared_experts=2,
                n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
                max_position_embeddings=8192, rope_theta=50000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16"),
            # CI-sized: a q bottleneck, 2 of 4 groups, YaRN, one dense layer, a shared expert
            "tiny-deepseek": of(
                "tiny-deepseek", 1, vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, q_lora_rank=32,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=8, top_k=2,
                moe_intermediate_size=64, intermediate_size=128, n_shared_experts=1, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, max_position_embeddings=8192, rope_theta=10000.0, yarn_factor=4.0,
                yarn_original_max_position_embeddings=2048, yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
            # Moonlight's proportions (heads x head dim = hidden, kv_lora_rank = hidden / 4, rope = nope / 2,
            # 2 shared experts, a dense first layer 8x an expert wide) at tiny-mixtral's expert scale (4 MoE
            # layers of 8 experts of 3 x 64 x 128, top-2): the MLA side of the context-pressure benchmark
            # (conf/experiment/context_pressure_mla.yaml)
            "tiny-moonlight": of(
                "tiny-moonlight", 1, vocab_size=512, hidden_size=64, num_layers=5, num_heads=4, q_lora_rank=None,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=8, top_k=2,
                moe_intermediate_size=128, intermediate_size=1024, n_shared_experts=2, n_group=1, topk_group=1,
                routed_scaling_factor=2.446, max_position_embeddings=8192, rope_theta=50000.0),
        }
