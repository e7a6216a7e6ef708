"""The overlap metrics of DESIGN.md §5 from copy and compute timelines.

Owns: `overlap_metrics` -- the one definition of `copy_busy_s`, `overlap_s`, `exposed_copy_s`,
`overlap_frac` and `link_gbps` that the engine's in-process timeline, the Nsight Systems reader
(`harness.profiling.nsys`) and the simulator all use. It builds on the engine's interval
library (`engine.intervals`: merge, union, intersection, clip), re-exported here.
Does not own: where intervals come from (CUDA events, an nsys export, a simulated schedule) or
rows and files (`harness.results`).

    from harness.profiling.overlap import overlap_metrics
    overlap_metrics(copy_intervals=[(0.0, 2.0), (1.0, 3.0)],   # two copy streams, overlapping
                    compute_intervals=[(2.0, 5.0)], h2d_bytes=3e9)
    # {'copy_busy_s': 3.0, 'overlap_s': 1.0, 'exposed_copy_s': 2.0,
    #  'overlap_frac': 0.333..., 'link_gbps': 1.0}

Intervals from several copy engines or streams that run at the same time are counted once,
never twice (each side is merged first). Results are in seconds: pass intervals in seconds
(the default) or give `time_unit_s`, the length of one timestamp unit in seconds (`1e-9` for
the nanosecond timestamps of an nsys export).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.intervals import Interval, Number, clip, intersection, intersection_length, merge, union_length


OVERLAP_METRICS = ("copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps")
OVERLAP_UNITS = {"copy_busy_s": "s", "overlap_s": "s", "exposed_copy_s": "s", "overlap_frac": "ratio",
                 "link_gbps": "GB/s"}


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


__all__ = ["OVERLAP_METRICS", "OVERLAP_UNITS", "Interval", "Number", "clip", "intersection", "intersection_length",
           "merge", "overlap_metrics", "union_length"]
