"""`none`: no prefetch (the baseline)."""
from __future__ import annotations

import torch

from engine.prefetch.base import Prefetcher


class NoPrefetch(Prefetcher):
    name = "none"

    def after_route(self, layer: int, h: torch.Tensor, ids: torch.Tensor) -> None:
        return None
