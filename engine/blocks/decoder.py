"""The layer stack's pieces: the pre-norm decoder layer, the token embedding and the LM head.

Owns: `DecoderLayer` -- x + attention(norm(x)), then x + mlp(norm(x)) -- composed of an
attention block, an MLP block (dense or MoE) and two norms, with its transient bound;
`Embedding` (optionally scaled, Gemma); `LMHead` (final norm, projection, tied or not,
optional final-logit soft-capping). Does not own: the blocks themselves (attention, mlp,
norms modules) or the pass loop (engine.model).

A family whose layer has another shape (Gemma 4's sandwich norms and dense MLP beside the
experts on a separately normed input) subclasses DecoderLayer and overrides `forward` and
`activation_bytes`, reusing the same blocks.

Dimension legend: B=batch, T=new tokens, D=hidden, N=B*T rows, V=vocab.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.attention import AttentionBlock
from engine.blocks.base import Block, Pass, TensorSpec
from engine.blocks.mlp import MoEBlock
from engine.blocks.norms import RMSNorm, norm_temp_bytes
from engine.kernels.cpu import linear
from engine.kv import LayerState
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


class DecoderLayer(Block):
    def __init__(self, index: int, attn_norm: RMSNorm, attention: AttentionBlock, mlp_norm: RMSNorm,
                 mlp: Block) -> None:
        super().__init__()
        self.index, self.attn_norm, self.attention, self.mlp_norm, self.mlp = index, attn_norm, attention, mlp_norm, mlp

    def children(self) -> tuple[Block, ...]:
        return (self.attn_norm, self.attention, self.mlp_norm, self.mlp)

    @property
    def moe(self) -> MoEBlock | None:
        """The layer's MoE block, or None for a dense layer."""
        return self.mlp if isinstance(self.mlp, MoEBlock) else None

    def forward(self, x: torch.Tensor, state: LayerState, p: Pass) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        return self.feed(self.attend(x, state, p), p)

    __call__ = forward

    def attend(self, x: torch.Tensor, state: LayerState, p: Pass) -> torch.Tensor:
        """The layer's part that reads the sequence's state: x [B, T, D] -> x + attention(norm(x)).
        A ragged step (MoEModel.forward_ragged) runs it once per sequence, each with its own
        state and positions, and `feed` once over every sequence's rows."""
        with p.span("attention", layer=self.index):
            return x + self.attention(self.attn_norm(x), state, p)

    def feed(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        """The layer's part that is per token: x [B, T, D] -> x + mlp(norm(x))."""
        B, T, _ = x.shape
        h = self.mlp_norm(x)
        return x + self.mlp(h.view(B * T, -1), p).view(B, T, -1)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        """Transient bytes over `rows` rows: the residual and the normed input, plus the larger of
        the two blocks, each after its norm's temporaries (engine.blocks.base.Transient)."""
        D = self.attn_norm.dim
        norm = norm_temp_bytes(rows, D, dtype_bytes)
        return 2 * rows * D * dtype_bytes + max(self.attention.activation_bytes(rows, dtype_bytes).after(norm),
                                                self.mlp.activation_bytes(rows, dtype_bytes).after(norm))


class Embedding(Block):
    def __init__(self, vocab: int, hidden: int, name: str = "model.embed_tokens.weight",
                 scale: float | None = None) -> None:
        super().__init__()
        self.vocab, self.hidden, self.name, self.scale = vocab, hidden, name, scale

    def tensors(self) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(self.name, (self.vocab, self.hidden))}

    def applied(self) -> list[TensorSpec]:
        """The weights every token is multiplied by (read whole each pass, 2 FLOPs per element
        per token), beside the tables it only looks rows up in: none for a plain embedding."""
        return []

    def __call__(self, ids: torch.Tensor, p: Pass | None = None) -> torch.Tensor:
        """ids [B, T] -> [B, T, D]; `p`: the pass, for an embedding that hands the layers more
        than x (Gemma 4's per-layer inputs)."""
        x = F.embedding(ids, self.w["weight"])                                     # [B, T, D]
        return x if self.scale is None else x * scale_like(self.scale, x)


def scale_like(scale: float, x: torch.Tensor) -> torch.Tensor:
    """A scalar multiplier in x's dtype, through fp32 (transformers' scaled embeddings: sqrt(3072)
    is 55.5 in bf16)."""
    return torch.tensor(scale, dtype=torch.float32, device=x.device).to(x.dtype)


class LMHead(Block):
    """Final norm and vocabulary projection; tied: the projection is the embedding (set by the model)."""

    def __init__(self, norm: RMSNorm, vocab: int, hidden: int, tied: bool, name: str = "lm_head.weight",
                 softcap: float | None = None) -> None:
        super().__init__()
        self.norm, self.vocab, self.hidden, self.tied, self.name, self.softcap = norm, vocab, hidden, tied, name, softcap

    def tensors(self) -> dict[str, TensorSpec]:
        return {} if self.tied else {"weight": TensorSpec(self.name, (self.vocab, self.hidden))}

    def children(self) -> tuple[Block, ...]:
        return (self.norm,)

    def __call__(self, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """x [B, T, D] -> logits [B, V] for the last position ([B, T, V] with all_logits)."""
        logits = linear(self.norm(x if all_logits else x[:, -1]), self.w["weight"])   # engine.kernels.cpu's on the CPU
        if self.softcap is not None:      # in place: one logits tensor alive, not three ([B, T, V] each)
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def activation_bytes(self, rows: int, batch: int, dtype_bytes: int, all_logits: bool = False) -> int:
        """The residual of `rows` rows held, then for the rows projected (the last of each of the
        `batch` sequences; every row with all_logits) the larger of the norm's temporaries and the
        normed rows beside their logits (counted at fp32 or wider)."""
        out, D = (rows if all_logits else batch), self.hidden
        return rows * D * dtype_bytes + max(norm_temp_bytes(out, D, dtype_bytes),
                                            out * (D * dtype_bytes + self.vocab * max(dtype_bytes, 4)))
