"""The blocks decoder layers are composed of (see engine.families for how a family uses them).

    base        TensorSpec, Block, Pass
    norms       RMSNorm (Llama, fp32-scaled, 1 + w)
    rope        Rope (partial rotary; memoised per pass)
    attention   AttentionBlock, GQAAttention
    mla         MLAAttention, LatentKV (multi-head latent attention and its compressed state)
    routers     Router, SoftmaxTopK, SigmoidGroupTopK
    experts     ExpertLayout, SwiGLUExperts
    mlp         DenseMLP, GatedMLP, MoEBlock
    decoder     DecoderLayer, Embedding, LMHead
    second wave (one module each, imported from there): sinks (SinkAttention), gated_attention
    (GatedAttention), deltanet + delta_rule (GatedDeltaNet, RecurrentState), gemma4 (Gemma 4's
    attention, layer, embedding), topk_routers, clamped_experts + mxfp4 (GPT-OSS's experts)

A block one family alone needs lives in a module of its own here, named for what it is, its
docstring saying which family uses it (a family stays one module, and families never import
each other); what several families share is re-exported above.
"""
from engine.blocks.attention import AttentionBlock, GQAAttention
from engine.blocks.base import Block, Pass, TensorSpec
from engine.blocks.decoder import DecoderLayer, Embedding, LMHead
from engine.blocks.experts import ExpertLayout, SwiGLUExperts
from engine.blocks.mla import LatentKV, MLAAttention
from engine.blocks.mlp import DenseMLP, GatedMLP, MoEBlock
from engine.blocks.norms import RMSNorm
from engine.blocks.rope import Rope
from engine.blocks.routers import Router, SigmoidGroupTopK, SoftmaxTopK

__all__ = ["AttentionBlock", "Block", "DecoderLayer", "DenseMLP", "Embedding", "ExpertLayout", "GQAAttention",
           "GatedMLP", "LMHead", "LatentKV", "MLAAttention", "MoEBlock", "Pass", "RMSNorm", "Rope", "Router",
           "SigmoidGroupTopK", "SoftmaxTopK", "SwiGLUExperts", "TensorSpec"]
