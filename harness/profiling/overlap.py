"""Interval arithmetic for copy/compute timelines, and the overlap metrics of DESIGN.md §5.

Owns: merging intervals into their union, union and intersection lengths, clipping to a
window, and `overlap_metrics` -- the one definition of `copy_busy_s`, `overlap_s`,
`exposed_copy_s`, `overlap_frac` and `link_gbps` that the engine's in-process timeline,
the Nsight Systems reader (`harness.profiling.nsys`) and the simulator all use.
Does not own: where intervals come from (CUDA events, an nsys export, a simulated
schedule) or rows and files (`harness.results`).

    from harness.profiling.overlap import overlap_metrics
    overlap_metrics(copy_intervals=[(0.0, 2.0), (1.0, 3.0)],   # two copy streams, overlapping
                    compute_intervals=[(2.0, 5.0)], h2d_bytes=3e9)
    # {'copy_busy_s': 3.0, 'overlap_s': 1.0, 'exposed_copy_s': 2.0,
    #  'overlap_frac': 0.333..., 'link_gbps': 1.0}

An interval is a `(start, end)` pair of numbers with `start <= end`, half-open in spirit:
two intervals that touch (`a.end == b.start`) share no time but merge into one piece.
Every function merges its inputs first, so intervals from several copy engines or streams
that run at the same time are counted once, never twice. Zero-length intervals hold no
time and vanish from a union.

Units: the functions here are unit-agnostic -- lengths come back in the unit of the
timestamps -- except `overlap_metrics`, whose results are in seconds: pass intervals in
seconds (the default) or give `time_unit_s`, the length of one timestamp unit in seconds
(`1e-9` for the nanosecond timestamps of an nsys export). Integer timestamps stay exact
integers until that final scaling.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Union

Number = Union[int, float]
Interval = tuple[Number, Number]

OVERLAP_METRICS = ("copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps")
OVERLAP_UNITS = {"copy_busy_s": "s", "overlap_s": "s", "exposed_copy_s": "s", "overlap_frac": "ratio",
                 "link_gbps": "GB/s"}


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


def overlap_metrics(copy_intervals: Iterable[Sequence[Number]], compute_intervals: Iterable[Sequence[Number]],
                    h2d_bytes: float | None = None, emulated: bool = False, *,
                    time_unit_s: float = 1.0) -> dict[str, float | None]:
    """The five DESIGN §5 overlap metrics of one copy timeline against one compute timeline.

    copy_busy_s     union of the copy intervals (all copy engines/streams together), s
    overlap_s       intersection of that union with the union of compute intervals, s
    exposed_copy_s  copy_busy_s - overlap_s: copy time not hidden under compute, s
    overlap_frac    overlap_s / copy_busy_s; None when copy_busy_s == 0 (nothing to hide)
    link_gbps       h2d_bytes / copy_busy_s / 1e9, GB/s; None when `emulated` (an emulated
                    device has no link, §3), when `h2d_bytes` is None or <= 0 (no host to
                    device transfer to claim a rate for) or when copy_busy_s == 0

    Intervals are in units of `time_unit_s` seconds (default 1.0: seconds).
    """
    if not time_unit_s > 0:
        raise ValueError(f"time_unit_s must be a positive number of seconds; got {time_unit_s!r}")
    copies = merge(copy_intervals)
    busy = sum((e - s for s, e in copies), 0)
    hidden = intersection_length(copies, compute_intervals)
    copy_busy_s = busy * time_unit_s
    overlap_s = hidden * time_unit_s
    exposed_copy_s = (busy - hidden) * time_unit_s
    overlap_frac = hidden / busy if busy > 0 else None
    if emulated or h2d_bytes is None or h2d_bytes <= 0 or busy <= 0:
        link_gbps = None
    else:
        link_gbps = h2d_bytes / copy_busy_s / 1e9
    return {"copy_busy_s": float(copy_busy_s), "overlap_s": float(overlap_s),
            "exposed_copy_s": float(exposed_copy_s),
            "overlap_frac": None if overlap_frac is None else float(overlap_frac),
            "link_gbps": link_gbps}
