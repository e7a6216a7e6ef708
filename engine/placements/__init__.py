"""Placement strategies, one module each; see engine.placements.base for the interface.

Look them up by name through engine.registry.PLACEMENTS.
"""
from collections.abc import Mapping
from typing import Any

from engine.placements.base import Placement, PlacementContext, PlacementTraits


def needs_cache(name: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether placement `name` with these options keeps a device expert cache (and so takes a
    capacity and a policy): asks the plugin itself. False for an unknown name."""
    from engine.registry import PLACEMENTS, UnknownPluginError

    try:
        cls = PLACEMENTS.get(name)
    except UnknownPluginError:
        return False
    return cls.uses_cache(dict(options or {}))


def traits(name: str, cfg, options: Mapping[str, Any] | None = None) -> PlacementTraits:
    """What placement `name` does with these options on model `cfg` (asks the plugin)."""
    from engine.registry import PLACEMENTS
    return PLACEMENTS.get(name).traits(cfg, dict(options or {}))


__all__ = ["Placement", "PlacementContext", "PlacementTraits", "needs_cache", "traits"]
