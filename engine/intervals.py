"""Interval arithmetic for timelines: the engine's one library of it (the harness's overlap
metrics and Nsight reader build on it).

Owns: merging intervals into their union, union and intersection lengths, clipping to a
window, and subtracting one set of intervals from another. An interval is a `(start, end)`
pair of numbers with `start <= end`, half-open in spirit: two intervals that touch share no
time but merge into one piece. Every function merges its inputs first, so intervals that run
at the same time (several copy streams) are counted once. Zero-length intervals hold no time
and vanish from a union. Lengths come back in the unit of the timestamps; integer timestamps
stay exact integers.

    merge([(0, 2), (1, 3), (3, 4)])                  # [(0, 4)]
    intersection_length([(0, 2)], [(1, 5)])          # 1
    subtract([(0, 10)], [(2, 3), (5, 6)])            # [(0, 2), (3, 5), (6, 10)]
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Union

Number = Union[int, float]
Interval = tuple[Number, Number]


def _checked(intervals: Iterable[Sequence[Number]]) -> list[Interval]:
    out: list[Interval] = []
    for i, iv in enumerate(intervals):
        try:
            start, end = iv
        except (TypeError, ValueError):
            raise ValueError(f"interval #{i} must be a (start, end) pair; got {iv!r}") from None
        if isinstance(start, float) and math.isnan(start) or isinstance(end, float) and math.isnan(end):
            raise ValueError(f"interval #{i} must have numeric start and end; got {iv!r} (NaN)")
        if end < start:
            raise ValueError(f"interval #{i} must have start <= end; got ({start!r}, {end!r})")
        out.append((start, end))
    return out


def merge(intervals: Iterable[Sequence[Number]]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint, non-touching pieces of positive length.

    Overlapping and touching intervals merge: `[(0, 2), (1, 3), (3, 4)] -> [(0, 4)]`.
    Zero-length intervals are dropped. Raises ValueError for an interval with end < start.
    """
    ivs = sorted(iv for iv in _checked(intervals) if iv[1] > iv[0])
    out: list[Interval] = []
    for start, end in ivs:
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def union_length(intervals: Iterable[Sequence[Number]]) -> Number:
    """Total time covered by at least one interval (overlaps counted once)."""
    return sum((end - start for start, end in merge(intervals)), 0)


def intersection(a: Iterable[Sequence[Number]], b: Iterable[Sequence[Number]]) -> list[Interval]:
    """The time covered by both `a` and `b`, as merged pieces (each side merged first)."""
    ma, mb = merge(a), merge(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ma) and j < len(mb):   # two-pointer sweep over two sorted disjoint lists
        start = max(ma[i][0], mb[j][0])
        end = min(ma[i][1], mb[j][1])
        if end > start:
            out.append((start, end))
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return out


def intersection_length(a: Iterable[Sequence[Number]], b: Iterable[Sequence[Number]]) -> Number:
    """Time covered by both `a` and `b`. Each side is merged first, so two overlapping copy
    streams under one kernel count that kernel's time once."""
    return sum((end - start for start, end in intersection(a, b)), 0)


def clip(intervals: Iterable[Sequence[Number]], start: Number, end: Number) -> list[Interval]:
    """The parts of `intervals` inside the window `[start, end]`, merged."""
    return intersection(intervals, [(start, end)])


def subtract(a: Iterable[Sequence[Number]], b: Iterable[Sequence[Number]]) -> list[Interval]:
    """The parts of the union of `a` not covered by the union of `b`."""
    out: list[Interval] = []
    holes = merge(b)
    for s0, s1 in merge(a):
        cur = s0
        for h0, h1 in holes:
            if h1 <= cur or h0 >= s1:
                continue
            if h0 > cur:
                out.append((cur, h0))
            cur = max(cur, h1)
        if cur < s1:
            out.append((cur, s1))
    return out
