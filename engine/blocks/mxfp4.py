"""MXFP4 (OCP Microscaling FP4), the format GPT-OSS publishes its experts in: every 32 consecutive
values of a row share one power-of-two scale (E8M0: a biased exponent byte), each value an FP4
E2M1 number (sign, 2-bit exponent, 1-bit mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives),
two values per byte, the first in the low nibble.

Owns: decoding (`dequantize`, bit-equal to transformers' `convert_moe_packed_tensors`, which
5.17 runs when it loads an MXFP4 checkpoint with `Mxfp4Config(dequantize=True)` or on a CPU) and
encoding (`quantize`: each block's scale the smallest power of two that fits its largest
magnitude under 6, each value rounded to the nearest FP4 number -- used for presets' seeded
random experts and test checkpoints). Does not own: where the packed bytes live or how an
expert runs on them (engine.blocks.clamped_experts).

    blocks, scales = quantize(w)            # w [R, C] -> uint8 [R, C/32, 16], uint8 [R, C/32]
    w2 = dequantize(blocks, scales)         # [R, C] float32, exactly the FP4 values times 2^(scale - 127)

Dimension legend: R=rows, C=values per row, G=C/32 blocks per row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


BLOCK = 32                                   # values sharing one scale
BIAS = 127                                   # E8M0 exponent bias
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)   # by nibble


def _pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two FP4 values of each byte, low nibble first."""
    lut = torch.tensor(FP4, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)


_PAIRS: dict[torch.device, torch.Tensor] = {}


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G*32] in `dtype` (None: float32;
    exact unless a value leaves dtype's range)."""
    pairs = _PAIRS.get(blocks.device)
    if pairs is None:
        pairs = _PAIRS[blocks.device] = _pairs(blocks.device)
    *lead, G, B = blocks.shape
    vals = pairs[blocks.to(torch.int32)].view(*lead, G, 2 * B)                     # [..., G, 32]
    vals = torch.ldexp(vals, scales.to(torch.int32)[..., None] - BIAS)
    return vals.view(*lead, G * 2 * B).to(dtype or torch.float32)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] (C a multiple of 32) -> (blocks uint8 [..., C/32, 16], scales uint8 [..., C/32])."""
    *lead, C = w.shape
    if C % BLOCK:
        raise ValueError(f"MXFP4 rows must hold a multiple of {BLOCK} values, got {C}")
    x = w.float().reshape(*lead, C // BLOCK, BLOCK)                                 # [..., G, 32]
    amax = x.abs().amax(dim=-1)                                                     # [..., G]
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    exp = exp.clamp(-BIAS, BIAS)
    mags = torch.tensor(FP4[:8], dtype=torch.float32, device=w.device)
    y = (x / torch.exp2(exp)[..., None]).clamp(-6.0, 6.0)                            # each |y| <= 6
    code = (y.abs()[..., None] - mags).abs().argmin(dim=-1)                         # nearest magnitude, 0..7
    code = code | torch.where(y < 0, 8, 0)                                          # sign bit (-0 stays +0)
    code = code.to(torch.uint8).view(*lead, C // BLOCK, BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)                                     # low nibble first
    return blocks.contiguous(), (exp + BIAS).to(torch.uint8)
