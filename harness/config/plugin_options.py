"""Plugin options in a config: each plugin checks its own, reported against the config keys.

Owns: a placement's options (its `Options`, then its check against the model), the chosen cache
policy's (prepared by the policy itself: files read here, never after weights load), and any
other plugin family's (`plugin_options`: the prefetcher's, the engine adapter's), each error a
`ConfigError`. Does not own: turning options into Hydra nodes (harness.plugins) or what they mean
(the plugins).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ModelConfig
from engine.registry import PLACEMENTS, POLICIES, UnknownPluginError
from harness import plugins
from harness.config.schema import ConfigError, RunConf
from harness.plugins import PluginOptionsError

def placement_options_of(name: str, options: dict[str, Any], mcfg: ModelConfig) -> dict[str, Any]:
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


def policy_options_of(cache: dict[str, Any], mcfg: ModelConfig, run: RunConf) -> dict[str, Any]:
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


def plugin_options(registry: Any, key: str, name: str, options: dict[str, Any]) -> Any:
    try:
        return plugins.parse(registry, name, options, key)
    except UnknownPluginError as exc:
        raise ConfigError(f"{key}.name: {exc}") from None
    except PluginOptionsError as exc:
        raise ConfigError(str(exc)) from None

