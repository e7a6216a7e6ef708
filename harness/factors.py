"""A job's factors: the swept settings every one of its rows carries as columns, read from its
composed config.

Owns: `factors_of` (read leniently, so even a config too broken to validate gets a failed row
that names what it sets), `lossy_of` (whether the config runs a lossy treatment, as far as the
config alone says; the engine corrects it once built) and `measurement_key_of` (the job's
`harness.sweep.measurement_key`: without the nodes that do not apply to it). Does not own:
validation (harness.config), the row schema (harness.results), fingerprints (harness.sweep).
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.blocks.quant_experts import label_of
from engine.kvquant import DEFAULT_KV_DTYPE, is_lossy
from engine.placements import needs_cache
from harness.config import DEFAULT_CAPACITY, ConfigError, ModelConf, default_capacity, model_config_of
from harness.sweep import measurement_key


def factors_of(cfg: DictConfig) -> dict[str, Any]:
    """The swept factors, read leniently so even an invalid config gets a failed row."""
    g = lambda key, default=None: OmegaConf.select(cfg, key, default=default)  # noqa: E731
    placement = g("placement.name")
    options = {k: v for k, v in (g("placement") or {}).items() if k != "name"}
    try:
        uses_cache = needs_cache(placement, options)
    except (TypeError, ValueError):   # invalid options: validate() reports them; the row still gets factors
        uses_cache = False
    try:
        from harness.engines import ENGINES
        ours = ENGINES.get(g("engine.name")).uses_placement
    except (ValueError, ImportError):             # an unknown engine: validate() reports it
        ours = True
    if not ours:                                  # the engine's own knobs are its columns
        placement, uses_cache = None, False
    # another engine's weights are its own knobs
    quant = label_of(g("experts.quant", "none"), g("experts.activations", "fp32")) if ours else None
    capacity, capacity_bytes = g("cache.capacity"), g("cache.capacity_bytes")
    capacity = "bytes" if capacity_bytes is not None and capacity is None else (capacity or _default_capacity(cfg))
    kv_dtype = g("kv.dtype", DEFAULT_KV_DTYPE)
    return {"engine": g("engine.name"), "model": g("model.name"), "placement": placement,
            "cache_capacity": str(capacity) if uses_cache else None,
            "cache_capacity_bytes": str(capacity_bytes) if uses_cache and capacity_bytes is not None else None,
            "expert_quant": quant,
            "cache_policy": g("cache.policy") if uses_cache else None,
            "prefetch": g("prefetch.name") if ours else None,
            "workload": g("workload.name"), "context_tokens": g("workload.context_tokens"),
            "gen_tokens": g("workload.gen_tokens"), "batch": g("workload.batch"), "dtype": g("model.dtype"),
            "kv_dtype": kv_dtype, "lossy": lossy_of(kv_dtype, g("model.dtype"), quant)}


def _default_capacity(cfg: DictConfig) -> str:
    """The capacity validate() gives a job that names none (its model's default_capacity), read
    leniently: DEFAULT_CAPACITY where the model cannot be resolved (validate() reports why)."""
    try:
        return default_capacity(model_config_of(ModelConf(**OmegaConf.to_container(cfg.model, resolve=True))))
    except (ConfigError, TypeError, ValueError, OSError, AttributeError):
        return DEFAULT_CAPACITY


def lossy_of(kv_dtype: Any, dtype: Any, quant: Any) -> bool | None:
    """Whether the job runs a lossy treatment: quantised experts or a KV format that loses
    precision ("auto" dtype: the checkpoint's, which only a lossless kv_dtype leaves exact
    whatever it is); None when its config is too broken to say. Corrected once the engine is
    built (harness.job.load_engine)."""
    if quant is not None and quant != "none":
        return True
    try:
        kv = kv_dtype != DEFAULT_KV_DTYPE if dtype == "auto" else is_lossy(kv_dtype, dtype)
    except ValueError:
        return None
    return kv if quant is not None or kv else None


def measurement_key_of(cfg: DictConfig, resolved: dict) -> str:
    """The job's `sweep.measurement_key`: without placement, cache and prefetch for an engine they
    do not apply to, without `cache` for a placement that keeps no expert cache -- what its factors
    (`factors_of`) leave null. An invalid config's twin failed too, and `twin_of` takes ok ones only."""
    factors = factors_of(cfg)
    inapplicable = (["placement", "cache", "prefetch"] if factors["placement"] is None
                    else [] if factors["cache_capacity"] is not None else ["cache"])
    return measurement_key(resolved, inapplicable)
