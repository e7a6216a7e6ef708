"""Eviction policies for the device expert cache: one file per policy, built by name.

Owns: building a policy from a registry name plus options, with the options checked
against what that policy accepts. Does not own: the registry itself (`engine.registry`)
or the cache mechanism (`engine.cache`).

    from engine.policies import make_policy
    p = make_policy("lru", capacity=4, n_experts=8)
    p = make_policy("belady", capacity=4, n_experts=8, layer=2, future=trace)
"""
from __future__ import annotations

import inspect
from typing import Any

from engine.policies.base import EvictionPolicy

__all__ = ["EvictionPolicy", "make_policy", "policy_options"]

_BASE_PARAMS = ("self", "capacity", "n_experts", "layer")


def policy_options(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The extra constructor options of policy class `cls` (name -> parameter), and
    whether it also takes arbitrary `**kwargs`."""
    params = inspect.signature(cls).parameters
    opts = {
        n: p for n, p in params.items()
        if n not in _BASE_PARAMS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    return opts, any(p.kind is p.VAR_KEYWORD for p in params.values())


def make_policy(name: str, capacity: int, n_experts: int, layer: int = 0, **options: Any) -> EvictionPolicy:
    """Build the policy registered as `name` for one cache layer.

    Raises `engine.registry.UnknownPluginError` (a ValueError) listing the known names for
    an unknown `name`, and `TypeError` naming the option and the accepted ones for an
    unknown or missing option.
    """
    from engine.registry import POLICIES        # lazy: registry scans entry points

    cls = POLICIES.get(name)
    accepted, var_kw = policy_options(cls)
    listed = ", ".join(accepted) or "none"
    unknown = [k for k in options if k not in accepted]
    if unknown and not var_kw:
        raise TypeError(
            f"cache policy {name!r} got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"accepted options: {listed}"
        )
    missing = [n for n, p in accepted.items() if p.default is p.empty and n not in options]
    if missing:
        raise TypeError(
            f"cache policy {name!r} requires option(s) {', '.join(map(repr, missing))}; "
            f"accepted options: {listed}"
        )
    return cls(capacity, n_experts, layer, **options)
