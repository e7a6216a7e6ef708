"""A roofline beside every speed: the physical limit of each phase on this machine.

Owns: per measured phase, the bound the hardware puts on it -- the bytes of weights, experts and
KV each pass must read and the FLOPs it must do (from the model's shape, the placement and the
phase's measured cache hits and misses), each at the machine's measured rates (RAM bandwidth and
GEMM rate per dtype from `moebench calibrate`, on the emulated device and the CPU alike), copies
fully hidden, no software overhead -- as `roofline_tok_per_s`, and the measurement's
`frac_of_roofline` (measured tok/s over the bound). Both are `source=model` rows, labelled with
the profile they came from. Without measured rates the rows are null with the reason (never a
guess). Does not own: the arithmetic (harness.costmodel: work, timemodel) or the rates
(harness.costmodel.calibrate).

    bound = roofline(spec, counts={"decode": {"expert_hits": 93, "expert_misses": 31}})
    bound.phases["decode"]          # roofline tok/s, or None with bound.reason
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from harness.config import RunSpec

MEASURED_PROFILE = "measured"          # what `moebench calibrate` writes by default (conf/hardware/measured.yaml)
BASIS = "bytes and FLOPs of the phase at this machine's measured rates; copies hidden; no software overhead"


@dataclass
class Roofline:
    profile: str | None
    phases: dict[str, float | None] = field(default_factory=dict)     # phase -> roofline tok/s
    reason: str | None = None                                          # why there is none
    basis: str = BASIS                                                 # what the bound assumes


def assumptions(spec: RunSpec, counted: bool) -> str:
    """BASIS, and what the bound takes from a model rather than the run: the distinct experts of a
    batched decode step where the placement counts no cache lookups (`counted` False: uniform
    routing simulated), and a mixed expert format's bytes at the mean over its experts (the
    popular ones, which decode reads most, are the larger int8 ones)."""
    parts = [BASIS]
    if spec.workload.batch > 1 and not counted:
        parts.append("distinct experts per batched step from simulated uniform routing (no lookups counted)")
    if getattr(spec.expert_quant, "mode", None) == "mixed":
        parts.append("mixed expert formats at their mean bytes")
    return "; ".join(parts)


def _profile(spec: RunSpec):
    """The job's hardware figures when it gives measured rates, else this machine's calibration."""
    from harness.costmodel.profiles import ProfileError, load_profile, profile_from_dict, profile_path

    hw = dataclasses.asdict(spec.hardware)
    if hw.get("source") == "measured" or hw.get("device_mem_gbps") is not None:
        return profile_from_dict(hw, "hardware")
    try:
        if profile_path(MEASURED_PROFILE).is_file():
            return load_profile(MEASURED_PROFILE)
    except (ProfileError, OSError):
        return None
    return None


def roofline(spec: RunSpec, counts: dict[str, dict[str, float]], capacity: int | None) -> Roofline:
    """The bound of each measured phase for this job, given its measured cache counts per phase and
    its resolved cache capacity."""
    from harness.costmodel import WorkloadShape, predict
    from harness.costmodel.profiles import Overheads, ProfileError

    try:
        profile = _profile(spec)
    except (ProfileError, ValueError) as exc:
        return Roofline(None, reason=f"the hardware figures are unusable: {exc}")
    if profile is None:
        return Roofline(None, reason="no measured rates for this machine: run `moebench calibrate` "
                                     "(writes conf/hardware/measured.yaml) or give hardware=<a measured profile>")
    w = spec.workload
    shape = WorkloadShape(context_tokens=w.context_tokens, gen_tokens=w.gen_tokens, batch=w.batch,
                          turn_tokens=w.turn_tokens, ubatch=w.ubatch, kv_dtype=spec.kv_dtype)
    dtype = spec.model_config.torch_dtype if spec.model.dtype == "auto" else spec.model.dtype
    try:
        p = predict(spec.model_config, spec.placement, shape, profile, capacity=capacity, policy=spec.policy or "lru",
                    placement_options=spec.placement_options, dtype=dtype, counts=counts or None,
                    overlap="full", overheads=Overheads())
    except (ProfileError, ValueError, KeyError) as exc:
        return Roofline(profile.name, reason=f"cannot bound this job on profile {profile.name!r}: {exc}")
    return Roofline(profile.name, {ph: est.tok_per_s for ph, est in p.phases.items()},
                    basis=assumptions(spec, bool(counts)))


def frac(measured_tok_per_s: float | None, bound: float | None) -> float | None:
    if not measured_tok_per_s or not bound:
        return None
    return measured_tok_per_s / bound
