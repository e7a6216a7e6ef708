"""Hardware profiles for the cost model: what a machine can do, read from conf/hardware/<name>.yaml.

Owns: the `HardwareProfile` dataclass (the fields of `harness.config.HardwareConf`, the
Hydra schema of the `hardware` group, plus the fitted software `Overheads` of a measured
machine), loading a profile by name or path with errors that name the file, the field and
the profiles available, listing profiles, writing a profile back (`save_profile`), and where
each figure comes from as the profile states it (`figure_origin`: datasheet, measured, assumed).
Does not own: measuring (harness.costmodel.calibrate) or predicting (harness.costmodel.timemodel).

    from harness.costmodel import load_profile, list_profiles
    list_profiles()                         # ['a100-pcie-40gb', ..., 'rtx5090-pcie5-x16']
    hw = load_profile("rtx4090-pcie4-x8")   # or a path to any profile yaml
    hw.h2d_gbps, hw.require("h2d_gbps", "device_tflops", why="fetch")

A profile yaml holds exactly the HardwareConf keys, so it is also a Hydra option
(`moebench hardware=rtx4090-pcie4-x8`); it describes hardware for prediction and keeps
`device: auto` / `device_memory: null`, so choosing it does not change where a run executes.

Software overheads (Python dispatch, kernel launches, copy hand-offs: the fixed costs per
forward pass, layer, expert, lookup, ... that dominate a tiny model) are not hardware and
not HardwareConf keys. Calibration fits them for the machine it measures and stores them
beside the yaml as `<name>.overheads.json` (a JSON file, so Hydra never mistakes it for a
group option). Datasheet profiles have none: predictions with them are the bytes/FLOPs
bound of the hardware, with zero software overhead.

Rates per dtype: what a matmul achieves depends on its dtype (on a CPU with AMX a bf16 GEMM can
run several times faster than fp32 while a bf16 GEMV reads weights slower), so the
dtype-dependent figures (`RATE_FIGURES`) are kept per dtype. `device_tflops` and `cpu_gflops`
are the figures at the profile's `dtype`; `dtype_rates` holds those of other dtypes and the
GEMV weight-read rates: {float32: {device_tflops: 82.6, cpu_gflops: 1600.0}, ...}.
`HardwareProfile.rate(figure, dtype)` answers for one dtype and the time model asks it for the
run's dtype; a figure the profile does not give for that dtype is refused (`require_rates`,
naming the figure and the dtype) -- never borrowed from another dtype. The GEMV figures are
optional: without one the weight-read roof is the memory bandwidth (dtype-independent).

Rates per weight format: what a GEMV over quantised weights achieves depends on the format too
(unpacking 4-bit blocks costs a CPU more per byte than reading 8-bit ones), so `dtype_rates` may
also be keyed by a quantised weight type (engine.formats: q4_k, q8_0, mxfp4, fp8, ...), e.g.
{q4_k: {cpu_gemv_gbps: 40.0}}: the rates of the routed experts held in that type (their weight
reads and, where given, their FLOPs). The time model asks the experts' type first (`expert_rate`)
and falls back to the run's dtype's figure, so a profile without one predicts as before.

Units: GB/s and GFLOP/s are decimal (1e9), TFLOP/s 1e12, device_memory_gib and host_memory_gib binary (2**30).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.dtypes import DTYPE_NAMES
from engine.formats import DTYPE_FORMATS, TYPES
from harness.config import HardwareConf

PROFILE_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"
OVERHEADS_SUFFIX = ".overheads.json"
SOURCES = ("datasheet", "measured")
CONF_FIELDS = tuple(f.name for f in dataclasses.fields(HardwareConf))
NUMERIC_FIELDS = ("h2d_gbps", "d2h_gbps", "device_tflops", "device_mem_gbps", "device_memory_gib", "cpu_gflops",
                  "cpu_mem_gbps", "host_memory_gib", "disk_read_gbps")
# the dtype-dependent figures (dtype_rates entries); the first two are also plain fields, at `dtype`
RATE_FIGURES = ("device_tflops", "cpu_gflops", "device_gemv_gbps", "cpu_gemv_gbps")
# the other keys dtype_rates takes: quantised weight types (a dtype's own format is its dtype's entry)
FORMAT_KEYS = tuple(t for t in TYPES if t not in DTYPE_FORMATS.values())
PLAIN_RATES = ("device_tflops", "cpu_gflops")


class ProfileError(ValueError):
    """A profile that cannot be found or read, or lacks a figure a computation needs."""


@dataclass(frozen=True)
class Overheads:
    """Fitted software terms: fixed costs in seconds per event (all zero = none), and the
    compute scale (1 = the profile's peak rates; a calibrated machine's achieved/peak ratio at
    the engine's small, oddly shaped matmuls, attention and elementwise work).

    Events (counted by harness.costmodel.passcost for every forward pass):
      pass_s          one forward pass (embedding, rope, final norm, lm_head call, argmax sync)
      layer_s         one decoder layer (attention-block ops, norms, router, the expert loop's setup)
      expert_s        one expert invocation (token gather, expert FFN ops, scatter-add)
      row_s           one token row through one layer (elementwise work on activations)
      slot_s          one routed (token, expert) slot: gather, routing-weight multiply, scatter-add of a row
      score_s         one materialised attention score (B*H*T*S of a pass; 0 where attention is fused)
      lookup_s        one device-cache lookup (fetch bookkeeping and policy)
      miss_s          one cache miss or streamed expert: issuing a copy and waiting for it, beyond bytes/link
      cpu_layer_s     one MoE layer run on the CPU (cpu/hybrid: activation hand-off and return)
      restore_s       one KV restore (prefill_restored), beyond bytes/link
    """

    compute_scale: float = 1.0
    pass_s: float = 0.0
    layer_s: float = 0.0
    expert_s: float = 0.0
    row_s: float = 0.0
    slot_s: float = 0.0
    score_s: float = 0.0
    lookup_s: float = 0.0
    miss_s: float = 0.0
    cpu_layer_s: float = 0.0
    restore_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict, compare=False)   # how and where they were fitted

    TERMS = ("pass_s", "layer_s", "expert_s", "row_s", "slot_s", "score_s", "lookup_s", "miss_s", "cpu_layer_s",
             "restore_s")

    def as_dict(self) -> dict[str, float]:
        """The per-event costs (not compute_scale)."""
        return {t: float(getattr(self, t)) for t in self.TERMS}

    @property
    def fitted(self) -> bool:
        return self.compute_scale != 1.0 or any(self.as_dict().values())

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "overheads") -> "Overheads":
        unknown = sorted(set(d) - set(cls.TERMS) - {"info", "compute_scale"})
        if unknown:
            raise ProfileError(f"{source}: unknown overhead term(s) {unknown}; allowed: "
                               f"{[*cls.TERMS, 'compute_scale']}")
        scale = d.get("compute_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ProfileError(f"{source}: compute_scale must be a finite number > 0, got {scale!r}")
        values: dict[str, float] = {"compute_scale": float(scale)}
        for t in cls.TERMS:
            v = d.get(t, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ProfileError(f"{source}: overhead {t} must be a finite number >= 0 (seconds), got {v!r}")
            values[t] = float(v)
        return cls(**values, info=dict(d.get("info") or {}))


@dataclass(frozen=True)
class HardwareProfile:
    """One machine's figures (HardwareConf's fields) and, when measured, its software overheads."""

    name: str
    source: str | None = None
    link: str | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    device_tflops: float | None = None
    device_mem_gbps: float | None = None
    device_memory_gib: float | None = None
    cpu_gflops: float | None = None
    cpu_mem_gbps: float | None = None
    host_memory_gib: float | None = None
    disk_read_gbps: float | None = None
    dtype: str | None = None
    dtype_rates: dict[str, dict[str, float]] | None = None
    notes: str | None = None
    device: str = "auto"
    device_memory: str | None = None
    overheads: Overheads = field(default_factory=Overheads)
    path: Path | None = field(default=None, compare=False)

    @property
    def emulated(self) -> bool:
        """Whether the figures describe moebench's CPU-emulated device (calibration writes
        `link: emulated ...` there: the "link" is a memcpy, not a bus)."""
        return (self.link or "").startswith("emulated")

    @property
    def device_kind(self) -> str:
        """What a run on this hardware would report as `device_kind`."""
        return "cpu" if self.emulated else "cuda"

    def require(self, *fields: str, why: str = "") -> None:
        """Raise ProfileError naming every listed figure this profile lacks (null)."""
        missing = [f for f in fields if getattr(self, f) is None]
        if missing:
            where = f" ({self.path})" if self.path else ""
            raise ProfileError(f"hardware profile {self.name!r}{where} has no {', '.join(missing)}"
                               f"{'; ' + why + ' needs it' if why else ''}; set it in the yaml "
                               f"(fields: {', '.join(NUMERIC_FIELDS)})")

    def rate(self, figure: str, dtype: str) -> float | None:
        """`figure` (one of RATE_FIGURES) at `dtype`: its dtype_rates entry, else the plain field
        when `dtype` is the profile's own; None when the profile does not give it for `dtype`."""
        if figure not in RATE_FIGURES:
            raise ValueError(f"rate figure: allowed {list(RATE_FIGURES)}, got {figure!r}")
        v = (self.dtype_rates or {}).get(dtype, {}).get(figure)
        if v is None and figure in PLAIN_RATES and dtype == self.dtype:
            v = getattr(self, figure)
        return v

    def expert_rate(self, figure: str, expert_type: str | None, dtype: str) -> float | None:
        """`figure` for routed experts held in `expert_type` (a quantised weight type): its
        dtype_rates entry when the profile gives one, else the figure at the run's `dtype`."""
        v = (self.dtype_rates or {}).get(expert_type, {}).get(figure) if expert_type in FORMAT_KEYS else None
        return v if v is not None else self.rate(figure, dtype)

    def require_rates(self, dtype: str, *figures: str, why: str = "") -> None:
        """Raise ProfileError naming every listed figure this profile lacks at `dtype`, and what
        it does have (a figure for another dtype is not used for this one)."""
        missing = [f for f in figures if self.rate(f, dtype) is None]
        if not missing:
            return
        where = f" ({self.path})" if self.path else ""
        have = []
        for f in missing:
            other = {d: r[f] for d, r in (self.dtype_rates or {}).items() if r.get(f) is not None}
            if f in PLAIN_RATES and getattr(self, f) is not None:
                other.setdefault(self.dtype or "an unnamed dtype (field 'dtype' is null)", getattr(self, f))
            if other:
                have.append(f"{f} is given for {', '.join(f'{d} ({v:g})' for d, v in other.items())}")
        raise ProfileError(
            f"hardware profile {self.name!r}{where} has no {', '.join(missing)} for {dtype}"
            f"{' (' + '; '.join(have) + ')' if have else ''}{'; ' + why + ' needs it' if why else ''}; "
            f"figures are not carried over from another dtype: add them under dtype_rates: {{{dtype}: {{...}}}} "
            f"in the yaml (or set dtype: {dtype} with the plain fields)")

    def conf_dict(self) -> dict[str, Any]:
        """Exactly the HardwareConf keys, in schema order (what a profile yaml holds)."""
        return {k: getattr(self, k) for k in CONF_FIELDS}

    def replace(self, **changes: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)


# --- finding and reading -------------------------------------------------------------------
def list_profiles(directory: str | Path | None = None) -> list[str]:
    """Names of the profiles (yaml files) in `directory` (default: conf/hardware)."""
    d = Path(directory) if directory is not None else PROFILE_DIR
    return sorted(p.stem for p in d.glob("*.yaml"))


def profile_path(name: str | Path, directory: str | Path | None = None) -> Path:
    """The yaml of profile `name` (a name in `directory`, or a path to a yaml file)."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.parent != Path("."):
        if not p.is_file():
            raise ProfileError(f"hardware profile file {p} does not exist")
        return p
    d = Path(directory) if directory is not None else PROFILE_DIR
    p = d / f"{name}.yaml"
    if not p.is_file():
        raise ProfileError(f"unknown hardware profile {str(name)!r}: no file {p}; available profiles in {d}: "
                           f"{', '.join(list_profiles(d)) or 'none'} (or pass a path to a profile yaml)")
    return p


def load_profile(name: str | Path, directory: str | Path | None = None) -> HardwareProfile:
    """Read and check a profile by name (conf/hardware/<name>.yaml) or path; loads its overheads sidecar."""
    path = profile_path(name, directory)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ProfileError(f"hardware profile {path}: not valid YAML ({err})") from err
    if not isinstance(raw, dict):
        raise ProfileError(f"hardware profile {path}: expected a mapping of HardwareConf keys, got {type(raw).__name__}")
    profile = profile_from_dict(raw, source=str(path))
    side = overheads_path(path)
    overheads = Overheads()
    if side.is_file():
        try:
            overheads = Overheads.from_dict(json.loads(side.read_text()), source=str(side))
        except json.JSONDecodeError as err:
            raise ProfileError(f"{side}: not valid JSON ({err})") from err
    return profile.replace(overheads=overheads, path=path)


def profile_from_dict(raw: dict[str, Any], source: str = "profile") -> HardwareProfile:
    """A profile from a mapping of HardwareConf keys; errors name the key and what is allowed."""
    unknown = sorted(set(raw) - set(CONF_FIELDS))
    if unknown:
        raise ProfileError(f"{source}: unknown key(s) {unknown}; a hardware profile holds only the HardwareConf "
                           f"keys: {list(CONF_FIELDS)}")
    if not raw.get("name"):
        raise ProfileError(f"{source}: field 'name' is missing or empty")
    src = raw.get("source")
    if src not in SOURCES:
        raise ProfileError(f"{source}: field 'source' must be one of {list(SOURCES)}, got {src!r}")
    for key in NUMERIC_FIELDS:
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ProfileError(f"{source}: field {key!r} must be a positive number or null, got {v!r}")
    for key in ("link", "dtype", "notes", "device", "device_memory"):
        v = raw.get(key)
        if v is not None and not isinstance(v, str):
            raise ProfileError(f"{source}: field {key!r} must be a string or null, got {v!r}")
    if raw.get("dtype") is not None and raw["dtype"] not in DTYPE_NAMES:
        raise ProfileError(f"{source}: field 'dtype' must be one of {list(DTYPE_NAMES)} or null, got {raw['dtype']!r}")
    values = {k: raw.get(k) for k in CONF_FIELDS if k in raw}
    values.update({k: float(values[k]) for k in NUMERIC_FIELDS if values.get(k) is not None})
    values["dtype_rates"] = _dtype_rates(raw, source)
    values.setdefault("device", "auto")
    return HardwareProfile(**values)


def _dtype_rates(raw: dict[str, Any], source: str) -> dict[str, dict[str, float]] | None:
    """The checked `dtype_rates` mapping: dtype name -> {figure: positive number}; an entry for
    the profile's own dtype must agree with the plain fields it restates."""
    rates = raw.get("dtype_rates")
    if rates is None:
        return None
    if not isinstance(rates, dict):
        raise ProfileError(f"{source}: field 'dtype_rates' must be a mapping dtype -> {{figure: number}}, got {rates!r}")
    out: dict[str, dict[str, float]] = {}
    for dt, figs in rates.items():
        if dt not in DTYPE_NAMES and dt not in FORMAT_KEYS:
            raise ProfileError(f"{source}: dtype_rates key {dt!r} is neither a dtype nor a quantised weight type; "
                               f"allowed: {list(DTYPE_NAMES)} or one of {', '.join(FORMAT_KEYS)}")
        if not isinstance(figs, dict):
            raise ProfileError(f"{source}: dtype_rates.{dt} must be a mapping of {list(RATE_FIGURES)}, got {figs!r}")
        unknown = sorted(set(figs) - set(RATE_FIGURES))
        if unknown:
            raise ProfileError(f"{source}: dtype_rates.{dt}: unknown figure(s) {unknown}; allowed: {list(RATE_FIGURES)}")
        for f, v in figs.items():
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ProfileError(f"{source}: dtype_rates.{dt}.{f} must be a positive number or null, got {v!r}")
            if dt == raw.get("dtype") and f in PLAIN_RATES and raw.get(f) is not None and float(raw[f]) != float(v):
                raise ProfileError(f"{source}: dtype_rates.{dt}.{f} = {v} contradicts {f} = {raw[f]} "
                                   f"(the plain field is the figure at the profile's dtype {dt})")
        out[dt] = {f: float(v) for f, v in figs.items() if v is not None}
    return out


# Where a datasheet profile's figures come from, as its notes state it (every conf/hardware datasheet
# profile does, in these words): the link's achievable copy rate is an assumption (~80% of the bus's
# theoretical), and so is the whole host (a CPU and RAM typical beside the card); the card's own
# figures are its vendor's datasheet's.
ASSUMED_WHERE_NOTES_SAY = {"assumed achievable": ("h2d_gbps", "d2h_gbps"),
                           "Host (assumption": ("cpu_gflops", "cpu_mem_gbps", "cpu_gemv_gbps")}


def figure_origin(profile: HardwareProfile, figure: str) -> str:
    """Where `figure` of `profile` comes from: "measured" (a calibrated profile: `moebench calibrate`
    measured every figure on that machine), "assumed" (a datasheet profile whose notes state it as an
    assumption: ASSUMED_WHERE_NOTES_SAY) or "datasheet"."""
    if profile.source == "measured":
        return "measured"
    notes = profile.notes or ""
    if any(figure in figures and phrase in notes for phrase, figures in ASSUMED_WHERE_NOTES_SAY.items()):
        return "assumed"
    return "datasheet"


def overheads_path(yaml_path: str | Path) -> Path:
    p = Path(yaml_path)
    return p.with_name(p.stem + OVERHEADS_SUFFIX)


# --- writing -----------------------------------------------------------------------------
def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    """Write `profile` as a yaml of HardwareConf keys, plus `<stem>.overheads.json` when it has
    overheads. The file's stem should equal `profile.name` for Hydra (`hardware=<name>`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Hardware profile {profile.name!r} (source: {profile.source}); keys = harness.config.HardwareConf.\n"
              "# Written by `moebench calibrate`; fitted software overheads (if any) are in the .overheads.json beside it.\n")
    path.write_text(header + yaml.safe_dump(profile.conf_dict(), sort_keys=False, width=100))
    if profile.overheads.fitted:
        o = profile.overheads
        body = {"compute_scale": o.compute_scale, **o.as_dict(), "info": o.info}
        overheads_path(path).write_text(json.dumps(body, indent=2, sort_keys=False) + "\n")
    return path
