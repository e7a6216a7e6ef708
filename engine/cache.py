"""Expert weights at rest and the fixed-capacity device expert cache (mechanism only).

Owns:
- `ExpertStore`: every routed expert packed as one contiguous row of a per-layer [E, P]
  tensor, in the layout (and storage dtype) of the family's `ExpertLayout`, which also
  runs it (engine.blocks.experts) -- on the device for resident layers, in host RAM
  (page-locked on CUDA when the placement copies from it) for offloaded ones -- so moving
  an expert is exactly one copy.
- `ExpertCache`: per layer, `capacity` preallocated device slots; lookups, copies into
  slots and their order, hit/miss and byte counters. Bytes are each expert's stored bytes
  (`ExpertStore.expert_nbytes`): under a mixed treatment experts differ in size, every slot
  is the largest's, and a copy moves (and a lookup counts) only the expert's own bytes.
Does not own: which expert to evict (an `EvictionPolicy` plugin per layer, with the
protection rule of engine.policies.base.still_needed) or which placement uses the cache.

    cache = ExpertCache(store, device, counters, capacity=4, policy_factory=lambda l: LRU(4, E, l))
    cache.lookup(layer, [1, 5, 6])   # the layer's experts for this pass, in compute order
    w = cache.acquire(layer, 1)      # device tensor [P]; the compute stream waits for its copy
    ... compute with w ...
    cache.release(layer, 1)          # its compute is issued: the slot may be refilled after it

One pass of a layer: `lookup` makes every lookup up front, in compute order -- so the hit
and miss counts, and every eviction, are the same whatever the copy schedule -- and picks
each miss's slot (a free one, or the policy's victim among the unprotected residents).
With `issue_ahead` (the default) it then queues every miss's copy on the copy stream at
once, in the order the experts compute, so expert i computes while expert i+1 copies; a
miss whose slot still holds an expert this pass has yet to compute (the layer needs more
experts than it has slots) is queued as soon as `release` says that expert's compute is
issued -- the copy stream waits on that compute's event. Without `issue_ahead` each miss's
copy is queued only when `acquire` reaches it (copy, wait, compute, one expert at a time:
the old behaviour, kept for comparison). Prefetches (`prefetch`, for a later layer) are
queued behind the current layer's own copies in issue-ahead mode and at once otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import TYPE_CHECKING

from engine.blocks.experts import ExpertLayout
from engine.counters import Counters
from engine.devices import CopyHandle, Device
from engine.layers import memo, rows
from engine.lazy import lazy_module
from engine.policies.base import EvictionPolicy, still_needed

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def row_views(buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row of a [rows, P] store or slot buffer as an alias made once (engine.layers.rows), so a
    kernel's memos on it (engine.layers.memo: a packed expert's matrices) are made once too; over
    the buffer's memory, they see every copy into the row (a slot refilled with another expert)."""
    return memo(buffer, "rows", lambda: rows(buffer))


class ExpertStore:
    """Packed expert rows per MoE layer: `rows[layer]` is [E, P] on host or device.

    `layout` is the family's ExpertLayout (P = layout.numel, dtype its storage dtype): the
    placements run an expert with `store.layout.run(x, row)`. A store built for the cache
    alone (tests, micro-benchmarks) may have none."""

    def __init__(self, n_experts: int, packed_numel: int, dtype: torch.dtype,
                 layout: ExpertLayout | None = None) -> None:
        self.n_experts = n_experts
        self.packed_numel = packed_numel
        self.dtype = dtype
        self.layout = layout
        self.rows: dict[int, torch.Tensor] = {}
        self.on_device: dict[int, bool] = {}

    @property
    def expert_bytes(self) -> int:
        """Bytes of one row (one cache slot); experts of a mixed treatment may store fewer."""
        return self.packed_numel * self.dtype.itemsize

    def expert_numel(self, layer: int, e: int) -> int:
        """Elements expert (layer, e) really stores (the layout's `expert_numel`)."""
        return self.packed_numel if self.layout is None else self.layout.expert_numel(layer, e)

    def expert_nbytes(self, layer: int, e: int) -> int:
        """The stored bytes of expert (layer, e): what one copy of it moves and what the counters count."""
        return self.expert_numel(layer, e) * self.dtype.itemsize

    def allocate(self, layer: int, device: Device, on_device: bool, pin: bool = False) -> torch.Tensor:
        """Layer's [E, P] rows: on the device, or in host RAM (page-locked on CUDA with `pin`)."""
        shape = (self.n_experts, self.packed_numel)
        rows = device.empty(shape, self.dtype, "experts:resident") if on_device \
            else device.host_empty(shape, self.dtype, pin=pin)
        self.rows[layer], self.on_device[layer] = rows, on_device
        return rows

    def expert(self, layer: int, e: int) -> torch.Tensor:
        """Expert (layer, e)'s stored elements: its row, or the row's first `expert_numel` ones."""
        n = self.expert_numel(layer, e)
        row = row_views(self.rows[layer])[e]
        return row if n == self.packed_numel else row[:n]

    def view(self, buffer: torch.Tensor, layer: int, e: int) -> torch.Tensor:
        """Expert (layer, e) in a slot or stream buffer [P] that holds it: the stored part."""
        n = self.expert_numel(layer, e)
        return buffer if n == self.packed_numel else buffer[:n]


class ExpertCache:
    """`capacity` device slots per layer in front of a host ExpertStore."""

    def __init__(self, store: ExpertStore, device: Device, counters: Counters, capacity: int,
                 layers: list[int], policy_factory: Callable[[int], EvictionPolicy], issue_ahead: bool = True) -> None:
        if capacity < 1 or capacity > store.n_experts:
            raise ValueError(f"cache capacity must be in [1, n_experts={store.n_experts}], got {capacity}")
        self.store, self.device, self.counters, self.capacity = store, device, counters, capacity
        self.issue_ahead = issue_ahead
        self.slots = {l: device.empty((capacity, store.packed_numel), store.dtype, "experts:cache") for l in layers}
        self.policy_factory = policy_factory
        self.lookup_log: dict[int, list[int]] | None = None                     # set to {} to record
        self.reset()

    def reset(self) -> None:
        """Empty every slot and reset policies and clocks (a cold cache)."""
        layers = list(self.slots)
        self.device.synchronize()                                               # no copy still in flight
        # prefetched experts still unused here are booked nowhere: a repeat's counters start at zero
        # right after (Engine.reset), so prefetch_wasted_bytes counts the ones evicted unused
        self.slot_of: dict[int, dict[int, int]] = {l: {} for l in layers}     # expert -> slot (resident)
        self.free: dict[int, list[int]] = {l: list(range(self.capacity - 1, -1, -1)) for l in layers}
        self.policy = {l: self.policy_factory(l) for l in layers}
        self.clock = dict.fromkeys(layers, 0)                                   # lookups so far, per layer
        self.ready: dict[tuple[int, int], CopyHandle | None] = {}               # (layer, slot) -> copy in flight
        self.last_use: dict[tuple[int, int], object] = {}                       # (layer, slot) -> compute event
        # this pass, per layer: expert -> slot for experts looked up and not yet released (their
        # slot stays theirs until release, even if a later lookup already chose it as a victim)
        self.in_use: dict[int, dict[int, int]] = {l: {} for l in layers}
        self.unissued: dict[int, dict[int, int]] = {l: {} for l in layers}     # expert -> slot, copy not queued
        self.blocked: dict[int, dict[int, list[int]]] = {l: {} for l in layers}  # expert -> copies waiting on its release
        self.prefetched: set[tuple[int, int]] = set()                           # (layer, expert) not yet used
        self.queued_prefetch: list[tuple[int, list[int]]] = []                  # behind the current layer's copies

    def resident(self, layer: int) -> set[int]:
        return set(self.slot_of[layer])

    # --- one pass of a layer -------------------------------------------------------------
    def lookup(self, layer: int, experts: list[int]) -> None:
        """Every lookup of one pass of `layer` (distinct experts, in compute order) up front;
        in issue-ahead mode, also queue their copies (see the module docstring)."""
        self._flush_prefetch(layer)                      # a prefetch for this layer goes before its lookups
        slots, policy, store = self.slot_of[layer], self.policy[layer], self.store
        in_use, unissued, blocked = self.in_use[layer], self.unissued[layer], self.blocked[layer]
        log = self.lookup_log.setdefault(layer, []) if self.lookup_log is not None else None
        for i, e in enumerate(experts):
            t = self.clock[layer]
            self.clock[layer] = t + 1
            if log is not None:
                log.append(e)
            if e in slots:
                policy.on_hit(e, t)
                self.counters.lookup(layer, True, store.expert_nbytes(layer, e))
                if (layer, e) in self.prefetched:
                    self.prefetched.discard((layer, e))
                    self.counters.add("prefetch_used", 1, layer)
            else:
                self.counters.lookup(layer, False, store.expert_nbytes(layer, e))
                slot, victim = self._take_slot(layer, t, still_needed(set(experts[i + 1:]), policy))
                slots[e] = slot
                policy.on_insert(e, t)
                unissued[e] = slot
                if victim in in_use:                     # its compute in this pass comes first
                    blocked.setdefault(victim, []).append(e)
            in_use[e] = slots[e]
        if self.issue_ahead:
            waiting = {x for xs in blocked.values() for x in xs}
            for e in experts:
                if e in unissued and e not in waiting:
                    self._issue(layer, e)
            self._flush_prefetch()

    def acquire(self, layer: int, e: int) -> torch.Tensor:
        """Device buffer [P] holding expert (layer, e); the compute stream waits for its copy.
        Looks e up first if this pass has not (a lone lookup: `lookup(layer, [e])`)."""
        if e not in self.in_use[layer]:
            self.lookup(layer, [e])
        if e in self.unissued[layer]:                    # not issued ahead: copy now
            self._issue(layer, e)
        slot = self.in_use[layer][e]
        self.device.wait(self.ready.pop((layer, slot), None))
        return self.store.view(row_views(self.slots[layer])[slot], layer, e)

    def release(self, layer: int, e: int) -> None:
        """The compute that read expert e has been issued; its slot may be refilled after it."""
        slot = self.in_use[layer].pop(e)
        self.last_use[(layer, slot)] = self.device.record_compute()
        waiting = self.blocked[layer].pop(e, [])
        if self.issue_ahead:
            for x in waiting:
                self._issue(layer, x)
            self._flush_prefetch()

    # --- prefetch ---------------------------------------------------------------------------
    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start copying `experts` of `layer` ahead of their lookups (no lookup is counted).

        At most `capacity` of them; experts already resident are skipped, and experts
        prefetched by this call are protected from each other's evictions. Issue-ahead mode:
        queued until the layer now running has queued all its own copies."""
        if self.issue_ahead:
            self.queued_prefetch.append((layer, list(experts)))
        else:
            self._prefetch_now(layer, list(experts))

    def _flush_prefetch(self, layer: int | None = None) -> None:
        """Issue queued prefetches -- all of them once no layer has a copy left to queue, or
        (with `layer`) those for `layer`, which is about to be looked up."""
        if not self.queued_prefetch:
            return
        if layer is None and any(self.unissued[l] for l in self.unissued):
            return
        keep = []
        for target, experts in self.queued_prefetch:
            if layer is None or target == layer:
                self._prefetch_now(target, experts)
            else:
                keep.append((target, experts))
        self.queued_prefetch = keep

    def _prefetch_now(self, layer: int, experts: list[int]) -> None:
        t = self.clock[layer]
        protected = set(self.in_use[layer])
        for e in experts[: self.capacity]:
            if e in self.slot_of[layer]:
                protected.add(e)
                continue
            slot, _ = self._take_slot(layer, t, protected)
            self.slot_of[layer][e] = slot
            self.policy[layer].on_prefetch(e, t)
            self.unissued[layer][e] = slot
            self._issue(layer, e, prefetch=True)
            self.prefetched.add((layer, e))
            self.counters.add("prefetch_issued", 1, layer)
            protected.add(e)

    # --- mechanism --------------------------------------------------------------------------
    def _take_slot(self, layer: int, t: int, protected: Set[int]) -> tuple[int, int | None]:
        """A slot for a new expert: a free one, or the policy's victim's; (slot, victim or None)."""
        if self.free[layer]:
            return self.free[layer].pop(), None
        policy = self.policy[layer]
        victim = policy.victim(t, protected)
        policy.on_evict(victim)
        slot = self.slot_of[layer].pop(victim)
        if (layer, victim) in self.prefetched:                                 # evicted before any use
            self.prefetched.discard((layer, victim))
            self.counters.add("prefetch_wasted_bytes", self.store.expert_nbytes(layer, victim), layer)
        return slot, victim

    def _issue(self, layer: int, e: int, prefetch: bool = False) -> None:
        """Queue the copy of expert e into the slot chosen for it, after that slot's last reader."""
        slot = self.unissued[layer].pop(e)
        self.ready[(layer, slot)] = self.device.copy_h2d(
            self.store.view(row_views(self.slots[layer])[slot], layer, e), self.store.expert(layer, e),
            after=self.last_use.get((layer, slot)), info={"layer": layer, "expert": e, "prefetch": prefetch})
        self.counters.transfer("h2d", "expert", self.store.expert_nbytes(layer, e), layer)
