"""Integer weight quantisers for the lossy `experts.quant` treatments (engine.blocks.quant_experts).

Owns the arithmetic of two formats of a weight matrix w [R, C] (R output channels, C inputs):
- int8, per output channel, symmetric: scale[r] = max|w[r]| / 127 (1 where the row is all zero),
  q = clamp(round(w / scale), -127, 127) stored as int8; w' = q * scale.
- int4, group-wise along the input dim, asymmetric: each run of `group` consecutive inputs of a
  row has lo = min(min w, 0), hi = max(max w, 0), scale = (hi - lo) / 15 (1 where hi == lo) and an
  integer zero point zero = clamp(round(-lo / scale), 0, 15); q = clamp(round(w / scale) + zero,
  0, 15), two per uint8 (the first in the low nibble, as MXFP4); w' = (q - zero) * scale.
And of the activations a matrix meets under `experts.activations=int8` (as llama.cpp's Q8_0 dot
products): per block of ACT_BLOCK inputs of a row of x, d = max|x| / 127 and q = round(x / d) as
int8; x' = q * d. Rounding is torch.round's (half to even), in float32. Does not own: where the parts live in an
expert's packed buffer or how an expert runs on them (engine.blocks.quant_experts).

    q, s = quantize_int8(w);          w2 = dequantize_int8(q, s)            # [R, C] int8, [R] fp32
    q, s, z = quantize_int4(w, 32);   w2 = dequantize_int4(q, s, z, 32)     # [R, C/2] u8, [R, C/32] fp32, u8
    q, d = quantize_activations(x);   x2 = round_activations(x)             # [n, C] int8, [n, C/32] fp32

Dimension legend: R=rows (output channels), C=inputs per row, G=C/group groups per row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


INT8_MAX = 127
INT4_LEVELS = 15            # q in [0, 15]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (q int8 [R, C], scale float32 [R])."""
    x = w.float()
    amax = x.abs().amax(dim=-1)                                                   # [R]
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [R, C]
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """q int8 [R, C], scale [R] -> [R, C] in `dtype` (None: float32; computed in float32)."""
    return (q.float() * scale[:, None]).to(dtype or torch.float32)


def check_group(cols: int, group: int) -> None:
    if group < 2 or group % 2:
        raise ValueError(f"experts.group_size must be an even number >= 2, got {group}")
    if cols % group:
        raise ValueError(f"int4 groups run along a matrix's input dim: {cols} inputs is not a multiple of "
                         f"experts.group_size={group}; pick a group size that divides {cols}")


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (q uint8 [R, C/2] two values a byte, scale float32 [R, G], zero uint8 [R, G])."""
    R, C = w.shape
    check_group(C, group)
    x = w.float().reshape(R, C // group, group)                                   # [R, G, g]
    lo = x.amin(dim=-1).clamp(max=0.0)                                            # [R, G]
    hi = x.amax(dim=-1).clamp(min=0.0)
    scale = (hi - lo) / INT4_LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, INT4_LEVELS)                         # [R, G], integer-valued
    q = (torch.round(x / scale[..., None]) + zero[..., None]).clamp(0, INT4_LEVELS).to(torch.uint8)
    q = q.reshape(R, C // 2, 2)                                                   # [R, C/2, 2]
    return (q[..., 0] | (q[..., 1] << 4)).contiguous(), scale, zero.to(torch.uint8)


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] -> uint8 [R, C], low nibble first."""
    return torch.stack((q & 0x0F, q >> 4), dim=-1).reshape(q.shape[0], 2 * q.shape[1])


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """q uint8 [R, C/2], scale [R, G], zero uint8 [R, G] -> [R, C] in `dtype` (None: float32;
    computed in float32)."""
    R = q.shape[0]
    vals = unpack_int4(q).float().view(R, -1, group)                              # [R, G, g]
    vals = (vals - zero.float()[..., None]) * scale[..., None]
    return vals.view(R, -1).to(dtype or torch.float32)


ACT_BLOCK = 32       # inputs sharing one activation scale under experts.activations=int8 (llama.cpp's Q8_0 block)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, K] (K a multiple of ACT_BLOCK) -> (q int8 [n, K], d fp32 [n, K/ACT_BLOCK]): per block of
    ACT_BLOCK inputs d = max|x| / 127 and q = x * (1 / d) rounded to the nearest, ties to even (0
    where d is 0), so q * d is x to 8 bits per block. A block holding a NaN or an infinity gets
    q = 0 and d = NaN: its products are NaN, never a silently finite number. The CPU kernel's
    rounding (engine.kernels.cpu) is this, bit for bit."""
    n, K = x.shape
    xb = x.float().reshape(n, K // ACT_BLOCK, ACT_BLOCK)
    finite = torch.isfinite(xb).all(-1, keepdim=True)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xb * torch.where(d > 0, 1.0 / d, torch.zeros_like(d)))
    q = torch.where(finite, q, torch.zeros_like(q)).to(torch.int8)
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    return q.reshape(n, K), d.squeeze(-1)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] as the int8 activations stand for it, q * d (quantize_activations), in x's dtype."""
    n, K = x.shape
    q, d = quantize_activations(x)
    return (q.view(n, K // ACT_BLOCK, ACT_BLOCK).float() * d.unsqueeze(-1)).reshape(n, K).to(x.dtype)
