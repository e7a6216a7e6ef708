"""Prefetch plugins: start copying the experts a later layer will need while this layer
computes. Looked up by name through engine.registry.PREFETCHERS (`none`,
`next_layer_gate`, `trace_oracle`); see engine.prefetch.base for the interface."""
from engine.prefetch.base import Prefetcher

__all__ = ["Prefetcher"]
