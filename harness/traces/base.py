"""What every trace importer shares: the model's shape, the passes it read, and the one place
that turns them into a validated DESIGN §3 routing trace.

Owns: `Shape` (what the command line says about the model: a preset or checkpoint via
`--model`, or `--n-experts/--expert-bytes/--top-k`), `Passes` (the ordered routing an importer
read, one forward pass at a time, with its batch rows), `Counts` (per-layer expert counts with
no order), `finish` (checks the importer's result against the shape -- expert count, layer
count, top-k -- and builds the trace and its meta), and `ImportFailure`, the one-line error.
Does not own: any engine's file format (one module per format), the trace file itself
(engine.trace).

N=tokens, L=MoE layers, k=top-k, E=experts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ModelConfig
from engine.trace import RoutingTrace


class ImportFailure(ValueError):
    """A file the importer cannot use; the message says what was wrong, what is allowed, what was given."""


@dataclass(frozen=True)
class Shape:
    """The model the routing came from, as far as the command line says: `cfg` (from --model) and
    the explicit values (each None when not given)."""

    cfg: ModelConfig | None = None
    dtype_bytes: int | None = None       # bytes per weight element for expert_bytes from cfg
    n_experts: int | None = None
    expert_bytes: int | None = None
    top_k: int | None = None

    def resolve(self, name: str, from_file: int | None, what_file: str) -> int | None:
        """One number from the file, the model and the flags: they must agree; None if none says."""
        given = {what_file: from_file, f"--{name.replace('_', '-')}": getattr(self, name),
                 f"--model {self.cfg.name if self.cfg else ''}".strip(): getattr(self.cfg, name, None)}
        known = {k: int(v) for k, v in given.items() if v is not None}
        if len(set(known.values())) > 1:
            raise ImportFailure(f"{name} mismatch: {', '.join(f'{k} says {v}' for k, v in known.items())}; "
                                f"allowed: one {name} (the model the routing was recorded on)")
        return next(iter(known.values()), None)


@dataclass
class Passes:
    """Routing read in execution order: each `add` is one forward pass (a step) of tokens."""

    ids: list[np.ndarray] = field(default_factory=list)          # per pass: int [n, L, k]
    sequences: list[np.ndarray] = field(default_factory=list)    # per pass: int [n]
    keep_sequences: bool = True
    steps: int = 0
    next_sequence: int = 0

    def new_sequences(self, n: int) -> list[int]:
        """`n` fresh sequence ids (a request, a choice, a batch row)."""
        out = list(range(self.next_sequence, self.next_sequence + n))
        self.next_sequence += n
        return out

    def add(self, ids: np.ndarray, sequence: Sequence[int] | np.ndarray | None = None) -> None:
        """One forward pass: ids [n, L, k]; sequence [n] (None: the sequences are not known)."""
        if len(ids) == 0:
            return
        if self.ids and ids.shape[1:] != self.ids[0].shape[1:]:
            L0, k0 = self.ids[0].shape[1:]
            raise ImportFailure(f"pass {self.steps} routes {ids.shape[1]} layers x top-{ids.shape[2]}, earlier "
                                f"passes {L0} layers x top-{k0}; allowed: routing of one model per import")
        self.ids.append(np.asarray(ids))
        if sequence is None:
            self.keep_sequences = False
        else:
            self.sequences.append(np.asarray(sequence, dtype=np.int64).reshape(len(ids)))
        self.steps += 1


@dataclass
class Counts:
    """Expert counts per layer, no token order (a count-only trace). int [L, E]."""

    counts: np.ndarray


@dataclass
class Read:
    """What an importer read: ordered passes or counts, plus what the files themselves say."""

    routing: Passes | Counts
    order: str                                   # how the file's order became steps (meta "order")
    n_experts: int | None = None                 # when the format carries it
    layers: list[int] | None = None              # model layer index per trace layer, when the format says
    layer_axis: int | None = None                # the format's layer-axis size when it spans every model layer
    meta: dict[str, Any] = field(default_factory=dict)   # extra meta (weights, an input trace's meta)
    weights: np.ndarray | None = None            # float [N, L, k] when the format has them


def finish(read: Read, shape: Shape, fmt: str, paths: Sequence[Path]) -> RoutingTrace:
    """The validated trace of `read`, its layers, experts and top-k checked against `shape`."""
    cfg = shape.cfg
    if isinstance(read.routing, Counts):
        counts = np.asarray(read.routing.counts, dtype=np.int64)               # [L, E seen]
        L, k_file = counts.shape[0], None
        if counts.sum() == 0:
            raise ImportFailure(f"{_names(paths)}: every count is 0; allowed: a dump recorded while requests ran")
    else:
        if not read.routing.ids:
            raise ImportFailure(f"{_names(paths)}: no routed token in the file(s); allowed: routing of >= 1 token")
        experts = np.concatenate(read.routing.ids).astype(np.int64)            # [N, L, k]
        L, k_file = experts.shape[1], experts.shape[2]
    n_experts = shape.resolve("n_experts", read.n_experts, f"the {fmt} file")
    if n_experts is None:
        raise ImportFailure(f"the {fmt} format does not say how many experts a layer has; give --model NAME|DIR "
                            "(a preset or a checkpoint directory) or --n-experts N")
    if isinstance(read.routing, Counts):                 # the counts of experts never seen are 0
        if counts.shape[1] > n_experts:
            raise ImportFailure(f"{_names(paths)}: counts for expert id {counts.shape[1] - 1}, outside "
                                f"[0, n_experts={n_experts}); allowed: ids of the model's experts")
        counts = np.pad(counts, ((0, 0), (0, n_experts - counts.shape[1])))
    top_k = shape.resolve("top_k", k_file, f"the {fmt} file")
    expert_bytes = _expert_bytes(shape, read.meta.get("expert_bytes"))
    moe_layers = _moe_layers(read, cfg, L, fmt)
    meta: dict[str, Any] = {**read.meta, "n_experts": n_experts, "expert_bytes": expert_bytes, "source": "import",
                            "format": fmt, "files": [p.name for p in paths], "order": read.order}
    if moe_layers is not None:
        meta["moe_layers"] = moe_layers
    if cfg is not None:
        meta.update(model=cfg.name, family=cfg.family, num_layers=int(cfg.num_layers),
                    hidden_size=int(cfg.hidden_size))
    if isinstance(read.routing, Counts):
        meta["count_only"] = True
        if top_k is not None:
            meta["top_k"] = top_k
        tr = RoutingTrace(experts=np.zeros((0, L, top_k or 1), np.int32), meta=meta, counts=counts,
                          source=f"imported {fmt} counts")
    else:
        meta["top_k"] = top_k
        seqs = np.concatenate(read.routing.sequences) if read.routing.keep_sequences else None
        steps = np.repeat(np.arange(read.routing.steps), [len(a) for a in read.routing.ids])
        tr = RoutingTrace(experts=experts, meta=meta, weights=read.weights, step=steps, sequence=seqs,
                          source=f"imported {fmt} routing")
    try:
        return tr.validate()
    except ValueError as exc:
        raise ImportFailure(f"{_names(paths)}: {exc}") from None


def _expert_bytes(shape: Shape, from_file: int | None) -> int:
    """--expert-bytes (a deployment's own size, e.g. quantised), else the input trace's, else the model's."""
    for value in (shape.expert_bytes, from_file):
        if value is not None:
            return int(value)
    if shape.cfg is not None:
        return int(shape.cfg.expert_bytes(shape.dtype_bytes))
    raise ImportFailure("expert_bytes is unknown: routing files do not say how many bytes an expert moves; "
                        "give --model NAME|DIR (with --dtype) or --expert-bytes B")


def _moe_layers(read: Read, cfg: ModelConfig | None, L: int, fmt: str) -> list[int] | None:
    """Model layer index of each trace layer, checked against the model's MoE layers."""
    if cfg is None:
        return read.layers
    want = [int(x) for x in cfg.moe_layers]
    if read.layers is None:
        if L != len(want):
            raise ImportFailure(f"layer count mismatch: the {fmt} routing has {L} MoE layers, model {cfg.name} "
                                f"has {len(want)} ({want}); allowed: the model's MoE layer count")
        return want
    if read.layer_axis is not None and read.layer_axis != cfg.num_layers:
        raise ImportFailure(f"layer count mismatch: the {fmt} dump spans {read.layer_axis} layers, model "
                            f"{cfg.name} has {cfg.num_layers}; allowed: a dump of that model")
    if sorted(read.layers) != want:
        raise ImportFailure(f"layer mismatch: the {fmt} dump routes layers {read.layers}, model {cfg.name}'s MoE "
                            f"layers are {want}; allowed: routing on exactly the model's MoE layers")
    return list(read.layers)


def _names(paths: Sequence[Path]) -> str:
    return ", ".join(str(p) for p in paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")


def check_ids(arr: Any, what: str) -> np.ndarray:
    """An integer array [N, L, k] of expert ids, or ImportFailure naming `what` and what it holds."""
    a = np.asarray(arr)
    if a.dtype.kind not in "iu":
        raise ImportFailure(f"{what}: expected integer expert ids [tokens, layers, top_k], got dtype {a.dtype}")
    if a.ndim != 3 or (a.shape[0] and (a.shape[1] < 1 or a.shape[2] < 1)):
        raise ImportFailure(f"{what}: expected expert ids of shape [tokens, layers, top_k], got shape {a.shape}")
    return a
