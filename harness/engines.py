"""Engine adapters: the one surface the scenario drives, for moebench's engine and for
Hugging Face transformers, so one sweep compares them side by side.

Owns: building an engine for a RunSpec, the per-process cache of the *measured* engine (a
sweep's jobs that share an engine configuration load it once; `LOADS` counts real loads;
nothing else is kept on the device between jobs), sessions, prefill/decode steps, KV
displacement, and counters (None where an engine cannot measure).
Does not own: timing or phases (harness.scenario), the reference (harness.reference).
"""
from __future__ import annotations

import gc
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
from harness.contract import session_tokens

log = logging.getLogger(__name__)
LOADS: list[tuple] = []            # one entry per real model load in this process (benchmarks count these)
_CACHE: "OrderedDict[tuple, Adapter]" = OrderedDict()
CACHE_SIZE = 1                     # only the measured engine: it alone occupies the device


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
    has_expert_cache: bool = False     # whether phases start from a cold or warm expert cache

    def set_instrument(self, instrument: Instrument | None) -> bool:
        """Attach a timeline/NVTX instrument (None detaches); False if this engine has no hook."""
        return False

    def reset_device_peak(self) -> None:
        """Start a new window for `device_peak`."""

    def device_peak(self) -> int | None:
        """Peak bytes the emulated device accounted since `reset_device_peak` (None: not emulated
        -- a real device's peak comes from its allocator, harness.measure)."""
        return None

    def close(self) -> None:
        """Free the engine's memory (device and host)."""


class MoebenchAdapter(Adapter):
    name = "moebench"

    def __init__(self, spec: RunSpec, placement: str | None = None, device: str | None = None,
                 prefetch_options: dict[str, Any] | None = None) -> None:
        """The job's engine; with `placement="resident"`, the same model with every expert resident
        (held to the job's budget on the job's device, or unbudgeted on `device="cpu"`: the
        reference, in host RAM)."""
        w = spec.workload
        src = spec.model.path or spec.model.name
        overrides = {"num_layers": spec.model_config.num_layers, "moe_layers": spec.model_config.moe_layers} \
            if spec.model.num_layers else None
        resident = placement == "resident"
        on = device or spec.hardware.device
        self.engine = Engine.from_pretrained(
            src, placement="resident" if resident else spec.placement,
            cache_capacity=None if resident else spec.capacity, cache_policy=spec.policy or "lru",
            policy_options=None if resident else spec.policy_options,
            device=on, dtype=spec.model.dtype, ubatch=w.ubatch, max_context=session_tokens_of(spec),
            batch=w.batch, seed=spec.model.seed,
            device_memory=None if device == "cpu" else spec.hardware.device_memory,
            model_overrides=overrides, prefetch="none" if resident else spec.prefetch,
            prefetch_options=None if resident else prefetch_options, **({} if resident else spec.placement_options))
        dev = self.engine.device
        self.device_kind, self.device_name, self.emulated = dev.kind, dev.name, dev.emulated
        self.resolved_capacity = self.engine.plan.capacity
        self.has_expert_cache = self.engine.placement.cache is not None

    def reset_device_peak(self) -> None:
        ledger = self.engine.device.ledger
        ledger.peak = ledger.total

    def device_peak(self) -> int | None:
        return self.engine.device.ledger.peak if self.emulated else None

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
            self.engine = None

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
        # the same work as ours: logits of the last position only, never [B, T, V]
        out = self.model(ids.to(self.device), past_key_values=sess["past"], use_cache=True, logits_to_keep=1)
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

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def session_tokens_of(spec: RunSpec) -> int:
    w = spec.workload
    return session_tokens(w.context_tokens, w.gen_tokens, w.turn_tokens)


def engine_key(spec: RunSpec) -> tuple:
    m, h, w = spec.model, spec.hardware, spec.workload
    return (spec.engine, m.name, m.path, m.dtype, m.num_layers, m.seed, h.device, h.device_memory,
            spec.placement, tuple(sorted(spec.placement_options.items())), spec.capacity, spec.policy,
            repr(spec.policy_options), spec.prefetch, w.batch, w.ubatch, session_tokens_of(spec))


def release_cached() -> None:
    """Free the cached measured engine (before something else needs its memory)."""
    while _CACHE:
        _, adapter = _CACHE.popitem(last=False)
        adapter.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_adapter(spec: RunSpec, prefetch_options: dict[str, Any] | None = None,
                key_extra: tuple = ()) -> tuple[Adapter, bool]:
    """(the job's measured adapter, loaded_now). Reuses the engine already loaded in this process
    for the same key; any other cached engine is freed first, never held beside it."""
    key = (*engine_key(spec), *key_extra)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key], False
    release_cached()
    adapter = HFAdapter(spec) if spec.engine == "hf" else MoebenchAdapter(spec, prefetch_options=prefetch_options)
    LOADS.append(key)
    _CACHE[key] = adapter
    return adapter, True
