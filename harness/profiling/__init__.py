"""Profiling: reading copy/compute timelines and turning them into the overlap metrics of
DESIGN.md §5.

  * `harness.profiling.overlap` -- pure interval arithmetic (union, intersection) and the
    `copy_busy_s / overlap_s / exposed_copy_s / overlap_frac / link_gbps` metrics;
  * `harness.profiling.nsys` -- the `nsys profile` command line and the reader of its
    SQLite export into tidy rows.
"""
