"""Full attention with an output gate: the attention layers of Qwen3-Next and Qwen3.5-MoE.

Owns: `GatedAttention`, a GQAAttention whose q projection yields a query and a gate per head
([q_h | gate_h] for each head h), with zero-centred `1 + w` per-head q/k RMSNorms (in fp32),
partial rotary, and the attention output scaled by sigmoid(gate) before the output projection.
The rope, the KV state (FullKV), the mask and the kernel are GQAAttention's. Does not own: the
linear-attention layers beside it (engine.blocks.deltanet).

Dimension legend: B=batch, T=new tokens, D=hidden, H/K=query/kv heads, h=head dim.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.attention import GQAAttention
from engine.blocks.base import Pass, TensorSpec, Transient
from engine.kv import KVState
from engine.layers import rms_norm_fp32
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


class GatedAttention(GQAAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, qk_norm="head", **kwargs)

    def tensors(self) -> dict[str, TensorSpec]:
        t = super().tensors()
        t["q"] = TensorSpec(self.prefix + "q_proj.weight", (2 * self.H * self.hd, self.D))
        if self.qkv_bias:
            t["q_b"] = TensorSpec(self.prefix + "q_proj.bias", (2 * self.H * self.hd,))
        for n in ("q_norm", "k_norm"):                       # 1 + w: stored zero-centred
            t[n] = TensorSpec(t[n].name, t[n].shape, "zeros")
        return t

    def forward(self, x: torch.Tensor, state: KVState, p: Pass) -> torch.Tensor:
        w, eps, hd = self.w, self.eps, self.hd
        B, T, _ = x.shape
        q, gate = F.linear(x, w["q"], w.get("q_b")).view(B, T, -1, 2 * hd).chunk(2, dim=-1)    # [B, T, H, h] each
        q = rms_norm_fp32(q, w["q_norm"], eps, offset=1.0)
        k = rms_norm_fp32(F.linear(x, w["k"], w.get("k_b")).view(B, T, -1, hd), w["k_norm"], eps, offset=1.0)
        v = F.linear(x, w["v"], w.get("v_b")).view(B, T, -1, hd)
        o = self.rotate_and_attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), state, p)  # [B, T, H*h]
        return F.linear(o * torch.sigmoid(gate.reshape(B, T, -1)), w["o"], w.get("o_b"))

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        base = super().activation_bytes(rows, dtype_bytes)
        gate = 3 * rows * self.H * self.hd * dtype_bytes            # the gate half, its reshape and sigmoid*o
        norms = 2 * rows * (self.H + self.K) * self.hd * 4          # fp32 steps of the q/k norms
        return Transient(base.held + gate + norms, base.peak)
