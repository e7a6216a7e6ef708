"""Eviction policy interface for the device expert cache.

Owns: the decision of *which* resident expert leaves when a slot is needed.
Does not own: slots, bytes, copies or counters -- those live in `engine.cache`
(mechanism). A policy instance serves exactly one cache layer (or one global pool)
and sees only expert ids and a logical clock, so the very same classes drive the
engine and the replay simulator.

Protocol, per lookup of expert `e` at logical time `t` (t counts lookups of this
layer, starting at 0, and increases by one per lookup, hit or miss):

    hit   -> policy.on_hit(e, t)
    miss  -> if the cache is full: v = policy.victim(t, protected); policy.on_evict(v)
             policy.on_insert(e, t)

`protected` are resident experts that must not be evicted now. `victim` must return a
resident, unprotected expert.

The protection rule (`still_needed`, the one definition the device cache and the replay
simulator share): a step (one forward pass) looks a layer's experts up in the order they
compute, ascending id; on a miss, the experts the same step will still look up in this
layer after this one are protected, so a copy issued ahead never evicts an expert the layer
is about to use -- unless that leaves the policy nothing it may evict (`evictable`: static
never evicts its pinned experts), then none is. Experts the step already looked up are not
protected: their slots are refilled once their compute is issued.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any, ClassVar

from engine.registry import NoOptions


class EvictionPolicy(ABC):
    """Chooses victims for one fixed-capacity cache. Subclasses register by `name`.

    `Options` is the policy's configuration as a user gives it (what the harness exposes as
    `cache.policy_options`): plain values and file paths. `prepare` turns it into constructor
    keyword arguments (reading any files) for a model; data a caller already has can be passed
    to the constructor directly (`make_policy(..., popularity=counts)`)."""

    name: str = ""
    Options: ClassVar[type] = NoOptions

    @classmethod
    def prepare(cls, options: Any, cfg: Any) -> dict[str, Any]:
        """Constructor keyword arguments from config-level `options` for model `cfg`; raises
        ValueError naming the option and what it must hold."""
        return {k: v for k, v in dataclasses.asdict(options).items() if v is not None}

    def __init__(self, capacity: int, n_experts: int, layer: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.n_experts = n_experts
        self.layer = layer
        self.resident: set[int] = set()

    # --- notifications -------------------------------------------------------------
    def on_hit(self, expert: int, t: int) -> None:
        """`expert` was found resident at time `t`."""

    def on_insert(self, expert: int, t: int) -> None:
        """`expert` was just made resident at time `t` (after a miss)."""
        self.resident.add(expert)

    def on_prefetch(self, expert: int, t: int) -> None:
        """`expert` was made resident ahead of its lookup, before the lookup at time `t`."""
        self.on_insert(expert, t)

    def on_evict(self, expert: int) -> None:
        """`expert` left the cache."""
        self.resident.discard(expert)

    # --- decision --------------------------------------------------------------------
    def evictable(self) -> Set[int]:
        """The residents this policy may ever choose as a victim (all of them by default)."""
        return self.resident

    @abstractmethod
    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        """Return the resident, unprotected expert to evict for a miss at time `t`."""

    def _candidates(self, protected: Set[int]) -> list[int]:
        cands = [e for e in self.resident if e not in protected]
        if not cands:
            raise self._no_victim(protected)
        return cands

    def _first_unprotected(self, order: Iterable[int], protected: Set[int]) -> int:
        """First expert of `order` (an eviction order over residents) not in `protected`."""
        for e in order:
            if e not in protected:
                return e
        raise self._no_victim(protected)

    def _no_victim(self, protected: Set[int]) -> RuntimeError:
        return RuntimeError(
            f"layer {self.layer}: no evictable expert (resident={sorted(self.resident)}, "
            f"protected={sorted(protected)}); capacity {self.capacity} is too small for one step"
        )


class OrderedPolicy(EvictionPolicy):
    """Shared mechanics of the order-based policies (FIFO, LRU, Static): residents kept in
    an eviction order, the victim being the first unprotected one. Subclasses decide what
    moves an expert in that order."""

    def __init__(self, capacity: int, n_experts: int, layer: int = 0) -> None:
        super().__init__(capacity, n_experts, layer)
        # OrderedDict, not dict: O(1) move_to_end / delete, and popping the front of a plain
        # dict leaves dummies that make the next `iter()` scan over them
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, expert: int, t: int) -> None:
        self.resident.add(expert)
        self._order[expert] = None

    def on_evict(self, expert: int) -> None:
        self.resident.discard(expert)
        self._order.pop(expert, None)

    def victim(self, t: int, protected: Set[int] = frozenset()) -> int:
        return self._first_unprotected(self._order, protected)


class FrequencyPolicy(EvictionPolicy):
    """Shared mechanics of the frequency-based policies (LFU, LFRU): *perfect* reference counts --
    every reference since the policy was created, kept when an expert is evicted, so an expert
    popular earlier returns with its history -- and each resident's (count, last use), whose
    minimum is the least frequently used expert, ties broken by least recent use. Subclasses
    decide which residents are candidates."""

    def __init__(self, capacity: int, n_experts: int, layer: int = 0) -> None:
        super().__init__(capacity, n_experts, layer)
        self._count: dict[int, int] = {}
        # (count, last use) of each resident: min() over these tuples picks the least frequently
        # used with the LRU tie-break in one C-level comparison per candidate
        self._key: dict[int, tuple[int, int]] = {}

    def count(self, expert: int) -> int:
        """References to `expert` so far (persisting across evictions)."""
        return self._count.get(expert, 0)

    def on_hit(self, expert: int, t: int) -> None:
        c = self._count.get(expert, 0) + 1   # a prefetched expert's first lookup is a hit
        self._count[expert] = c
        self._key[expert] = (c, t)

    def on_insert(self, expert: int, t: int) -> None:
        self.resident.add(expert)
        c = self._count.get(expert, 0) + 1
        self._count[expert] = c
        self._key[expert] = (c, t)

    def on_prefetch(self, expert: int, t: int) -> None:
        """Resident ahead of its lookup: not a reference, so its count does not change."""
        self.resident.add(expert)
        self._key[expert] = (self._count.get(expert, 0), t)

    def on_evict(self, expert: int) -> None:
        self.resident.discard(expert)
        self._key.pop(expert, None)

    def least_frequent(self, candidates: Iterable[int], protected: Set[int]) -> int:
        """The least frequently used (then least recent) of `candidates`, a non-empty set of residents."""
        key = self._key
        cands = [e for e in candidates if e not in protected] if protected else candidates
        if not cands:
            raise self._no_victim(protected)
        return min(cands, key=key.__getitem__)


def still_needed(later: Set[int], policy: EvictionPolicy) -> Set[int]:
    """The protection rule (module docstring): the residents of `policy` that are in `later`
    (looked up after this one in the same step), unless the policy could then evict none."""
    evictable = policy.evictable()
    if evictable <= later:                   # every evictable resident still needed: protect none
        return frozenset()
    return policy.resident & later


def layer_row(value: Any, layer: int, what: str) -> list:
    """Return the per-layer part of `value`: `value[layer]` when `value` is a mapping
    {layer: seq} or a 2-D sequence/array [layers][...], else `value` itself as a list.

    Lets policies that take per-layer data (popularity, traces) accept either the row for
    their own layer or the whole table. Tensors/arrays are read through `.tolist()`.
    """
    if isinstance(value, Mapping):
        if layer not in value:
            raise ValueError(f"{what}: no entry for layer {layer}; layers given: {sorted(value)}")
        value = value[layer]
    if hasattr(value, "tolist"):                     # numpy array / torch tensor
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{what}: expected a sequence (or per-layer table), got {type(value).__name__}")
    first = value[0] if len(value) else None
    if (isinstance(first, Sequence) and not isinstance(first, (str, bytes))) \
            or getattr(first, "ndim", 0) >= 1:     # a row array, not a numpy scalar
        if not 0 <= layer < len(value):
            raise ValueError(f"{what}: table has {len(value)} layers, layer {layer} requested")
        value = value[layer]
        if hasattr(value, "tolist"):
            value = value.tolist()
    return list(value)
