"""An in-process timeline: the engine's spans and copies as intervals, and their export as a
Chrome/Perfetto trace.

Owns: recording spans (step, layer, attention, router, expert, copy), copy intervals
(asynchronous, and synchronous ones marked `sync`) and compute-stream idle time, with host
`perf_counter` times; on CUDA, compute spans and copies are also bracketed by CUDA events
and resolved onto the host clock at `collect()`, so what is recorded is when the GPU did
the work, not when Python launched it. Does not own: the overlap arithmetic
(harness.profiling.overlap) or NVTX (engine.nvtx_ranges).

Device compute (`compute_intervals`) is all of the engine's work on the compute stream,
not only the attention/router/expert spans: embedding, norms, residual adds, shared
experts, the final norm and lm_head count too. On CUDA it is recorded as event-timed
segments: a segment opens when a step begins, closes just before the compute stream is made
to wait for a copy (or hands the experts to the host) and reopens right after that wait
-- its start event completes only once the wait is satisfied -- so the gaps between
segments are exactly the stalls. On the emulated device the main thread is the compute
stream: compute is the step (and layer) spans minus idle time (`wait`, `host`) and minus
synchronous copies. Copy intervals are trusted as link rates only for copies of at least
engine.devices.LINK_TRUSTED_MIN_BYTES (see engine.devices for the reasoning).

    tl = Timeline("cpu")
    eng.set_instrument(tl)
    ... run ...
    tl.collect()
    tl.intervals("copy", t0, t1), tl.intervals(COMPUTE, t0, t1)
    json.dump(tl.chrome_trace(), open("trace.json", "w"))     # open in ui.perfetto.dev
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.intervals import subtract
from engine.hooks import Instrument

COMPUTE = ("attention", "router", "expert")   # spans also event-timed on CUDA, for the trace view
SEGMENT = "compute"                           # event-timed compute-stream segments (CUDA)
IDLE = ("wait", "host")                       # compute stream idle: waiting for a copy / experts on the host


@dataclass
class Span:
    kind: str
    t0: float
    t1: float
    attrs: dict[str, Any] = field(default_factory=dict)
    track: str = "compute"          # compute | copy (a separate row in the trace viewer)
    events: tuple[Any, Any] | None = None   # CUDA (start, end), resolved at collect()


class Timeline(Instrument):
    enabled = True
    times_copies = True

    def __init__(self, device_kind: str = "cpu") -> None:
        self.device_kind = device_kind
        self.spans: list[Span] = []
        self._lock = threading.Lock()      # copies are reported from the copy worker thread
        self.origin = time.perf_counter()
        self._ref: tuple[Any, float] | None = None
        self._segment: Any = None          # CUDA: start event of the open compute segment
        self._steps = 0                    # steps open (segments exist only inside a step)
        if device_kind == "cuda":
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            torch.cuda.synchronize()
            self._ref = (ev, time.perf_counter())

    # --- Instrument interface ---------------------------------------------------------
    @contextmanager
    def span(self, kind: str, **attrs: Any) -> Iterator[None]:
        cuda = self._ref is not None and kind in COMPUTE
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if kind == "step":
            self._steps += 1
            self._open_segment()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            if kind == "step":
                self._close_segment()
                self._steps -= 1
            s = Span(kind, t0, t1, attrs, "copy" if kind == "copy" else "compute")
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                s.events = (start, end)
            with self._lock:
                self.spans.append(s)

    @contextmanager
    def idle(self, why: str, **attrs: Any) -> Iterator[None]:
        self._close_segment()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            if self._steps:
                self._open_segment()
            with self._lock:
                self.spans.append(Span(why, t0, t1, attrs))

    def _open_segment(self) -> None:
        if self._ref is not None and self._segment is None:
            self._segment = torch.cuda.Event(enable_timing=True)
            self._segment.record()

    def _close_segment(self) -> None:
        if self._segment is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        with self._lock:
            self.spans.append(Span(SEGMENT, 0.0, 0.0, {}, "compute", (self._segment, end)))
        self._segment = None

    def copy(self, t0: float, t1: float, nbytes: int, info: dict[str, Any]) -> None:
        with self._lock:
            self.spans.append(Span("copy", t0, t1, {**info, "bytes": nbytes}, "copy"))

    def copy_events(self, start: Any, end: Any, nbytes: int, info: dict[str, Any]) -> None:
        with self._lock:
            self.spans.append(Span("copy", 0.0, 0.0, {**info, "bytes": nbytes}, "copy", (start, end)))

    # --- reading ------------------------------------------------------------------------
    def collect(self) -> None:
        """Resolve CUDA events onto the host clock (synchronises once)."""
        if self._ref is None:
            return
        torch.cuda.synchronize()
        ref_ev, ref_t = self._ref
        for s in self.spans:
            if s.events is not None:
                start, end = s.events
                s.t0 = ref_t + ref_ev.elapsed_time(start) / 1e3
                s.t1 = ref_t + ref_ev.elapsed_time(end) / 1e3
                s.events = None

    def intervals(self, kinds: str | tuple[str, ...], t0: float = float("-inf"),
                  t1: float = float("inf")) -> list[tuple[float, float]]:
        """(start, end) of spans of `kinds`, clipped to [t0, t1]."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        return [(max(s.t0, t0), min(s.t1, t1)) for s in self.spans
                if s.kind in kinds and s.t1 > t0 and s.t0 < t1]

    def compute_intervals(self, t0: float = float("-inf"), t1: float = float("inf")) -> list[tuple[float, float]]:
        """When the device computed (see the module docstring). CUDA: the event-timed
        compute-stream segments. Emulated device: the main thread *is* the device's compute
        stream, so everything it does inside a step counts (routing bookkeeping included)
        except idle time and synchronous copies."""
        if self.device_kind == "cuda":
            return self.intervals(SEGMENT, t0, t1)
        sync = [(max(s.t0, t0), min(s.t1, t1)) for s in self.spans
                if s.kind == "copy" and s.attrs.get("sync") and s.t1 > t0 and s.t0 < t1]
        return subtract(self.intervals(("step", "layer"), t0, t1), self.intervals(IDLE, t0, t1) + sync)

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def chrome_trace(self, markers: list[tuple[str, float, float]] | None = None) -> dict[str, Any]:
        """Chrome trace-event JSON (Perfetto opens it): complete events in microseconds,
        one thread row for compute and one for copies; `markers` add phase rows."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": f"moebench ({self.device_kind})"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "phases"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "copies"}},
        ]
        us = lambda t: (t - self.origin) * 1e6  # noqa: E731
        for name, t0, t1 in markers or []:
            events.append({"ph": "X", "name": name, "cat": "phase", "pid": 1, "tid": 1, "ts": us(t0),
                           "dur": max(0.0, us(t1) - us(t0))})
        for s in self.spans:
            label = s.kind if "layer" not in s.attrs else f"{s.kind} L{s.attrs['layer']}"
            if s.kind == "expert" or (s.kind == "copy" and "expert" in s.attrs):
                label += f" e{s.attrs.get('expert')}"
            events.append({"ph": "X", "name": label, "cat": s.kind, "pid": 1, "tid": 3 if s.track == "copy" else 2,
                           "ts": us(s.t0), "dur": max(0.0, us(s.t1) - us(s.t0)),
                           "args": {k: v for k, v in s.attrs.items() if isinstance(v, (int, float, str, bool))}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


class Instruments(Instrument):
    """Several instruments at once (e.g. a Timeline and NVTX ranges)."""

    def __init__(self, *parts: Instrument) -> None:
        self.parts = [p for p in parts if p.enabled]
        self.enabled = bool(self.parts)
        self.times_copies = any(p.times_copies for p in self.parts)

    @contextmanager
    def _each(self, hook: str, *args: Any, **attrs: Any) -> Iterator[None]:
        with ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(getattr(p, hook)(*args, **attrs))
            yield

    def span(self, kind: str, **attrs: Any) -> AbstractContextManager:
        return self._each("span", kind, **attrs)

    def idle(self, why: str, **attrs: Any) -> AbstractContextManager:
        return self._each("idle", why, **attrs)

    def copy(self, t0: float, t1: float, nbytes: int, info: dict[str, Any]) -> None:
        for p in self.parts:
            p.copy(t0, t1, nbytes, info)

    def copy_events(self, start: Any, end: Any, nbytes: int, info: dict[str, Any]) -> None:
        for p in self.parts:
            p.copy_events(start, end, nbytes, info)

