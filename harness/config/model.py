"""The job's model and expert cache as the config gives them, resolved before any weight is read.

Owns: the model's `ModelConfig` from `model.*` (a checkpoint's config.json or a preset, truncated
by `model.num_layers`), the routed experts' treatment from `experts.*`, and the expert cache's
size (`cache.capacity` slots or `cache.capacity_bytes`), each refused with a `ConfigError` naming
the key. Does not own: the schemas (harness.config.schema) or the order of the checks
(harness.config.validate).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import PRESETS, ModelConfig, preset
from engine.devices import parse_bytes
from harness.config.schema import DEFAULT_CAPACITY, ConfigError, ExpertsConf, ModelConf, allowed_error

def model_config_of(model: ModelConf) -> ModelConfig:
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
            raise allowed_error("model.name", sorted(PRESETS), model.name)
        mcfg = preset(model.name)
    if model.num_layers is not None:
        if not 1 <= model.num_layers <= mcfg.num_layers:
            raise allowed_error("model.num_layers", f"1..{mcfg.num_layers}", model.num_layers)
        if model.num_layers <= min(mcfg.moe_layers):      # e.g. DeepSeek-V3's 3 dense first layers
            raise allowed_error("model.num_layers", f"{min(mcfg.moe_layers) + 1}..{mcfg.num_layers} (the first MoE "
                           f"layer of {mcfg.name or 'this model'} is layer {min(mcfg.moe_layers)})", model.num_layers)
        mcfg = mcfg.replace(num_layers=model.num_layers,
                            moe_layers=tuple(l for l in mcfg.moe_layers if l < model.num_layers))
    return mcfg


def expert_quant_of(experts: dict[str, Any], mcfg: ModelConfig) -> Any:
    """experts.* resolved to the engine's ExpertQuant (None: exact); popularity files read here."""
    from engine.blocks.quant_experts import resolve_expert_quant
    e = ExpertsConf(**experts)
    try:
        spec = resolve_expert_quant(mcfg, e.quant, group_size=e.group_size, mixed_count=e.mixed_count,
                                    mixed_fraction=e.mixed_fraction, mixed_high=e.mixed_high,
                                    popularity=e.popularity, trace=e.trace, activations=e.activations)
        if spec is not None:
            mcfg.replace(expert_quant=spec).architecture()        # a layout that cannot be quantised says so
    except ValueError as exc:
        raise ConfigError(str(exc) if str(exc).startswith("experts.") else f"experts.quant={e.quant}: {exc}") from None
    return spec


def capacity_bytes_of(cache: dict[str, Any]) -> int | None:
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
        raise allowed_error("cache.capacity_bytes", "a positive size (e.g. 256MiB, 2GiB) or null", raw)
    return n


def default_capacity(mcfg: ModelConfig) -> str:
    """cache.capacity when none is given: DEFAULT_CAPACITY slots (a small cache, so a run on the
    tiny models sees misses), unless that many cannot hold one token's experts or exceed the
    experts there are (DeepSeek-V3 routes to 8): then 'auto', the largest cache the budget holds."""
    return DEFAULT_CAPACITY if mcfg.top_k <= int(DEFAULT_CAPACITY) <= mcfg.n_experts else "auto"


def capacity_of(raw: Any, mcfg: ModelConfig, in_use: bool) -> int | str:
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
        raise allowed_error("cache.capacity", allowed, raw) from None
    if in_use and not mcfg.top_k <= capacity <= mcfg.n_experts:
        raise allowed_error("cache.capacity", allowed, capacity)
    return capacity

