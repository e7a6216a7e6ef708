"""Instrumentation hook: named spans around engine work, with a no-op default.

Owns: the interface the engine calls (`span(kind, **attrs)` as a context manager) and
the do-nothing default. Does not own: NVTX, timelines or profilers -- those are
`Instrument` subclasses (engine.timeline, engine.nvtx_ranges) that the harness attaches.

Span kinds used by the engine: step, layer, attention, router, expert, copy. Copies that
run asynchronously (and synchronous ones, marked `sync`) are reported through `copy` /
`copy_events` instead of spans; time in which the device's compute stream runs none of the
engine's work -- waiting for a copy ('wait'), or while the experts run on the host ('host')
-- is bracketed by `idle(why)`, so an instrument can tell device compute from stalls.
With the default `NULL`, a span costs one method call and a shared context manager.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from collections.abc import Callable
from typing import Any

_NULL_CTX = nullcontext()


class Instrument:
    """Base and no-op default. Override `span` to record; keep `enabled` False when off."""

    enabled = False
    times_copies = False    # it times copies itself (copy / copy_events): CUDA copies then get timing
                            # events and the idle-stream gate (engine.devices); NVTX ranges do not

    def span(self, kind: str, **attrs: Any) -> AbstractContextManager:
        return _NULL_CTX

    def idle(self, why: str, **attrs: Any) -> AbstractContextManager:
        """The compute stream does none of the engine's work inside this block: it waits for
        a copy (why='wait') or the work runs on the host (why='host')."""
        return _NULL_CTX

    def copy(self, t0: float, t1: float, nbytes: int, info: dict[str, Any]) -> None:
        """An asynchronous copy ran from t0 to t1 (perf_counter seconds; emulated device)."""

    def copy_events(self, start: Any, end: Any, nbytes: int, info: dict[str, Any]) -> None:
        """An asynchronous copy bracketed by CUDA events (resolved by the instrument later)."""


NULL = Instrument()


# progress of long engine work, (what, done, total): ("load", MoE layers loaded, MoE layers),
# ("prefill", micro-batches done, micro-batches); the harness shows it, the engine never prints
Progress = Callable[[str, int, int], None]


class RoutingHook:
    """Hears every forward pass's routing (trace recorders, tests). The model calls
    `begin_pass(batch, tokens)` once per forward pass, then `route(layer, ids, weights)` once per
    MoE layer in layer order, with ids/weights [B*T, k] (row-major over [B, T]) before the
    experts run. Add one with `MoEModel.add_routing_hook`, remove it with `remove_routing_hook`."""

    def begin_pass(self, batch: int, tokens: int) -> None:
        """A forward pass of `batch` sequences x `tokens` new tokens starts."""

    def route(self, layer: int, ids: Any, weights: Any) -> None:
        """MoE layer `layer` routed its rows to `ids` with `weights`."""


class RouteCallback(RoutingHook):
    """A routing hook from a plain function f(layer, ids, weights)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def route(self, layer: int, ids: Any, weights: Any) -> None:
        self.fn(layer, ids, weights)
