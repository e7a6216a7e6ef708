"""Attention with learned sinks (GPT-OSS): each head has one extra logit in its softmax that
attends to nothing, so a query can put weight nowhere.

Owns: `SinkAttention` (GQAAttention, its `sinks` [H] tensor and `attend` with the sink) and
`attention_with_sinks`, the kernel: softmax over [scores, sink_h] with the sink's column dropped,
computed by scaled_dot_product_attention over one extra key -- every real key gets a zero in
an extra head dimension, the extra key a one there and a zero value, and each query carries
sink_h / scale in that dimension, so the extra key's score is exactly the head's sink and the
kernel (its blocking, its fp32 softmax) stays torch's. The grouped-query KV is never repeated
per query head. Does not own: the projections, rope, window or state (GQAAttention).

Dimension legend: B=batch, H/K=query/kv heads, T=queries, S=keys, h=head dim.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.attention import GQAAttention
from engine.blocks.base import TensorSpec
from engine.layers import heads_last
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, H, T, h], k/v [B, K, S, h], mask bool [T, S] or None, sinks [H] -> [B, T, H*h]."""
    B, H, T, hd = q.shape
    scale = hd ** -0.5 if scale is None else scale
    sink = (sinks / scale).to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    q1 = torch.cat((q, sink), dim=-1)                                           # [B, H, T, h+1]
    k1 = F.pad(k, (0, 1, 0, 1))                                                 # [B, K, S+1, h+1]
    k1[:, :, -1, -1] = 1.0                                                      # the sink key
    v1 = F.pad(v, (0, 1, 0, 1))                                                 # its value: zero
    if mask is not None:
        mask = F.pad(mask, (0, 1), value=True)                                  # every query sees the sink
    out = F.scaled_dot_product_attention(q1, k1, v1, attn_mask=mask, scale=scale, enable_gqa=H != k.shape[1])
    return heads_last(out[..., :hd])                                            # [B, T, H*h]


class SinkAttention(GQAAttention):
    causal_skips = False        # the sink column pads the mask: an explicit one, its whole rectangle computed

    def tensors(self) -> dict[str, TensorSpec]:
        return super().tensors() | {"sinks": TensorSpec(self.prefix + "sinks", (self.H,))}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return attention_with_sinks(q, k, v, mask, self.w["sinks"], self.scale)

    def workspace_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str) -> int:
        S = context if self.window is None else min(context, self.window - 1 + tokens)
        B, T, db, h1 = batch, tokens, dtype_bytes, self.hd + 1
        widened = 2 * B * self.K * (S + 1) * h1 * db + 2 * B * self.H * T * h1 * db    # k/v + sink; q + sink, out
        return super().workspace_bytes(batch, tokens, context, dtype_bytes, device_kind) + widened + T * (S + 1)
