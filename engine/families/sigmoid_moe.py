"""DeepSeek-V3's MoE layers, shared by the families that adopted them: deepseek_v3 (DeepSeek-V3,
Kimi-K2, Moonlight) and glm4_moe (GLM-4.5 / 4.6).

Owns: `SigmoidRouting` (the config fields these layers add: shared experts, routing groups,
the routed scaling factor, the multi-token-prediction layer count), their config.json keys
(`ROUTING_KEYS`), and `SigmoidMoEFamily`, the family hooks built from them: the first
`first_k_dense_replace` layers dense (a DenseMLP of `intermediate_size`), every later one a
MoE block of a SigmoidGroupTopK router (engine.blocks.routers), the routed SwiGLU experts under
`mlp.experts` (per-expert or fused tensors) and the shared experts beside them
(`mlp.shared_experts`: one ungated DenseMLP of n_shared_experts x moe_intermediate_size that
runs on every row -- non-routed weights, so planned with the non-expert weights, resident
under every placement, never a cache lookup, never in a routing trace) -- plus the checks
config.json gets before anything is built (quantisation, MTP layers). Does not own: attention
(each family's: MLA for deepseek_v3, GQA for glm4_moe) or the router's arithmetic.

A family mixes it in ahead of its base: `class Glm4Moe(SigmoidMoEFamily, GQAFamily)`, so these
hooks replace the base's.

MTP: DeepSeek-V3 and GLM-4.5 publish `num_nextn_predict_layers` extra layers (stored as
`model.layers.<num_hidden_layers>.*`) for speculative multi-token prediction. Generation
here is plain next-token decoding, as transformers' own model: those layers are never built
or read (`Family.skipped`: loading does not warn about them), and `parse` logs that they are ignored.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.blocks.base import Block
from engine.blocks.experts import SwiGLUExperts
from engine.blocks.mlp import DenseMLP
from engine.blocks.routers import SigmoidGroupTopK
from engine.config import ModelConfig
from engine.families.base import Family
from engine.quant import refuse_unsupported

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SigmoidRouting:
    n_shared_experts: int = 0           # shared experts (their MLP is n x moe_intermediate_size wide)
    n_group: int = 1                    # routing groups; the top-k is chosen within `topk_group` of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_mtp_layers: int = 0             # num_nextn_predict_layers: multi-token prediction, not used here


ROUTING_KEYS: dict[str, tuple[str, Any]] = {   # SigmoidRouting field -> (config.json key, default)
    "n_shared_experts": ("n_shared_experts", 0), "n_group": ("n_group", 1), "topk_group": ("topk_group", 1),
    "routed_scaling_factor": ("routed_scaling_factor", 1.0), "num_mtp_layers": ("num_nextn_predict_layers", 0)}


class SigmoidMoEFamily(Family):
    dense_layers_default: ClassVar[int] = 1     # first_k_dense_replace when config.json omits it (transformers')

    # --- config.json --------------------------------------------------------------------
    @classmethod
    def check_hf(cls, d: dict[str, Any], name: str) -> None:
        """Refuse what these layers cannot run, before anything is built; log the MTP layers ignored."""
        refuse_unsupported(d, cls.name)
        mtp = d.get("num_nextn_predict_layers") or 0
        if mtp:
            n = d["num_hidden_layers"]
            log.info("%s %s: %d multi-token-prediction layer(s) (num_nextn_predict_layers; model.layers.%s.*) are not "
                     "used for generation and are not loaded", cls.name, name or "", mtp,
                     n if mtp == 1 else f"{n}-{n + mtp - 1}")

    @classmethod
    def moe_layers(cls, d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
        return tuple(range(d.get("first_k_dense_replace", cls.dense_layers_default), n_layers))

    @classmethod
    def routing_hf_config(cls, cfg: ModelConfig) -> dict[str, Any]:
        """The routing fields, expert shape and dense-layer count back as config.json keys."""
        k = cfg.num_layers - cfg.n_moe_layers
        if tuple(cfg.moe_layers) != tuple(range(k, cfg.num_layers)):
            raise ValueError(f"{cls.name}: moe_layers {tuple(cfg.moe_layers)} cannot be written as "
                             f"first_k_dense_replace (the dense layers must be the first ones)")
        return {"n_routed_experts": cfg.n_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
                "first_k_dense_replace": k, "norm_topk_prob": cfg.norm_topk_prob,
                **{key: getattr(cfg, f) for f, (key, _) in ROUTING_KEYS.items()}}

    # --- blocks (Family.mlp composes them: dense_mlp for the first layers, else a MoEBlock) ----------
    @classmethod
    def router(cls, cfg: ModelConfig, i: int) -> SigmoidGroupTopK:
        a = cfg.arch
        return SigmoidGroupTopK(f"model.layers.{i}.mlp.gate", cfg.hidden_size, cfg.n_experts, cfg.top_k, a.n_group,
                                a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)

    @classmethod
    def beside(cls, cfg: ModelConfig, i: int) -> tuple[Block, ...]:
        """The shared experts: always run, on the same rows, added after the routed ones."""
        n = cfg.arch.n_shared_experts
        if not n:
            return ()
        return (DenseMLP(f"model.layers.{i}.mlp.shared_experts.", cfg.hidden_size, n * cfg.moe_intermediate_size,
                         cfg.arch.hidden_act),)

    @classmethod
    def experts(cls, cfg: ModelConfig) -> SwiGLUExperts:
        return SwiGLUExperts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.arch.hidden_act, "model.layers.{layer}.mlp")
