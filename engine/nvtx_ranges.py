"""NVTX ranges in a `moebench` domain, for Nsight Systems.

Owns: turning engine spans into NVTX push/pop ranges named after the operation and its
layer/expert (`expert L3 e5`, `attention L0`, `step prefill`), with event attributes
built once per name and cached; whole phases are `moebench:<phase>`. Off by default: the engine's default instrument is the
no-op `engine.hooks.NULL`; pass `NvtxRanges()` to `Engine.set_instrument` to turn it on.
Uses the `nvtx` package only -- never `torch.cuda.nvtx`, which raises on CPU builds. With
no profiler attached, the package's calls are cheap no-ops, so this also runs on a CPU.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.hooks import Instrument

COLORS = {"step": "blue", "layer": "purple", "attention": "green", "router": "yellow", "expert": "orange",
          "copy": "red", "phase": "cyan", "wait": "white", "host": "grey"}


class NvtxRanges(Instrument):
    enabled = True

    def __init__(self, domain: str = "moebench") -> None:
        try:
            import nvtx
        except ImportError as exc:
            raise RuntimeError("NVTX ranges need the `nvtx` package (pip install nvtx)") from exc
        self._domain = nvtx.get_domain(domain)
        self._attrs: dict[str, Any] = {}

    def _attributes(self, name: str, kind: str) -> Any:
        attrs = self._attrs.get(name)
        if attrs is None:   # built once per distinct name
            attrs = self._attrs[name] = self._domain.get_event_attributes(message=name,
                                                                         color=COLORS.get(kind, "white"))
        return attrs

    @staticmethod
    def range_name(kind: str, attrs: dict[str, Any]) -> str:
        if kind == "phase":   # phase ranges carry a prefix the Nsight parser selects by
            return f"moebench:{attrs['phase']}"
        name = kind
        if "phase" in attrs:
            name += f" {attrs['phase']}"
        if "layer" in attrs:
            name += f" L{attrs['layer']}"
        if "expert" in attrs:
            name += f" e{attrs['expert']}"
        return name

    @contextmanager
    def span(self, kind: str, **attrs: Any) -> Iterator[None]:
        a = self._attributes(self.range_name(kind, attrs), kind)
        self._domain.push_range(a)
        try:
            yield
        finally:
            self._domain.pop_range()


    def idle(self, why: str, **attrs: Any) -> Any:
        """Compute-stream stalls (waiting for a copy, experts on the host) as their own ranges."""
        return self.span(why, **attrs)
