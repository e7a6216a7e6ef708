"""How to build an engine: `EngineOptions`, the one object `Engine.from_pretrained` reads.

Owns: the options' names, defaults and grouping into a dataclass (plain values, no torch), and
`EngineOptions.of(**kw)`, which sorts keyword arguments into the named fields and the placement's
own options (anything else). Does not own: checking them against a model, a device or the
registries -- `Engine.from_pretrained` does that before it allocates anything.

    from engine import Engine, EngineOptions
    opts = EngineOptions(placement="fetch", cache_capacity=4, device="cpu", placement_options={"issue_ahead": 2})
    eng = Engine.from_pretrained("tiny-mixtral", opts)
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=4, device="cpu", issue_ahead=2)
    opts.replace(device="cuda")                      # another engine of the same model
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.kvquant import DEFAULT_KV_DTYPE

if TYPE_CHECKING:
    from engine.blocks.quant_experts import ExpertQuant
    from engine.hooks import Instrument, Progress


@dataclass(frozen=True)
class EngineOptions:
    """Everything `Engine.from_pretrained` takes beside the model's source."""

    # where routed experts run and what moves (engine.placements; `placement_options`: its Options' fields,
    # e.g. issue_ahead for fetch, n_cpu_layers for hybrid, stream_threshold for stream)
    placement: str = "resident"
    placement_options: dict[str, Any] = field(default_factory=dict)
    # the device expert cache of a placement that keeps one: slots per layer (an int or "auto") or bytes over
    # all MoE layers ("256MiB" or an int), not both; its eviction policy and that policy's constructor options
    cache_capacity: int | str | None = None
    cache_capacity_bytes: int | str | None = None
    cache_policy: str = "lru"
    policy_options: dict[str, Any] | None = None
    prefetch: str = "none"
    prefetch_options: dict[str, Any] | None = None
    # where it runs: auto | cpu (an emulated device) | cuda; the device budget (on CUDA it also caps torch's
    # allocator for this process until close()); bytes the planner keeps free beside its plan
    device: str = "auto"
    device_memory: int | str | None = None
    reserve_bytes: int | None = None
    # the model as run: its dtype (auto: the checkpoint's), config fields replaced (e.g. num_layers), the seed of a
    # preset's random weights
    dtype: str = "float32"
    model_overrides: dict[str, Any] | None = None
    seed: int = 0
    # the work it plans for: prefill micro-batch, the longest session (None: 4096 or the model's limit), sessions
    ubatch: int = 512
    max_context: int | None = None
    batch: int = 1
    # treatments (lossy, labelled): the KV format (model | f16 | bf16 | q8 | q4 | fp8: engine.kvquant); the routed
    # experts' "none" | "int8" | "int4" | "mixed" (quant_options: group_size, mixed_count | mixed_fraction,
    # popularity | trace) or a resolved ExpertQuant (engine.blocks.quant_experts)
    kv_dtype: str = DEFAULT_KV_DTYPE
    expert_quant: ExpertQuant | str | None = "none"
    quant_options: dict[str, Any] | None = None
    # room in the plan for prefill(all_logits=True): every position's logits of one micro-batch (a quality pass)
    all_logits: bool = False
    # observers: spans (timeline, NVTX), the routing of every pass kept (`model.step_log`), long-load progress
    instrument: Instrument | None = None
    record_lookups: bool = False
    progress: Progress | None = None

    @classmethod
    def of(cls, **kw: Any) -> "EngineOptions":
        """The options from keyword arguments: named fields by name, anything else a placement option."""
        names = {f.name for f in dataclasses.fields(cls)}
        placement_options = {**kw.pop("placement_options", {})} if "placement_options" in kw else {}
        placement_options.update({k: kw.pop(k) for k in [k for k in kw if k not in names]})
        return cls(**kw, placement_options=placement_options)

    def replace(self, **kw: Any) -> "EngineOptions":
        """A copy with fields replaced (a keyword that names no field is a placement option, added)."""
        extra = EngineOptions.of(**kw)
        named = {k: getattr(extra, k) for k in kw if k in {f.name for f in dataclasses.fields(self)}}
        named["placement_options"] = {**self.placement_options, **extra.placement_options} \
            if "placement_options" not in kw else extra.placement_options
        return dataclasses.replace(self, **named)
