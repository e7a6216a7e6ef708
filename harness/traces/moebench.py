"""moebench's own routing traces (`run.record_trace=true`'s routing.npz,
`engine.trace_recorder.TraceRecorder`, `moebench-sim --save-trace`) merged into one.

Owns: concatenating traces of one model in the order given -- steps and sequences renumbered so
each file's passes follow the previous file's -- or summing count-only ones. Does not own: the
file format (engine.trace) or the checks against a model (harness.traces.base).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.trace import RoutingTrace, load_trace
from harness.traces.base import Counts, ImportFailure, Passes, Read

SAME = ("n_experts", "moe_layers", "expert_bytes")        # what every merged trace must share


def read(paths: Sequence[Path], **_: Any) -> Read:
    traces = []
    for path in paths:
        try:
            traces.append(load_trace(path))
        except (ValueError, FileNotFoundError) as exc:
            raise ImportFailure(str(exc)) from None
    first = traces[0]
    for path, tr in zip(paths[1:], traces[1:]):
        for key, a, b in [(k, getattr(first, k), getattr(tr, k)) for k in SAME] + [("count_only", first.count_only,
                                                                                     tr.count_only)]:
            if a != b:
                raise ImportFailure(f"{path}: {key}={b}, {paths[0]} has {a}; allowed: traces of one model, all "
                                    "ordered or all count-only")
    meta = {k: v for k, v in first.meta.items() if k not in ("source", "count_only", "order", "files", "format")}
    common = dict(n_experts=first.n_experts, layers=first.moe_layers, meta=meta)
    if first.count_only:
        total = np.sum([tr.counts for tr in traces], axis=0)
        return Read(Counts(total), order="none: count-only traces, summed", **common)
    passes = Passes()
    for tr in traces:
        _add(passes, tr)
    weights = np.concatenate([tr.weights for tr in traces]) if all(t.weights is not None for t in traces) else None
    return Read(passes, order="the input traces' own steps, one file after another", weights=weights, **common)


def _add(passes: Passes, tr: RoutingTrace) -> None:
    """`tr`'s passes after those already added, its sequences given fresh ids."""
    steps = tr.step_ids()                                                     # [N], dense from 0
    seq = tr.sequence
    ids = passes.new_sequences(int(seq.max()) + 1 if seq is not None and len(seq) else 0)
    bounds = np.flatnonzero(np.diff(steps)) + 1
    for block in np.split(np.arange(tr.n_tokens), bounds):
        if len(block):
            passes.add(tr.experts[block], None if seq is None else np.asarray(ids)[seq[block]])
