"""Config schemas: one dataclass per Hydra group option, registered in the ConfigStore, and
the strict checks Hydra alone does not make.

Owns: the shape of a moebench run's configuration (groups model, placement, cache, experts,
prefetch, workload, hardware, run, engine, kv, experiment) and `validate(cfg)`, which turns a
composed DictConfig into a plain `RunSpec` -- or raises `ConfigError` naming the key, the
allowed values and the value given -- *before* any model weights are read.
Does not own: running anything (harness.runner).

Canonical overrides: model=tiny-mixtral, model.path=DIR, placement=fetch, cache.capacity=4,
cache.capacity=auto, cache.capacity_bytes=256MiB, cache.policy=lru, experts.quant=int4,
experts.group_size=32, prefetch=none, workload=coding_agent,
workload.context_tokens=4096, workload.gen_tokens=64, workload.batch=1, workload.ubatch=512,
run.repeats=3, run.warmup=1, engine=hf, kv.dtype=q8 (kv=q8).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.config import PRESETS, ModelConfig, preset
from engine.devices import parse_bytes
from engine.dtypes import DTYPE_NAMES
from engine.kvquant import DEFAULT_KV_DTYPE, KV_DTYPES, KVFormatError, is_lossy
from engine.placements import needs_cache
from engine.registry import PLACEMENTS, POLICIES, PREFETCHERS, UnknownPluginError
from harness import plugins
from harness.plugins import PluginConf, PluginOptionsError
from harness.contract import EXPERT_CACHE_STATES, RESUME_MODES, session_tokens
from harness.passes import DEFAULT_PASSES, check_passes

WORKLOADS = ("coding_agent", "chat", "long_doc")
TOKEN_SOURCES = ("text", "random")
PROFILERS = ("none", "torch", "nsys")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = (*DTYPE_NAMES, "auto")       # "auto": the dtype the checkpoint was saved in
KV_ENGINES = ("moebench", "llamacpp")  # the engines that apply kv.dtype (llama.cpp: as -ctk/-ctv)


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key, what is allowed and what was given."""


# what composing a config (Hydra: an unknown key, a bad override, a missing group option) or
# checking it (OmegaConf's types, ours) raises for bad input: a one-line message, never a traceback
BAD_CONFIG = (ConfigError, HydraException, OmegaConfBaseException)


def config_error_line(exc: BaseException) -> str:
    """One line for a BAD_CONFIG error: the lines of its message and of its cause's, without
    OmegaConf's key/type trailer lines."""
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


PolicyOptionsConf = plugins.policy_options_schema()     # every registered policy's option fields


DEFAULT_CAPACITY = "4"


@dataclass
class CacheConf:
    # expert slots per layer: an int, or "auto" (sized from the device budget); null: 4, or what
    # capacity_bytes holds
    capacity: Optional[str] = None
    capacity_bytes: Optional[str] = None   # or the cache as bytes over all MoE layers ("256MiB"), not both
    policy: str = "lru"               # a registered policy: lru | lfu | fifo | static | belady | ...
    policy_options: PolicyOptionsConf = field(default_factory=PolicyOptionsConf)   # the chosen policy's


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


GROUP_SCHEMAS: dict[str, type] = {f.name: f.type if isinstance(f.type, type) else globals()[f.type]
                                  for f in dataclasses.fields(Config)}


def register_configs() -> None:
    """Register the schema and every group option in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(name="moebench_schema", node=Config)
    for name in PRESETS:
        cs.store(group="model", name=name, node=ModelConf(name=name))
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


# --- validation -----------------------------------------------------------------------------
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
    expert_quant: Any = None          # engine.blocks.quant_experts.ExpertQuant, resolved; None: exact experts
    capacity_bytes: int | None = None  # the cache in bytes (capacity is None then)
    kv_dtype: str = DEFAULT_KV_DTYPE                                 # how the KV is stored (engine.kvquant)

    @property
    def all_logits(self) -> bool:
        """The job's engine keeps every position's logits of a micro-batch, which its memory plan
        makes room for: the quality pass runs on it (harness.passes.quality: moebench under
        check_reference, `quality` in run.passes)."""
        return self.engine == "moebench" and self.run.check_reference and "quality" in self.run.passes

    @property
    def lossy(self) -> bool:
        """A lossy treatment runs (its outputs differ from the exact model's by design): quantised
        experts, or a KV format that loses precision for the model's dtype."""
        return is_lossy(self.kv_dtype, self.dtype, self.expert_quant)

    @property
    def dtype(self) -> str:
        """The dtype the model runs in: model.dtype, `auto` resolved to the checkpoint's."""
        return _run_dtype(self.model, self.model_config)

    @property
    def model_label(self) -> str:
        return self.model.name if not self.model.path else f"{self.model.name}:{Path(self.model.path).name}"


def _run_dtype(model: ModelConf, mcfg: ModelConfig) -> str:
    return mcfg.torch_dtype if model.dtype == "auto" else model.dtype


def _allowed(key: str, allowed: Any, given: Any) -> ConfigError:
    return ConfigError(f"{key}: allowed {allowed}, got {given!r}")


def check_keys(cfg: DictConfig) -> None:
    """Reject keys that no schema declares -- including ones added with `+key=value`,
    which Hydra accepts despite a schema -- at every level of a structured node."""
    for group, node in cfg.items():
        if group == "hydra":
            continue
        if group not in GROUP_SCHEMAS:
            raise ConfigError(f"unknown config key {group!r}; allowed top-level keys: {sorted(GROUP_SCHEMAS)}")
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{group} must be a config group, got {node!r}")
        _check_node(group, node, GROUP_SCHEMAS[group])


def _check_node(path: str, node: DictConfig, fallback: type) -> None:
    schema = OmegaConf.get_type(node)
    schema = schema if dataclasses.is_dataclass(schema) else fallback
    allowed = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        if key not in allowed:
            raise ConfigError(f"unknown config key '{path}.{key}'; allowed keys in {path!r}"
                              f"{' for ' + repr(node.get('name')) if 'name' in node else ''}: {allowed}")
        child = node[key]
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _check_node(f"{path}.{key}", child, OmegaConf.get_type(child))


def _model_config(model: ModelConf) -> ModelConfig:
    if model.path:
        p = Path(model.path)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path: expected a Hugging Face checkpoint directory with config.json, "
                              f"got {model.path!r}")
        try:
            mcfg = ModelConfig.from_hf_dir(p)
        except ValueError as exc:          # unreadable JSON, unsupported architecture, missing key
            raise ConfigError(f"model.path: {exc}") from None
    else:
        if model.name not in PRESETS:
            raise _allowed("model.name", sorted(PRESETS), model.name)
        mcfg = preset(model.name)
    if model.num_layers is not None:
        if not 1 <= model.num_layers <= mcfg.num_layers:
            raise _allowed("model.num_layers", f"1..{mcfg.num_layers}", model.num_layers)
        if model.num_layers <= min(mcfg.moe_layers):      # e.g. DeepSeek-V3's 3 dense first layers
            raise _allowed("model.num_layers", f"{min(mcfg.moe_layers) + 1}..{mcfg.num_layers} (the first MoE "
                           f"layer of {mcfg.name or 'this model'} is layer {min(mcfg.moe_layers)})", model.num_layers)
        mcfg = mcfg.replace(num_layers=model.num_layers,
                            moe_layers=tuple(l for l in mcfg.moe_layers if l < model.num_layers))
    return mcfg


def _expert_quant(experts: dict[str, Any], mcfg: ModelConfig) -> Any:
    """experts.* resolved to the engine's ExpertQuant (None: exact); popularity files read here."""
    from engine.blocks.quant_experts import resolve_expert_quant
    e = ExpertsConf(**experts)
    try:
        spec = resolve_expert_quant(mcfg, e.quant, group_size=e.group_size, mixed_count=e.mixed_count,
                                    mixed_fraction=e.mixed_fraction, mixed_high=e.mixed_high,
                                    popularity=e.popularity, trace=e.trace)
        if spec is not None:
            mcfg.replace(expert_quant=spec).architecture()        # a layout that cannot be quantised says so
    except ValueError as exc:
        raise ConfigError(str(exc) if str(exc).startswith("experts.") else f"experts.quant={e.quant}: {exc}") from None
    return spec


def _capacity_bytes(cache: dict[str, Any]) -> int | None:
    raw = cache.get("capacity_bytes")
    if raw is None:
        return None
    if cache.get("capacity") is not None:
        raise ConfigError(f"cache.capacity_bytes: give the expert cache as cache.capacity (slots per layer, or "
                          f"auto) or as cache.capacity_bytes, not both; got cache.capacity={cache['capacity']!r} "
                          f"and cache.capacity_bytes={raw!r}")
    try:
        n = parse_bytes(raw)
    except ValueError:
        n = None
    if n is None or n <= 0:
        raise _allowed("cache.capacity_bytes", "a positive size (e.g. 256MiB, 2GiB) or null", raw)
    return n


def _capacity(raw: Any, mcfg: ModelConfig, in_use: bool) -> int | str:
    """cache.capacity as given: "auto" or an int -- its type checked whatever the placement, so a
    wrong value never passes silently because this placement ignores it; its range [top_k,
    n_experts] checked where a placement keeps a cache (the default 4 stays valid for a model
    with top_k 8 under a placement that has no cache)."""
    allowed = f"an int in [top_k={mcfg.top_k}, n_experts={mcfg.n_experts}] or 'auto'"
    text = str(raw).strip()
    if text == "auto":
        return "auto"
    try:
        capacity = int(text)
    except ValueError:
        raise _allowed("cache.capacity", allowed, raw) from None
    if in_use and not mcfg.top_k <= capacity <= mcfg.n_experts:
        raise _allowed("cache.capacity", allowed, capacity)
    return capacity


def _placement_options(name: str, options: dict[str, Any], mcfg: ModelConfig) -> dict[str, Any]:
    """The plugin's own option check, reported against the config keys; the options as the
    engine takes them."""
    try:
        parsed = plugins.parse(PLACEMENTS, name, options, "placement")
    except (UnknownPluginError, PluginOptionsError) as exc:
        raise ConfigError(str(exc) if isinstance(exc, PluginOptionsError) else f"placement.name: {exc}") from None
    values = dataclasses.asdict(parsed)
    try:
        PLACEMENTS.get(name).check_model(mcfg, values)
    except ValueError as exc:
        raise ConfigError(f"placement.{exc}") from None
    return values


def _policy_options(cache: dict[str, Any], mcfg: ModelConfig, run: RunConf) -> dict[str, Any]:
    """The chosen policy's options from `cache.policy_options`, prepared by the policy itself
    (files read here, never after weights load)."""
    policy = cache["policy"]
    try:
        options = plugins.chosen_policy_options(policy, cache.get("policy_options") or {})
        if policy == "belady" and run.expert_cache == "warm":
            raise ValueError("run.expert_cache=warm adds lookups the recorded future does not hold; allowed with "
                             "belady: run.expert_cache=cold")
        return POLICIES.get(policy).prepare(options, mcfg)
    except PluginOptionsError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(f"cache.policy_options (cache.policy={policy}): {exc}") from None


def _plugin(registry: Any, key: str, name: str, options: dict[str, Any]) -> Any:
    try:
        return plugins.parse(registry, name, options, key)
    except UnknownPluginError as exc:
        raise ConfigError(f"{key}.name: {exc}") from None
    except PluginOptionsError as exc:
        raise ConfigError(str(exc)) from None


def _kv_dtype(kv: dict[str, Any], mcfg: ModelConfig, engine: str, engine_options: Any) -> str:
    """kv.dtype, checked against the model's state kinds and head_dim (before any weight is read)."""
    name = kv.get("dtype", DEFAULT_KV_DTYPE)
    if name not in KV_DTYPES:
        raise _allowed("kv.dtype", list(KV_DTYPES), name)
    if name != DEFAULT_KV_DTYPE and engine not in KV_ENGINES:
        raise ConfigError(f"kv.dtype={name}: engine={engine} has no KV storage treatments; allowed with "
                          f"engine={engine}: kv.dtype={DEFAULT_KV_DTYPE} (kv.dtype applies to engine="
                          f"{' | '.join(KV_ENGINES)})")
    if engine == "llamacpp":
        from harness.llamacpp.flags import FlagError
        try:
            engine_options.flags(None, None, None, name)          # -ctk/-ctv, checked with engine.* knobs
        except FlagError as exc:
            raise ConfigError(str(exc)) from None
        return name
    try:
        mcfg.architecture().state_terms(4, name)
    except KVFormatError as exc:
        raise ConfigError(f"kv.dtype: {exc}") from None
    return name


def validate(cfg: DictConfig) -> RunSpec:
    check_keys(cfg)
    c = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    model = ModelConf(**c["model"])
    workload, hardware, run = WorkloadConf(**c["workload"]), HardwareConf(**c["hardware"]), RunConf(**c["run"])
    if model.dtype not in DTYPES:
        raise _allowed("model.dtype", list(DTYPES), model.dtype)
    mcfg = _model_config(model)
    placement = dict(c["placement"])
    pname = placement.pop("name")
    from harness.engines import ENGINES
    engine_opts = dict(c["engine"])
    engine = engine_opts.pop("name")
    engine_options = _plugin(ENGINES, "engine", engine, engine_opts)
    loader = ENGINES.get(engine).checkpoint_loader
    if model.path and loader:                 # before any loader sees the dir (harness.remote_code)
        from harness.remote_code import RemoteCodeRefused, refuse_checkpoint_code
        try:
            refuse_checkpoint_code(model.path, model.trust_remote_code, loader)
        except RemoteCodeRefused as exc:
            raise ConfigError(f"model.path: {exc}") from None
    prefetch = c["prefetch"]["name"]
    prefetch_options = dataclasses.asdict(_plugin(PREFETCHERS, "prefetch", prefetch,
                                                  dict(c["prefetch"].get("options") or {})))
    for key, value, allowed in (("workload.name", workload.name, WORKLOADS),
                                ("workload.tokens", workload.tokens, TOKEN_SOURCES),
                                ("hardware.device", hardware.device, DEVICES),
                                ("run.profiler", run.profiler, PROFILERS),
                                ("run.resume", run.resume, RESUME_MODES),
                                ("run.expert_cache", run.expert_cache, EXPERT_CACHE_STATES),
                                ("cache.policy", c["cache"]["policy"], POLICIES.names())):
        if value not in allowed:
            raise _allowed(key, list(allowed), value)
    for key in ("context_tokens", "gen_tokens", "batch", "ubatch"):
        if getattr(workload, key) < 1:
            raise ConfigError(f"workload.{key}: must be >= 1, got {getattr(workload, key)}")
    if workload.turn_tokens < 1:
        raise ConfigError(f"workload.turn_tokens: must be >= 1, got {workload.turn_tokens}")
    if run.threads is not None and run.threads < 1:
        raise ConfigError(f"run.threads: must be >= 1 or null, got {run.threads}")
    if run.repeats < 1 or run.warmup < 0:
        raise ConfigError(f"run.repeats must be >= 1 and run.warmup >= 0, got {run.repeats}, {run.warmup}")
    try:
        run.passes = list(check_passes(run.passes, run))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if hardware.device_memory is not None:
        try:
            budget = parse_bytes(hardware.device_memory)
        except ValueError as exc:
            raise ConfigError(f"hardware.device_memory: {exc}") from None
        if budget is None or budget <= 0:
            raise ConfigError(f"hardware.device_memory: must be a positive size (e.g. 64MiB, 8GiB) or null, "
                              f"got {hardware.device_memory!r}")
    if run.profiler == "nsys":
        from harness.profiling.nsys import NsysNotFound, find_nsys
        try:
            find_nsys()
        except NsysNotFound as exc:
            raise ConfigError(f"run.profiler=nsys: {exc}") from None
    # the whole session -- context, replies and two more turns -- must fit the model
    needed = session_tokens(workload.context_tokens, workload.gen_tokens, workload.turn_tokens)
    if needed > mcfg.max_position_embeddings:
        raise ConfigError(
            f"workload.context_tokens: {workload.context_tokens} (+ {workload.gen_tokens} generated + 2 turns of "
            f"{workload.turn_tokens}) = {needed} tokens is longer than the model allows "
            f"(max_position_embeddings {mcfg.max_position_embeddings} for {mcfg.name or model.name!r})")
    placement = _placement_options(pname, placement, mcfg)
    if placement.get("cuda_graph") and run.record_trace:
        raise ConfigError("run.record_trace=true: placement.cuda_graph=true keeps routing on the device, so a "
                          "routing trace cannot be recorded; allowed with it: run.record_trace=false")
    uses_cache = needs_cache(pname, placement)
    capacity_bytes = _capacity_bytes(c["cache"])
    capacity: int | str | None = None if capacity_bytes is not None else \
        _capacity(c["cache"]["capacity"] if c["cache"]["capacity"] is not None else DEFAULT_CAPACITY, mcfg, uses_cache)
    if not uses_cache:
        capacity = capacity_bytes = None
    expert_quant = _expert_quant(c["experts"], mcfg)
    if expert_quant is not None and not ENGINES.get(engine).uses_placement:
        raise ConfigError(f"experts.quant={c['experts']['quant']}: quantised experts are moebench's treatment; "
                          f"engine={engine} runs its own weights (its engine.* knobs); allowed with engine={engine}: "
                          "experts.quant=none")
    if expert_quant is not None:              # the planner, cost model and roofline see the stored bytes
        mcfg = mcfg.replace(expert_quant=expert_quant)
    if prefetch != "none" and not uses_cache:
        raise ConfigError(f"prefetch={prefetch}: needs a placement with a device expert cache "
                          f"(fetch, or stream with stream_fallback=fetch); got placement={pname}")
    policy_options = _policy_options(c["cache"], mcfg, run) if uses_cache else {}
    kv_dtype = _kv_dtype(c.get("kv") or {}, mcfg, engine, engine_options)
    if engine == "llamacpp":
        try:
            engine_options.weights_for(_run_dtype(model, mcfg))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return RunSpec(kv_dtype=kv_dtype, model=model, placement=pname, placement_options=placement, capacity=capacity,
                   policy=c["cache"]["policy"] if uses_cache else None, prefetch=prefetch,
                   workload=workload, hardware=hardware, run=run, engine=engine, model_config=mcfg,
                   policy_options=policy_options, prefetch_options=prefetch_options, engine_options=engine_options,
                   expert_quant=expert_quant, capacity_bytes=capacity_bytes)
