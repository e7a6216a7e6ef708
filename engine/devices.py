"""The compute device: real CUDA, or a CPU-emulated device with an accounted memory budget.

Owns: where "device" tensors live, device-memory accounting against a budget, host
buffers (pinned on CUDA), and the copy mechanism (a dedicated copy stream with CUDA
events on CUDA; real memory copies on the emulated device).
Does not own: what to copy or when (engine.cache, placements), counters.

    dev = Device.create("auto", budget_bytes=None)
    buf = dev.empty((4, 1024), torch.float32, label="expert_slots")   # accounted
    ev = dev.copy_h2d(buf[0], host_row)                                # async on CUDA
    dev.wait(ev)                                                       # compute waits on the event

On the emulated device every tensor is in host RAM; "device" tensors are separate
allocations counted against the budget, and copies are real memcpys, so bytes moved
are real but link speeds are not (results say emulated=true).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class DeviceMemoryError(MemoryError):
    """An allocation on the (emulated) device would exceed its budget."""


def fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(v: int | str | None) -> int | None:
    """'64MiB', '2GB', 1048576 or None -> bytes."""
    if v is None or isinstance(v, int):
        return v
    s = str(v).strip().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.upper().endswith(u):
            return int(float(s[: -len(u)]) * mult)
    try:
        return int(float(s))
    except ValueError:
        raise ValueError(f"cannot read {v!r} as a size; use bytes or e.g. '512MiB', '8GiB'") from None


@dataclass
class MemoryLedger:
    """Bytes held on the device by label, with a peak and an optional budget."""

    budget: int | None
    held: dict[str, int] = field(default_factory=dict)
    peak: int = 0

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def take(self, label: str, nbytes: int) -> None:
        if self.budget is not None and self.total + nbytes > self.budget:
            lines = [f"  {k:<24} {fmt_bytes(v):>12}" for k, v in sorted(self.held.items())]
            raise DeviceMemoryError(
                f"device budget exceeded allocating {fmt_bytes(nbytes)} for {label!r}:\n" + "\n".join(lines)
                + f"\n  {'+ ' + label:<24} {fmt_bytes(nbytes):>12}\n  {'= total':<24} "
                f"{fmt_bytes(self.total + nbytes):>12} > budget {fmt_bytes(self.budget)}")
        self.held[label] = self.held.get(label, 0) + nbytes
        self.peak = max(self.peak, self.total)

    def give(self, label: str, nbytes: int) -> None:
        self.held[label] = self.held.get(label, 0) - nbytes
        if self.held[label] <= 0:
            del self.held[label]


class Device:
    """Either CUDA (kind='cuda') or the emulated device on the CPU (kind='cpu')."""

    def __init__(self, kind: str, budget_bytes: int | None = None, index: int = 0) -> None:
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {kind!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False")
        self.kind = kind
        self.emulated = kind == "cpu"
        self.torch_device = torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")
        if budget_bytes is None and kind == "cuda":
            budget_bytes = torch.cuda.mem_get_info(self.torch_device)[0]
        self.ledger = MemoryLedger(budget_bytes)
        self.copy_stream = torch.cuda.Stream(self.torch_device) if kind == "cuda" else None

    @classmethod
    def create(cls, spec: str = "auto", budget_bytes: int | str | None = None) -> "Device":
        kind = ("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec
        return cls(kind, parse_bytes(budget_bytes))

    @property
    def name(self) -> str:
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.torch_device)
        return "cpu (emulated device)"

    # --- allocation ------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, label: str) -> torch.Tensor:
        nbytes = _numel(shape) * dtype.itemsize
        self.ledger.take(label, nbytes)
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def adopt(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """Move a weight to the device (a real copy on the emulated device too) and account it."""
        self.ledger.take(label, t.numel() * t.element_size())
        if self.emulated:
            return t.clone() if t.is_contiguous() else t.contiguous()
        return t.to(self.torch_device)

    def release(self, label: str, t: torch.Tensor) -> None:
        self.ledger.give(label, t.numel() * t.element_size())

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host buffer; page-locked on CUDA so a host->device copy is one DMA."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.kind == "cuda")

    # --- copies and ordering ---------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: "torch.cuda.Event | None" = None):
        """Copy host `src` into device `dst`; returns an event to wait on (None when already done).

        On CUDA the copy runs on the dedicated copy stream, first waiting for `after` (the
        last compute that read `dst`), so a buffer is never overwritten while in use.
        """
        if self.copy_stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return done

    def wait(self, event) -> None:
        """Make the compute stream wait for `event` (no device-wide synchronise)."""
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def record_compute(self):
        """An event marking the compute issued so far (None on the emulated device)."""
        if self.kind != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.torch_device))
        return ev

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Device -> host copy (a real copy on the emulated device too)."""
        return t.to("cpu", copy=True) if self.emulated else t.to("cpu")

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device copy of activations (not accounted: transient)."""
        return t.clone() if self.emulated else t.to(self.torch_device, non_blocking=False)

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
