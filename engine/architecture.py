"""A model as blocks, without weights: what the loader, the planner and the exporter ask.

Owns: `Architecture` -- the embedding, the decoder layers, the head and the routed experts'
layout that a family builds for one ModelConfig (`Family.architecture(cfg)`) -- and the sums
over them: non-expert parameters, each layer's state term, the transient bound of a forward
pass, the attention workspace. Does not own: weights (engine.model fills the blocks), the
plan itself (engine.planner), any family's choices (engine.families).

    arch = cfg.architecture()             # fresh blocks for this config, no tensors allocated
    arch.non_expert_params(), arch.state_terms(2), arch.experts.nbytes(2)
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine.blocks.base import Block, TensorSpec
from engine.blocks.decoder import DecoderLayer, Embedding, LMHead
from engine.blocks.experts import ExpertLayout
from engine.kv import StateTerm
from engine.kvquant import kv_format

STATE_TENSORS_PER_LAYER = 2     # the most device tensors one layer's state holds (K and V; latent and rope key; ...)


@dataclass
class Architecture:
    embedding: Embedding
    layers: list[DecoderLayer]
    head: LMHead
    experts: ExpertLayout              # the routed experts of every MoE layer

    def blocks(self) -> tuple[Block, ...]:
        return (self.embedding, *self.layers, self.head)

    def walk(self) -> Iterator[tuple[Block, str, TensorSpec]]:
        """Every non-expert tensor with its owning block (a tied head declares none)."""
        for block in self.blocks():
            yield from block.walk()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.moe is not None)

    def non_expert_params(self) -> int:
        """Everything except routed experts: embeddings, attention, norms, routers, dense and shared MLPs."""
        return sum(spec.numel for _, _, spec in self.walk())

    def non_expert_bytes(self, dtype_bytes: int) -> int:
        """Their device bytes at `dtype_bytes` per element (a tensor kept in fp32 at 4)."""
        return sum(spec.nbytes(dtype_bytes) for _, _, spec in self.walk())

    def state_terms(self, dtype_bytes: int, kv_dtype: str | None = None) -> list[StateTerm]:
        """Each layer's state term, in layer order, its KV stored in `kv_dtype` (engine.kvquant)."""
        return [layer.attention.state_term(dtype_bytes, kv_dtype) for layer in self.layers]

    def activation_bytes(self, rows: int, batch: int, dtype_bytes: int, all_logits: bool = False) -> int:
        """Peak transient bytes of one forward pass over `rows` rows (B*T) of `batch` sequences,
        attention workspace apart: the largest layer's, or the head's (every row's logits with
        all_logits)."""
        return max(max(layer.activation_bytes(rows, dtype_bytes) for layer in self.layers),
                   self.head.activation_bytes(rows, batch, dtype_bytes, all_logits))

    def workspace_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str,
                        kv_dtype: str | None = None) -> int:
        """The largest layer's attention workspace, with reading back a KV stored in another
        format than the model's (`kv_read_bytes`)."""
        return max(layer.attention.workspace_bytes(batch, tokens, context, dtype_bytes, device_kind)
                   + layer.attention.kv_read_bytes(batch, tokens, context, dtype_bytes, kv_dtype)
                   for layer in self.layers)

    def n_device_tensors(self, kv_dtype: str | None = None) -> int:
        """Device tensors the engine allocates: the non-expert weights, each layer's state (a
        block-quantised KV holds a scale tensor beside each payload) and each MoE layer's
        expert rows or slots."""
        return (sum(1 for _ in self.walk()) + len(self.layers) * STATE_TENSORS_PER_LAYER * kv_format(kv_dtype).n_parts
                + len(self.moe_layers))
