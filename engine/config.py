"""Model shapes: one dataclass for every supported MoE family, read from a Hugging Face
`config.json` (current or older Hub form) or looked up in a preset table by exact name.

Owns: the numbers that define a model (sizes, family quirks) and their validation.
Does not own: weights (engine.checkpoint), memory planning (engine.planner).

    cfg = ModelConfig.from_hf_dir("path/to/checkpoint")     # reads config.json
    cfg = preset("qwen3-30b-a3b")                            # real shapes, no weights
    cfg.expert_params, cfg.kv_bytes_per_token(2)
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture string in config.json -> family handled by engine.model
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"}
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclass(frozen=True)
class ModelConfig:
    family: str                      # mixtral | qwen2_moe | qwen3_moe | olmoe
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    moe_intermediate_size: int       # per routed expert
    intermediate_size: int           # dense MLP layers (Qwen mlp_only_layers / sparse step)
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # "linear" rope scaling; 1.0 = none
    hidden_act: str = "silu"
    norm_topk_prob: bool = True
    qkv_bias: bool = False           # bias on q/k/v projections
    o_bias: bool = False             # bias on the output projection
    qk_norm: str = "none"            # none | head (Qwen3, per head) | full (OLMoE, whole projection)
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (0 = none)
    moe_layers: tuple[int, ...] = ()  # layers with routed experts; others are dense
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"     # dtype the weights were saved in
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in MODEL_TYPES.values():
            raise UnsupportedModelError(
                f"family {self.family!r} is not supported; supported: {sorted(set(MODEL_TYPES.values()))}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} not supported; supported: {ACTIVATIONS}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))

    # --- derived sizes ------------------------------------------------------------
    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def attention_params(self) -> int:
        D, H, K, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        p = D * H * hd + 2 * D * K * hd + H * hd * D
        if self.qkv_bias:
            p += H * hd + 2 * K * hd
        if self.o_bias:
            p += D
        if self.qk_norm == "head":
            p += 2 * hd
        elif self.qk_norm == "full":
            p += H * hd + K * hd
        return p

    def non_expert_params(self) -> int:
        """Everything except routed experts: embeddings, attention, norms, routers, dense and shared MLPs."""
        D = self.hidden_size
        p = self.vocab_size * D * (1 if self.tie_word_embeddings else 2) + D
        for layer in range(self.num_layers):
            p += self.attention_params() + 2 * D
            if self.is_moe_layer(layer):
                p += self.n_experts * D
                if self.shared_expert_intermediate_size:
                    p += 3 * D * self.shared_expert_intermediate_size + D
            else:
                p += 3 * D * self.intermediate_size
        return p

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes for one token of one sequence, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --- Hugging Face config.json ---------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> "ModelConfig":
        archs = d.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        family = family or MODEL_TYPES.get(d.get("model_type", ""))
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: "
                f"{sorted(ARCHITECTURES)} (model_type {sorted(MODEL_TYPES)})")
        D = d["hidden_size"]
        H = d["num_attention_heads"]
        head_dim = d.get("head_dim") or D // H
        n_experts = d.get("num_local_experts") or d.get("num_experts")
        if not n_experts:
            raise UnsupportedModelError(f"{family}: config has neither num_local_experts nor num_experts > 0")
        rope = _rope(d)
        sliding = d.get("sliding_window") if family == "mixtral" else None
        if family in ("qwen2_moe", "qwen3_moe") and d.get("use_sliding_window"):
            raise UnsupportedModelError(f"{family}: use_sliding_window=true is not supported")
        n_layers = d["num_hidden_layers"]
        if family in ("qwen2_moe", "qwen3_moe"):
            step = d.get("decoder_sparse_step", 1) or 1
            dense = set(d.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        else:
            moe_layers = tuple(range(n_layers))
        inter = d.get("intermediate_size", 0)
        qk_norm = {"qwen3_moe": "head", "olmoe": "full"}.get(family, "none")
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=D,
            num_layers=n_layers,
            num_heads=H,
            num_kv_heads=d.get("num_key_value_heads") or H,
            head_dim=head_dim,
            n_experts=n_experts,
            top_k=d["num_experts_per_tok"],
            moe_intermediate_size=d.get("moe_intermediate_size") or inter,
            intermediate_size=inter,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope[0],
            rope_scaling_factor=rope[1],
            hidden_act=d.get("hidden_act", "silu"),
            norm_topk_prob=True if family == "mixtral" else bool(d.get("norm_topk_prob", False)),
            qkv_bias=bool(d.get("qkv_bias", True)) if family == "qwen2_moe" else bool(d.get("attention_bias", False)),
            o_bias=False if family in ("mixtral", "qwen2_moe") else bool(d.get("attention_bias", False)),
            qk_norm=qk_norm,
            clip_qkv=d.get("clip_qkv") if family == "olmoe" else None,
            shared_expert_intermediate_size=(d.get("shared_expert_intermediate_size", 0)
                                             if family == "qwen2_moe" else 0),
            moe_layers=moe_layers,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32").replace("torch.", ""),
            name=name,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: cannot read it ({exc})") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
        if not isinstance(d, dict):
            raise ValueError(f"{p}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_hf_dict(d, name=Path(path).name)
        except KeyError as exc:
            raise ValueError(f"{p}: missing key {exc} that the {d.get('model_type')!r} family needs") from None


def _rope(d: dict[str, Any]) -> tuple[float, float]:
    """(theta, linear factor) from either `rope_parameters` (current) or `rope_theta`/`rope_scaling` (older Hub)."""
    params = d.get("rope_parameters") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return float(theta), 1.0
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return float(theta), 1.0
    if kind == "linear":
        return float(theta), float(scaling["factor"])
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported; supported: default, linear")


# --- presets: real shapes for sizing runs, seeded random weights ---------------------
def _mk(**kw: Any) -> ModelConfig:
    return ModelConfig(**kw)


PRESETS: dict[str, ModelConfig] = {
    # the embedded default: small enough for CI, large enough that caching matters
    "tiny-mixtral": _mk(family="mixtral", name="tiny-mixtral", vocab_size=512, hidden_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, n_experts=8, top_k=2,
                        moe_intermediate_size=128, intermediate_size=128, max_position_embeddings=8192,
                        rope_theta=1e6),
    "mixtral-8x7b": _mk(family="mixtral", name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, n_experts=8, top_k=2,
                        moe_intermediate_size=14336, intermediate_size=14336, max_position_embeddings=32768,
                        rope_theta=1e6, torch_dtype="bfloat16"),
    "qwen3-30b-a3b": _mk(family="qwen3_moe", name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048,
                         num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, n_experts=128, top_k=8,
                         moe_intermediate_size=768, intermediate_size=6144, max_position_embeddings=40960,
                         rms_norm_eps=1e-6, rope_theta=1e6, qk_norm="head", torch_dtype="bfloat16"),
    "olmoe-1b-7b": _mk(family="olmoe", name="olmoe-1b-7b", vocab_size=50304, hidden_size=2048, num_layers=16,
                       num_heads=16, num_kv_heads=16, head_dim=128, n_experts=64, top_k=8,
                       moe_intermediate_size=1024, intermediate_size=1024, max_position_embeddings=4096,
                       norm_topk_prob=False, qk_norm="full", torch_dtype="bfloat16"),
    "qwen1.5-moe-a2.7b": _mk(family="qwen2_moe", name="qwen1.5-moe-a2.7b", vocab_size=151936, hidden_size=2048,
                             num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, n_experts=60, top_k=4,
                             moe_intermediate_size=1408, intermediate_size=5632, max_position_embeddings=8192,
                             rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=False, qkv_bias=True,
                             shared_expert_intermediate_size=5632, torch_dtype="bfloat16"),
}


def preset(name: str) -> ModelConfig:
    """Exact-name lookup in PRESETS."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))} "
                         "(or pass a Hugging Face checkpoint directory)")
    return PRESETS[name]
