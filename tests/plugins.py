"""Tests of core behaviour that use a plugin's own case (llama.cpp's server, its knob column,
its sub-commands) skip where that plugin is not registered: an engine is one plugin, and
removing it (tests/test_plugin_removal.py) leaves every other test green."""
from __future__ import annotations

import pytest

from harness.engines.registry import ENGINES


def needs_engine(name: str) -> pytest.MarkDecorator:
    """Skip unless the engine plugin `name` is registered."""
    return pytest.mark.skipif(name not in ENGINES.names(),
                              reason=f"engine {name!r} is not registered (its plugin is not installed)")


def engine_params(*names: str) -> list:
    """`names` as pytest params, each skipped where its engine is not registered."""
    return [pytest.param(n, marks=needs_engine(n)) for n in names]
