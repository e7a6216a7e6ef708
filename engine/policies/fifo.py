"""First-in-first-out eviction.

Owns: insertion order of the resident experts. Does not own: the slots (`engine.cache`).
The victim is the resident inserted longest ago that is not protected; hits do not
refresh an expert's position (that is what distinguishes FIFO from LRU, and why FIFO
shows Belady's anomaly).
"""
from __future__ import annotations

from engine.policies.base import OrderedPolicy


class FIFO(OrderedPolicy):
    name = "fifo"
