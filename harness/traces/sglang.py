"""SGLang's expert-distribution recorder dumps as routing traces: `stat` (counts) and `per_token`.

Owns: reading the recorder's files. Does not own: the checks against the model and the trace
file (harness.traces.base).

The formats, as SGLang defines them (the server runs with
`--expert-distribution-recorder-mode MODE`; `/start_expert_distribution_record`,
`/stop_expert_distribution_record` and `/dump_expert_distribution_record` drive it):

* `stat`, older servers -- `ExpertDistributionRecorder.dump_record` in
  python/sglang/srt/managers/expert_distribution.py writes
  `expert_distribution_rank{R}_timestamp{T}.csv`: a header `layer_id,expert_id,count`, then
  one line per (layer, expert) that was routed to at least once. Only experts with a count
  appear, so the file does not say how many experts a layer has (give --model or --n-experts).
* `stat`, newer servers -- `_StatAccumulator.dump` in python/sglang/srt/eplb/expert_distribution.py
  `torch.save`s `expert_distribution_recorder_{T}.pt`: a dict with `logical_count`, an int
  tensor `[buffered passes, num_layers, num_logical_experts]` (a ring buffer: the pass order
  does not survive it), `rank` and `average_utilization_rate_over_window`.
* `per_token` -- `_DetailAccumulator.dump` (same file) `torch.save`s
  `expert_distribution_recorder_{T}_{R}.pt`: a dict with `records`, one per forward pass in
  execution order -- `forward_pass_id`, `input_ids`, `positions`, `extend_seq_lens`,
  `forward_mode`, and `topk_ids_of_layer`, int32 `[num_layers, tokens, 8]` of *physical*
  expert ids (-1 where a layer routed nothing or beyond top-k) -- and
  `last_physical_to_logical_map`, `[num_layers, num_physical_experts]`.

`num_layers` counts every layer of the model (dense ones stay empty), so a layer's index is the
model's. Both `stat` forms carry counts only: the import is a count-only trace (meta
count_only), for popularity analyses; several files are summed (one rank's dumps, or dumps of
separate recordings: tensor-parallel ranks record the same tokens). `per_token` is ordered: one
step per record, physical ids mapped to logical ones; records name no request, so the trace has
no sequence ids.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.traces.base import Counts, ImportFailure, Passes, Read

STAT_HEADER = ["layer_id", "expert_id", "count"]


def read_stat(paths: Sequence[Path], **_: Any) -> Read:
    """Counts summed over every file: `[num_layers, experts]`, layers with none dropped."""
    total: np.ndarray | None = None
    n_experts: int | None = None
    layer_axis: int | None = None
    for path in paths:
        if path.suffix == ".csv":
            counts = _read_csv(path)
        else:
            dump = _torch_load(path, "a stat dump: a dict with logical_count [passes, layers, experts]")
            if "records" in dump:
                raise ImportFailure(f"{path}: a per_token/per_pass dump (it holds records); import it with "
                                    "--from sglang-per-token")
            counts = _tensor(dump, "logical_count", path, ndim=3).sum(axis=0)        # [num_layers, E]
            n_experts = _same(n_experts, counts.shape[1], path, "experts")
            layer_axis = _same(layer_axis, counts.shape[0], path, "layers")
        total = counts if total is None else _add(total, counts)
    assert total is not None
    layers = [int(l) for l in np.flatnonzero(total.sum(axis=1))]
    return Read(Counts(total[layers]), order="none: stat counts per layer and expert, summed over the dump(s)",
                n_experts=n_experts, layers=layers, layer_axis=layer_axis)


def read_per_token(paths: Sequence[Path], **_: Any) -> Read:
    """One step per record, in file order; physical ids mapped through the last physical-to-logical map."""
    passes = Passes()
    blocks: list[np.ndarray] = []                      # per record: logical ids [num_layers, n, K], -1 empty
    n_experts: int | None = None
    for path in paths:
        dump = _torch_load(path, "a per_token dump: a dict with records and last_physical_to_logical_map")
        if "records" not in dump:
            raise ImportFailure(f"{path}: no records (keys {sorted(dump)}); a stat dump is imported with "
                                "--from sglang-stat; allowed here: a per_token dump")
        mapping = _tensor(dump, "last_physical_to_logical_map", path, ndim=2)        # [num_layers, P]
        n_experts = _same(n_experts, int(mapping.max()) + 1, path, "logical experts")
        for i, rec in enumerate(dump["records"]):
            if not isinstance(rec, dict) or "topk_ids_of_layer" not in rec:
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ImportFailure(f"{path}: record {i} has no topk_ids_of_layer ({keys}); a per_pass dump holds "
                                    "per-pass counts only; allowed: a per_token dump")
            phys = _tensor(rec, "topk_ids_of_layer", path, ndim=3).astype(np.int64)  # [num_layers, n, K]
            if phys.shape[0] != mapping.shape[0]:
                raise ImportFailure(f"{path}: record {i} routes {phys.shape[0]} layers, the map has "
                                    f"{mapping.shape[0]}; allowed: one model per dump")
            if phys.size and phys.max() >= mapping.shape[1]:
                raise ImportFailure(f"{path}: record {i} names physical expert {int(phys.max())}, the map has "
                                    f"{mapping.shape[1]}")
            rows = np.arange(phys.shape[0])[:, None, None]
            blocks.append(np.where(phys >= 0, mapping[rows, np.maximum(phys, 0)], -1))
    if not blocks:
        raise ImportFailure(f"{', '.join(map(str, paths))}: no records; allowed: a dump recorded while requests ran")
    used = np.zeros(blocks[0].shape[0], dtype=bool)
    for b in blocks:
        used |= (b >= 0).any(axis=(1, 2))
    layers = [int(l) for l in np.flatnonzero(used)]
    k = None
    for i, b in enumerate(blocks):
        if b.shape[1] == 0:
            continue
        valid = (b[layers] >= 0).sum(axis=2)                                          # [L, n]
        k = int(valid.max()) if k is None else k
        ids = b[layers][:, :, :k]                                  # the router's top-k slots, then -1 padding
        if valid.min() != valid.max() or int(valid.max()) != k or (ids < 0).any():
            raise ImportFailure(f"record {i}: tokens route to between {int(valid.min())} and {int(valid.max())} "
                                f"experts (the first records: {k}); allowed: one top-k, every token routed on "
                                "every MoE layer, in the first top-k slots")
        passes.add(ids.transpose(1, 0, 2))                                            # [n, L, k]
    return Read(passes, order="one step per recorded forward pass, in record order; no request ids",
                n_experts=n_experts, layers=layers, layer_axis=blocks[0].shape[0])


def _read_csv(path: Path) -> np.ndarray:
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as exc:
        raise ImportFailure(f"{path}: cannot read it ({exc})") from None
    if not rows or [c.strip() for c in rows[0]] != STAT_HEADER:
        raise ImportFailure(f"{path}: header {rows[0] if rows else 'missing'}; allowed: {','.join(STAT_HEADER)} "
                            "(SGLang's stat dump)")
    try:
        table = np.array([[int(c) for c in r] for r in rows[1:] if r], dtype=np.int64).reshape(-1, 3)
    except ValueError:
        raise ImportFailure(f"{path}: a row that is not three integers layer_id,expert_id,count") from None
    if table.size and table.min() < 0:
        raise ImportFailure(f"{path}: a negative layer, expert or count ({int(table.min())}); allowed: >= 0")
    counts = np.zeros((int(table[:, 0].max(initial=-1)) + 1, int(table[:, 1].max(initial=-1)) + 1), np.int64)
    np.add.at(counts, (table[:, 0], table[:, 1]), table[:, 2])
    return counts


def _torch_load(path: Path, allowed: str) -> dict[str, Any]:
    import pickle

    import torch
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)     # tensors and plain containers only
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        raise ImportFailure(f"{path}: not a readable torch.save file ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}); allowed: {allowed}") from None
    if not isinstance(obj, dict):
        raise ImportFailure(f"{path}: holds a {type(obj).__name__}; allowed: {allowed}")
    return obj


def _tensor(obj: dict[str, Any], key: str, path: Path, ndim: int) -> np.ndarray:
    value = obj.get(key)
    arr = value.numpy() if hasattr(value, "numpy") else np.asarray(value) if value is not None else None
    if arr is None or arr.ndim != ndim or arr.dtype.kind not in "iu":
        got = "missing" if arr is None else f"dtype {arr.dtype}, shape {arr.shape}"
        raise ImportFailure(f"{path}: {key} must be an integer tensor of {ndim} dimensions, got {got}")
    return arr


def _same(known: int | None, value: int, path: Path, what: str) -> int:
    if known is not None and known != value:
        raise ImportFailure(f"{path}: {value} {what}, earlier files {known}; allowed: dumps of one model")
    return value


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sum of two count tables, padded to the larger shape (a CSV lists only the counts it saw)."""
    shape = (max(a.shape[0], b.shape[0]), max(a.shape[1], b.shape[1]))
    out = np.zeros(shape, np.int64)
    out[:a.shape[0], :a.shape[1]] += a
    out[:b.shape[0], :b.shape[1]] += b
    return out
