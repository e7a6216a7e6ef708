"""Expert layouts: how one routed expert is packed, read, written and run.

Owns: the `ExpertLayout` interface the expert store, the placements' shared expert loop and
the exporter ask -- the packed buffer's size and storage dtype (so a quantised or biased
expert is still one contiguous buffer and one copy), reading one expert from a checkpoint
into it (per-expert Hub tensors or fused stacked ones), drawing a preset's seeded random one,
writing it back under Hub names, and the kernel that runs it on a set of rows -- and
`SwiGLUExperts`, the first wave's gate/up/down expert, whose products on the CPU are the engine's
own small-batch kernel (engine.kernels.cpu: a decode step's rows on every intra-op thread). Does not own: where experts live
(engine.cache), which rows an expert gets or how outputs accumulate
(engine.placements.base.Placement.combine: that order is the invariant's).

A family with another expert (GPT-OSS's clamped SwiGLU with biases, MXFP4 blocks whose
storage dtype is uint8) subclasses ExpertLayout; placements need no change.

Dimension legend: n=rows routed to one expert, D=hidden, I=expert intermediate, P=packed numel.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.checkpoint import Checkpoint, MissingTensorError
from engine.kernels import cpu as cpu_kernels
from engine.layers import cast, expert_ffn, expert_ffn_grouped, grouped_mm_supported, swiglu_matrices
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

RandomTensor = Callable[[str, tuple[int, ...]], "torch.Tensor"]   # name, shape -> seeded fp32 values (std 0.02)


class ExpertLayout(ABC):
    fused_on_hub: bool = False   # the Hub stacks a layer's experts ([E, ...] tensors), not one set each
    quant: str = "none"          # the lossy treatment it stores (engine.blocks.quant_experts), "none": exact
    stored_format: str | None = None   # a published format it keeps as stored (engine.formats); None: dense

    @property
    @abstractmethod
    def numel(self) -> int:
        """Elements of one packed expert buffer."""

    @property
    def params(self) -> int:
        """Parameters of one expert (FLOP and size arithmetic); the packed numel unless quantised."""
        return self.numel

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The packed buffer's dtype when the model runs in `dtype` (a quantised layout: uint8)."""
        return dtype

    def nbytes(self, dtype_bytes: int) -> int:
        """Bytes of one packed expert when the model runs at `dtype_bytes` per element."""
        return self.numel * dtype_bytes

    def expert_numel(self, layer: int, e: int) -> int:
        """Elements expert (layer, e) really stores: `numel`, unless experts differ in size (a mixed
        treatment), when a store row or cache slot holds `numel` and the expert its first ones."""
        return self.numel

    def mean_nbytes(self, dtype_bytes: int, n_experts: int, layers: Iterable[int]) -> float:
        """Mean stored bytes of one expert over `layers` (what an average copy moves)."""
        return float(self.nbytes(dtype_bytes))

    def matrices(self) -> tuple[tuple[int, int], ...]:
        """The weight matrices a quantised treatment quantises: ((rows=outputs, cols=inputs), ...),
        laid row-major one after another at the start of the packed buffer; the rest of it (biases)
        is kept as it is. A layout that cannot be quantised raises ValueError."""
        raise ValueError(f"expert layout {type(self).__name__} does not declare its weight matrices, so "
                         f"experts.quant cannot quantise it; allowed for it: experts.quant=none")

    @abstractmethod
    def read_into(self, ckpt: Checkpoint, layer: int, e: int, out: torch.Tensor) -> None:
        """Write expert (layer, e) from the checkpoint into the 1-D packed buffer `out`."""

    def random_into(self, random: RandomTensor, layer: int, e: int, out: torch.Tensor) -> None:
        """A preset's seeded random expert (layer, e), drawn as one packed buffer."""
        out.copy_(random(f"model.layers.{layer}.experts.{e}", (self.numel,)))

    @abstractmethod
    def hub_tensors(self, layer: int, e: int, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Expert (layer, e) under its per-expert Hub names (what export writes and read_into reads);
        for a layout `fused_on_hub`, its row of each stacked tensor under that tensor's name."""

    def hub_layer(self, layer: int, experts: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every expert of MoE layer `layer` (packed buffers in id order, each valid until the next
        is drawn) under Hub names: per expert, or stacked [E, ...] for a layout `fused_on_hub`."""
        rows = [self.hub_tensors(layer, e, packed) for e, packed in enumerate(experts)]
        if not self.fused_on_hub:
            return {name: t for row in rows for name, t in row.items()}
        return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}

    @abstractmethod
    def run(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The expert on rows x [n, D] from its packed buffer [P] -> [n, D] (unweighted)."""

    def run_add_(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, gate: torch.Tensor) -> None:
        """`out.add_(run(x, packed) * gate)` (out [n, D] in x's dtype, gate [n, 1]): a routed expert's
        weighted output added in place (a layout may do it in one op: the same values)."""
        out.add_(cast(self.run(x, packed) * gate, out.dtype))

    def grouped_supported(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `run_grouped` can run this layout at `dtype` on `device` (False: no grouped kernel)."""
        return False

    def run_grouped(self, x: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Every expert of a layer on rows grouped by expert, with no host sync: x [M, D] sorted by
        expert, rows [E, P] the layer's packed experts, offs [E] int32 end of each expert's group
        -> [M, D] unweighted; each group bitwise equal to `run` on it (the invariant)."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped kernel")

    @abstractmethod
    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        """Transient bytes of `run` over `rows` rows."""



class ByteLayout(ExpertLayout):
    """A layout whose packed buffer is raw bytes (MXFP4, int8, int4): stored as uint8 whatever
    the model runs in, so an expert's bytes are its `numel` at any compute dtype."""

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def nbytes(self, dtype_bytes: int) -> int:
        return self.numel

class SwiGLUExperts(ExpertLayout):
    """act(x @ gate^T) * (x @ up^T) @ down^T, packed as [gate (I*D) | up (I*D) | down (D*I)]."""

    def __init__(self, hidden: int, intermediate: int, act: str, prefix: str,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 fused_prefixes: tuple[str, ...] = ("model.layers.{layer}.mlp",), fused_on_hub: bool = False) -> None:
        """prefix: the MoE block's, with a {layer} field ("model.layers.{layer}.block_sparse_moe");
        names: per-expert (gate, up, down) tensor names under `{prefix}.experts.{e}.`; fused
        stacked `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I] are also read
        under `prefix` and each of `fused_prefixes`; fused_on_hub: export writes that stacked form
        (Gemma 4's checkpoints) instead of the per-expert names."""
        self.D, self.I, self.act, self.prefix, self.names = hidden, intermediate, act, prefix, names
        self.fused_prefixes, self.fused_on_hub = fused_prefixes, fused_on_hub

    @property
    def numel(self) -> int:
        return 3 * self.D * self.I

    def expert_names(self, layer: int, e: int) -> tuple[str, str, str]:
        p = f"{self.prefix.format(layer=layer)}.experts.{e}."
        return tuple(p + n + ".weight" for n in self.names)

    def _views(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D, I = self.D, self.I
        return out[: 2 * I * D].view(2 * I, D), out[2 * I * D:].view(D, I)           # [2I, D], [D, I]

    def read_into(self, ckpt: Checkpoint, layer: int, e: int, out: torch.Tensor) -> None:
        gate, up, down = self.expert_names(layer, e)
        gu, dn = self._views(out)
        D, I = self.D, self.I
        if ckpt.has(gate):
            gu[:I].copy_(ckpt.weight(gate, (I, D)))
            gu[I:].copy_(ckpt.weight(up, (I, D)))
            dn.copy_(ckpt.weight(down, (D, I)))
            return
        prefix = self.prefix.format(layer=layer)
        for p in (prefix, *(f.format(layer=layer) for f in self.fused_prefixes)):
            fused = f"{p}.experts.gate_up_proj"
            if ckpt.has(fused):
                gu.copy_(ckpt.weight(fused, (2 * I, D), row=e))
                dn.copy_(ckpt.weight(f"{p}.experts.down_proj", (D, I), row=e))
                return
        raise MissingTensorError(f"tensor {gate!r} is missing from checkpoint {ckpt.path} "
                                 f"(no fused {prefix}.experts.gate_up_proj either)")

    def hub_tensors(self, layer: int, e: int, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        gu, dn = self._views(packed)
        if self.fused_on_hub:
            p = f"{self.prefix.format(layer=layer)}.experts."
            return {p + "gate_up_proj": gu.clone(), p + "down_proj": dn.clone()}
        gate, up, down = self.expert_names(layer, e)
        return {gate: gu[: self.I].clone(), up: gu[self.I:].clone(), down: dn.clone()}

    def matrices(self) -> tuple[tuple[int, int], ...]:
        return ((2 * self.I, self.D), (self.D, self.I))                                # gate|up, down

    def run(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """On the CPU, engine.kernels.cpu's products: a decode step's few rows read the weights on
        every intra-op thread (torch's GEMV reads them on one core here); elsewhere F.linear."""
        if not cpu_kernels.usable(x, packed):
            return expert_ffn(x, packed, self.D, self.I, self.act)
        if self.one_op:               # the same kernels and activation in one op: no return to Python between
            return cpu_kernels.swiglu(x, *swiglu_matrices(packed, self.D, self.I))
        return expert_ffn(x, packed, self.D, self.I, self.act, cpu_kernels.small_linear)

    def run_add_(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, gate: torch.Tensor) -> None:
        if (self.one_op and cpu_kernels.usable(x, packed) and out.dtype == gate.dtype == x.dtype
                and out.is_contiguous()):
            cpu_kernels.swiglu_add_(out, x, *swiglu_matrices(packed, self.D, self.I), gate)
        else:
            super().run_add_(out, x, packed, gate)

    @property
    def one_op(self) -> bool:
        """Whether the kernels run this expert whole, in one op, where they run (engine.kernels.cpu.
        swiglu: SiLU's gating is the one they have)."""
        return self.act == "silu"

    def grouped_supported(self, dtype: torch.dtype, device: torch.device) -> bool:
        return grouped_mm_supported(dtype, device)

    def run_grouped(self, x: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Each group takes `run`'s path for its rows (on the CPU the kernel's, which reads the
        group sizes there), so a group's output is bitwise `run` on it."""
        linear = cpu_kernels.grouped_small_linear if cpu_kernels.usable(x, rows) else None
        return expert_ffn_grouped(x, rows, offs, self.D, self.I, self.act, linear)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        return rows * (2 * self.D + 4 * self.I) * dtype_bytes     # rows, gate|up, act, act*up / down, *weight
