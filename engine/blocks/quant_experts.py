"""Quantised routed experts: the lossy `expert_quant` treatments (int8, int4, mixed).

Owns:
- `ExpertQuant`: the treatment as plain, hashable data (it rides on ModelConfig.expert_quant, so
  every consumer of `cfg.architecture().experts` -- loader, planner, cost model -- sees the
  stored bytes) and `resolve_expert_quant`, which builds it from user options, reading the
  popularity a `mixed` treatment ranks experts by.
- `QuantExperts`: any dense ExpertLayout that declares its weight `matrices()` (SwiGLU, GPT-OSS's
  clamped SwiGLU), quantised at load -- after the dense expert is read from the checkpoint or
  drawn from the preset's seed -- into ONE uint8 buffer per expert, so an expert is still one
  copy: [fp32: each matrix's scales | the layout's other values (biases) | uint8: each matrix's
  int4 zero points | its int8 / packed int4 values], padded to 16 bytes. `run`, for a SwiGLU
  expert's rows (<= engine.kernels.cpu.QUANT_MAX_ROWS, fp32) on the CPU, runs the CPU kernel on
  the packed bytes themselves (integer values converted in registers, each scale applied once to
  a row's or a group's sum: the dequantised expert's product up to fp32 rounding, without writing
  it; every placement runs the same path for the same rows, so the invariant holds within a
  treatment); otherwise it dequantises into a dense expert in the activation dtype and runs the
  dense kernel on it. With `activations="int8"` (experts.activations) every product's inputs are
  rounded to int8 per block of 32 first (engine.blocks.intquant.round_activations) on either path,
  the kernel's `*_q8_` forms multiplying integers: a treatment of its own, labelled `+a8`.
- `MixedExperts`: per MoE layer, the most popular experts kept in int8 and the rest in int4.
  Every row of the store and every cache slot is the int8 size (the larger), an int4 expert uses
  its first bytes; an expert's stored bytes (`expert_numel`) are what is copied and counted,
  and the kernel tells the two formats apart by the length of the buffer it is handed.
Does not own: the quantisers' arithmetic (engine.blocks.intquant), where experts live (engine.cache).

    spec = resolve_expert_quant(cfg, "int4", group_size=32)      # or "int8", "mixed", "none" -> None
    cfg = cfg.replace(expert_quant=spec); cfg.architecture().experts.nbytes(2)   # stored bytes

A `mixed` treatment needs popularity: `popularity=FILE` (a [moe layers][experts] table, .json,
.csv or .npy, as the static policy reads) or `trace=FILE` (a routing trace .npz recorded on this
model, `run.record_trace=true`; its per-layer expert counts). The `mixed_count` most popular
experts of each layer (or round(mixed_fraction * n_experts); ties: lower id first) are int8.

Dimension legend: R=rows (output channels), C=inputs, G=C/group_size, n=rows routed, D=hidden.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.blocks.experts import ByteLayout, ExpertLayout, RandomTensor, SwiGLUExperts
from engine.blocks.intquant import (ACT_BLOCK, check_group, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8,
                                    round_activations)
from engine.checkpoint import Checkpoint
from engine.kernels import cpu as cpu_kernels
from engine.layers import expert_ffn, gated
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

QUANT_MODES = ("none", "int8", "int4", "mixed")
ACTIVATIONS = ("fp32", "int8")     # what an expert matrix's inputs are: as computed, or rounded to int8 per block
MIXED_HIGH = ("int8",)             # the higher precision of a mixed treatment
DEFAULT_GROUP = 32
DEFAULT_MIXED_FRACTION = 0.25
ALIGN = 16                         # every packed expert a multiple of this, so each row's fp32 view is aligned


@dataclass(frozen=True)
class ExpertQuant:
    mode: str                                            # int8 | int4 | mixed
    group_size: int = DEFAULT_GROUP                      # int4 (and mixed's int4 experts)
    high: tuple[tuple[int, tuple[int, ...]], ...] = ()   # mixed: (moe layer, its int8 expert ids), per layer
    activations: str = "fp32"                            # "int8": each matrix's inputs rounded per block first

    @property
    def label(self) -> str:
        """The treatment as a results column names it: the mode, "+a8" with int8 activations."""
        return label_of(self.mode, self.activations)

    def high_of(self, layer: int) -> frozenset[int]:
        return frozenset(dict(self.high).get(layer, ()))


def label_of(mode: str, activations: str = "fp32") -> str:
    """A treatment's name in results: `mode`, and "+a8" where its activations are int8."""
    return f"{mode}+a8" if activations == "int8" and mode != "none" else mode


def resolve_expert_quant(cfg: Any, mode: str, group_size: int = DEFAULT_GROUP, mixed_count: int | None = None,
                         mixed_fraction: float | None = None, mixed_high: str = "int8",
                         popularity: str | None = None, trace: str | None = None,
                         activations: str = "fp32") -> ExpertQuant | None:
    """The treatment `mode` for model `cfg` (None for "none", the exact experts); ValueError naming
    the option, what is allowed and what was given."""
    if mode not in QUANT_MODES:
        raise ValueError(f"experts.quant must be one of {list(QUANT_MODES)}, got {mode!r}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"experts.activations must be one of {list(ACTIVATIONS)}, got {activations!r}")
    if activations != "fp32" and mode == "none":
        raise ValueError(f"experts.activations={activations} rounds the inputs of quantised experts' products; "
                         f"it needs experts.quant=int8|int4|mixed, got experts.quant=none")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"experts.group_size must be an even int >= 2, got {group_size!r}")
    mixed_given = [k for k, v in (("mixed_count", mixed_count), ("mixed_fraction", mixed_fraction),
                                  ("popularity", popularity), ("trace", trace)) if v is not None]
    if mode != "mixed":
        if mixed_given:
            raise ValueError(f"experts.{mixed_given[0]} applies to experts.quant=mixed only, got experts.quant={mode}")
        return None if mode == "none" else ExpertQuant(mode, group_size, activations=activations)
    if mixed_high not in MIXED_HIGH:
        raise ValueError(f"experts.mixed_high must be one of {list(MIXED_HIGH)}, got {mixed_high!r}")
    E = cfg.n_experts
    if mixed_count is not None and mixed_fraction is not None:
        raise ValueError("give experts.mixed_count or experts.mixed_fraction, not both")
    if mixed_count is not None:
        if isinstance(mixed_count, bool) or not isinstance(mixed_count, int) or not 0 <= mixed_count <= E:
            raise ValueError(f"experts.mixed_count must be an int in [0, n_experts={E}], got {mixed_count!r}")
        n_high = mixed_count
    else:
        frac = DEFAULT_MIXED_FRACTION if mixed_fraction is None else mixed_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
            raise ValueError(f"experts.mixed_fraction must be a number in [0, 1], got {mixed_fraction!r}")
        n_high = int(frac * E + 0.5)
    table = _popularity(cfg, popularity, trace)
    high = tuple((layer, tuple(sorted(sorted(range(E), key=lambda e: (-table[layer][e], e))[:n_high])))
                 for layer in cfg.moe_layers)
    return ExpertQuant("mixed", group_size, high, activations)


def _popularity(cfg: Any, popularity: str | None, trace: str | None) -> dict[int, list[float]]:
    from engine.trace import expert_counts, popularity_table, trace_for_model
    if popularity and trace:
        raise ValueError("give experts.quant=mixed one source of popularity: experts.popularity=FILE or "
                         "experts.trace=FILE, not both")
    if popularity:
        return popularity_table(popularity, cfg)
    if trace:
        tr = trace_for_model(trace, cfg)
        return dict(zip(tr.moe_layers, expert_counts(tr).tolist()))
    raise ValueError("experts.quant=mixed ranks experts by popularity and needs experts.popularity=FILE "
                     "(.json/.csv/.npy, [moe layers][experts] counts) or experts.trace=FILE (a routing trace "
                     "recorded on this model: run.record_trace=true writes <job dir>/routing.npz)")


def quantized_layout(base: ExpertLayout, spec: ExpertQuant | None) -> ExpertLayout:
    """The layout that stores `base`'s experts under treatment `spec` (base itself for None)."""
    if spec is None:
        return base
    if spec.mode == "mixed":
        return MixedExperts(base, QuantExperts(base, "int8", activations=spec.activations),
                            QuantExperts(base, "int4", spec.group_size, spec.activations),
                            {layer: frozenset(ids) for layer, ids in spec.high})
    return QuantExperts(base, spec.mode, spec.group_size, spec.activations)


class QuantExperts(ByteLayout):
    """`base`'s expert quantised to `fmt` ("int8" | "int4"), one uint8 buffer (module docstring);
    `activations="int8"`: each matrix's inputs rounded to int8 per block (intquant.round_activations)
    before the product, as llama.cpp's Q8_0 / Q4_0 dot products do."""

    def __init__(self, base: ExpertLayout, fmt: str, group_size: int = DEFAULT_GROUP, activations: str = "fp32") -> None:
        if fmt not in ("int8", "int4"):
            raise ValueError(f"QuantExperts format must be 'int8' or 'int4', got {fmt!r}")
        self.base, self.fmt, self.group, self.activations = base, fmt, group_size, activations
        self.fused_on_hub = base.fused_on_hub
        self.mats = base.matrices()                       # ((R, C), ...): raises for a layout that cannot be quantised
        if fmt == "int4":
            for _, C in self.mats:
                check_group(C, group_size)
        self.rest = base.numel - sum(R * C for R, C in self.mats)
        f32 = [R * (C // group_size if fmt == "int4" else 1) for R, C in self.mats]     # scales per matrix
        u8 = [(R * (C // group_size), R * C // 2) if fmt == "int4" else (0, R * C) for R, C in self.mats]
        o, self.scale_at, self.zero_at, self.q_at = 0, [], [], []
        for n in f32:
            self.scale_at.append((o, n))
            o += 4 * n
        self.rest_at = (o, self.rest)
        o += 4 * self.rest
        for nz, nq in u8:
            self.zero_at.append((o, nz))
            o += nz
            self.q_at.append((o, nq))
            o += nq
        self._numel = -(-o // ALIGN) * ALIGN
        # the CPU kernel runs gate|up and down from the packed bytes: a plain SwiGLU expert (nothing
        # but its matrices), int4 groups it can read
        plain = type(base) is SwiGLUExperts and self.rest == 0
        if activations == "int8":
            if not plain or any(C % ACT_BLOCK for _, C in self.mats):
                raise ValueError(f"experts.activations=int8 runs plain SwiGLU experts whose matrices have a multiple "
                                 f"of {ACT_BLOCK} inputs; {type(base).__name__} with inputs "
                                 f"{[C for _, C in self.mats]} is not one (allowed for it: experts.activations=fp32)")
            self._kernel_ok = fmt == "int8" or cpu_kernels.int4_q8_group_ok(group_size)
        else:
            self._kernel_ok = plain and (fmt == "int8" or cpu_kernels.int4_group_ok(group_size))

    quant = property(lambda self: self.fmt)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def params(self) -> int:
        return self.base.params


    # --- packing ------------------------------------------------------------------------------
    @staticmethod
    def _f32(out: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
        o, n = at
        return out[o:o + 4 * n].view(torch.float32)

    def pack(self, dense: torch.Tensor, out: torch.Tensor) -> None:
        """dense [base.numel] (any float dtype) -> the packed uint8 buffer out [>= numel]."""
        o = 0
        for k, (R, C) in enumerate(self.mats):
            w = dense[o:o + R * C].view(R, C)
            o += R * C
            qo, qn = self.q_at[k]
            if self.fmt == "int8":
                q, scale = quantize_int8(w)
                out[qo:qo + qn].copy_(q.view(torch.uint8).reshape(-1))
            else:
                q, scale, zero = quantize_int4(w, self.group)
                zo, zn = self.zero_at[k]
                out[zo:zo + zn].copy_(zero.reshape(-1))
                out[qo:qo + qn].copy_(q.reshape(-1))
            self._f32(out, self.scale_at[k]).copy_(scale.reshape(-1))
        self._f32(out, self.rest_at).copy_(dense[o:].float())
        out[self.q_at[-1][0] + self.q_at[-1][1]:self.numel].zero_()          # padding

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised dense expert [base.numel] in `dtype`, on packed's device."""
        dense = torch.empty(self.base.numel, dtype=dtype, device=packed.device)
        o = 0
        for k, (R, C) in enumerate(self.mats):
            qo, qn = self.q_at[k]
            scale = self._f32(packed, self.scale_at[k])
            if self.fmt == "int8":
                w = dequantize_int8(packed[qo:qo + qn].view(torch.int8).view(R, C), scale, dtype)
            else:
                zo, zn = self.zero_at[k]
                G = C // self.group
                w = dequantize_int4(packed[qo:qo + qn].view(R, C // 2), scale.view(R, G),
                                    packed[zo:zo + zn].view(R, G), self.group, dtype)
            dense[o:o + R * C].copy_(w.reshape(-1))
            o += R * C
        dense[o:].copy_(self._f32(packed, self.rest_at))
        return dense

    # --- the ExpertLayout interface -----------------------------------------------------------
    def read_into(self, ckpt: Checkpoint, layer: int, e: int, out: torch.Tensor) -> None:
        dense = torch.empty(self.base.numel, dtype=torch.float32)
        self.base.read_into(ckpt, layer, e, dense)        # the exact expert, then quantised
        self.pack(dense, out)

    def random_into(self, random: RandomTensor, layer: int, e: int, out: torch.Tensor) -> None:
        """The preset's seeded dense expert (the same values the exact model draws), quantised."""
        dense = torch.empty(self.base.numel, dtype=torch.float32)
        self.base.random_into(random, layer, e, dense)
        self.pack(dense, out)

    def hub_tensors(self, layer: int, e: int, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dequantised, under the dense layout's names (export writes what the treatment computes with)."""
        return self.base.hub_tensors(layer, e, self.unpack(packed[:self.numel], torch.float32))

    def run(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        if self._kernel_ok and cpu_kernels.quant_usable(x, packed) and packed.data_ptr() % 4 == 0:
            return self.run_packed(x, packed)
        if self.activations == "int8":      # the dequantised expert on rounded inputs: what the kernel computes
            base = self.base
            return expert_ffn(x, self.unpack(packed, x.dtype), base.D, base.I, base.act,
                              lambda a, w: F.linear(round_activations(a), w))
        return self.base.run(x, self.unpack(packed, x.dtype))

    def run_packed(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The expert on rows x by the CPU kernel on the packed bytes, whatever the row count (`run`
        takes it up to engine.kernels.cpu.QUANT_MAX_ROWS; benchmarks/bench_quant_rows.py beyond)."""
        gate, up = self._packed_linear(x, packed, 0).chunk(2, dim=-1)          # [n, I] each
        return self._packed_linear(gated(gate, up, self.base.act), packed, 1)   # as engine.layers.expert_ffn

    def _packed_linear(self, x: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
        """x @ dequant(matrix k)^T by the CPU kernel, reading the matrix's parts where pack put them."""
        R, C = self.mats[k]
        if self.activations == "int8":
            if self.fmt == "int8":
                return cpu_kernels.int8_q8_linear(x, packed, self.q_at[k][0], self.scale_at[k][0], R, C)
            return cpu_kernels.int4_q8_linear(x, packed, self.q_at[k][0], self.scale_at[k][0], self.zero_at[k][0], R,
                                              C, self.group)
        if self.fmt == "int8":
            return cpu_kernels.int8_linear(x, packed, self.q_at[k][0], self.scale_at[k][0], R, C)
        return cpu_kernels.int4_linear(x, packed, self.q_at[k][0], self.scale_at[k][0], self.zero_at[k][0], R, C,
                                       self.group)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        # the dense kernel's, the dequantised expert, and the largest matrix's temporaries: its unpacked
        # uint8 values (and the nibble pair they came from) and two float32 copies
        big = max(R * C for R, C in self.mats)
        return (self.base.activation_bytes(rows, dtype_bytes) + self.base.numel * dtype_bytes
                + big * (2 + 4 + 4 + dtype_bytes))


class MixedExperts(ByteLayout):
    """Per MoE layer, the experts in `high[layer]` stored by `hi` (int8), the rest by `lo` (int4)."""

    def __init__(self, base: ExpertLayout, hi: QuantExperts, lo: QuantExperts, high: dict[int, frozenset[int]]) -> None:
        if hi.numel == lo.numel:
            raise ValueError(f"mixed experts tell formats apart by size, but {hi.fmt} and {lo.fmt} are both "
                             f"{hi.numel} bytes")
        self.base, self.hi, self.lo, self.high = base, hi, lo, high
        self.fused_on_hub = base.fused_on_hub
        self._by_numel = {hi.numel: hi, lo.numel: lo}

    quant = "mixed"

    def fmt_of(self, layer: int, e: int) -> QuantExperts:
        return self.hi if e in self.high.get(layer, frozenset()) else self.lo

    @property
    def numel(self) -> int:
        return max(self.hi.numel, self.lo.numel)          # a store row / cache slot holds either

    def expert_numel(self, layer: int, e: int) -> int:
        return self.fmt_of(layer, e).numel

    @property
    def params(self) -> int:
        return self.base.params


    def mean_nbytes(self, dtype_bytes: int, n_experts: int, layers: Iterable[int]) -> float:
        layers = list(layers)
        total = sum(self.expert_numel(l, e) for l in layers for e in range(n_experts))
        return total / (len(layers) * n_experts)

    def read_into(self, ckpt: Checkpoint, layer: int, e: int, out: torch.Tensor) -> None:
        out.zero_()
        fmt = self.fmt_of(layer, e)
        fmt.read_into(ckpt, layer, e, out[:fmt.numel])

    def random_into(self, random: RandomTensor, layer: int, e: int, out: torch.Tensor) -> None:
        out.zero_()
        fmt = self.fmt_of(layer, e)
        fmt.random_into(random, layer, e, out[:fmt.numel])

    def hub_tensors(self, layer: int, e: int, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        fmt = self.fmt_of(layer, e)
        return fmt.hub_tensors(layer, e, packed[:fmt.numel])

    def run(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        fmt = self._by_numel.get(packed.numel())
        if fmt is None:
            raise ValueError(f"a mixed expert buffer must hold {self.lo.numel} (int4) or {self.hi.numel} (int8) "
                             f"bytes, got {packed.numel()}: pass the store's `expert(layer, e)` view")
        return fmt.run(x, packed)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        return max(self.hi.activation_bytes(rows, dtype_bytes), self.lo.activation_bytes(rows, dtype_bytes))
