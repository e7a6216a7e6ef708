"""Expert weights at rest and the fixed-capacity device expert cache (mechanism only).

Owns:
- `ExpertStore`: every routed expert packed as one contiguous row [gate | up | down]
  of a per-layer [E, P] tensor -- on the device for resident layers, in host RAM
  (pinned on CUDA) for offloaded ones -- so moving an expert is exactly one copy.
- `ExpertCache`: per layer, `capacity` preallocated device slots; lookups, copies into
  slots, hit/miss and byte counters.
Does not own: which expert to evict (an `EvictionPolicy` plugin per layer) or which
placement uses the cache.

    cache = ExpertCache(store, device, counters, capacity=4, policy_factory=lambda l: LRU(4, E, l))
    w = cache.acquire(layer, e)      # device tensor [P]; copies on a miss
    ... compute with w ...
    cache.release(layer, e)          # marks the slot's last use (CUDA event)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.counters import Counters
from engine.devices import CopyHandle, Device
from engine.policies.base import EvictionPolicy


class ExpertStore:
    """Packed expert rows per MoE layer: `rows[layer]` is [E, P] on host or device."""

    def __init__(self, n_experts: int, packed_numel: int, dtype: torch.dtype) -> None:
        self.n_experts = n_experts
        self.packed_numel = packed_numel
        self.dtype = dtype
        self.rows: dict[int, torch.Tensor] = {}
        self.on_device: dict[int, bool] = {}

    @property
    def expert_bytes(self) -> int:
        return self.packed_numel * self.dtype.itemsize

    def allocate(self, layer: int, device: Device, on_device: bool) -> torch.Tensor:
        shape = (self.n_experts, self.packed_numel)
        rows = device.empty(shape, self.dtype, "experts:resident") if on_device else device.host_empty(shape, self.dtype)
        self.rows[layer], self.on_device[layer] = rows, on_device
        return rows

    def expert(self, layer: int, e: int) -> torch.Tensor:
        return self.rows[layer][e]


class ExpertCache:
    """`capacity` device slots per layer in front of a host ExpertStore."""

    def __init__(self, store: ExpertStore, device: Device, counters: Counters, capacity: int,
                 layers: list[int], policy_factory: Callable[[int], EvictionPolicy]) -> None:
        if capacity < 1 or capacity > store.n_experts:
            raise ValueError(f"cache capacity must be in [1, n_experts={store.n_experts}], got {capacity}")
        self.store, self.device, self.counters, self.capacity = store, device, counters, capacity
        self.slots = {l: device.empty((capacity, store.packed_numel), store.dtype, "experts:cache") for l in layers}
        self.policy_factory = policy_factory
        self.lookup_log: dict[int, list[int]] | None = None                     # set to {} to record
        self.reset()

    def reset(self) -> None:
        """Empty every slot and reset policies and clocks (a cold cache)."""
        layers = list(self.slots)
        self.device.synchronize()                                               # no copy still in flight
        for key in getattr(self, "prefetched", set()):                          # never used: wasted
            self.counters.add("prefetch_wasted_bytes", self.store.expert_bytes, key[0])
        self.slot_of: dict[int, dict[int, int]] = {l: {} for l in layers}     # expert -> slot
        self.free: dict[int, list[int]] = {l: list(range(self.capacity - 1, -1, -1)) for l in layers}
        self.policy = {l: self.policy_factory(l) for l in layers}
        self.clock = dict.fromkeys(layers, 0)                                   # lookups so far, per layer
        self.ready: dict[tuple[int, int], CopyHandle | None] = {}               # (layer, slot) -> copy in flight
        self.last_use: dict[tuple[int, int], object] = {}                       # (layer, slot) -> compute event
        self.in_use: dict[int, set[int]] = {l: set() for l in layers}
        self.prefetched: set[tuple[int, int]] = set()                           # (layer, expert) not yet used

    def resident(self, layer: int) -> set[int]:
        return set(self.slot_of[layer])

    def _load(self, layer: int, e: int, t: int, protected: set[int], prefetch: bool) -> None:
        """Give expert e a slot (evicting if full) and start its copy."""
        policy, slots = self.policy[layer], self.slot_of[layer]
        if self.free[layer]:
            slot = self.free[layer].pop()
        else:
            victim = policy.victim(t, protected)
            policy.on_evict(victim)
            slot = slots.pop(victim)
            if (layer, victim) in self.prefetched:                             # evicted before any use
                self.prefetched.discard((layer, victim))
                self.counters.add("prefetch_wasted_bytes", self.store.expert_bytes, layer)
        slots[e] = slot
        (policy.on_prefetch if prefetch else policy.on_insert)(e, t)
        nbytes = self.store.expert_bytes
        self.ready[(layer, slot)] = self.device.copy_h2d(
            self.slots[layer][slot], self.store.expert(layer, e), after=self.last_use.get((layer, slot)),
            info={"layer": layer, "expert": e, "prefetch": prefetch})
        self.counters.add("h2d_bytes", nbytes, layer)

    def acquire(self, layer: int, e: int) -> torch.Tensor:
        """Device buffer [P] holding expert (layer, e); one lookup, one copy on a miss."""
        t = self.clock[layer]
        self.clock[layer] = t + 1
        if self.lookup_log is not None:
            self.lookup_log.setdefault(layer, []).append(e)
        slots, nbytes = self.slot_of[layer], self.store.expert_bytes
        if e in slots:
            self.policy[layer].on_hit(e, t)
            self.counters.lookup(layer, True, nbytes)
            if (layer, e) in self.prefetched:
                self.prefetched.discard((layer, e))
                self.counters.add("prefetch_used", 1, layer)
        else:
            self.counters.lookup(layer, False, nbytes)
            self._load(layer, e, t, self.in_use[layer], prefetch=False)
        slot = slots[e]
        self.device.wait(self.ready.pop((layer, slot), None))
        self.in_use[layer].add(e)
        return self.slots[layer][slot]

    def release(self, layer: int, e: int) -> None:
        """The compute that read expert e has been issued; its slot may be refilled after it."""
        self.in_use[layer].discard(e)
        self.last_use[(layer, self.slot_of[layer][e])] = self.device.record_compute()

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start copying `experts` of `layer` ahead of their lookups (no lookup is counted).

        At most `capacity` of them; experts already resident are skipped, and experts
        prefetched by this call are protected from each other's evictions."""
        t = self.clock[layer]
        protected = set(self.in_use[layer])
        for e in experts[: self.capacity]:
            if e in self.slot_of[layer]:
                protected.add(e)
                continue
            self._load(layer, e, t, protected, prefetch=True)
            self.prefetched.add((layer, e))
            self.counters.add("prefetch_issued", 1, layer)
            protected.add(e)
