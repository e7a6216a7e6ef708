"""A roofline beside every speed: the physical limit of each phase on this machine.

Owns: per measured phase, the bound the hardware puts on it -- the bytes of weights, experts and
KV each pass must read and the FLOPs it must do (from the model's shape, the placement and the
phase's measured cache hits and misses), each at the machine's measured rates (RAM bandwidth and
GEMM rate per dtype from `moebench calibrate`, on the emulated device and the CPU alike), copies
fully hidden, no software overhead -- as `roofline_tok_per_s`, and the measurement's
`frac_of_roofline` (measured tok/s over the bound). Both are `source=model` rows, labelled with
the profile they came from. Without measured rates the rows are null with the reason (never a
guess). The CPU's read bandwidth (weights and KV read from host RAM: the emulated device's and CPU
experts') is the machine's, not a kernel's: a STREAM-class read at the run's thread count
(harness.read_bandwidth, measured when `roofline` is given the threads), unless the job gives its
own hardware figures, which are then the bound's as given (`machine_rates`: the profile a job is
judged on, which the prediction pass uses too). A measurement above ROOFLINE_SLACK x its bound means the
bound is wrong (`wrong`), never a fraction to print. Does not own: the arithmetic
(harness.costmodel: work, timemodel), the rates (harness.costmodel.calibrate) or the read
(harness.read_bandwidth).

    bound = roofline(spec, counts={"decode": {"expert_hits": 93, "expert_misses": 31}}, capacity=4, threads=2)
    bound.phases["decode"]          # roofline tok/s, or None with bound.reason
    wrong(measured_tok_per_s, bound.phases["decode"])    # None, or why the bound cannot be right
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.config import RunSpec

if TYPE_CHECKING:
    from harness.costmodel.profiles import HardwareProfile
    from harness.read_bandwidth import ReadBandwidth

MEASURED_PROFILE = "measured"          # what `moebench calibrate` writes by default (conf/hardware/measured.yaml)
BASIS = "bytes and FLOPs of the phase at this machine's measured rates; copies hidden; no software overhead"
ROOFLINE_SLACK = 1.05                  # a measurement this far above its bound: the bound is wrong, not the run
GIVEN = "the job's hardware figures, as given"


@dataclass
class Roofline:
    profile: str | None
    phases: dict[str, float | None] = field(default_factory=dict)     # phase -> roofline tok/s
    reason: str | None = None                                          # why there is none
    basis: str = BASIS                                                 # what the bound assumes
    read: ReadBandwidth | None = None                                  # the machine's read bandwidth it used
    read_method: str | None = None                                     # where its read figures came from

    def columns(self) -> dict[str, object]:
        """What each of its rows says of the bound: profile, basis, read bandwidth and its method."""
        return {"roofline_profile": self.profile, "roofline_basis": self.basis, "roofline_read_method": self.read_method,
                "roofline_read_gbps": self.read.gbps if self.read else None,
                "roofline_read_gbps_all_cores": self.read.all_cores_gbps if self.read else None}


def wrong(measured_tok_per_s: float | None, bound: float | None) -> str | None:
    """Why the bound cannot be this measurement's roofline (it ran more than ROOFLINE_SLACK x
    faster than the bound allows), or None."""
    f = frac(measured_tok_per_s, bound)
    if f is None or f <= ROOFLINE_SLACK:
        return None
    return (f"roofline wrong: measured {measured_tok_per_s:.4g} tok/s is {f:.2f}x the bound {bound:.4g} tok/s "
            f"(more than {ROOFLINE_SLACK}x): the bound's rates are below this machine's")


def machine_read(threads: int) -> ReadBandwidth:
    """This machine's read bandwidth at `threads` and at all cores (harness.read_bandwidth)."""
    from harness.read_bandwidth import read_bandwidth
    return read_bandwidth(threads)


def with_read_bandwidth(profile, gbps: float, dtype: str):
    """`profile` with the CPU's weight-read and memory figures at `dtype` set to `gbps` (the
    emulated device's too: its memory is host RAM)."""
    rates = {d: dict(r) for d, r in (profile.dtype_rates or {}).items()}
    mine = rates.setdefault(dtype, {})
    mine["cpu_gemv_gbps"] = gbps
    changes = {"cpu_mem_gbps": gbps}
    if profile.emulated:
        mine["device_gemv_gbps"] = gbps
        changes["device_mem_gbps"] = gbps
    return profile.replace(dtype_rates=rates, **changes)


def assumptions(spec: RunSpec, counted: bool) -> str:
    """BASIS, and what the bound takes from a model rather than the run: the distinct experts of a
    batched decode step where the placement counts no cache lookups (`counted` False: uniform
    routing simulated), and a mixed expert format's bytes at the mean over its experts (the
    popular ones, which decode reads most, are the larger int8 ones)."""
    parts = [BASIS]
    if spec.workload.batch > 1 and not counted:
        parts.append("distinct experts per batched step from simulated uniform routing (no lookups counted)")
    if spec.expert_quant is not None and spec.expert_quant.mode == "mixed":
        parts.append("mixed expert formats at their mean bytes")
    return "; ".join(parts)


def machine_profile(spec: RunSpec):
    """(the job's hardware figures when it gives measured rates, True) else (this machine's
    calibration, False), or (None, False)."""
    from harness.costmodel.profiles import ProfileError, load_profile, profile_from_dict, profile_path

    hw = dataclasses.asdict(spec.hardware)
    if hw.get("source") == "measured" or hw.get("device_mem_gbps") is not None:
        return profile_from_dict(hw, "hardware"), True
    try:
        if profile_path(MEASURED_PROFILE).is_file():
            return load_profile(MEASURED_PROFILE), False
    except (ProfileError, OSError):
        return None, False
    return None, False


@dataclass
class MachineRates:
    """This machine's profile as a job is judged on it (the roofline, the prediction pass): the
    profile with its CPU read rate at the job's threads, where that rate came from -- or None and
    why there is none."""

    profile: HardwareProfile | None
    reason: str | None = None
    read: ReadBandwidth | None = None
    method: str | None = None


def machine_rates(spec: RunSpec, threads: int | None) -> MachineRates:
    """`machine_profile`, with the machine's read bandwidth measured at `threads` in place of the
    profile's (unless the job gives its hardware figures, or `threads` is None)."""
    from harness.costmodel.profiles import ProfileError

    try:
        profile, given = machine_profile(spec)
    except (ProfileError, ValueError) as exc:
        return MachineRates(None, reason=f"the hardware figures are unusable: {exc}")
    if profile is None:
        return MachineRates(None, reason="no measured rates for this machine: run `moebench calibrate` "
                                         "(writes conf/hardware/measured.yaml) or give hardware=<a measured profile>")
    if threads is None or given:
        return MachineRates(profile, method=GIVEN if given else f"profile {profile.name!r}'s figures")
    read = machine_read(threads)
    return MachineRates(with_read_bandwidth(profile, read.gbps, spec.dtype), read=read, method=read.method)


def roofline(spec: RunSpec, counts: dict[str, dict[str, float]], capacity: int | None,
             threads: int | None = None) -> Roofline:
    """The bound of each measured phase for this job, given its measured cache counts per phase, its
    resolved cache capacity and its intra-op `threads` (the machine's read bandwidth is measured
    at that count, unless the job gives its hardware figures; None: the profile's read figures)."""
    from harness.costmodel import predict
    from harness.predict_inputs import shape_of
    from harness.costmodel.profiles import Overheads, ProfileError

    m = machine_rates(spec, threads)
    if m.profile is None:
        return Roofline(None, reason=m.reason)
    profile, read, method = m.profile, m.read, m.method
    try:
        p = predict(spec.model_config, spec.placement, shape_of(spec), profile, capacity=capacity,
                    policy=spec.policy or "lru", placement_options=spec.placement_options, dtype=spec.dtype,
                    counts=counts or None, overlap="full", overheads=Overheads())
    except (ProfileError, ValueError, KeyError) as exc:
        return Roofline(profile.name, reason=f"cannot bound this job on profile {profile.name!r}: {exc}",
                        read=read, read_method=method)
    return Roofline(profile.name, {ph: est.tok_per_s for ph, est in p.phases.items()},
                    basis=assumptions(spec, bool(counts)), read=read, read_method=method)


def frac(measured_tok_per_s: float | None, bound: float | None) -> float | None:
    if not measured_tok_per_s or not bound:
        return None
    return measured_tok_per_s / bound
