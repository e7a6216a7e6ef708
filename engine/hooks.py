"""Instrumentation hook: named spans around engine work, with a no-op default.

Owns: the interface the engine calls (`span(kind, **attrs)` as a context manager) and
the do-nothing default. Does not own: NVTX, timelines or profilers -- those are
`Instrument` subclasses supplied by the harness (profiling issue).

Span kinds used by the engine: step, layer, attention, router, expert, copy.
With the default `NULL`, a span costs one method call and a shared context manager.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

_NULL_CTX = nullcontext()


class Instrument:
    """Base and no-op default. Override `span` to record; keep `enabled` False when off."""

    enabled = False

    def span(self, kind: str, **attrs: Any) -> AbstractContextManager:
        return _NULL_CTX


NULL = Instrument()
