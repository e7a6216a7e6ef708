"""`engine=moebench`: our exact offloading engine (engine.Engine) behind the adapter interface.

Owns: building the engine for a RunSpec -- the job's placement held to the job's device budget,
or (`placement="resident"`) the same model with every expert resident: on the job's device for
the ablation (under the job's experts.quant and kv.dtype), or unbudgeted on `device="cpu"` with
the exact model (`exact=True`: exact experts, KV in the model's dtype) for the reference in host
RAM -- and forwarding
sessions, passes, KV displacement, counters, instrumentation and the emulated device's ledger.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from engine.hooks import NULL, Instrument, Progress
from engine.kvquant import DEFAULT_KV_DTYPE
from harness.engines.base import EngineAdapter, Produced

if TYPE_CHECKING:
    from harness.config.schema import RunSpec


class MoebenchAdapter(EngineAdapter):
    name = "moebench"
    checks_finite = True              # every pass checked in the engine, read with its token (Engine.greedy)
    kv_treatments = per_position_logits = routing_hooks = resident_twin = memory_plan = cost_model = True
    serves = True
    # moebench ran exact experts only until experts.quant, and kept its KV in the model's dtype until kv.dtype
    columns_before = {"expert_quant": "none", "kv_dtype": "model"}

    def __init__(self, spec: RunSpec, placement: str | None = None, device: str | None = None,
                 prefetch_options: dict[str, Any] | None = None, progress: Progress | None = None, exact: bool = False,
                 quality: bool = False) -> None:
        """exact: the exact model whatever the job's treatments (experts.quant, kv.dtype): the
        numerical reference. quality: a quality pass (harness.quality) will run on this engine, so
        its memory plan makes room for a micro-batch's logits at every position."""
        from engine import Engine, EngineOptions       # torch: loaded by the job that builds one

        w = spec.workload
        src = spec.model.path or spec.model.name
        overrides = {"num_layers": spec.model_config.num_layers, "moe_layers": spec.model_config.moe_layers} \
            if spec.model.num_layers else None
        resident = placement == "resident"
        t0 = time.perf_counter()
        job = EngineOptions(
            placement=spec.placement, placement_options=dict(spec.placement_options), cache_capacity=spec.capacity,
            cache_capacity_bytes=spec.capacity_bytes, cache_policy=spec.policy or "lru",
            policy_options=spec.policy_options, prefetch=spec.prefetch, prefetch_options=prefetch_options,
            device=device or spec.hardware.device,
            device_memory=None if device == "cpu" else spec.hardware.device_memory,
            dtype=spec.model.dtype, model_overrides=overrides, seed=spec.model.seed, ubatch=w.ubatch,
            max_context=spec.session_tokens, batch=spec.planned_batch,
            kv_dtype=DEFAULT_KV_DTYPE if exact else spec.kv_dtype,
            expert_quant=None if exact else spec.expert_quant, all_logits=quality, progress=progress)
        if resident:                           # the same model, every expert resident: no cache, no prefetch
            job = job.replace(placement="resident", placement_options={}, cache_capacity=None,
                              cache_capacity_bytes=None, policy_options=None, prefetch="none", prefetch_options=None)
        self.engine = Engine.from_pretrained(src, job)
        self.load_s = time.perf_counter() - t0
        dev = self.engine.device
        self.device_kind, self.device_name, self.emulated = dev.kind, dev.name, dev.emulated
        self.resolved_capacity = self.engine.plan.capacity
        self.has_expert_cache = self.engine.placement.cache is not None
        self.compute_dtype = self.engine.options["dtype"]
        self.lossy = self.engine.lossy

    def placement_map(self) -> str:
        placement = self.engine.placement
        options = dataclasses.asdict(placement.options) if dataclasses.is_dataclass(placement.options) else {}
        return type(placement).traits(self.engine.cfg, options).layer_map(self.engine.cfg)

    @classmethod
    def build(cls, spec: RunSpec, options: Any, **kw: Any) -> "MoebenchAdapter":
        """The job's measured engine (the quality pass, harness.passes.quality, runs on it)."""
        return cls(spec, quality=spec.all_logits, **kw)

    def resident_adapter(self, spec: RunSpec) -> "MoebenchAdapter":
        """The same model on the job's device, budget, experts.quant and kv.dtype, every expert resident."""
        return MoebenchAdapter(spec, placement="resident")

    def new_session(self, batch: int):
        return self.engine.new_session(batch)

    def prefill(self, sess, rows) -> Produced:
        out = self.engine.prefill(sess, rows)
        return Produced(self.engine.greedy(sess, out), out)

    def decode(self, sess, tokens: list[int], steps: int) -> Iterator[Produced]:
        for _ in range(steps):
            out = self.engine.decode_step(sess, tokens)
            tokens = self.engine.greedy(sess, out)
            yield Produced(tokens, out)

    def offload(self, sess) -> None:
        sess.offload()

    def restore(self, sess) -> None:
        sess.restore()

    def close_session(self, sess) -> None:
        sess.close()

    def serve(self, requests, max_concurrency: int | None, prefix_cache: str = "isolated",
              prefix: list[int] | None = None):
        """In process: the engine's continuous batcher (its prefix cache unless isolated), driven on
        the client-side clock; its cached prompt tokens are the prefix cache's copies."""
        from engine.batcher import ContinuousBatcher
        from harness.serving.drive import drive
        batcher = ContinuousBatcher(self.engine, None, max_concurrency or len(requests),
                                    prefix_cache=prefix_cache != "isolated")
        try:
            if prefix_cache == "primed" and prefix:
                batcher.prime(prefix)
            return drive(batcher, requests, max_concurrency)
        finally:
            batcher.close()

    def counters(self) -> dict[str, int]:
        return self.engine.counters

    def reset(self) -> None:
        self.engine.reset()

    def set_instrument(self, instrument: Instrument | None) -> bool:
        self.engine.set_instrument(instrument)
        self.instrument = instrument or NULL
        return True

    def set_progress(self, progress: Progress | None) -> None:
        self.engine.progress = progress

    def reset_device_peak(self) -> None:
        ledger = self.engine.device.ledger
        ledger.peak = ledger.total

    def device_peak(self) -> int | None:
        return self.engine.device.ledger.peak if self.emulated else None

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
            self.engine = None
