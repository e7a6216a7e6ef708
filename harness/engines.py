"""Engine adapters: the one surface the scenario drives, for moebench's engine and for
Hugging Face transformers, so one sweep compares them side by side.

Owns: building an engine for a RunSpec, the per-process engine cache (a sweep's jobs
that share an engine configuration load it once; `LOADS` counts real loads), sessions,
prefill/decode steps, KV displacement, and counters (None where an engine cannot measure).
Does not own: timing or phases (harness.scenario).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from engine import Engine
from engine.export import export_preset
from engine.hooks import NULL, Instrument
from harness.config import RunSpec

log = logging.getLogger(__name__)
LOADS: list[tuple] = []            # one entry per real model load in this process (benchmarks count these)
_CACHE: "OrderedDict[tuple, Adapter]" = OrderedDict()
CACHE_SIZE = 2                     # the measured engine and its `resident` reference


class Adapter(ABC):
    name: str
    device_kind: str
    device_name: str
    emulated: bool
    resolved_capacity: int | None = None

    @abstractmethod
    def new_session(self, batch: int) -> Any: ...
    @abstractmethod
    def prefill(self, sess: Any, rows: list[list[int]]) -> torch.Tensor: ...
    @abstractmethod
    def decode_step(self, sess: Any, tokens: list[int]) -> torch.Tensor: ...
    @abstractmethod
    def offload(self, sess: Any) -> None: ...
    @abstractmethod
    def restore(self, sess: Any) -> None: ...
    @abstractmethod
    def close_session(self, sess: Any) -> None: ...

    def counters(self) -> dict[str, int] | None:
        """Cumulative engine counters, or None when this engine cannot measure them."""
        return None

    def reset(self) -> None:
        """Cold state between repeats (empty expert caches)."""

    instrument: Instrument = NULL

    def set_instrument(self, instrument: Instrument | None) -> bool:
        """Attach a timeline/NVTX instrument (None detaches); False if this engine has no hook."""
        return False


class MoebenchAdapter(Adapter):
    name = "moebench"

    def __init__(self, spec: RunSpec, placement: str | None = None,
                 prefetch_options: dict[str, Any] | None = None) -> None:
        w = spec.workload
        src = spec.model.path or spec.model.name
        overrides = {"num_layers": spec.model_config.num_layers, "moe_layers": spec.model_config.moe_layers} \
            if spec.model.num_layers else None
        resident = placement == "resident"
        self.engine = Engine.from_pretrained(
            src, placement="resident" if resident else spec.placement,
            cache_capacity=None if resident else spec.capacity, cache_policy=spec.policy or "lru",
            device=spec.hardware.device, dtype=spec.model.dtype, ubatch=w.ubatch, max_context=context_needed(spec),
            batch=w.batch, seed=spec.model.seed,
            # the reference is a numerical check, not a measurement: it is not held to the budget
            device_memory=None if resident else spec.hardware.device_memory,
            model_overrides=overrides, prefetch="none" if resident else spec.prefetch,
            prefetch_options=None if resident else prefetch_options, **({} if resident else spec.placement_options))
        dev = self.engine.device
        self.device_kind, self.device_name, self.emulated = dev.kind, dev.name, dev.emulated
        self.resolved_capacity = self.engine.plan.capacity

    def new_session(self, batch: int):
        return self.engine.new_session(batch)

    def prefill(self, sess, rows):
        return self.engine.prefill(sess, rows)

    def decode_step(self, sess, tokens):
        return self.engine.decode_step(sess, tokens)

    def offload(self, sess) -> None:
        sess.offload()

    def restore(self, sess) -> None:
        sess.restore()

    def close_session(self, sess) -> None:
        sess.close()

    def counters(self) -> dict[str, int]:
        return self.engine.counters

    def reset(self) -> None:
        self.engine.reset()

    def set_instrument(self, instrument: Instrument | None) -> bool:
        self.engine.set_instrument(instrument)
        self.instrument = instrument or NULL
        return True


class HFAdapter(Adapter):
    """transformers' own model; on CUDA, accelerate's device_map offload within the budget."""

    name = "hf"

    def __init__(self, spec: RunSpec) -> None:
        import transformers

        path = spec.model.path or str(export_preset(spec.model.name, spec.model.seed, spec.model_config,
                                                    Path(spec.run.out) / ".checkpoints"))
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "auto": "auto"}[spec.model.dtype]
        cuda = spec.hardware.device == "cuda" or (spec.hardware.device == "auto" and torch.cuda.is_available())
        kwargs: dict[str, Any] = {"dtype": dtype}
        if cuda:
            kwargs["device_map"] = "auto"
            if spec.hardware.device_memory:
                kwargs["max_memory"] = {0: spec.hardware.device_memory, "cpu": "1000GiB"}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        self.device = torch.device("cuda") if cuda else torch.device("cpu")
        self.device_kind = "cuda" if cuda else "cpu"
        self.device_name = torch.cuda.get_device_name() if cuda else "cpu"
        self.emulated = False     # transformers runs on the CPU for real here: no device is emulated

    def new_session(self, batch: int):
        from transformers import DynamicCache
        return {"past": DynamicCache(config=self.model.config), "host": None}

    @torch.inference_mode()
    def _forward(self, sess, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids.to(self.device), past_key_values=sess["past"], use_cache=True)
        return out.logits[:, -1]

    def prefill(self, sess, rows):
        return self._forward(sess, torch.tensor(rows))

    def decode_step(self, sess, tokens):
        return self._forward(sess, torch.tensor(tokens)[:, None])

    def offload(self, sess) -> None:
        for layer in sess["past"].layers:
            layer.keys, layer.values = layer.keys.to("cpu", copy=True), layer.values.to("cpu", copy=True)

    def restore(self, sess) -> None:
        for layer in sess["past"].layers:
            layer.keys, layer.values = layer.keys.to(self.device, copy=True), layer.values.to(self.device, copy=True)

    def close_session(self, sess) -> None:
        sess["past"] = None


def context_needed(spec: RunSpec) -> int:
    """KV the scenario needs: context, replies, and two further turns (continuation, restored)."""
    w = spec.workload
    return w.context_tokens + w.gen_tokens + 2 * (w.turn_tokens + 1)


def engine_key(spec: RunSpec, placement: str | None = None) -> tuple:
    m, h = spec.model, spec.hardware
    base = (spec.engine if placement is None else "moebench", m.name, m.path, m.dtype, m.num_layers, m.seed,
            h.device, h.device_memory)
    if placement == "resident":
        return (*base, "resident", spec.workload.batch, spec.workload.ubatch, context_needed(spec))
    return (*base, spec.placement, tuple(sorted(spec.placement_options.items())), spec.capacity, spec.policy,
            spec.prefetch,
            spec.workload.batch, spec.workload.ubatch, context_needed(spec))


def get_adapter(spec: RunSpec, placement: str | None = None, prefetch_options: dict[str, Any] | None = None,
                key_extra: tuple = ()) -> tuple[Adapter, bool]:
    """(adapter, loaded_now). Reuses an engine already loaded in this process for the same key."""
    key = (*engine_key(spec, placement), *key_extra)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key], False
    while len(_CACHE) >= CACHE_SIZE:   # free the oldest before loading: never three models at once
        _CACHE.popitem(last=False)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    adapter = (HFAdapter(spec) if spec.engine == "hf" and placement is None
               else MoebenchAdapter(spec, placement, prefetch_options))
    LOADS.append(key)
    _CACHE[key] = adapter
    return adapter, True
