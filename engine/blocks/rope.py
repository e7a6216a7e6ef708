"""Rotary position embedding: which dims rotate, at what frequencies, with what scaling.

Owns: `Rope`, a frozen (hashable) description that a forward pass memoises its cos/sin tables
under, so layers sharing one rope compute it once per pass and layers with another (Gemma's
global vs sliding layers, DeepSeek's rope head dim) get their own. Does not own: the rotation
arithmetic (engine.layers.rope_cos_sin / apply_rope).

    rope = Rope(dim=128, theta=1e6)
    cos, sin = rope.tables(p)                   # [T, dim] each, once per pass
    q = rope.apply(q, cos, sin)                 # q [B, H, T, h]; h > dim rotates the first dim only

A new scaling (YaRN, NTK) is a subclass overriding `tables` (and `attention_scaling` where the
scheme scales cos/sin), kept in this module once a second family needs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.blocks.base import Pass
from engine.layers import apply_rope, rope_cos_sin


@dataclass(frozen=True)
class Rope:
    dim: int                      # rotated dims per head (< head dim: partial rotary)
    theta: float = 10000.0
    linear_factor: float = 1.0    # "linear" scaling; 1.0 = none

    def tables(self, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim] at the pass's positions, in the pass's dtype (memoised per pass)."""
        return p.cached(("rope", self), lambda: rope_cos_sin(p.positions, self.dim, self.theta,
                                                             self.linear_factor, p.dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)
