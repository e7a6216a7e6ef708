"""What a `moebench predict` row was computed from, and where each input came from.

Owns: `Job` (one composed, checked job of the command), the hardware profile a job's `hardware` group holds (`hardware_profile`: its figures as
composed -- the profile yaml's, with any set on the command line -- and the fitted software
overheads beside the yaml), the workload shape (`shape_of`), and `inputs_of`: every profile
figure and workload value a prediction uses, each `{"value", "unit", "source"}`, the source one
of SOURCES --
  datasheet   a datasheet profile's figure (harness.costmodel.profiles.figure_origin)
  measured    a calibrated profile's figure (`moebench calibrate` on that machine)
  assumed     a figure a datasheet profile's notes call an assumption, or a config default
  overridden  set on the command line
-- and, for a placement with an expert cache, the hit rate it is predicted at and where that
comes from (`hit_rate_source`: cache.hit_rate, or a synthetic routing trace of a stated skew).
Does not own: predicting (harness.predict, harness.costmodel), the figures themselves.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.config import ConfigError, RunSpec
from harness.plan import budget_of

if TYPE_CHECKING:
    from harness.costmodel import HardwareProfile, Routing, WorkloadShape

SOURCES = ("datasheet", "measured", "assumed", "overridden")
WORKLOAD = (("context_tokens", "tokens"), ("gen_tokens", "tokens"), ("turn_tokens", "tokens"), ("batch", "sequences"),
            ("ubatch", "tokens"))


@dataclass(frozen=True)
class Job:
    """One job of the command: its overrides, its checked spec, the hit rate it sets, its hardware option."""

    overrides: list[str]
    spec: RunSpec
    hit_rate: float | None            # cache.hit_rate, taken out of the config before it is validated
    hardware_option: str              # the `hardware` group's option (a conf/hardware yaml's name, or local)
    cache_policy: str                 # cache.policy as composed (a spec keeps it only for a cache placement)


def hardware_profile(job: Job) -> HardwareProfile | None:
    """The profile the job's `hardware` node holds, with the overheads fitted beside its yaml; None
    when it holds no figures (`hardware=local`, the default: no source). ConfigError when a figure
    set on the command line is not one a profile may hold."""
    from harness.costmodel.profiles import PROFILE_DIR, ProfileError, load_profile, profile_from_dict

    conf = dataclasses.asdict(job.spec.hardware)
    if conf.get("source") is None:
        return None
    try:
        hw = profile_from_dict(conf, source=f"hardware={job.hardware_option}")
        yaml = PROFILE_DIR / f"{job.hardware_option}.yaml"
        return hw.replace(overheads=load_profile(yaml).overheads) if yaml.is_file() else hw
    except ProfileError as exc:
        raise ConfigError(str(exc)) from None


def shape_of(spec: RunSpec) -> WorkloadShape:
    from harness.costmodel import WorkloadShape
    w = spec.workload
    return WorkloadShape(context_tokens=w.context_tokens, gen_tokens=w.gen_tokens, batch=spec.planned_batch,
                         turn_tokens=w.turn_tokens, ubatch=w.ubatch, kv_dtype=spec.kv_dtype)


def _entry(value: Any, unit: str | None, source: str, note: str | None = None) -> dict[str, Any]:
    out = {"value": value, "unit": unit, "source": source}
    if note:
        out["note"] = note
    return out


def given_keys(overrides: Sequence[str]) -> set[str]:
    """The keys (and groups) the command line sets."""
    return {o.lstrip("+~").partition("=")[0] for o in overrides}


def inputs_of(job: Job, hw: HardwareProfile | None, placement: str, options: dict[str, Any], uses_cache: bool,
              routing: Routing) -> dict[str, Any]:
    """Every input of the row's prediction with its source (the module docstring)."""
    from harness.costmodel.profiles import figure_origin
    from harness.costmodel.timemodel import expert_type_of
    from engine.registry import PLACEMENTS

    spec, given = job.spec, given_keys(job.overrides)

    def conf(key: str, *also: str) -> str:
        return "overridden" if given & {key, *also} else "assumed"
    out: dict[str, Any] = {f"workload.{k}": _entry(getattr(spec.workload, k), unit, conf(f"workload.{k}"))
                           for k, unit in WORKLOAD}
    out["model.dtype"] = _entry(spec.dtype, None, conf("model.dtype"))
    out["kv.dtype"] = _entry(spec.kv_dtype, None, conf("kv.dtype", "kv"))
    out["model.weight_format"] = _entry(spec.weights_note, None, conf("model.weight_format", "model.expert_format",
                                                                     "model.gguf", "engine.weights"),
                                        "the format the engine holds the weights in (engine.formats)")
    if spec.expert_quant is not None:
        out["experts.quant"] = _entry(spec.expert_quant.mode, None, conf("experts.quant", "experts"))
    budget, h = budget_of(spec), spec.hardware
    if given & {"hardware.device_memory", "hardware.device_memory_gib"}:
        origin = "overridden"
    elif h.device_memory is not None:                 # set by an experiment or config file
        origin = "assumed"
    elif h.device_memory_gib is not None:             # the profile's card (budget_of's rule)
        origin = figure_origin(hw, "device_memory_gib") if hw is not None else "assumed"
    else:                                             # a real card's free memory, or none
        origin = "measured" if budget is not None else "assumed"
    out["hardware.device_memory"] = _entry(
        budget, "B", origin, None if budget is not None else "no budget: every plan fits; set hardware.device_memory")
    if hw is not None:
        dt = spec.dtype
        traits = PLACEMENTS.get(placement).traits(spec.model_config, options)
        figures = [("h2d_gbps", "GB/s", None), ("device_mem_gbps", "GB/s", None), ("device_tflops", "TFLOP/s", dt),
                   ("device_gemv_gbps", "GB/s", dt), ("host_memory_gib", "GiB", None), ("disk_read_gbps", "GB/s", None)]
        if traits.uses_cpu:
            figures += [("d2h_gbps", "GB/s", None), ("cpu_mem_gbps", "GB/s", None), ("cpu_gflops", "GFLOP/s", dt),
                        ("cpu_gemv_gbps", "GB/s", dt)]
        for fig, unit, at in figures:
            value = getattr(hw, fig) if at is None else hw.rate(fig, at)
            if value is None and at is not None and fig.endswith("gemv_gbps"):
                continue                      # optional: weight reads go at the memory bandwidth then
            keys = {f"hardware.{fig}"} | ({"hardware.dtype", "hardware.dtype_rates", f"hardware.dtype_rates.{at}",
                                           f"hardware.dtype_rates.{at}.{fig}"} if at is not None else set())
            name = f"hardware.{fig}" + (f"[{at}]" if at is not None else "")
            out[name] = _entry(value, unit, "overridden" if given & keys else figure_origin(hw, fig))
        et = expert_type_of(spec.planned_config)              # the routed experts' own rates, where given
        for fig, unit in (("device_tflops", "TFLOP/s"), ("device_gemv_gbps", "GB/s"), ("cpu_gflops", "GFLOP/s"),
                          ("cpu_gemv_gbps", "GB/s")):
            value = (hw.dtype_rates or {}).get(et or "", {}).get(fig)
            if value is None or (fig.startswith("cpu") and not traits.uses_cpu):
                continue
            keys = {"hardware.dtype_rates", f"hardware.dtype_rates.{et}", f"hardware.dtype_rates.{et}.{fig}"}
            out[f"hardware.{fig}[{et}]"] = _entry(value, unit, "overridden" if given & keys else figure_origin(hw, fig),
                                                  f"the routed experts' ({et}) rate, in place of the {dt} one")
        o = hw.overheads
        out["software_overheads"] = _entry("fitted" if o.fitted else "none", None,
                                           "measured" if o.fitted else "assumed",
                                           None if o.fitted else "a datasheet profile's bound: no software overhead")
    if uses_cache:
        if job.hit_rate is not None:
            out["hit_rate"] = _entry(job.hit_rate, "ratio", "overridden", "decode; prefill's lookups stay simulated")
            out["hit_rate_source"] = "cache.hit_rate"
        else:
            out["hit_rate"] = _entry(None, "ratio", "assumed", "decode, replayed through the cache policy")
            out["hit_rate_source"] = f"synthetic routing trace ({_skew(routing)})"
    return out


def _skew(routing: Routing) -> str:
    if routing.zipf == 0 and routing.reuse == 0:
        return "uniform: zipf=0, reuse=0"
    return f"zipf={routing.zipf:g}, reuse={routing.reuse:g}"
