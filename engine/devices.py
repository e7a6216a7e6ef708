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
allocations counted against the budget, and copies are real memcpys run on a worker
thread (torch releases the GIL in copy_), so they really overlap compute and are timed by
wall clock; bytes moved are real but link speeds are not (results say emulated=true).
Every asynchronous copy is reported to the instrument (`Instrument.copy`): wall-clock
intervals on the emulated device, start/end CUDA events on CUDA.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.hooks import NULL, Instrument


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
class CopyHandle:
    """An issued host->device copy: a future (emulated) or start/end events (CUDA)."""

    nbytes: int
    future: Future | None = None
    start: Any = None
    end: Any = None


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
        # one worker: copies complete in issue order, like a CUDA copy stream
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="moebench-copy") if kind == "cpu" else None
        self.instrument: Instrument = NULL

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
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 info: dict[str, Any] | None = None) -> CopyHandle:
        """Start copying host `src` into device `dst`; returns a handle to `wait` on.

        CUDA: on the dedicated copy stream, first waiting for `after` (the event of the
        last compute that read `dst`), so a buffer is never overwritten while in use;
        start and end events bracket the copy. Emulated: on the copy worker thread (the
        main thread's compute is synchronous, so `dst`'s readers are already done).
        """
        nbytes = src.numel() * src.element_size()
        info = info or {}
        inst = self.instrument
        if self._worker is not None:
            def run() -> None:
                t0 = time.perf_counter()
                dst.copy_(src)
                if inst.enabled:
                    inst.copy(t0, time.perf_counter(), nbytes, info)
            return CopyHandle(nbytes, future=self._worker.submit(run))
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            start, end = torch.cuda.Event(enable_timing=inst.enabled), torch.cuda.Event(enable_timing=inst.enabled)
            start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.copy_stream)
        if inst.enabled:
            inst.copy_events(start, end, nbytes, info)
        return CopyHandle(nbytes, start=start, end=end)

    def wait(self, handle: CopyHandle | None) -> None:
        """Block compute until the copy is done: the compute stream waits on the copy's end
        event (no device-wide synchronise) on CUDA; the worker's future on the emulated device."""
        if handle is None:
            return
        if handle.future is not None:
            if handle.future.done() or not self.instrument.enabled:
                handle.future.result()
            else:
                with self.instrument.span("wait", bytes=handle.nbytes):
                    handle.future.result()
        else:
            torch.cuda.current_stream(self.torch_device).wait_event(handle.end)

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
        """Wait for all device work, copies included."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self._worker is not None:
            self._worker.submit(lambda: None).result()   # the worker runs in order: all earlier copies are done


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
