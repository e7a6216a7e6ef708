"""RMSNorm as a block: the Llama form (scale after the cast back), and the fp32-scaled forms
(GPT-OSS; Qwen3-Next's zero-centred `1 + w`; a weightless norm; Gemma 4's pow form).

Owns: which norm a tensor name is and its transient bytes. Does not own: the arithmetic
(engine.layers.rms_norm / rms_norm_fp32).

    RMSNorm("model.norm.weight", 4096, 1e-5)                         # w * norm(x).to(dtype)
    RMSNorm(name, 2048, 1e-6, offset=1.0)                            # (norm(x32) * (1 + w)).to(dtype)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.base import Block, TensorSpec
from engine.layers import rms_norm, rms_norm_fp32
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def norm_temp_bytes(rows: int, hidden: int, dtype_bytes: int) -> int:
    """Transient bytes of one RMSNorm over [rows, hidden]: the fp32 copy, its square/product, the cast."""
    return rows * hidden * (2 * 4 + dtype_bytes)


class RMSNorm(Block):
    def __init__(self, name: str | None, dim: int, eps: float, offset: float = 0.0,
                 weight_in_fp32: bool = False) -> None:
        """name None: no weight (a plain norm); offset 1.0: `1 + w` (the weight is stored
        zero-centred); weight_in_fp32: scale before the cast back (implied by an offset)."""
        super().__init__()
        self.name, self.dim, self.eps, self.offset = name, dim, eps, offset
        self.fp32 = weight_in_fp32 or bool(offset) or name is None

    def tensors(self) -> dict[str, TensorSpec]:
        if self.name is None:
            return {}
        return {"weight": TensorSpec(self.name, (self.dim,), "zeros" if self.offset else "ones")}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return rms_norm_fp32(x, self.w.get("weight"), self.eps, self.offset)
        return rms_norm(x, self.w["weight"], self.eps)


def pow_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's form: in fp32, x * (mean(x^2) + eps)^(-1/2) by `pow` (not rsqrt), times w (if any),
    cast back."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (x32 if weight is None else x32 * weight.float()).to(x.dtype)


class PowRMSNorm(RMSNorm):
    """`pow_rms_norm` as a block (name None: no weight, as Gemma 4's v-norm and router norm)."""

    def __init__(self, name: str | None, dim: int, eps: float) -> None:
        super().__init__(name, dim, eps, weight_in_fp32=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return pow_rms_norm(x, self.w.get("weight"), self.eps)
