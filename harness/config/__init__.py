"""Configuration: dataclass schemas registered in Hydra's ConfigStore, and the strict checks Hydra
alone does not make.

Owns: the shape of a moebench run's configuration (groups model, placement, cache, experts,
prefetch, workload, hardware, run, engine, kv, experiment) and `validate(cfg)`, which turns a
composed DictConfig into a plain `RunSpec` -- or raises `ConfigError` naming the key, the
allowed values and the value given -- *before* any model weights are read. One module per seam:

  schema          the group dataclasses, `register_configs`, `RunSpec`, `ConfigError`
  validate        `validate` and `check_keys`: the order of the checks, the fixed groups' values
  model           the model's ModelConfig, the experts' treatment, the expert cache's size
  plugin_options  each plugin's options checked by the plugin (placement, policy, prefetch, engine)

Does not own: running anything (harness.runner).

Canonical overrides: model=tiny-mixtral, model.path=DIR, placement=fetch, cache.capacity=4,
cache.capacity=auto, cache.capacity_bytes=256MiB, cache.policy=lru, experts.quant=int4,
experts.group_size=32, prefetch=none, workload=coding_agent,
workload.context_tokens=4096, workload.gen_tokens=64, workload.batch=1, workload.ubatch=512,
run.repeats=3, run.warmup=1, engine=hf, kv.dtype=q8 (kv=q8).
"""
from __future__ import annotations

from harness.config.model import (capacity_bytes_of, capacity_of, default_capacity, expert_quant_of,
                                  model_config_of)
from harness.config.schema import (BAD_CONFIG, DEFAULT_CAPACITY, GROUP_SCHEMAS, CacheConf, Config, ConfigError,
                                   ExpertsConf, HardwareConf, KVConf, ModelConf, RunConf, RunSpec, WorkloadConf,
                                   config_error_line, register_configs)
from harness.config.validate import check_keys, validate

__all__ = ["BAD_CONFIG", "DEFAULT_CAPACITY", "GROUP_SCHEMAS", "CacheConf", "Config", "ConfigError", "ExpertsConf",
           "HardwareConf", "KVConf", "ModelConf", "RunConf", "RunSpec", "WorkloadConf", "capacity_bytes_of",
           "capacity_of", "check_keys", "default_capacity", "config_error_line", "expert_quant_of", "model_config_of",
           "register_configs", "validate"]
