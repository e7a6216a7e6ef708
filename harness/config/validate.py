"""Checking a composed config: `validate(cfg)` turns a DictConfig into a plain `RunSpec` -- or
raises `ConfigError` naming the key, the allowed values and the value given -- *before* any model
weights are read.

Owns: rejecting keys no schema declares (`check_keys`, `+key=value` included), the fixed groups'
values and ranges, the order of the checks, and asking each plugin (engine adapter, placement,
policy, prefetcher) to check its own part. Does not own: the schemas (harness.config.schema), the
model and cache resolution (harness.config.model), plugin options (harness.config.plugin_options),
running anything (harness.runner).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.devices import parse_bytes
from engine.kvquant import DEFAULT_KV_DTYPE, KV_DTYPES
from engine.placements import needs_cache
from engine.registry import POLICIES, PREFETCHERS
from harness.config.model import (capacity_bytes_of, capacity_of, default_capacity, expert_quant_of,
                                  model_config_of)
from harness.config.plugin_options import placement_options_of, plugin_options, policy_options_of
from harness.config.schema import (DEVICES, DTYPES, GROUP_SCHEMAS, PROFILERS,
                                   TOKEN_SOURCES, WORKLOADS, ConfigError, HardwareConf, ModelConf,
                                   RunConf, RunSpec, WorkloadConf, allowed_error)
from harness.contract import EXPERT_CACHE_STATES, RESUME_MODES, session_tokens
from harness.passes import check_passes
from harness.serving.load import LoadConf, check_load, schedule


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


def _kv_dtype(kv: dict[str, Any], engine: str, adapter: type) -> str:
    """kv.dtype: a known format, and one the job's engine applies (its own check -- against the
    model's state kinds, or as its own flags -- comes with the engine's: `EngineAdapter.check`)."""
    name = kv.get("dtype", DEFAULT_KV_DTYPE)
    if name not in KV_DTYPES:
        raise allowed_error("kv.dtype", list(KV_DTYPES), name)
    if name != DEFAULT_KV_DTYPE and not adapter.kv_treatments:
        from harness.engines.registry import engines_with
        raise ConfigError(f"kv.dtype={name}: engine={engine} has no KV storage treatments; allowed with "
                          f"engine={engine}: kv.dtype={DEFAULT_KV_DTYPE} (kv.dtype applies to engine="
                          f"{' | '.join(engines_with('kv_treatments'))})")
    return name


def validate(cfg: DictConfig) -> RunSpec:
    check_keys(cfg)
    c = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    model = ModelConf(**c["model"])
    workload, hardware, run = WorkloadConf(**c["workload"]), HardwareConf(**c["hardware"]), RunConf(**c["run"])
    if model.dtype not in DTYPES:
        raise allowed_error("model.dtype", list(DTYPES), model.dtype)
    mcfg = model_config_of(model)
    placement = dict(c["placement"])
    pname = placement.pop("name")
    from harness.engines.registry import ENGINES
    engine_opts = dict(c["engine"])
    engine = engine_opts.pop("name")
    engine_options = plugin_options(ENGINES, "engine", engine, engine_opts)
    adapter = ENGINES.get(engine)
    loader = adapter.checkpoint_loader
    if model.path and loader:                 # before any loader sees the dir (harness.remote_code)
        from harness.remote_code import RemoteCodeRefused, refuse_checkpoint_code
        try:
            refuse_checkpoint_code(model.path, model.trust_remote_code, loader)
        except RemoteCodeRefused as exc:
            raise ConfigError(f"model.path: {exc}") from None
    prefetch = c["prefetch"]["name"]
    prefetch_options = dataclasses.asdict(plugin_options(PREFETCHERS, "prefetch", prefetch,
                                                  dict(c["prefetch"].get("options") or {})))
    for key, value, allowed in (("workload.name", workload.name, WORKLOADS),
                                ("workload.tokens", workload.tokens, TOKEN_SOURCES),
                                ("hardware.device", hardware.device, DEVICES),
                                ("run.profiler", run.profiler, PROFILERS),
                                ("run.resume", run.resume, RESUME_MODES),
                                ("run.expert_cache", run.expert_cache, EXPERT_CACHE_STATES),
                                ("cache.policy", c["cache"]["policy"], POLICIES.names())):
        if value not in allowed:
            raise allowed_error(key, list(allowed), value)
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
    placement = placement_options_of(pname, placement, mcfg)
    if placement.get("cuda_graph") and run.record_trace:
        raise ConfigError("run.record_trace=true: placement.cuda_graph=true keeps routing on the device, so a "
                          "routing trace cannot be recorded; allowed with it: run.record_trace=false")
    if c["cache"].get("hit_rate") is not None:     # harness.predict takes it out before it validates
        raise ConfigError(f"cache.hit_rate: a what-if of `moebench predict` (the decode hit rate it assumes); a run "
                          f"measures its own and a plan uses none; allowed here: null, got {c['cache']['hit_rate']!r}")
    uses_cache = needs_cache(pname, placement)
    capacity_bytes = capacity_bytes_of(c["cache"])
    requested = c["cache"]["capacity"] if c["cache"]["capacity"] is not None else default_capacity(mcfg)
    capacity: int | str | None = None if capacity_bytes is not None else capacity_of(requested, mcfg, uses_cache)
    if not uses_cache:
        capacity = capacity_bytes = None
    expert_quant = expert_quant_of(c["experts"], mcfg)
    if expert_quant is not None and not adapter.uses_placement:
        raise ConfigError(f"experts.quant={c['experts']['quant']}: quantised experts are moebench's treatment; "
                          f"engine={engine} runs its own weights (its engine.* knobs); allowed with engine={engine}: "
                          "experts.quant=none")
    if expert_quant is not None:              # the planner, cost model and roofline see the stored bytes
        mcfg = mcfg.replace(expert_quant=expert_quant)
    if prefetch != "none" and not uses_cache:
        raise ConfigError(f"prefetch={prefetch}: needs a placement with a device expert cache "
                          f"(fetch, or stream with stream_fallback=fetch); got placement={pname}")
    policy_options = policy_options_of(c["cache"], mcfg, run) if uses_cache else {}
    kv_dtype = _kv_dtype(c.get("kv") or {}, engine, adapter)
    try:
        load = check_load(LoadConf(**c["load"]))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    load = load if load.name != "none" else None
    try:                                      # the KV its longest request needs; a trace file read once here
        load_tokens = max((r.input_len + r.output_len for r in schedule(load)), default=0) if load else 0
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if load_tokens > mcfg.max_position_embeddings:
        raise ConfigError(
            f"load: its longest request, {load_tokens} tokens (prompt and output), is longer than the model allows "
            f"(max_position_embeddings {mcfg.max_position_embeddings} for {mcfg.name or model.name!r})")
    spec = RunSpec(kv_dtype=kv_dtype, load=load, load_tokens=load_tokens, model=model, placement=pname, placement_options=placement, capacity=capacity,
                   policy=c["cache"]["policy"] if uses_cache else None, prefetch=prefetch,
                   workload=workload, hardware=hardware, run=run, engine=engine, model_config=mcfg,
                   policy_options=policy_options, prefetch_options=prefetch_options, engine_options=engine_options,
                   expert_quant=expert_quant, capacity_bytes=capacity_bytes,
                   all_logits=adapter.per_position_logits and run.check_reference and "quality" in run.passes)
    try:
        adapter.check(spec)                   # the engine's own part: its KV treatment, its knobs
        weights, note = adapter.held_weights(spec)     # the format its weights are held in, as it holds them
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return dataclasses.replace(spec, weights=weights, weights_note=note)
