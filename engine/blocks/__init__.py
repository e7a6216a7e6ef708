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

Blocks a single family needs live in that family's module; a block moves here when a second
family needs it.
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
