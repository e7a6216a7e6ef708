"""Engine adapters, one plugin family: `moebench` (ours), `hf` (transformers), and whatever the
entry-point group `moebench.engines` adds -- so one sweep compares them side by side.

Owns: the registry (`ENGINES`, name -> "module:Class", lazily imported), building the job's
measured adapter with its parsed options, and the per-process cache of that *measured* engine
(a sweep's jobs that share an engine configuration load it once; `LOADS` counts real loads;
nothing else is kept between jobs, so only the measured engine occupies the device).
Does not own: the interface (harness.engines.base), timing or phases (harness.scenario), the
reference (harness.reference).
"""
from __future__ import annotations

import atexit
import gc
import logging
from collections import OrderedDict
from typing import Any

import torch

from engine.registry import Registry
from harness.contract import session_tokens
from harness.engines.base import EngineAdapter, Produced, argmax
from harness.machine import job_threads

log = logging.getLogger(__name__)
ENGINES = Registry("engine", "moebench.engines", {
    "moebench": "harness.engines.moebench:MoebenchAdapter",
    "hf": "harness.engines.hf:HFAdapter",
    "llamacpp": "harness.engines.llamacpp:LlamaCppAdapter",
})
LOADS: list[tuple] = []            # one entry per real model load in this process (benchmarks count these)
_CACHE: "OrderedDict[tuple, EngineAdapter]" = OrderedDict()

__all__ = ["ENGINES", "EngineAdapter", "LOADS", "Produced", "argmax", "engine_key", "get_adapter",
           "release_cached", "session_tokens_of"]


def session_tokens_of(spec: Any) -> int:
    w = spec.workload
    return session_tokens(w.context_tokens, w.gen_tokens, w.turn_tokens)


def engine_key(spec: Any) -> tuple:
    m, h, w = spec.model, spec.hardware, spec.workload
    threads = job_threads(spec) if ENGINES.get(spec.engine).threads_at_load else None
    return (spec.engine, threads, repr(spec.engine_options), m.name, m.path, m.dtype, m.num_layers, m.seed, h.device,
            h.device_memory, spec.placement, tuple(sorted(spec.placement_options.items())), spec.capacity,
            spec.policy, repr(spec.policy_options), spec.prefetch, w.batch, w.ubatch, session_tokens_of(spec),
            getattr(spec, "capacity_bytes", None), repr(getattr(spec, "expert_quant", None)),
            getattr(spec, "kv_dtype", "model"),          # a KV treatment is another engine, never a reused one
            spec.quality_pass)                           # its logits are in the engine's memory plan


@atexit.register          # and when the process ends: a llama.cpp adapter's temporary dir goes with its server
def release_cached() -> None:
    """Free the cached measured engine (before something else needs its memory)."""
    while _CACHE:
        _, adapter = _CACHE.popitem(last=False)
        adapter.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_adapter(spec: Any, key_extra: tuple = (), **kw: Any) -> tuple[EngineAdapter, bool]:
    """(the job's measured adapter, loaded_now). Reuses the engine already loaded in this process
    for the same key; any other cached engine is freed first, never held beside it."""
    key = (*engine_key(spec), *key_extra)
    if key in _CACHE and not _CACHE[key].alive():   # e.g. a server killed between jobs: start a new one
        release_cached()
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key], False
    release_cached()
    adapter = ENGINES.get(spec.engine).build(spec, spec.engine_options, **kw)
    LOADS.append(key)
    _CACHE[key] = adapter
    return adapter, True
