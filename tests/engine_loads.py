"""Counting the model loads a block of test code makes: `engine_loads()` records every measured
engine that any run's engine cache (harness.engines.EngineCache) builds inside it -- what a
"nothing was loaded" assertion checks, whichever session (a job's own, or a test's) the code used.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness.engines import EngineCache, engine_key


@contextmanager
def engine_loads() -> Iterator[list[tuple]]:
    """The engine keys of the real loads made inside the block, in order."""
    loads: list[tuple] = []
    real = EngineCache.get

    def get(self: EngineCache, spec: Any, *args: Any, **kw: Any):
        adapter, loaded = real(self, spec, *args, **kw)
        if loaded:
            loads.append(engine_key(spec))
        return adapter, loaded

    EngineCache.get = get
    try:
        yield loads
    finally:
        EngineCache.get = real
