"""Golden values for the interval arithmetic and the DESIGN §5 overlap metrics.

Every expected value is worked out by hand in the comment beside it."""
from __future__ import annotations

import pytest

from harness.profiling.overlap import (OVERLAP_METRICS, OVERLAP_UNITS, clip, intersection, intersection_length,
                                       merge, overlap_metrics, union_length)


# ----------------------------------------------------------------------------- merge / union

def test_merge_empty():
    assert merge([]) == []
    assert union_length([]) == 0


def test_merge_disjoint_sorted():
    # [5,6] and [1,2] do not touch: two pieces, sorted; 1 + 1 = 2
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]
    assert union_length([(5, 6), (1, 2)]) == 2


def test_merge_overlapping_counted_once():
    # two copy streams [0,4] and [2,6] -> [0,6] = 6, not 4 + 4 = 8
    assert merge([(0, 4), (2, 6)]) == [(0, 6)]
    assert union_length([(0, 4), (2, 6)]) == 6


def test_merge_nested():
    # [3,4] inside [1,10] -> [1,10] = 9
    assert merge([(1, 10), (3, 4)]) == [(1, 10)]
    assert union_length([(3, 4), (1, 10)]) == 9


def test_merge_touching():
    # [0,1] and [1,2] share only the instant 1: one piece [0,2] of length 2
    assert merge([(1, 2), (0, 1)]) == [(0, 2)]
    assert union_length([(0, 1), (1, 2)]) == 2


def test_merge_drops_zero_length_and_chains():
    # [2,2] holds no time; [0,3],[1,5],[5,7] chain into [0,7]; [9,9.5] stays apart
    assert merge([(2, 2), (5, 7), (0, 3), (1, 5), (9, 9.5)]) == [(0, 7), (9, 9.5)]
    assert union_length([(2, 2)]) == 0


def test_merge_rejects_backwards_interval():
    with pytest.raises(ValueError, match=r"interval #1 must have start <= end; got \(3, 2\)"):
        merge([(0, 1), (3, 2)])
    with pytest.raises(ValueError, match="must be a \\(start, end\\) pair"):
        merge([(0, 1, 2)])


# ----------------------------------------------------------------------------- intersection

def test_intersection_two_copy_streams_under_one_kernel_counted_once():
    # copies [0,4] and [2,6] (union [0,6]) under kernel [1,5]: overlap [1,5] = 4,
    # not ([1,4] = 3) + ([2,5] = 3) = 6
    assert intersection([(0, 4), (2, 6)], [(1, 5)]) == [(1, 5)]
    assert intersection_length([(0, 4), (2, 6)], [(1, 5)]) == 4


def test_intersection_overlapping_compute_streams_counted_once():
    # copy [0,10]; kernels on two streams [2,6] and [4,8] (union [2,8]) -> 6, not 4 + 4
    assert intersection_length([(0, 10)], [(2, 6), (4, 8)]) == 6


def test_intersection_disjoint_and_touching_are_zero():
    assert intersection_length([(0, 1)], [(2, 3)]) == 0     # disjoint
    assert intersection_length([(0, 1)], [(1, 2)]) == 0     # touching: no shared time
    assert intersection([(0, 1)], [(1, 2)]) == []


def test_intersection_nested_and_many_pieces():
    # a = [0,10]; b = [1,2],[3,5],[9,12] -> [1,2],[3,5],[9,10] = 1 + 2 + 1 = 4
    assert intersection([(0, 10)], [(9, 12), (1, 2), (3, 5)]) == [(1, 2), (3, 5), (9, 10)]
    assert intersection_length([(0, 10)], [(9, 12), (1, 2), (3, 5)]) == 4
    # symmetric
    assert intersection_length([(9, 12), (1, 2), (3, 5)], [(0, 10)]) == 4


def test_intersection_empty_side():
    assert intersection_length([], [(0, 1)]) == 0
    assert intersection_length([(0, 1)], []) == 0


def test_clip():
    # [0,4],[6,10] clipped to [3,7] -> [3,4],[6,7]
    assert clip([(0, 4), (6, 10)], 3, 7) == [(3, 4), (6, 7)]


# ----------------------------------------------------------------------------- metrics

def test_overlap_metrics_names_and_units_are_design_names():
    assert OVERLAP_METRICS == ("copy_busy_s", "overlap_s", "exposed_copy_s", "overlap_frac", "link_gbps")
    assert set(overlap_metrics([], [])) == set(OVERLAP_METRICS) == set(OVERLAP_UNITS)


def test_overlap_metrics_golden():
    # copies [0,2] (stream A) and [1,3] (stream B): union [0,3] -> copy_busy_s = 3
    # compute [2,5]: overlap = [2,3] = 1; exposed = 3 - 1 = 2; frac = 1/3
    # link = 3e9 B / 3 s / 1e9 = 1.0 GB/s
    m = overlap_metrics([(0.0, 2.0), (1.0, 3.0)], [(2.0, 5.0)], h2d_bytes=3e9)
    assert m["copy_busy_s"] == pytest.approx(3.0)
    assert m["overlap_s"] == pytest.approx(1.0)
    assert m["exposed_copy_s"] == pytest.approx(2.0)
    assert m["overlap_frac"] == pytest.approx(1 / 3)
    assert m["link_gbps"] == pytest.approx(1.0)


def test_overlap_metrics_fully_hidden_nested():
    # copy [2,3] nested in compute [0,10]: busy 1, overlap 1, exposed 0, frac 1
    m = overlap_metrics([(2, 3)], [(0, 10)], h2d_bytes=2e9)
    assert (m["copy_busy_s"], m["overlap_s"], m["exposed_copy_s"], m["overlap_frac"]) == (1.0, 1.0, 0.0, 1.0)
    assert m["link_gbps"] == pytest.approx(2.0)   # 2e9 B / 1 s / 1e9


def test_overlap_metrics_disjoint_and_touching():
    # copy [0,1] and compute [1,2] touch: busy 1, overlap 0, exposed 1, frac 0
    m = overlap_metrics([(0, 1)], [(1, 2)])
    assert (m["copy_busy_s"], m["overlap_s"], m["exposed_copy_s"], m["overlap_frac"]) == (1.0, 0.0, 1.0, 0.0)
    assert m["link_gbps"] is None                 # no h2d_bytes given


def test_overlap_metrics_no_copies():
    # nothing copied: busy 0, nothing to hide -> frac None (not 0); no time -> no rate
    m = overlap_metrics([], [(0, 5)], h2d_bytes=100)
    assert m == {"copy_busy_s": 0.0, "overlap_s": 0.0, "exposed_copy_s": 0.0, "overlap_frac": None,
                 "link_gbps": None}


def test_overlap_metrics_link_never_from_emulated_or_without_bytes():
    assert overlap_metrics([(0, 1)], [], h2d_bytes=1e9, emulated=True)["link_gbps"] is None
    assert overlap_metrics([(0, 1)], [], h2d_bytes=0)["link_gbps"] is None
    assert overlap_metrics([(0, 1)], [], h2d_bytes=1e9)["link_gbps"] == pytest.approx(1.0)


def test_overlap_metrics_nanosecond_timestamps():
    # integer ns: copies [1000,3000],[2000,4000] -> busy 3000 ns = 3e-6 s;
    # compute [3500,9000] -> overlap 500 ns = 5e-7 s; link 6000 B / 3e-6 s / 1e9 = 2.0 GB/s
    m = overlap_metrics([(1000, 3000), (2000, 4000)], [(3500, 9000)], h2d_bytes=6000, time_unit_s=1e-9)
    assert m["copy_busy_s"] == pytest.approx(3e-6)
    assert m["overlap_s"] == pytest.approx(5e-7)
    assert m["exposed_copy_s"] == pytest.approx(2.5e-6)
    assert m["overlap_frac"] == pytest.approx(500 / 3000)
    assert m["link_gbps"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="time_unit_s must be a positive"):
        overlap_metrics([], [], time_unit_s=0)
