"""`none`: no prefetch (the baseline)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.prefetch.base import Prefetcher

if TYPE_CHECKING:                 # annotations only: the registry lists prefetchers without torch
    import torch


class NoPrefetch(Prefetcher):
    name = "none"

    def after_route(self, layer: int, h: torch.Tensor, ids: torch.Tensor) -> None:
        return None
