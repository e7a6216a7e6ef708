"""The configuration's shape: one dataclass per Hydra group option, registered in the
ConfigStore, and `RunSpec`, the checked job that validation returns.

Owns: the schemas of the groups model, placement, cache, experts, prefetch, workload, hardware,
run, engine, kv (a plugin group's node is built from its plugins' `Options`: harness.plugins),
`register_configs`, the allowed values of the fixed groups, `ConfigError` and the one-line message
of any bad-config error. Does not own: checking a composed config (harness.config.validate).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from engine.config import PRESETS, ModelConfig
from engine.dtypes import DTYPE_NAMES
from engine.kvquant import DEFAULT_KV_DTYPE, KV_DTYPES, is_lossy
from engine.shipped import SHIPPED, shipped_checkpoint
from harness import plugins
from harness.contract import session_tokens
from harness.passes import DEFAULT_PASSES
from harness.plugins import PluginConf
from harness.serving.load import LoadConf

if TYPE_CHECKING:
    from engine.blocks.quant_experts import ExpertQuant

WORKLOADS = ("coding_agent", "chat", "long_doc")
TOKEN_SOURCES = ("text", "random")
PROFILERS = ("none", "torch", "nsys")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = (*DTYPE_NAMES, "auto")       # "auto": the dtype the checkpoint was saved in


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key, what is allowed and what was given."""


# what composing a config (Hydra: an unknown key, a bad override, a missing group option) or
# checking it (OmegaConf's types, ours) raises for bad input: a one-line message, never a traceback
BAD_CONFIG = (ConfigError, HydraException, OmegaConfBaseException)


def config_error_line(exc: BaseException) -> str:
    """One line for a BAD_CONFIG error: a value of the wrong type or an unknown key as `KEY: allowed
    TYPE, got VALUE` (harness.hydra_errors), else the lines of its message and of its cause's,
    without OmegaConf's key/type trailer lines."""
    from harness.hydra_errors import typed_line
    if (line := typed_line(exc)) is not None:
        return line
    lines: list[str] = []
    for e in (exc, exc.__cause__):
        for line in str(e or "").splitlines():
            line = line.strip()
            if line and line not in lines and not line.startswith(("full_key:", "object_type=", "reference_type=")):
                lines.append(line)
    return "; ".join(lines) or type(exc).__name__


# --- schemas -------------------------------------------------------------------------------
@dataclass
class ModelConf:
    name: str = "tiny-mixtral"        # a preset name, or a label when `path` is set
    path: Optional[str] = None        # Hugging Face checkpoint directory (config.json + *.safetensors)
    dtype: str = "float32"            # float32 | bfloat16 | float16 | auto (the checkpoint's)
    num_layers: Optional[int] = None  # truncate a preset (sizing runs on a small machine)
    seed: int = 0                     # seeded random weights for presets
    # run code shipped in the checkpoint (an auto_map's .py files) where a loader would: transformers
    # (engine=hf), llama.cpp's converter (engine=llamacpp); false: such a checkpoint is refused
    trust_remote_code: bool = False
    # the format the weights are held in (engine.formats: bf16, fp16, fp8, mxfp4, a GGUF type such as q4_k or
    # iq4_xs, or a recipe such as q4_k_m); null: the published one (the preset's, config.json's), as the
    # job's engine holds it (its adapter's `held_weights`)
    weight_format: Optional[str] = None
    expert_format: Optional[str] = None   # the routed experts' format, overriding weight_format's for them
    gguf: Optional[str] = None            # a GGUF file: its header's per-tensor types and sizes (no tensor data read)


PolicyOptionsConf = plugins.policy_options_schema()     # every registered policy's option fields


DEFAULT_CAPACITY = "4"


@dataclass
class CacheConf:
    # expert slots per layer: an int, or "auto" (sized from the device budget); null: what
    # capacity_bytes holds, else 4 (auto for a model routing each token to more: default_capacity)
    capacity: Optional[str] = None
    capacity_bytes: Optional[str] = None   # or the cache as bytes over all MoE layers ("256MiB"), not both
    policy: str = "lru"               # a registered policy: lru | lfu | fifo | static | belady | ...
    policy_options: PolicyOptionsConf = field(default_factory=PolicyOptionsConf)   # the chosen policy's
    hit_rate: Optional[float] = None  # `moebench predict` only: the decode hit rate it assumes (a run measures its own)


@dataclass
class ExpertsConf:
    """The routed experts' treatment (engine.blocks.quant_experts): exact, or quantised at load."""

    quant: str = "none"                     # none (exact) | int8 | int4 | mixed
    group_size: int = 32                    # int4: inputs sharing one scale and zero point
    mixed_count: Optional[int] = None       # mixed: int8 experts per layer ...
    mixed_fraction: Optional[float] = None  # ... or this fraction of them (default 0.25); the rest int4
    mixed_high: str = "int8"                # mixed: the higher precision
    popularity: Optional[str] = None        # mixed: [moe layers][experts] counts (.json/.csv/.npy) ...
    trace: Optional[str] = None             # ... or a routing trace recorded on this model (.npz)
    activations: str = "fp32"               # fp32 | int8: the products' inputs rounded per 32 (as llama.cpp's Q8_0)


@dataclass
class KVConf:
    """How sessions store their KV cache (engine.kvquant): `model` (the default) is the model's
    dtype, exact; f16 | bf16 | q8 | q4 | fp8 are lossy treatments (labelled `lossy=true`, with
    their quality measured against the exact reference)."""

    dtype: str = DEFAULT_KV_DTYPE


@dataclass
class WorkloadConf:
    name: str = "coding_agent"
    context_tokens: int = 4096        # tokens up to and including the measured turn
    gen_tokens: int = 32              # generated tokens (the first comes from prefill)
    turn_tokens: int = 64             # new tokens in a continuation / restored turn
    batch: int = 1                    # sessions run together
    ubatch: int = 512                 # prefill micro-batch (llama.cpp -ub)
    tokens: str = "text"              # text | random (labelled baseline)
    seed: int = 0


@dataclass
class HardwareConf:
    """Where a run executes (device, budget) and, for the cost model, what the hardware can
    do. Profiles in conf/hardware/*.yaml fill the figures; `source` says where they came
    from ("datasheet" or "measured"); null means unknown."""

    name: str = "local"
    device: str = "auto"              # auto | cpu (emulated device) | cuda
    device_memory: Optional[str] = None  # device budget, e.g. "64MiB"; default: free CUDA memory / unlimited on CPU
    source: Optional[str] = None      # datasheet | measured
    link: Optional[str] = None        # e.g. "PCIe 4.0 x16"
    h2d_gbps: Optional[float] = None  # host->device link GB/s (pinned)
    d2h_gbps: Optional[float] = None
    device_tflops: Optional[float] = None    # dense matmul TFLOP/s at the profile's dtype
    device_mem_gbps: Optional[float] = None  # device memory bandwidth GB/s
    device_memory_gib: Optional[float] = None
    cpu_gflops: Optional[float] = None       # CPU matmul GFLOP/s (all cores) at the profile's dtype
    cpu_mem_gbps: Optional[float] = None     # host RAM bandwidth GB/s
    host_memory_gib: Optional[float] = None  # host RAM: what stays on the host must fit it (harness.plan.host_plan)
    disk_read_gbps: Optional[float] = None   # read rate of the disk the weights are on: what pages in when RAM does not hold them
    dtype: Optional[str] = None              # dtype device_tflops and cpu_gflops are for
    # the dtype-dependent figures of other dtypes (and GEMV weight-read GB/s), per dtype name:
    # {bfloat16: {device_tflops: .., cpu_gflops: .., device_gemv_gbps: .., cpu_gemv_gbps: ..}}
    # (harness.costmodel.profiles.RATE_FIGURES)
    dtype_rates: Optional[Dict[str, Dict[str, float]]] = None
    notes: Optional[str] = None


@dataclass
class RunConf:
    repeats: int = 3
    warmup: int = 1
    check_reference: bool = True      # check every measured phase against the exact reference (CPU, host RAM)
    quiet: bool = False               # no progress bars or summary (CI)
    out: str = "results"              # results root for single runs and sweeps
    sweep_id: Optional[str] = None    # name of the sweep dir; default: a hash of the command-line overrides
    resume: str = "auto"              # a sweep dir holding another sweep: auto (refuse) | add | replace
    retry_failed: bool = True         # rerunning a sweep re-runs its failed jobs
    expert_cache: str = "cold"        # prefill_fresh starts from a cold cache, or warm (left by another session)
    timeline: bool = True             # one extra instrumented repeat: copy/compute overlap (profiler=timeline rows)
    trace: bool = False               # write the timeline as Chrome/Perfetto JSON (<job dir>/trace.json)
    nvtx: bool = False                # NVTX ranges (domain moebench) during the timeline pass
    ablation: bool = True             # exposed_copy_ablation_s: this placement's phase times minus resident's
    ablation_aa: bool = False         # calibration: with placement=resident, the ablation too (A/A, harness.ablation)
    profiler: str = "none"            # none | torch (torch.profiler pass) | nsys (re-launch under Nsight Systems)
    record_trace: bool = False        # save one repeat's routing as <job dir>/routing.npz (DESIGN §3 trace file)
    threads: Optional[int] = None     # torch intra-op threads; default: OMP_NUM_THREADS if set, else the
                                      # physical cores available to the process (harness.machine)
    # the passes a job runs, in this order (harness.passes; `moebench --help` lists them)
    passes: List[str] = field(default_factory=lambda: list(DEFAULT_PASSES))


@dataclass
class Config:
    model: ModelConf = field(default_factory=ModelConf)
    placement: PluginConf = field(default_factory=PluginConf)
    cache: CacheConf = field(default_factory=CacheConf)
    experts: ExpertsConf = field(default_factory=ExpertsConf)
    prefetch: PluginConf = field(default_factory=PluginConf)
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    hardware: HardwareConf = field(default_factory=HardwareConf)
    run: RunConf = field(default_factory=RunConf)
    engine: PluginConf = field(default_factory=PluginConf)
    kv: KVConf = field(default_factory=KVConf)
    load: LoadConf = field(default_factory=LoadConf)   # requests arriving over time (conf/load); none: no load


GROUP_SCHEMAS: dict[str, type] = {f.name: f.type if isinstance(f.type, type) else globals()[f.type]
                                  for f in dataclasses.fields(Config)}


def register_configs() -> None:
    """Register the schema and every group option in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(name="moebench_schema", node=Config)
    for name in PRESETS:
        cs.store(group="model", name=name, node=ModelConf(name=name))
    for name in SHIPPED:                  # trained weights: the checkpoint dir shipped with moebench
        cs.store(group="model", name=name, node=ModelConf(name=name, path=str(shipped_checkpoint(name))))
    cs.store(group="model", name="hf", node=ModelConf(name="hf-checkpoint"))
    plugins.register(cs)                  # placement, prefetch, engine: one option per registered plugin
    cs.store(group="cache", name="default", node=CacheConf())
    cs.store(group="experts", name="default", node=ExpertsConf())
    for w in WORKLOADS:
        cs.store(group="workload", name=w, node=WorkloadConf(name=w))
    cs.store(group="hardware", name="local", node=HardwareConf())
    cs.store(group="run", name="default", node=RunConf())
    cs.store(group="kv", name="default", node=KVConf())
    for name in KV_DTYPES:                # kv=q8 as a group option; kv.dtype=q8 the same
        cs.store(group="kv", name=name, node=KVConf(dtype=name))


# --- the checked job ------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    """Everything a job needs, checked; plain values only."""

    model: ModelConf
    placement: str
    placement_options: dict[str, Any]
    capacity: int | str | None
    policy: str | None
    prefetch: str
    workload: WorkloadConf
    hardware: HardwareConf
    run: RunConf
    engine: str
    model_config: ModelConfig
    policy_options: dict[str, Any] = field(default_factory=dict)     # constructor kwargs, prepared by the policy
    prefetch_options: dict[str, Any] = field(default_factory=dict)   # the prefetcher's Options as kwargs
    engine_options: Any = None                                       # the engine adapter's parsed Options
    expert_quant: ExpertQuant | None = None   # the routed experts' treatment, resolved; None: exact experts
    capacity_bytes: int | None = None  # the cache in bytes (capacity is None then)
    kv_dtype: str = DEFAULT_KV_DTYPE                                 # how the KV is stored (engine.kvquant)
    # the job's engine keeps every position's logits of a micro-batch, which its memory plan makes room for:
    # the quality pass runs on it (an engine with per-position logits, under check_reference, `quality` in
    # run.passes: harness.passes.quality)
    all_logits: bool = False
    # the bytes the job's engine holds the weights in (engine.formats.WeightBytes) where they are not the
    # model's blocks at model.dtype, and what the plan prints about the format (the adapter's `held_weights`)
    weights: Any = None
    weights_note: str = ""
    load: LoadConf | None = None       # checked (harness.serving.load.check_load); None: load=none
    load_tokens: int = 0               # the load's longest request, prompt and output (its schedule's)

    @property
    def lossy(self) -> bool:
        """A lossy treatment runs (its outputs differ from the exact model's by design): quantised
        experts, or a KV format that loses precision for the model's dtype."""
        return is_lossy(self.kv_dtype, self.dtype, self.expert_quant)

    @property
    def dtype(self) -> str:
        """The dtype the model runs in: model.dtype, `auto` resolved to the checkpoint's."""
        return run_dtype(self.model, self.model_config)

    @property
    def session_tokens(self) -> int:
        """The KV a job's sessions need: the context, the replies and two further turns (harness.contract);
        under a load, also its longest request (prompt and output)."""
        w = self.workload
        return max(session_tokens(w.context_tokens, w.gen_tokens, w.turn_tokens), self.load_tokens)

    @property
    def planned_batch(self) -> int:
        """The sequences the engine holds KV and activations for at once: the workload's batch, or a
        load's max_concurrency (one more with a prefix cache: its copy of the shared prefix) where
        that is larger."""
        load = self.load
        if load is None:
            return self.workload.batch
        cache = 1 if load.shared_prefix and load.prefix_cache != "isolated" else 0   # the prefix cache's session
        return max(self.workload.batch, (load.max_concurrency or 0) + cache)

    @property
    def planned_config(self) -> ModelConfig:
        """The model config plans and predictions count: with the bytes the engine holds its weights in."""
        return self.model_config if self.weights is None else self.model_config.replace(weight_bytes=self.weights)

    @property
    def model_label(self) -> str:
        if not self.model.path or Path(self.model.path).name == self.model.name:   # a preset; a shipped checkpoint
            return self.model.name
        return f"{self.model.name}:{Path(self.model.path).name}"


def run_dtype(model: ModelConf, mcfg: ModelConfig) -> str:
    return mcfg.torch_dtype if model.dtype == "auto" else model.dtype


def allowed_error(key: str, allowed: Any, given: Any) -> ConfigError:
    """The error for a value outside what is allowed: the key, what is allowed, what was given."""
    return ConfigError(f"{key}: allowed {allowed}, got {given!r}")
