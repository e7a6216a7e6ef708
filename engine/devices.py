"""The compute device: real CUDA, or a CPU-emulated device with an accounted memory budget.

Owns: where "device" tensors live, device-memory accounting against a budget (and, on CUDA,
the same budget as a cap on torch's caching allocator), host buffers (page-locked on CUDA
for placements that copy them, engine.hostmem), the copy mechanism (a dedicated copy
stream with CUDA events on CUDA; real memory copies on the emulated device) and the
synchronous activation copies of the CPU-expert placements, timed where they run.
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
intervals on the emulated device, start/end CUDA events on CUDA. Synchronous copies
(`to_host`, `to_device`) are reported the same way, marked `sync`, bracketed by events on
the compute stream on CUDA -- so a copy's interval is the copy, not a host span that also
waited for the kernels queued before it.

Copy start events and the smallest copy `link_gbps` is trusted for. An event recorded on
an idle copy stream completes at once, while the host is still launching the copy behind
it (torch's copy_ plus cudaMemcpyAsync: about 5-15 us), so the start would be early by
that launch latency L and a copy of S bytes on a link of B bytes/s would look like
S / (S/B + L). With an instrument on, `copy_h2d` therefore queues a short spin
(`COPY_GATE_CYCLES`, about 25 us at 2 GHz) on an idle copy stream before the start event,
so the event and the copy are both queued before the event can complete (a copy queued
behind earlier copies needs no gate: its start completes when they do). What remains is
the DMA engine's fixed per-copy setup (about 1-2 us), which is real link cost, plus any
launch latency beyond the gate on an overloaded host. Counting the worst case, a residual
of L = 7.5 us, the relative error of one copy's rate is L*B/S; at B = 55 GB/s (PCIe 5 x16)
it is <= 5% for S >= L*B/0.05 ~= 8.3 MB, so `link_gbps` is trusted for copies of at least
`LINK_TRUSTED_MIN_BYTES` = 8 MiB (Mixtral-8x7B bf16 experts are 336 MiB, OLMoE's 12 MiB,
Qwen3-30B-A3B's 9 MiB; tiny test models' are KiB and their link_gbps says nothing).
The gate only exists in instrumented runs, which are diagnostic: speed tables come from
runs with the instrument off (DESIGN.md §7).

Device budget on CUDA. An explicit `budget_bytes` is also set as torch's per-process
memory fraction for this GPU (`torch.cuda.set_per_process_memory_fraction(budget / total)`),
so a transient that pushes the caching allocator's reserved memory past the budget fails
with torch.OutOfMemoryError as it would on a card that small, instead of borrowing the
real card's spare memory. That cap is per process and device, not per engine: every other
engine and tensor in the same process on that GPU is held to it too (an engine built
without a budget, like the harness's resident reference, does not lift it); building
another engine with a budget replaces it, and `close()` (Engine.close) removes this
device's cap, restoring the cap of the most recent device still open (or none), so closing
a second engine never uncaps a first that is still in use. Without an explicit budget nothing is capped (the
ledger's budget is then the free memory at creation).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine import hostmem
from engine.hooks import NULL, Instrument
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

COPY_GATE_CYCLES = 50_000            # GPU clock cycles (~25 us at 2 GHz) an idle copy stream spins when timed
LINK_TRUSTED_MIN_BYTES = 8 << 20     # smallest copy whose event-timed rate link_gbps is trusted for
# CUDA device index -> the open devices that capped it, (id(Device), cap fraction), latest last
_allocator_caps: dict[int, list[tuple[int, float]]] = {}


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
        self.allocator_cap: int | None = None            # bytes torch's allocator is capped at (CUDA)
        if kind == "cuda":
            if budget_bytes is None:
                budget_bytes = torch.cuda.mem_get_info(self.torch_device)[0]
            else:
                self._cap_allocator(budget_bytes)
        self.ledger = MemoryLedger(budget_bytes)
        self.copy_stream = torch.cuda.Stream(self.torch_device) if kind == "cuda" else None
        # one worker: copies complete in issue order, like a CUDA copy stream
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="moebench-copy") if kind == "cpu" else None
        self.instrument: Instrument = NULL
        # race amplifier for tests (CUDA): every copy first waits this many GPU cycles on the copy
        # stream, so a read that does not wait for its copy's event sees stale bytes
        self.copy_delay_cycles = 0

    @classmethod
    def create(cls, spec: str = "auto", budget_bytes: int | str | None = None) -> "Device":
        kind = ("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec
        return cls(kind, parse_bytes(budget_bytes))

    @property
    def name(self) -> str:
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.torch_device)
        return "cpu (emulated device)"

    # --- the budget as an allocator cap (CUDA) ------------------------------------------
    def _cap_allocator(self, budget: int) -> None:
        total = torch.cuda.get_device_properties(self.torch_device).total_memory
        fraction = min(1.0, budget / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.torch_device)
        self.allocator_cap = min(budget, total)
        _allocator_caps.setdefault(self.torch_device.index, []).append((id(self), fraction))

    def close(self) -> None:
        """Remove this device's allocator cap; the latest cap of a device still open applies again."""
        if self.allocator_cap is not None:
            caps = _allocator_caps.get(self.torch_device.index, [])
            caps[:] = [c for c in caps if c[0] != id(self)]
            torch.cuda.set_per_process_memory_fraction(caps[-1][1] if caps else 1.0, self.torch_device)
        self.allocator_cap = None

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

    def pin_method(self, pin: bool) -> str:
        """How `host_empty(..., pin)` allocates (an engine.hostmem.PIN_METHODS name)."""
        return "register" if pin and self.kind == "cuda" else "none"

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """Host buffer of exactly `shape`; with `pin`, page-locked on CUDA (so a copy from or
        to it is one asynchronous DMA) for as long as any view of it lives."""
        return hostmem.host_empty(shape, dtype, pin=self.pin_method(pin) == "register")

    # --- copies and ordering ---------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 info: dict[str, Any] | None = None) -> CopyHandle:
        """Start copying host `src` into device `dst`; returns a handle to `wait` on.

        CUDA: on the dedicated copy stream, first waiting for `after` (the event of the
        last compute that read `dst`), so a buffer is never overwritten while in use;
        start and end events bracket the copy (with an instrument on, an idle stream is
        gated first so the start event does not run ahead of the copy's launch -- see the
        module docstring). Emulated: on the copy worker thread (the main thread's compute
        is synchronous, so `dst`'s readers are already done).
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
        timed = inst.enabled and inst.times_copies     # under NVTX alone (nsys: CUPTI times them) no gate
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            if self.copy_delay_cycles:
                torch.cuda._sleep(self.copy_delay_cycles)
            if timed and self.copy_stream.query():      # idle: hold it until the copy below is queued
                torch.cuda._sleep(COPY_GATE_CYCLES)
            start, end = torch.cuda.Event(enable_timing=timed), torch.cuda.Event(enable_timing=timed)
            start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.copy_stream)
        if timed:
            inst.copy_events(start, end, nbytes, info)
        return CopyHandle(nbytes, start=start, end=end)

    def wait(self, handle: CopyHandle | None) -> None:
        """Block compute until the copy is done: the compute stream waits on the copy's end
        event (no device-wide synchronise) on CUDA; the worker's future on the emulated device.
        The instrument hears of it as compute-stream idle time (`Instrument.idle('wait')`)."""
        if handle is None:
            return
        if handle.future is not None:
            if handle.future.done() or not self.instrument.enabled:
                handle.future.result()
            else:
                with self.instrument.idle("wait", bytes=handle.nbytes):
                    handle.future.result()
        elif self.instrument.enabled:
            with self.instrument.idle("wait", bytes=handle.nbytes):
                torch.cuda.current_stream(self.torch_device).wait_event(handle.end)
        else:
            torch.cuda.current_stream(self.torch_device).wait_event(handle.end)

    def record_compute(self):
        """An event marking the compute issued so far (None on the emulated device)."""
        if self.kind != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.torch_device))
        return ev

    @contextmanager
    def sync_copy(self, nbytes: int, info: dict[str, Any]) -> Iterator[None]:
        """Time a synchronous copy where it runs: CUDA events on the compute stream (the start
        completes when the kernels queued before it have), wall clock on the emulated device."""
        inst = self.instrument
        if not inst.enabled:
            yield
            return
        info = {**info, "sync": True}
        if self.emulated:
            t0 = time.perf_counter()
            yield
            inst.copy(t0, time.perf_counter(), nbytes, info)
            return
        stream = torch.cuda.current_stream(self.torch_device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        inst.copy_events(start, end, nbytes, info)

    def to_host(self, t: torch.Tensor, info: dict[str, Any] | None = None) -> torch.Tensor:
        """Device -> host copy (a real copy on the emulated device too), timed where it runs."""
        with self.sync_copy(t.numel() * t.element_size(), {"direction": "d2h", **(info or {})}):
            return t.to("cpu", copy=True) if self.emulated else t.to("cpu")

    def to_device(self, t: torch.Tensor, info: dict[str, Any] | None = None) -> torch.Tensor:
        """Host -> device copy of activations (not accounted: transient), timed where it runs."""
        with self.sync_copy(t.numel() * t.element_size(), {"direction": "h2d", **(info or {})}):
            return t.clone() if self.emulated else t.to(self.torch_device, non_blocking=False)

    def synchronize(self) -> None:
        """Wait for all device work, copies included."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self._worker is not None:
            try:
                self._worker.submit(lambda: None).result()   # the worker runs in order: all earlier copies are done
            except RuntimeError:      # shut down (at interpreter exit), which waited for every copy it held
                pass


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
