"""Token -> expert dispatch: which rows of a layer's micro-batch each expert computes.

Owns: grouping one MoE layer's top-k routing into per-expert token lists with a single
device->host transfer (`group_by_expert`), the slow obvious reference it must equal
(`group_by_expert_reference`, one `nonzero` -- one host sync -- per expert), and per-expert
token counts without any host sync (`tokens_per_expert`), and the whole grouping kept on the
device for grouped GEMMs (`group_on_device`: no host sync at all). Does not own: running experts
(engine.placements.base.Placement.combine) or routing itself (engine.blocks.routers).

    r = group_by_expert(ids, n_experts)        # ids [N, k] -> Dispatch; one .tolist()
    for e, tok, kpos in r: ...                 # ascending expert id; rows in ascending order

Dimension legend: N=rows (B*T), k=top-k, E=experts, M=N*k routed (row, slot) pairs.

Why one transfer: the expert loop needs the list of used experts (host control flow) and
each expert's rows. `unique()` plus a `nonzero()` per expert is a host sync each on CUDA
(their output sizes depend on the data), so a layer with 8 used experts stalled the host 9
times, and the copy issue order of a fetching placement could not be known before the
first expert ran. Here: one stable sort of the M flattened ids and the E+1 group
boundaries (`searchsorted`, no sync), then the boundaries read with one `.tolist()`. The
stable sort keeps each expert's (row, slot) pairs in ascending flat position -- exactly
the row-major order `(ids == e).nonzero()` returns -- so gathers and `index_add_` see the
same rows in the same order and outputs stay bitwise equal. One row (decode at batch 1) skips
the sort: its k distinct experts are read with the one `.tolist()` and ordered on the host,
since at that size the sort's dozen ops of dispatch cost more than the work.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class Dispatch:
    """One layer's dispatch: experts used (ascending) and, per expert, its rows and top-k slots."""

    experts: list[int]
    rows: list[torch.Tensor]        # per used expert: row indices [n] into the layer's input, ascending
    slots: list[torch.Tensor]       # per used expert: top-k position [n] of that expert in each row
    order: torch.Tensor | None = None   # [M] flat (row, slot) positions grouped by expert (group_by_expert)
    offsets: list[int] | None = None    # where each used expert's group starts in `order`, then the end
    one_row_slots: list[int] | None = None   # a single row's routing: its slot of each used expert

    def gates(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """weights [N, k] -> per used expert, the routing weight of each of its rows [n, 1]
        (`weights[rows, slots, None]`; from `group_by_expert`, one gather for the layer and a view each,
        or for one row a view each)."""
        if self.one_row_slots is not None:
            g = weights.reshape(-1, 1, 1).unbind(0)                             # k x [1, 1]
            return [g[s] for s in self.one_row_slots]
        if self.order is None:
            return [weights[t, s, None] for t, s in zip(self.rows, self.slots)]
        g = weights.reshape(-1, 1)[self.order]                                  # [M, 1]
        return [g[a:b] for a, b in zip(self.offsets, self.offsets[1:])]

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return iter(zip(self.experts, self.rows, self.slots))

    def __len__(self) -> int:
        return len(self.experts)


def group_by_expert(ids: torch.Tensor, n_experts: int) -> Dispatch:
    """ids [N, k] int64 -> Dispatch, with exactly one device->host transfer."""
    N, k = ids.shape
    if N == 1 and (one := _one_row(ids)) is not None:
        return one
    flat = ids.reshape(-1)                                                      # [M]
    sorted_ids, order = torch.sort(flat, stable=True)                           # [M], [M]
    edges = torch.arange(n_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    bounds = torch.searchsorted(sorted_ids, edges).tolist()                     # [E+1]: the one transfer
    all_rows, all_slots = order // k, order % k                                 # [M] each, flat positions ascending
    experts = [e for e in range(n_experts) if bounds[e + 1] > bounds[e]]
    offsets = [bounds[e] for e in experts] + [bounds[n_experts]]                # empty groups in between take no room
    rows = [all_rows[a:b] for a, b in zip(offsets, offsets[1:])]                # views: no op per expert
    slots = [all_slots[a:b] for a, b in zip(offsets, offsets[1:])]
    return Dispatch(experts, rows, slots, order, offsets)


def _one_row(ids: torch.Tensor) -> Dispatch | None:
    """`group_by_expert` of one row (decode at batch 1): its k experts read with one transfer and
    ordered on the host, no sort, boundaries or per-expert slices on the device (a dozen ops of
    dispatch per layer). A row's experts are distinct (top-k), so each group is that one row;
    None if a router repeated one (the sorted grouping then handles it)."""
    chosen = ids.tolist()[0]                                                    # [k]: the one transfer
    k = len(chosen)
    if len(set(chosen)) < k:
        return None
    row, slot = _index_tensors(ids.device, k)
    by_id = sorted(range(k), key=chosen.__getitem__)                            # slots in ascending expert id
    return Dispatch([chosen[s] for s in by_id], [row] * k, [slot[s] for s in by_id], one_row_slots=by_id)


@functools.cache
def _index_tensors(device: torch.device, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The row index [0] and each slot index [s] (s < k) of a one-row Dispatch, made once per
    device: read-only index tensors every such Dispatch shares."""
    return torch.zeros(1, dtype=torch.long, device=device), list(torch.arange(k, device=device).split(1))


@dataclass(frozen=True)
class DeviceDispatch:
    """One layer's dispatch kept on the device (no host sync, shapes fixed by N and k)."""

    order: torch.Tensor        # [M] flat (row, slot) positions grouped by expert, ascending within a group
    offs: torch.Tensor         # [E] int32: end of each expert's group in `order` (grouped GEMM offsets)
    accumulate: torch.Tensor   # [N, k]: per row, where its slots sit in `order`, in ascending expert id


def group_on_device(ids: torch.Tensor, n_experts: int) -> DeviceDispatch:
    """ids [N, k] -> DeviceDispatch with no device->host transfer: the same stable sort as
    `group_by_expert`, group ends from `tokens_per_expert`, and per row the places of its slots
    in that order -- ascending place is ascending expert id (a row's experts are distinct and
    the sort is by id), the order `Placement.combine` adds them in."""
    N, k = ids.shape
    order = torch.sort(ids.reshape(-1), stable=True).indices                    # [M]
    offs = tokens_per_expert(ids, n_experts).cumsum(0).to(torch.int32)          # [E]
    place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))  # [M]
    return DeviceDispatch(order, offs, place.view(N, k).sort(dim=1).values)      # [N, k]


def group_by_expert_reference(ids: torch.Tensor) -> Dispatch:
    """The obvious version (one `nonzero` per used expert); `group_by_expert` must equal it."""
    experts = ids.unique().tolist()                                             # sorted ascending
    pairs = [(ids == e).nonzero(as_tuple=True) for e in experts]                # ([n], [n]) each
    return Dispatch(experts, [p[0] for p in pairs], [p[1] for p in pairs])


def tokens_per_expert(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """ids [..., k] -> int64 [E]: how many (row, slot) pairs chose each expert; no host sync
    (unlike `bincount`, whose output size is read from the data on CUDA)."""
    flat = ids.reshape(-1)                                                      # [M]
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)       # [E]
    return counts.index_add_(0, flat, torch.ones_like(flat))
