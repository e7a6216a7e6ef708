"""Routing traces: the `.npz` file exchanged by the engine, the simulator and users (DESIGN.md §3).

Owns: the `RoutingTrace` container, its validation, `save_trace`/`load_trace`, and
`lookup_sequences` -- the exact per-layer device-cache lookup order the engine produces for a
trace. Does not own: recording a trace from a running engine (`engine.trace_recorder`),
replaying lookups through eviction policies, statistics or synthetic traces (`harness.sim`),
nor the cache itself (`engine.cache`).

File format (`np.savez`, read with `allow_pickle=False`), N=tokens, L=MoE layers, k=top-k:

    experts   int32   [N, L, k]   routed expert ids, each in [0, n_experts), distinct per (token, layer);
                                  slot order is the router's (descending weight) when recorded
    weights   float32 [N, L, k]   optional: routing weights of those experts
    step      int32   [N]         optional extension: forward-pass index of each token (tokens of one
                                  prefill micro-batch or one decode step share it; non-decreasing).
                                  Without it every token is its own step (decode-like replay).
    sequence  int32   [N]         optional extension: batch row (sequence) each token belongs to, so
                                  "previous token" statistics compare tokens of the same sequence
    counts    int64   [L, E]      optional extension, a *count-only* trace (meta count_only: true): how
                                  many tokens routed to each expert, per layer, with no token order (an
                                  imported SGLang `stat` dump); experts is then empty, [0, L, k]
    meta      str (0-d)           JSON object: at least n_experts, expert_bytes; recorded traces add
                                  model, family, num_layers, moe_layers, top_k, hidden_size, dtype, and
                                  expert_bytes_vary when experts store different bytes (a mixed
                                  treatment: expert_bytes is then the slot size, no expert's own)

A count-only trace serves popularity analyses only (`expert_counts`: static's hot-expert profile,
the simulator's popularity table); everything that needs the order tokens were routed in
(`lookup_arrays`, and so every replay, curve, prefetch oracle and routing statistic) refuses it
in one line (`require_order`) rather than inventing an order.

The engine looks up, per forward pass and MoE layer, the *sorted unique* experts used by
that pass's tokens, once each (engine.placements.base `combine`). `lookup_sequences` rebuilds
exactly that order, which is why `step` makes replay exact for prefill micro-batches.

    rec = TraceRecorder(eng)                    # engine.trace_recorder: hooks eng.model's routing
    eng.generate(prompts, 16)
    save_trace("run.npz", rec.trace())
    tr = load_trace("run.npz")                  # validated; ValueError names what is wrong
    seqs = lookup_sequences(tr)                 # {trace layer: [expert ids in lookup order]}
    RoutingTrace.from_reference_string([7, 0, 1, 2, 0, 3], n_experts=8)   # textbook paging
"""
from __future__ import annotations

import json
import logging
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["RoutingTrace", "save_trace", "load_trace", "lookup_sequences",
           "lookup_arrays", "expert_counts", "distinct_per_pass", "require_order", "REQUIRED_META"]

REQUIRED_META = ("n_experts", "expert_bytes")
ARRAYS = ("experts", "weights", "step", "sequence", "counts")


@dataclass
class RoutingTrace:
    """Per token and MoE layer, the routed experts (N=tokens, L=MoE layers, k=top-k).

    Construct, then `validate()` (done by `load_trace`, `save_trace` and the simulator);
    construction itself checks nothing, so a broken trace can be built to test errors.
    """

    experts: np.ndarray                      # int32 [N, L, k]
    meta: dict[str, Any]
    weights: np.ndarray | None = None        # float32 [N, L, k]
    step: np.ndarray | None = None           # int32 [N], non-decreasing
    sequence: np.ndarray | None = None       # int32 [N]
    counts: np.ndarray | None = None         # int64 [L, E]: a count-only trace (no tokens, no order)
    source: str = field(default="trace", compare=False, repr=False)   # for error messages

    # --- shape ---------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def n_experts(self) -> int:
        return int(self.meta["n_experts"])

    @property
    def expert_bytes(self) -> int:
        return int(self.meta["expert_bytes"])

    @property
    def count_only(self) -> bool:
        """Whether this trace holds per-layer expert counts and no token order (module docstring)."""
        return self.counts is not None

    @property
    def moe_layers(self) -> list[int]:
        """Model layer index of each trace layer (meta `moe_layers`, else 0..L-1)."""
        return [int(x) for x in self.meta.get("moe_layers", range(self.n_layers))]

    def step_ids(self) -> np.ndarray:
        """int64 [N]: dense 0-based step index of each token (each token its own step without `step`)."""
        if self.step is None:
            return np.arange(self.n_tokens, dtype=np.int64)
        s = np.asarray(self.step)
        change = np.empty(len(s), dtype=np.int64)
        if len(s):
            change[0] = 0
            change[1:] = s[1:] != s[:-1]
        return np.cumsum(change)

    # --- construction --------------------------------------------------------------------
    @classmethod
    def from_reference_string(cls, refs: Sequence[int] | np.ndarray, n_experts: int | None = None,
                              expert_bytes: int = 1) -> "RoutingTrace":
        """A page-reference string as a trace with layers=1, top_k=1 (one lookup per reference).

        `n_experts` defaults to max(refs) + 1."""
        arr = np.asarray(refs)
        if arr.ndim != 1:
            raise ValueError(f"reference string must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"reference string has dtype {arr.dtype}; expected integers")
        if n_experts is None:
            n_experts = int(arr.max()) + 1 if arr.size else 1
        tr = cls(experts=arr.astype(np.int32).reshape(-1, 1, 1),
                 meta={"n_experts": int(n_experts), "expert_bytes": int(expert_bytes), "moe_layers": [0],
                       "source": "reference_string"})
        return tr.validate()

    # --- validation ----------------------------------------------------------------------
    def validate(self) -> "RoutingTrace":
        """Check dtypes, shapes, id ranges, meta and step order; normalise dtypes in place
        (experts/step/sequence -> int32, weights -> float32). Returns self.

        Raises ValueError naming the array, what was expected and what was given."""
        where = f"{self.source}: "
        ex = self.experts
        if not isinstance(ex, np.ndarray):
            ex = np.asarray(ex)
        if not np.issubdtype(ex.dtype, np.integer):
            raise ValueError(f"{where}experts has dtype {ex.dtype}; expected an integer dtype (int32)")
        if ex.ndim != 3:
            raise ValueError(f"{where}experts has shape {ex.shape}; expected 3 dimensions [tokens, layers, top_k]")
        if ex.shape[1] < 1 or ex.shape[2] < 1:
            raise ValueError(f"{where}experts has shape {ex.shape}; layers and top_k must be >= 1")
        self._validate_meta(where, ex.shape)
        E = int(self.meta["n_experts"])
        if ex.size:
            bad = (ex < 0) | (ex >= E)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"{where}expert id {int(ex[idx])} at {list(idx)} is out of range [0, {E})")
            if ex.shape[2] > 1:
                srt = np.sort(ex, axis=2)                                     # [N, L, k]
                dup = srt[:, :, 1:] == srt[:, :, :-1]                         # [N, L, k-1]
                if dup.any():
                    t, l, j = (int(i) for i in np.argwhere(dup)[0])
                    raise ValueError(f"{where}token {t} layer {l} routes to expert {int(srt[t, l, j])} more "
                                     f"than once; the top-{ex.shape[2]} ids of a token must be distinct")
        self.experts = ex.astype(np.int32, copy=False)
        if self.weights is not None:
            w = np.asarray(self.weights)
            if not np.issubdtype(w.dtype, np.floating):
                raise ValueError(f"{where}weights has dtype {w.dtype}; expected a floating dtype (float32)")
            if w.shape != ex.shape:
                raise ValueError(f"{where}weights shape {tuple(w.shape)} does not match experts {tuple(ex.shape)}")
            self.weights = w.astype(np.float32, copy=False)
        for name in ("step", "sequence"):
            a = getattr(self, name)
            if a is None:
                continue
            a = np.asarray(a)
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"{where}{name} has dtype {a.dtype}; expected an integer dtype (int32)")
            if a.shape != (ex.shape[0],):
                raise ValueError(f"{where}{name} shape {tuple(a.shape)} does not match experts: expected "
                                 f"({ex.shape[0]},), one entry per token")
            if name == "step" and len(a) > 1:
                dec = np.flatnonzero(a[1:] < a[:-1])
                if dec.size:
                    i = int(dec[0]) + 1
                    raise ValueError(f"{where}step must be non-decreasing (tokens of one forward pass are "
                                     f"contiguous), but step[{i}]={int(a[i])} < step[{i - 1}]={int(a[i - 1])}")
            if name == "sequence" and a.size and a.min() < 0:
                raise ValueError(f"{where}sequence ids must be >= 0, got {int(a.min())}")
            setattr(self, name, a.astype(np.int32, copy=False))
        self._validate_counts(where, ex.shape)
        return self

    def _validate_counts(self, where: str, shape: tuple[int, ...]) -> None:
        marked = self.meta.get("count_only") is True
        if (self.counts is None) != (not marked):
            raise ValueError(f"{where}meta count_only={self.meta.get('count_only')!r} but the counts array is "
                             f"{'missing' if self.counts is None else 'present'}; a count-only trace has both "
                             "(count_only: true and int64 counts [layers, n_experts]), an ordered trace neither")
        if self.counts is None:
            return
        c, E = np.asarray(self.counts), int(self.meta["n_experts"])
        if not np.issubdtype(c.dtype, np.integer) or c.shape != (shape[1], E) or (c.size and c.min() < 0):
            raise ValueError(f"{where}counts must be integers >= 0 of shape ({shape[1]}, {E}) [layers, n_experts]; "
                             f"got dtype {c.dtype}, shape {tuple(c.shape)}")
        if shape[0] != 0 or any(a is not None for a in (self.weights, self.step, self.sequence)):
            raise ValueError(f"{where}a count-only trace holds no tokens: experts must be empty ([0, layers, k]) "
                             f"and weights/step/sequence absent; given experts shape {tuple(shape)}")
        self.counts = c.astype(np.int64, copy=False)

    def _validate_meta(self, where: str, shape: tuple[int, ...]) -> None:
        meta = self.meta
        if not isinstance(meta, dict):
            raise ValueError(f"{where}meta must be a JSON object (dict), got {type(meta).__name__}")
        for key in REQUIRED_META:
            if key not in meta:
                raise ValueError(f"{where}meta {key} missing; required keys: {', '.join(REQUIRED_META)}; "
                                 f"given: {', '.join(sorted(meta)) or 'none'}")
            v = meta[key]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{where}meta {key} must be an integer, got {v!r}")
        if meta["n_experts"] < 1:
            raise ValueError(f"{where}meta n_experts must be >= 1, got {meta['n_experts']}")
        if meta["expert_bytes"] < 0:
            raise ValueError(f"{where}meta expert_bytes must be >= 0, got {meta['expert_bytes']}")
        if "moe_layers" in meta:
            ml = meta["moe_layers"]
            if not isinstance(ml, (list, tuple)):
                raise ValueError(f"{where}meta moe_layers must be a list of model layer indices, got {ml!r}")
            if len(ml) != shape[1]:
                raise ValueError(f"{where}meta moe_layers has {len(ml)} entries, which does not match experts "
                                 f"shape {tuple(shape)}: expected one model layer index per trace layer ({shape[1]})")
        if "top_k" in meta and int(meta["top_k"]) != shape[2]:
            raise ValueError(f"{where}meta top_k={meta['top_k']} does not match experts shape {tuple(shape)} "
                             f"(top_k axis = {shape[2]})")
        if meta["n_experts"] < shape[2]:
            raise ValueError(f"{where}meta n_experts={meta['n_experts']} is smaller than top_k={shape[2]}")


# --- file I/O ------------------------------------------------------------------------------
def save_trace(path: str | Path, trace: RoutingTrace, compress: bool = True) -> Path:
    """Validate `trace` and write it as an `.npz` (see the module docstring). Returns the path."""
    trace.validate()
    arrays: dict[str, np.ndarray] = {"experts": trace.experts, "meta": np.array(json.dumps(trace.meta))}
    for name in ("weights", "step", "sequence", "counts"):
        a = getattr(trace, name)
        if a is not None:
            arrays[name] = a
    path = Path(path)
    with open(path, "wb") as f:          # a file object: np.savez would otherwise append ".npz"
        (np.savez_compressed if compress else np.savez)(f, **arrays)
    return path


ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")     # a zip's first local header; an empty zip's end record


def load_trace(path: str | Path) -> RoutingTrace:
    """Read and validate a trace file; ValueError names the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file, not an .npz trace (a trace is written by run.record_trace=true "
                         "or engine.trace.save_trace)")
    with open(path, "rb") as f:
        head = f.read(8)
    if not head.startswith(ZIP_MAGIC):   # else np.load reads it as a pickle and talks of "pickled data"
        what = "a single .npy array" if head.startswith(b"\x93NUMPY") else f"its first bytes are {head!r}"
        raise ValueError(f"{path}: not a routing trace: a trace is an .npz (zip) archive of experts and meta, "
                         f"written by run.record_trace=true or engine.trace.save_trace, and this file is not a zip "
                         f"archive ({what})")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a readable .npz trace file ({type(err).__name__}: {err}); "
                         "truncated or not written by save_trace") from err
    try:
        with z:
            return _read_arrays(path, z)
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as err:   # damaged member: bad CRC, cut short
        raise ValueError(f"{path}: damaged .npz trace file ({type(err).__name__}: {err})") from err


def _read_arrays(path: Path, z: "np.lib.npyio.NpzFile") -> RoutingTrace:
    names = set(z.files)
    if "experts" not in names or "meta" not in names:
        missing = [n for n in ("experts", "meta") if n not in names]
        present = ", ".join(sorted(names)) or "none"
        raise ValueError(f"{path}: missing array(s) {', '.join(missing)}; a trace needs experts and meta "
                         f"(optional: weights, step, sequence, counts); arrays present: {present}")
    extra = names - set(ARRAYS) - {"meta"}
    if extra:
        log.warning("%s: ignoring unknown arrays %s", path, sorted(extra))
    raw = _member(path, z, "meta")
    if raw.dtype.kind not in "US" or raw.ndim != 0:
        raise ValueError(f"{path}: meta must be a 0-d string array holding JSON, got dtype {raw.dtype} "
                         f"shape {raw.shape}")
    text = raw[()]
    text = text.decode() if isinstance(text, bytes) else str(text)
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: meta is not valid JSON ({err})") from err
    tr = RoutingTrace(experts=_member(path, z, "experts"), meta=meta,
                      weights=_member(path, z, "weights") if "weights" in names else None,
                      step=_member(path, z, "step") if "step" in names else None,
                      sequence=_member(path, z, "sequence") if "sequence" in names else None,
                      counts=_member(path, z, "counts") if "counts" in names else None,
                      source=str(path))
    return tr.validate()


def _member(path: Path, z: "np.lib.npyio.NpzFile", name: str) -> np.ndarray:
    """One array of the file; an object array (pickled Python objects, which a trace never holds and
    which are never unpickled) is refused naming the file and the array."""
    try:
        return z[name]
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise ValueError(f"{path}: array {name!r} holds Python objects (dtype object), which are not loaded; "
                             "a trace's arrays are numeric (experts: int32 [tokens, layers, top_k]) and its meta "
                             "a JSON string") from None
        raise ValueError(f"{path}: array {name!r} cannot be read ({err})") from None


def trace_for_model(path: str | Path, cfg: Any) -> RoutingTrace:
    """`load_trace(path)`, checked to have been recorded on a model of `cfg`'s expert layout."""
    tr = load_trace(path)
    if tr.n_experts != cfg.n_experts or list(tr.moe_layers) != list(cfg.moe_layers):
        raise ValueError(f"{path} was recorded on a model with {tr.n_experts} experts and MoE layers "
                         f"{list(tr.moe_layers)}; this model has {cfg.n_experts} and {list(cfg.moe_layers)}")
    return tr


def popularity_table(path: str | Path, cfg: Any) -> dict[int, list[float]]:
    """A [moe layers][experts] table of expert popularity (.json, .csv or .npy), per model layer."""
    p = Path(path)
    try:
        if p.suffix == ".npy":
            table = np.load(p, allow_pickle=False)
        elif p.suffix == ".json":
            table = np.asarray(json.loads(p.read_text()), dtype=float)
        else:
            table = np.loadtxt(p, delimiter=",", ndmin=2)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} ({exc}); expected .json, .csv or .npy") from None
    shape = (cfg.n_moe_layers, cfg.n_experts)
    if table.shape != shape:
        raise ValueError(f"{path} holds a table of shape {table.shape}; this model needs {shape} ([moe layers][experts])")
    return dict(zip(cfg.moe_layers, table.tolist()))


# --- derived views -------------------------------------------------------------------------
def require_order(trace: RoutingTrace, what: str) -> None:
    """ValueError, one line, when `trace` is count-only: `what` needs the order tokens were routed in."""
    if trace.count_only:
        raise ValueError(f"{trace.source}: a count-only trace (expert counts per layer, no token order) cannot "
                         f"drive {what}, which needs the order tokens were routed in; it supports popularity "
                         "analyses only (static's hot-expert profile, moebench-sim --popularity); import an "
                         "ordered trace for this")


def lookup_arrays(trace: RoutingTrace) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per trace layer: (ids int64 [M], step int64 [M]) -- the engine's lookup order.

    Per step (dense index, see `RoutingTrace.step_ids`) the sorted unique experts of that
    step's tokens; steps in order. M = lookups of that layer. A count-only trace is refused."""
    require_order(trace, "a cache replay (lookups in order)")
    E, k = trace.n_experts, trace.top_k
    out = []
    if trace.step is None:                   # one token per step: its k distinct ids, sorted
        steps = np.repeat(np.arange(trace.n_tokens, dtype=np.int64), k)
        for l in range(trace.n_layers):
            ids = np.sort(trace.experts[:, l, :], axis=1).reshape(-1).astype(np.int64)   # [N*k]
            out.append((ids, steps))
        return out
    g = trace.step_ids()                                                       # [N]
    for l in range(trace.n_layers):
        key = np.unique(g[:, None] * E + trace.experts[:, l, :])              # sorted (step, id) pairs
        out.append((key % E, key // E))
    return out


def lookup_sequences(trace: RoutingTrace, model_layers: bool = False) -> dict[int, list[int]]:
    """Per layer, the exact expert lookup order the engine's device cache sees for `trace`.

    Keys are trace layer indices 0..L-1, or the model's layer indices (meta `moe_layers`)
    with `model_layers=True` -- the form `policy_options={"future": ...}` of an engine needs."""
    keys = trace.moe_layers if model_layers else range(trace.n_layers)
    return {key: ids.tolist() for key, (ids, _) in zip(keys, lookup_arrays(trace))}


def expert_counts(trace: RoutingTrace) -> np.ndarray:
    """int64 [L, E]: how many tokens routed to each expert, per trace layer (static's popularity);
    a count-only trace's own counts."""
    if trace.counts is not None:
        return np.asarray(trace.counts, dtype=np.int64)
    L, E = trace.n_layers, trace.n_experts
    flat = trace.experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]   # [N, L, k]
    return np.bincount(flat.reshape(-1), minlength=L * E).reshape(L, E)


def distinct_per_pass(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """float [L] each: the mean distinct experts per forward pass, over decode passes (one token per
    sequence) and over prefill passes (more than one); NaN where there is no such pass."""
    N, L = trace.n_tokens, trace.n_layers
    step = trace.step if trace.step is not None else np.arange(N)
    seq = trace.sequence if trace.sequence is not None else np.zeros(N, dtype=np.int64)
    decode: list[list[int]] = [[] for _ in range(L)]
    prefill: list[list[int]] = [[] for _ in range(L)]
    bounds = np.flatnonzero(np.diff(step)) + 1                         # passes: runs of equal step
    for rows in np.split(np.arange(N), bounds) if N else []:
        one_each = len(np.unique(seq[rows])) == len(rows)
        for l in range(L):
            (decode if one_each else prefill)[l].append(len(np.unique(trace.experts[rows, l, :])))
    mean = lambda xs: float(np.mean(xs)) if xs else np.nan            # noqa: E731
    return np.array([mean(x) for x in decode]), np.array([mean(x) for x in prefill])
