"""What every block is: tensors it declares and holds, and the forward pass it runs in.

Owns: `TensorSpec` (a tensor's checkpoint name, shape and how a preset's seeded random
weights draw it), `Block` (declares its tensors, holds them once loaded, counts its
parameters), `Transient` (a block's transient bytes, for the planner) and `Pass` (what the blocks of one forward pass share: positions, memoised rope
tables and masks, the instrument, and the model's hand-off of routed experts to the
placement). Does not own: the numerics (engine.layers) or where weights live (engine.model).

Blocks are plain objects and cheap to build without weights, so the planner and the exporter
build the very blocks the model runs and read their tensors, state terms and activation
bounds -- one home for each shape.

    for block, key, spec in layer.walk():     # every tensor a layer needs, with its owner
        block.w[key] = load(spec)
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


INITS = ("normal", "ones", "zeros", "router", "fan_in")
# std 0.02 | ones | zeros | std 1.0 (softmax routing decided by clear margins) | std 1/sqrt(fan-in): logits of
# std ~1 (a sigmoid router's scores spread over (0, 1) instead of saturating into exact ties at 1.0)


@dataclass(frozen=True)
class TensorSpec:
    name: str                   # the tensor's name in the checkpoint
    shape: tuple[int, ...]
    init: str = "normal"        # how a preset's seeded random weights draw it (INITS)
    dtype: str | None = None    # None: the model's dtype; "float32": kept in fp32 whatever it runs in
                                # (transformers' _keep_in_fp32_modules: DeepSeek-V3's router bias)

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"tensor {self.name!r}: init must be one of {INITS}, got {self.init!r}")
        if self.dtype not in (None, "float32"):
            raise ValueError(f"tensor {self.name!r}: dtype must be None (the model's) or 'float32', got {self.dtype!r}")

    def nbytes(self, dtype_bytes: int) -> int:
        """Bytes on the device when the model runs at `dtype_bytes` per element."""
        return self.numel * (4 if self.dtype == "float32" else dtype_bytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Transient:
    """A block's transient bytes over a micro-batch: `held` alive through its whole run, `peak`
    of its largest single step on top. The norm that makes a block's input is one more step
    before it, so a layer bounds the block by `after(norm)`; a block that does not split its
    bound reports it all as held."""

    held: int
    peak: int = 0

    @property
    def total(self) -> int:
        return self.held + self.peak

    def after(self, step: int) -> int:
        return self.held + max(step, self.peak)


class Block:
    """A piece of a decoder layer. Subclasses declare `tensors()` (local key -> TensorSpec) and
    list sub-blocks in `children()`; once loaded, `self.w[key]` holds each tensor."""

    def __init__(self) -> None:
        self.w: dict[str, torch.Tensor] = {}

    def tensors(self) -> dict[str, TensorSpec]:
        return {}

    def children(self) -> tuple[Block, ...]:
        return ()

    def walk(self) -> Iterator[tuple[Block, str, TensorSpec]]:
        """(owner, key, spec) for every tensor of this block and its sub-blocks."""
        for key, spec in self.tensors().items():
            yield self, key, spec
        for child in self.children():
            yield from child.walk()

    def params(self) -> int:
        return sum(spec.numel for _, _, spec in self.walk())


ExpertRunner = Callable[[int, "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class StaticStep:
    """A decode step whose kernels and their arguments do not depend on the host's token count
    (engine.static_decode: what a CUDA graph replays): the position of the one new token is the
    device tensor `pos` [1], and attention reads the first `keys` positions of the state's
    buffers (a bucket fixed per captured graph) under a mask computed on the device."""

    pos: torch.Tensor     # [1] int64 on the device: the new token's absolute position
    keys: int             # key positions every layer attends (masked past `pos`)

    def mask(self) -> torch.Tensor:
        """[1, keys] bool: True where a key position is at or before the new token's."""
        return (torch.arange(self.keys, device=self.pos.device) <= self.pos)[None, :]


class Pass:
    """One forward pass over [B, T] new tokens after `past` held ones.

    `run_experts(layer, h, ids, weights)` is the model's hand-off of routed experts (routing
    hooks, step log, prefetcher, then the placement); `cached(key, make)` memoises what several
    layers share (rope tables per Rope, masks per window), computed once per pass. A static
    step (`static`, T = 1) has no host `past` (None: a block that reads it fails instead of
    baking a position into a captured graph); its position is `static.pos` on the device."""

    def __init__(self, batch: int, tokens: int, past: int | None, device: torch.device, dtype: torch.dtype,
                 span: Callable[..., AbstractContextManager], run_experts: ExpertRunner,
                 static: StaticStep | None = None) -> None:
        self.batch, self.tokens, self.past, self.static = batch, tokens, past, static
        self.device, self.dtype, self.span, self.run_experts = device, dtype, span, run_experts
        self._memo: dict[Hashable, Any] = {}

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions of the new tokens [T]."""
        if self.static is not None:
            return self.static.pos
        return self.cached("positions", lambda: torch.arange(self.past, self.past + self.tokens, device=self.device))

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]
