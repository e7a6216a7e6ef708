"""Quantised checkpoints: which `quantization_config`s the engine reads, and how.

Owns: reading config.json's `quantization_config` -- `block_fp8` finds DeepSeek-V3's published
block-wise FP8 format (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`: each
quantised `<name>.weight` is float8_e4m3fn with a `<name>.weight_scale_inv` of one fp32 scale
per 128 x 128 block), `refuse_unsupported` raises for any other method, naming it -- and
`BlockFP8.dequantize`, the reverse of that quantisation (w * scale_inv, block by block: the
arithmetic of DeepSeek's own `weight_dequant`). Does not own: finding tensors (engine.checkpoint,
which dequantises FP8 tensors as it reads them) or which families refuse what (their `parse`).

FP8 weights are dequantised at load, to the dtype the engine runs in: the engine never runs
FP8 matmuls, so the planner, the expert cache and every byte counter see bf16/fp32 weights --
twice (four times) the FP8 bytes on disk. That is logged when the checkpoint is opened.

    fp8 = block_fp8(json.load(open("config.json")))     # BlockFP8(block=(128, 128)) or None
    w = fp8.dequantize(w_fp8, scale_inv)                  # fp32 [out, in]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import UnsupportedModelError
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")     # dtype names: a checkpoint's tensors in these are block-scaled
SCALE_SUFFIX = "_scale_inv"          # <name>.weight -> <name>.weight_scale_inv


def is_float8(dtype: torch.dtype) -> bool:
    return str(dtype).removeprefix("torch.") in FLOAT8


@dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int]           # weight_block_size: rows x columns of one scale

    def dequantize(self, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """w [..., O, I] float8, scale_inv [..., ceil(O/bo), ceil(I/bi)] -> fp32 w * scale_inv per block."""
        bo, bi = self.block
        O, I = w.shape[-2:]
        want = (-(-O // bo), -(-I // bi))
        if tuple(scale_inv.shape[-2:]) != want:
            raise ValueError(f"FP8 scales have shape {tuple(scale_inv.shape)}; a [{O}, {I}] weight in {bo} x {bi} "
                             f"blocks needs [..., {want[0]}, {want[1]}]")
        s = scale_inv.float().repeat_interleave(bo, dim=-2)[..., :O, :].repeat_interleave(bi, dim=-1)[..., :I]
        return w.float() * s


def _method(d: dict[str, Any]) -> str | None:
    q = d.get("quantization_config")
    if not q:
        return None
    return str(q.get("quant_method", "<no quant_method>"))


def block_fp8(d: dict[str, Any]) -> BlockFP8 | None:
    """The block-wise FP8 format of this config.json, None when it declares no such quantisation
    (another method is not this function's to refuse: `refuse_unsupported`)."""
    if _method(d) != "fp8":
        return None
    q = d["quantization_config"]
    block, fmt = q.get("weight_block_size"), q.get("fmt", "e4m3")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(f"quantization_config quant_method 'fp8' without weight_block_size [rows, cols] "
                                    f"(got {block!r}): only block-wise FP8 (DeepSeek-V3's format) is supported")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"quantization_config quant_method 'fp8' with fmt {fmt!r}: only 'e4m3' is supported")
    return BlockFP8((int(block[0]), int(block[1])))


def refuse_unsupported(d: dict[str, Any], family: str) -> None:
    """UnsupportedModelError naming the method unless config.json is unquantised or block-wise FP8."""
    method = _method(d)
    if method is not None and method != "fp8":
        raise UnsupportedModelError(
            f"{family}: quantization_config quant_method {method!r} is not supported; supported: 'fp8' with "
            "weight_block_size (block-wise FP8, DeepSeek-V3's published format; dequantised at load) or an "
            "unquantised checkpoint")
    block_fp8(d)
