"""Placement strategies, one module each; see engine.placements.base for the interface.

Look them up by name through engine.registry.PLACEMENTS.
"""
from engine.placements.base import Placement, PlacementContext

__all__ = ["Placement", "PlacementContext"]
