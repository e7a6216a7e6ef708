"""The exact reference every measured phase is checked against (`max_abs_logit_diff`,
`token_agreement`), computed where it fits and never on the measured device.

Owns: the reference of one prompt -- per phase, the logits that chose each token and the
tokens, the expert sets of each forward pass a `trace_oracle` prefetcher replays, and the
quality run every job's `quality` phase compares with (harness.quality) -- computed by our
engine with every expert resident *on the CPU, in host RAM*, in the run's dtype, with the KV in
the model's dtype whatever the job's `kv.dtype` (the reference is the exact model, never the
treatment: `reference_key` leaves the treatment out, so exact and lossy jobs share it); kept in
the run's memo (a dict the caller holds: harness.session.RunSession.references) and in a file
under the results root keyed by (model identity, dtype, prompt,
lengths), so a later job or sweep loads it instead of recomputing; a cache file that is not a
reference (refused by `weights_only` loading, garbage, another layout) is named in a warning,
moved aside to `<name>.bad-<time>` and recomputed, never a failure of the jobs that share it. The engine that computed it
is freed before the measured engine is built; if the full copy does not fit host RAM the
refusal shows the arithmetic (engine.Engine's host-RAM check) and says how to go on.
Does not own: running phases (harness.scenario), the measured engine (harness.engines).

    ref = reference_for(spec, sample, root=Path("results"), memo={})
    check_phase(measured.phase("decode"), ref.result.phase("decode"))
"""
from __future__ import annotations

import gc
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.config import RunSpec
from harness.engines.moebench import MoebenchAdapter
from harness.quality import QualityRun, quality_run
from harness.scenario import PhaseResult, RepeatResult, run_repeat
from harness.sweep import model_identity
from workloads.base import WorkloadSample

log = logging.getLogger(__name__)
REFERENCE_DIR = ".reference"
FORMAT = 2                                   # 2: with the quality run (harness.quality)


@dataclass
class Reference:
    key: str
    result: RepeatResult                        # phases with logits and tokens; no timings used
    steps: dict[int, list[list[int]]]           # per MoE layer, the sorted experts of each forward pass
    origin: str                                 # "computed" | "file" | "memory"
    quality: QualityRun | None = None           # every kept position's logits, the prompt's NLL (harness.quality)


def reference_key(spec: RunSpec, sample: WorkloadSample) -> str:
    m, w = spec.model, spec.workload
    payload = {"format": FORMAT, "model": model_identity({"name": m.name, "path": m.path, "seed": m.seed,
                                                          "num_layers": m.num_layers}),
               "dtype": m.dtype, "gen_tokens": w.gen_tokens, "ubatch": w.ubatch,
               "prompt": hashlib.sha256(repr((sample.contexts, sample.continuations)).encode()).hexdigest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _path(root: Path, key: str) -> Path:
    return root / REFERENCE_DIR / f"{key}.pt"


def _save(path: Path, ref: Reference) -> None:
    from harness.results import atomic_write_bytes

    phases = {p.phase: {"logits": p.logits, "tokens": p.tokens} for p in ref.result.phases}
    buf = io.BytesIO()
    q = ref.quality
    quality = None if q is None else {"logits": q.logits, "nll": q.nll, "nll_count": q.nll_count,
                                      "continuation": q.continuation}
    torch.save({"format": FORMAT, "key": ref.key, "phases": phases, "steps": ref.steps, "quality": quality}, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())


def _load(path: Path, key: str) -> Reference | None:
    """The reference in `path`, or None (recompute it): a file of another prompt or format is
    left for the new one to replace; one that is no reference at all is set aside (`_set_aside`)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict):
            raise TypeError(f"it holds a {type(data).__name__}, not a dict")
        if data.get("format") != FORMAT or data.get("key") != key:
            log.warning("reference file %s is for another prompt or format; recomputing it", path)
            return None
        phases = [PhaseResult(name, logits=v["logits"], tokens=v["tokens"]) for name, v in data["phases"].items()]
        q = data.get("quality")
        quality = None if q is None else QualityRun(q["logits"], q["nll"], q["nll_count"], q["continuation"])
        steps = {int(k): v for k, v in data["steps"].items()}
    except Exception as exc:  # noqa: BLE001 -- whatever is wrong with it (weights_only refused it, garbage, another
        _set_aside(path, exc)     # layout), it is no reference: every job sharing the prompt would fail on it
        return None
    return Reference(key, RepeatResult(phases), steps, "file", quality)


def _set_aside(path: Path, why: Exception) -> None:
    """Warn, naming the file, and move it to `<name>.bad-<time>` (kept for a look, never read again)."""
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        os.replace(path, aside)
        where = f"moved to {aside}"
    except OSError as exc:
        where = f"left in place (it could not be moved aside: {exc.strerror or exc})"
    # the first sentence: torch's refusal goes on to explain how to load the file without weights_only
    reason = (str(why).strip().splitlines() or [""])[0].split(". ")[0]
    log.warning("reference cache file %s is not a reference (%s: %s); %s, and the reference is computed again",
                path, type(why).__name__, reason, where)


def reference_for(spec: RunSpec, sample: WorkloadSample, root: Path, memo: dict[str, Reference] | None = None,
                  free_memory: Callable[[], None] | None = None) -> Reference:
    """The reference for this job's prompt: from `memo` (the run's, by `reference_key`; it is kept
    there), from its file, or computed on the CPU -- `free_memory` called (the run's cached engine
    released) when the full copy does not fit host RAM beside what is already held."""
    key = reference_key(spec, sample)
    memo = {} if memo is None else memo
    if key in memo:
        ref = memo[key]
        return Reference(ref.key, ref.result, ref.steps, "memory", ref.quality)
    path = _path(root, key)
    ref = _load(path, key) if path.is_file() else None
    if ref is None:
        ref = _compute(spec, sample, key, free_memory)
        try:
            _save(path, ref)
        except OSError as exc:   # the reference is still right; only the cache is missing
            log.warning("could not cache the reference in %s: %s", path, exc)
    memo[key] = ref
    return ref


def _compute(spec: RunSpec, sample: WorkloadSample, key: str, free_memory: Callable[[], None] | None) -> Reference:
    try:
        adapter = MoebenchAdapter(spec, placement="resident", device="cpu", exact=True, quality=True)
    except MemoryError:
        # the host RAM check counts what is already held: a previous job's cached engine may share
        # it with the full copy the reference needs; free it and ask again
        if free_memory is not None:
            free_memory()
        try:
            adapter = MoebenchAdapter(spec, placement="resident", device="cpu", exact=True, quality=True)
        except MemoryError as exc:
            raise MemoryError(f"the numerical reference (every expert resident in host RAM, "
                              f"run.check_reference=true) does not fit: {exc}. Run with run.check_reference=false, "
                              "or once on a machine with more RAM, which caches the reference under "
                              "<run.out>/.reference/") from exc
    try:
        adapter.engine.model.step_log = {}
        res = run_repeat(adapter, sample, spec.workload.gen_tokens, keep_logits=True)
        steps = adapter.engine.model.step_log
        adapter.engine.model.step_log = None
        quality = quality_run(adapter.engine, sample.contexts, spec.workload.gen_tokens)
    finally:
        adapter.close()
        del adapter
        gc.collect()
    for p in res.phases:      # a reference holds what was computed, never how long it took
        p.client, p.engine = {}, {}
    return Reference(key, RepeatResult(res.phases), steps, "computed", quality)
