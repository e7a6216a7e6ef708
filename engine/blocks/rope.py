"""Rotary position embedding: which dims rotate, at what frequencies, with what scaling.

Owns: `Rope`, a frozen (hashable) description that a forward pass memoises its cos/sin tables
under, so layers sharing one rope compute it once per pass and layers with another (Gemma's
global vs sliding layers, DeepSeek's rope head dim) get their own. Does not own: the rotation
arithmetic (engine.layers.rope_cos_sin / apply_rope).

    rope = Rope(dim=128, theta=1e6)
    cos, sin = rope.tables(p)                   # [T, dim] each, once per pass
    q = rope.apply(q, cos, sin)                 # q [B, H, T, h]; h > dim rotates the first dim only

A scaling scheme is a subclass overriding `inv_freq` and, where it scales cos/sin,
`attention_scaling`: `Yarn` (DeepSeek-V3, GPT-OSS) is the worked example, equal to transformers'
`rope_type: yarn` (tests/engine/test_blocks.py); `Proportional` (Gemma 4's global layers) another.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.blocks.base import Pass
from engine.layers import apply_rope, rope_cos_sin
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class Rope:
    dim: int                      # rotated dims per head (< head dim: partial rotary)
    theta: float = 10000.0
    linear_factor: float = 1.0    # "linear" scaling; 1.0 = none

    def tables(self, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim] at the pass's positions, in the pass's dtype (memoised per pass)."""
        return p.cached(("rope", self), lambda: self.cos_sin(p.positions, p.dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.dim, self.theta, self.linear_factor, dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context scaled by `scale` (1 when not scaled up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Yarn(Rope):
    """YaRN (arXiv 2309.00071) as transformers' `rope_type: yarn`: frequencies interpolated by
    `factor` below the correction range, extrapolated above it, a linear ramp between (the range
    from `beta_fast`/`beta_slow` rotations over `original_max_position_embeddings`), and cos/sin
    scaled by the attention factor (given, or from `factor` and `mscale`/`mscale_all_dim`).
    A family whose attention also corrects its softmax scale (DeepSeek-V3) does that in its
    attention block with `yarn_mscale`."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return float(yarn_mscale(self.factor))

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies."""
        dim, base = self.dim, self.theta
        pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(base)))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001                                            # no singularity
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        keep = 1 - ramp                                              # 1: extrapolate (high frequencies)
        return interpolation * (1 - keep) + extrapolation * keep

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]   # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                          # [T, dim]
        s = self.attention_scaling
        return (emb.cos() * s).to(dtype), (emb.sin() * s).to(dtype)


@dataclass(frozen=True)
class Proportional(Rope):
    """transformers' `rope_type: proportional` (Gemma 4's global layers): cos/sin over the whole
    head dim (`dim`) in rotate-half pairs, at the whole head dim's frequencies, but only the first
    `fraction * dim/2` pairs rotate; the others get frequency 0 (cos 1, sin 0: they pass through)."""

    fraction: float = 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dim, angles = self.dim, int(self.fraction * self.dim // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=positions.device).float() / dim
        inv_freq = torch.cat((1.0 / (self.theta ** exponents),
                              torch.zeros(dim // 2 - angles, device=positions.device))) / self.linear_factor
        freqs = positions.float()[:, None] * inv_freq[None, :]                          # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                         # [T, dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)
