"""The natural order of factor values, shared by the figures and the sweep table.

Owns: `natural_key` -- numbers (also "1024" as text) numerically, then text ("auto"), then
missing values -- so contexts read 256 < 512 < 1024 wherever they are listed.
Does not own: colours or labels (harness.plotstyle), the table's columns (harness.table).
"""
from __future__ import annotations

import math

import pandas as pd


def missing(v: object) -> bool:
    return v is None or (not isinstance(v, str) and bool(pd.isna(v)))


def number(v: object) -> float | None:
    if missing(v) or isinstance(v, bool):
        return None
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def natural_key(v: object) -> tuple:
    """Sort key of a factor value: numbers (also "1024") numerically, then text ("auto"), then missing."""
    if missing(v):
        return (2, 0.0, "")
    x = number(v)
    return (0, x, "") if x is not None else (1, 0.0, str(v))
