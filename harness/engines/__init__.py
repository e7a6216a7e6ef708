"""Engine adapters, one plugin family: `moebench` (ours), `hf` (transformers), `llamacpp` (llama.cpp's
server) and whatever the entry-point group `moebench.engines` adds -- so one sweep compares them
side by side.

Owns: building the job's measured adapter with its parsed options, and `EngineCache`, which keeps that *measured* engine
between the jobs of one run (a sweep's jobs that share an engine configuration load it once;
`EngineCache.loads` counts real loads; nothing else is kept between jobs, so only the measured
engine occupies the device). A cache is an object its run holds (harness.session.RunSession),
never module state; what it holds is closed when it is released, garbage-collected, or the
process exits (a llama.cpp adapter's server and temporary dir with it).
Does not own: the registry and what it answers (harness.engines.registry), the interface
(harness.engines.base), timing or phases (harness.scenario), the reference (harness.reference).

    engines = EngineCache()
    adapter, loaded_now = engines.get(spec)     # a validated RunSpec
    engines.release()                           # before something else needs the memory
"""
from __future__ import annotations

import gc
import logging
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.lazy import lazy_module
from harness.engines.base import EngineAdapter, Produced, argmax
from harness.engines.registry import ENGINES
from harness.machine import job_threads

if TYPE_CHECKING:
    import torch

    from harness.config.schema import RunSpec
else:                  # the registry and its adapters' options load without torch (moebench --help, plan)
    torch = lazy_module("torch", globals())

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "EngineAdapter", "EngineCache", "Produced", "argmax", "engine_key", "session_tokens_of"]


def session_tokens_of(spec: RunSpec) -> int:
    """The KV the job's sessions need (RunSpec.session_tokens)."""
    return spec.session_tokens


def engine_key(spec: RunSpec) -> tuple:
    m, h, w = spec.model, spec.hardware, spec.workload
    threads = job_threads(spec) if ENGINES.get(spec.engine).threads_at_load else None
    return (spec.engine, threads, repr(spec.engine_options), m.name, m.path, m.dtype, m.num_layers, m.seed, h.device,
            h.device_memory, spec.placement, tuple(sorted(spec.placement_options.items())), spec.capacity,
            spec.policy, repr(spec.policy_options), spec.prefetch, spec.planned_batch, w.ubatch, session_tokens_of(spec),
            spec.capacity_bytes, repr(spec.expert_quant),
            spec.kv_dtype,                               # a KV treatment is another engine, never a reused one
            spec.all_logits)                             # its logits are in the engine's memory plan


def _close_all(held: "OrderedDict[tuple, EngineAdapter]") -> None:
    """Close every adapter in `held` (oldest first) and give their memory back."""
    while held:
        _, adapter = held.popitem(last=False)
        adapter.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineCache:
    """The measured engine of a run, kept between its jobs: at most one adapter, reused by a job
    with the same `engine_key`, any other freed before a new one is built."""

    def __init__(self) -> None:
        self._held: OrderedDict[tuple, EngineAdapter] = OrderedDict()
        self.loads: list[tuple] = []      # one key per real model load (benchmarks and tests count them)
        # when the cache is collected or the process exits: a cached llama.cpp adapter's server and
        # temporary dir go with it (the finalizer holds the dict, never the cache)
        self._finalizer = weakref.finalize(self, _close_all, self._held)

    def get(self, spec: RunSpec, key_extra: tuple = (), **kw: Any) -> tuple[EngineAdapter, bool]:
        """(the job's measured adapter, loaded_now). Reuses the engine already loaded for the same
        key; any other cached engine is freed first, never held beside it."""
        key = (*engine_key(spec), *key_extra)
        if key in self._held and not self._held[key].alive():   # e.g. a server killed between jobs: a new one
            self.release()
        if key in self._held:
            self._held.move_to_end(key)
            return self._held[key], False
        self.release()
        adapter = ENGINES.get(spec.engine).build(spec, spec.engine_options, **kw)
        self.loads.append(key)
        self._held[key] = adapter
        return adapter, True

    def loaded(self) -> bool:
        """Whether an engine is held."""
        return bool(self._held)

    def release(self) -> None:
        """Free the cached measured engine (before something else needs its memory)."""
        _close_all(self._held)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a launcher's worker process gets the run's task function): nothing loaded here
        crosses; the other process starts with an empty cache of its own."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
