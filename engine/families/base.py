"""The model-family interface: what one architecture tells the engine.

Owns: `Family` -- which Hugging Face `architectures` / `model_type`s it reads, its own frozen
config dataclass (`Config`), parsing `config.json` into a ModelConfig (`parse`) and writing
one back (`hf_config`, for export), building each decoder layer from blocks (`layer`), the
routed experts' layout (`experts`), its norm (`norm`), the embedding and head, and its
presets -- plus what every family shares: the config.json readers (`hf_common`, `rope_from_hf`),
the pre-norm layer (`pre_norm_layer`), config checks (`require_supported`, `require_multiple`).
Does not own: the blocks (engine.blocks), loading or running them (engine.model), planning
(engine.planner asks the blocks the family built).

Families are registered by name in engine.registry.FAMILIES (or the entry-point group
`moebench.families`) and are used as classes: nothing is instantiated.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from engine.architecture import Architecture
from engine.blocks.attention import AttentionBlock
from engine.blocks.base import Block
from engine.blocks.decoder import DecoderLayer, Embedding, LMHead
from engine.blocks.experts import ExpertLayout
from engine.blocks.mlp import DenseMLP, MoEBlock
from engine.blocks.norms import RMSNorm
from engine.blocks.routers import Router
from engine.config import ModelConfig, UnsupportedModelError


class Family(ABC):
    name: ClassVar[str] = ""                          # the registry name, ModelConfig.family
    architectures: ClassVar[tuple[str, ...]] = ()     # config.json "architectures" it reads
    model_types: ClassVar[tuple[str, ...]] = ()       # config.json "model_type"s it reads
    Config: ClassVar[type]                            # frozen dataclass: the fields beyond ModelConfig's

    # --- config.json --------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def parse(cls, d: dict[str, Any], name: str) -> ModelConfig:
        """config.json (current or older Hub form) -> ModelConfig; UnsupportedModelError for
        options this family cannot run."""

    @classmethod
    @abstractmethod
    def hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        """ModelConfig -> config.json in the current transformers form, so that
        `parse(hf_config(cfg))` gives cfg back and transformers builds the same model."""

    # --- blocks -------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def layer(cls, cfg: ModelConfig, i: int) -> DecoderLayer:
        """Decoder layer i, composed of blocks (no weights yet); a MoE block exactly at cfg.moe_layers."""

    @classmethod
    @abstractmethod
    def experts(cls, cfg: ModelConfig) -> ExpertLayout:
        """The routed experts' packed layout, reading, writing and kernel."""

    @classmethod
    def routed_experts(cls, cfg: ModelConfig) -> ExpertLayout:
        """`experts(cfg)` as stored under cfg.expert_quant (engine.blocks.quant_experts): what every
        MoE block and the architecture use."""
        from engine.blocks.quant_experts import quantized_layout
        return quantized_layout(cls.experts(cfg), cfg.expert_quant)

    @classmethod
    @abstractmethod
    def norm(cls, cfg: ModelConfig, name: str) -> RMSNorm:
        """The family's hidden-size norm for tensor `name`."""

    @classmethod
    def mlp(cls, cfg: ModelConfig, i: int) -> Block:
        """Layer i's MLP: `dense_mlp` where cfg has no routed experts, else a MoEBlock of the
        family's `router`, `experts` and the MLPs `beside` them."""
        if not cfg.is_moe_layer(i):
            return cls.dense_mlp(cfg, i)
        return MoEBlock(i, cls.router(cfg, i), cls.routed_experts(cfg), cls.beside(cfg, i))

    @classmethod
    def dense_mlp(cls, cfg: ModelConfig, i: int) -> Block:
        return DenseMLP(f"model.layers.{i}.mlp.", cfg.hidden_size, cfg.arch.intermediate_size, cfg.arch.hidden_act)

    @classmethod
    def router(cls, cfg: ModelConfig, i: int) -> Router:
        """MoE layer i's router (a family that builds its MLPs with `mlp` provides it)."""
        raise NotImplementedError(f"family {cls.name!r} builds MoE blocks with Family.mlp but has no router")

    @classmethod
    def beside(cls, cfg: ModelConfig, i: int) -> tuple[Block, ...]:
        """MLPs beside the routed experts of MoE layer i (shared experts), summed after them."""
        return ()

    @classmethod
    def pre_norm_layer(cls, cfg: ModelConfig, i: int, attention: AttentionBlock, mlp: Block) -> DecoderLayer:
        """Layer i as x + attention(norm(x)), then x + mlp(norm(x)), the norms under the Hub's
        `input_layernorm` / `post_attention_layernorm` names (most families' layer)."""
        p = f"model.layers.{i}."
        return DecoderLayer(i, cls.norm(cfg, p + "input_layernorm.weight"), attention,
                            cls.norm(cfg, p + "post_attention_layernorm.weight"), mlp)

    @classmethod
    def embedding(cls, cfg: ModelConfig) -> Embedding:
        return Embedding(cfg.vocab_size, cfg.hidden_size)

    @classmethod
    def head(cls, cfg: ModelConfig) -> LMHead:
        return LMHead(cls.norm(cfg, "model.norm.weight"), cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings)

    @classmethod
    def architecture(cls, cfg: ModelConfig) -> Architecture:
        return Architecture(cls.embedding(cfg), [cls.layer(cfg, i) for i in range(cfg.num_layers)], cls.head(cfg),
                            cls.routed_experts(cfg))

    @classmethod
    def skipped(cls, cfg: ModelConfig) -> tuple[str, ...]:
        """Regexes (re.search) of the checkpoint tensors this family leaves unread on purpose; the
        loader warns about any other tensor no block reads. Every family's: `rotary_emb.inv_freq`
        buffers, which older checkpoints store and every rope recomputes from config.json (as
        transformers skips them), and the layers past the model's `num_layers`, which are never
        built: DeepSeek-V3's and GLM-4.5's multi-token-prediction layers (model.layers.<num_hidden_layers>.*)
        and the layers a `num_layers` override leaves out."""
        built = "|".join(str(i) for i in range(cfg.num_layers))
        return (r"rotary_emb\.inv_freq$", rf"^model\.layers\.(?!(?:{built})\.)\d+\.")

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        """Named configs at real shapes (seeded random weights); gathered into engine.config.PRESETS."""
        return {}

    # --- shared by every family's parse / hf_config -------------------------------------------
    @classmethod
    def hf_common(cls, d: dict[str, Any], *, moe_intermediate_size: int,
                  moe_layers: tuple[int, ...]) -> dict[str, Any]:
        """The ModelConfig common fields from config.json (expert count under any of the Hub keys)."""
        key = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if d.get(k)), None)
        if key is None:
            raise UnsupportedModelError(f"{cls.name}: config has none of num_local_experts, num_experts, "
                                        "n_routed_experts > 0")
        n_experts = d[key]
        if not 1 <= d["num_experts_per_tok"] <= n_experts:      # named as config.json names them
            raise ValueError(f"num_experts_per_tok must be in [1, {key}={n_experts}], got {d['num_experts_per_tok']}")
        return dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_layers=d["num_hidden_layers"],
                    n_experts=n_experts, top_k=d["num_experts_per_tok"], moe_intermediate_size=moe_intermediate_size,
                    moe_layers=moe_layers, max_position_embeddings=d.get("max_position_embeddings", 4096),
                    tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                    torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32").replace("torch.", ""))

    @classmethod
    def hf_common_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        """The common fields back as config.json keys (weights exported in fp32)."""
        return {"architectures": [cls.architectures[0]], "model_type": cls.model_types[0],
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
                "num_experts_per_tok": cfg.top_k, "max_position_embeddings": cfg.max_position_embeddings,
                "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": "float32"}


def require_supported(field: str, values: Iterable[str], supported: tuple[str, ...]) -> None:
    """UnsupportedModelError naming the config field, the values outside `supported`, and those."""
    bad = sorted(set(values) - set(supported))
    if bad:
        raise UnsupportedModelError(f"{field} {bad} not supported; supported: {supported}")


def require_multiple(name: str, value: int, of_name: str, of: int) -> None:
    if value % of:
        raise ValueError(f"{name} {value} is not a multiple of {of_name} {of}")


def rope_from_hf(d: dict[str, Any]) -> tuple[float, float]:
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
