"""GPT-OSS's routed expert: a clamped SwiGLU with biases, dense or kept packed in MXFP4.

Owns two ExpertLayouts of the same expert, (up + 1) * gate * sigmoid(alpha * gate) with gate
clamped above at `limit` and up to [-limit, limit], then the down projection, every projection
with its bias:
- `ClampedSwiGLUExperts`: dense, in the model's dtype, packed [gate (I*D) | up (I*D) | down (D*I)
  | gate bias (I) | up bias (I) | down bias (D)]; reads the Hub's stacked tensors (`gate_up_proj`
  [E, D, 2I] with gate and up *interleaved* along 2I, `down_proj` [E, I, D], their biases) or an
  MXFP4 checkpoint, dequantised at load.
- `MXFP4Experts`: the published storage kept as it is -- one uint8 buffer per expert holding the
  fp32 biases, the FP4 blocks and E8M0 scales of gate/up (rows de-interleaved) and down -- so an
  expert moves as its stored bytes (what the counters count), dequantised inside `run`.
Both write the Hub's stacked form back (`fused_on_hub`). Does not own: the MXFP4 encoding
(engine.blocks.mxfp4), where experts live or how outputs are combined (engine.cache, the placement).

Dimension legend: n=rows routed to one expert, D=hidden, I=expert intermediate, G=blocks of 32.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.experts import ByteLayout, ExpertLayout, RandomTensor
from engine.blocks.mxfp4 import BLOCK, dequantize, quantize
from engine.checkpoint import Checkpoint, MissingTensorError
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

ALPHA = 1.702                   # GPT-OSS's sigmoid slope (transformers' GptOssExperts.alpha)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[2I, ...] rows (gate, up, gate, up, ...) -> [gate rows | up rows]."""
    return torch.cat((t[0::2], t[1::2]))


def interleave(t: torch.Tensor) -> torch.Tensor:
    """The inverse of deinterleave."""
    out = torch.empty_like(t)
    half = t.shape[0] // 2
    out[0::2], out[1::2] = t[:half], t[half:]
    return out


def clamped_swiglu(x: torch.Tensor, gate_up: torch.Tensor, gate_up_b: torch.Tensor, down: torch.Tensor,
                   down_b: torch.Tensor, limit: float, alpha: float = ALPHA) -> torch.Tensor:
    """x [n, D], gate_up [2I, D] (gate rows first), gate_up_b [2I], down [D, I], down_b [D] -> [n, D]."""
    gate, up = F.linear(x, gate_up, gate_up_b).chunk(2, dim=-1)                   # [n, I] each
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.linear((up + 1) * (gate * torch.sigmoid(gate * alpha)), down, down_b)


class ClampedSwiGLUExperts(ExpertLayout):
    fused_on_hub = True

    def __init__(self, hidden: int, intermediate: int, limit: float = 7.0,
                 prefix: str = "model.layers.{layer}.mlp.experts") -> None:
        self.D, self.I, self.limit, self.prefix = hidden, intermediate, limit, prefix

    @property
    def numel(self) -> int:
        return 3 * self.D * self.I + 2 * self.I + self.D

    def names(self, layer: int) -> dict[str, str]:
        p = self.prefix.format(layer=layer) + "."
        return {n: p + n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}

    def _views(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up [2I, D], down [D, I], gate_up bias [2I], down bias [D]) views of a packed buffer."""
        D, I = self.D, self.I
        w = 2 * I * D
        return (out[:w].view(2 * I, D), out[w:w + D * I].view(D, I), out[w + D * I:w + D * I + 2 * I],
                out[w + D * I + 2 * I:])

    def read_into(self, ckpt: Checkpoint, layer: int, e: int, out: torch.Tensor) -> None:
        n = self.names(layer)
        gu, dn, gub, dnb = self._views(out)
        if ckpt.has(n["gate_up_proj"]):
            D, I = self.D, self.I
            gu.copy_(deinterleave(ckpt.weight(n["gate_up_proj"], (D, 2 * I), row=e).t()))   # [D, 2I] -> [2I, D]
            dn.copy_(ckpt.weight(n["down_proj"], (I, D), row=e).t())                       # [I, D] -> [D, I]
        elif ckpt.has(n["gate_up_proj"] + "_blocks"):                                 # MXFP4, dequantised at load
            gu.copy_(deinterleave(dequantize(*self._mx_rows(ckpt, n["gate_up_proj"], e))))
            dn.copy_(dequantize(*self._mx_rows(ckpt, n["down_proj"], e)))
        else:
            raise MissingTensorError(f"tensor {n['gate_up_proj']!r} (or its MXFP4 _blocks/_scales) is missing "
                                     f"from checkpoint {ckpt.path}")
        gub.copy_(deinterleave(ckpt.weight(n["gate_up_proj_bias"], (2 * self.I,), row=e)))
        dnb.copy_(ckpt.weight(n["down_proj_bias"], (self.D,), row=e))

    @staticmethod
    def _mx_rows(ckpt: Checkpoint, name: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ckpt.get_row(name + "_blocks", e), ckpt.get_row(name + "_scales", e)

    def hub_tensors(self, layer: int, e: int, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        n = self.names(layer)
        gu, dn, gub, dnb = self._views(packed)
        return {n["gate_up_proj"]: interleave(gu).t().contiguous(), n["gate_up_proj_bias"]: interleave(gub),
                n["down_proj"]: dn.t().contiguous(), n["down_proj_bias"]: dnb.clone()}

    def matrices(self) -> tuple[tuple[int, int], ...]:
        return ((2 * self.I, self.D), (self.D, self.I))                                # gate|up, down; biases kept

    def run(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        gu, dn, gub, dnb = self._views(packed)
        return clamped_swiglu(x, gu, gub, dn, dnb, self.limit)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        # rows; gate|up; the clamps, gate*alpha, its sigmoid, their product, up + 1, the product; down
        return rows * (2 * self.D + 9 * self.I) * dtype_bytes


class MXFP4Experts(ByteLayout, ClampedSwiGLUExperts):
    """The same expert kept in MXFP4: one uint8 buffer [biases fp32 (2I + D) | gate/up blocks
    [2I, D/32, 16] | their scales [2I, D/32] | down blocks [D, I/32, 16] | their scales [D, I/32]]."""

    stored_format = "mxfp4"

    def __init__(self, hidden: int, intermediate: int, limit: float = 7.0,
                 prefix: str = "model.layers.{layer}.mlp.experts") -> None:
        if hidden % BLOCK or intermediate % BLOCK:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes that are multiples of {BLOCK}, "
                             f"got {hidden} and {intermediate}")
        super().__init__(hidden, intermediate, limit, prefix)
        D, I = hidden, intermediate
        sizes = (4 * (2 * I + D), I * D, 2 * I * D // BLOCK, D * I // 2, D * I // BLOCK)   # bytes of each part
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @property
    def params(self) -> int:
        return 3 * self.D * self.I + 2 * self.I + self.D


    def matrices(self) -> tuple[tuple[int, int], ...]:
        raise ValueError("GPT-OSS experts kept in MXFP4 (expert_format 'mxfp4') are quantised already; "
                         "experts.quant=int8|int4|mixed needs them dense: model_overrides={'expert_format': "
                         "'dense'}; allowed with mxfp4: experts.quant=none")

    def _parts(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(biases fp32 [2I + D], gate_up blocks, gate_up scales, down blocks, down scales) views."""
        D, I, o = self.D, self.I, self.offsets
        part = [out[o[k]:o[k + 1]] for k in range(5)]
        return (part[0].view(torch.float32), part[1].view(2 * I, D // BLOCK, BLOCK // 2),
                part[2].view(2 * I, D // BLOCK), part[3].view(D, I // BLOCK, BLOCK // 2), part[4].view(D, I // BLOCK))

    def read_into(self, ckpt: Checkpoint, layer: int, e: int, out: torch.Tensor) -> None:
        n = self.names(layer)
        if not ckpt.has(n["gate_up_proj"] + "_blocks"):
            raise MissingTensorError(f"tensor {n['gate_up_proj'] + '_blocks'!r} is missing from checkpoint "
                                     f"{ckpt.path}: expert_format 'mxfp4' keeps the published MXFP4 blocks; a dense "
                                     f"checkpoint loads with expert_format='dense'")
        bias, gub, gus, dnb, dns = self._parts(out)
        blocks, scales = self._mx_rows(ckpt, n["gate_up_proj"], e)
        gub.copy_(deinterleave(blocks))
        gus.copy_(deinterleave(scales))
        blocks, scales = self._mx_rows(ckpt, n["down_proj"], e)
        dnb.copy_(blocks)
        dns.copy_(scales)
        bias.copy_(torch.cat((deinterleave(ckpt.weight(n["gate_up_proj_bias"], (2 * self.I,), row=e)),
                              ckpt.weight(n["down_proj_bias"], (self.D,), row=e))).float())

    def random_into(self, random: RandomTensor, layer: int, e: int, out: torch.Tensor) -> None:
        """Seeded dense weights (std 0.02), quantised: an MXFP4 expert of the preset's shape."""
        D, I, p = self.D, self.I, f"model.layers.{layer}.experts.{e}."
        bias, gub, gus, dnb, dns = self._parts(out)
        for (blocks, scales), w in ((gub, gus), random(p + "gate_up", (2 * I, D))), ((dnb, dns), random(p + "down", (D, I))):
            b, s = quantize(w)
            blocks.copy_(b)
            scales.copy_(s)
        bias.copy_(random(p + "bias", (2 * I + D,)))

    def hub_tensors(self, layer: int, e: int, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        n = self.names(layer)
        bias, gub, gus, dnb, dns = self._parts(packed)
        return {n["gate_up_proj"] + "_blocks": interleave(gub), n["gate_up_proj"] + "_scales": interleave(gus),
                n["down_proj"] + "_blocks": dnb.clone(), n["down_proj"] + "_scales": dns.clone(),
                n["gate_up_proj_bias"]: interleave(bias[:2 * self.I]), n["down_proj_bias"]: bias[2 * self.I:].clone()}

    def run(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        bias, gub, gus, dnb, dns = self._parts(packed)
        bias = bias.to(x.dtype)
        return clamped_swiglu(x, dequantize(gub, gus, x.dtype), bias[:2 * self.I], dequantize(dnb, dns, x.dtype),
                              bias[2 * self.I:], self.limit)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        # the dense bound, the two dequantised projections (3*I*D values) and the temporaries of the
        # larger dequantisation (2I*D values): int32 byte indices, fp32 values, their scaled copy
        values = 2 * self.I * self.D
        return (super().activation_bytes(rows, dtype_bytes) + 3 * self.I * self.D * dtype_bytes
                + values * (2 + 4 + 4) + (2 * self.I + self.D) * dtype_bytes)
