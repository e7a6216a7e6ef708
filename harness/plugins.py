"""Plugin families end to end: each plugin's `Options` dataclass *is* its Hydra schema.

Owns: turning the registries (engine.registry.PLACEMENTS, POLICIES, PREFETCHERS and
harness.engines.registry.ENGINES, entry-point plugins included) into Hydra config-group nodes at startup,
and checking a composed group's values with the plugin's own `Options` (its `__post_init__`
checks included), reported against the config keys. A plugin is one file plus its registration;
nothing here names a plugin.

  placement=<name>       node {name, <Options fields>}          placement.n_cpu_layers=2
  prefetch=<name>        node {name, options: {<Options>}}      prefetch.options.<field>=...
  engine=<name>          node {name, <Options fields>}          engine.n_cpu_moe=4
  cache.policy_options   one node holding every policy's option fields (each defaulting to
                         null); only the chosen policy's may be set   cache.policy_options.trace=FILE

Does not own: the fixed groups (harness.config) or what the options mean (the plugins).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigNode

from engine.registry import PLACEMENTS, POLICIES, PREFETCHERS, Registry


class PluginOptionsError(ValueError):
    """A plugin's options are wrong; the message names the key, what is allowed and what was given."""


@dataclass
class PluginConf:
    """The base of every plugin group node: which plugin (generated subclasses add its options)."""

    name: str = ""


def _fields(options_cls: type) -> list[tuple[str, Any, Any]]:
    """(name, type, dataclasses.field) of an Options dataclass, types resolved, defaults kept."""
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            raise TypeError(f"{options_cls.__qualname__}.{f.name}: a plugin option needs a default (Hydra schema)")
        out.append((f.name, hints[f.name], default))
    return out


def _ident(*parts: str) -> str:
    return "_".join(p.replace("-", "_").replace(".", "_") for p in parts)


def flat_schema(kind: str, name: str, options_cls: type) -> type:
    """{name, <option fields>}: the group node of a placement or an engine."""
    return make_dataclass(_ident(kind, name, "Conf"), [("name", str, field(default=name)), *_fields(options_cls)],
                          bases=(PluginConf,))


def nested_schema(kind: str, name: str, options_cls: type) -> type:
    """{name, options: {<option fields>}}: the group node of a prefetcher."""
    opts = make_dataclass(_ident(kind, name, "Options"), _fields(options_cls))
    return make_dataclass(_ident(kind, name, "Conf"), [("name", str, field(default=name)),
                                                        ("options", opts, field(default_factory=opts))],
                          bases=(PluginConf,))


def policy_options_schema() -> type:
    """One node with every registered policy's option fields, each Optional and null by default."""
    merged: dict[str, tuple[Any, str]] = {}
    for name in POLICIES.names():
        for fname, ftype, _ in _fields(POLICIES.get(name).Options):
            if fname in merged and merged[fname][0] != ftype:
                raise TypeError(f"cache policies {merged[fname][1]!r} and {name!r} both declare option {fname!r} "
                                f"with different types ({merged[fname][0]} vs {ftype})")
            merged.setdefault(fname, (ftype, name))
    return make_dataclass("PolicyOptionsConf", [(f, Optional[t], field(default=None)) for f, (t, _) in merged.items()])


def parse(registry: Registry, name: str, values: dict[str, Any], key: str) -> Any:
    """`registry`'s plugin `name` built from `values` with its Options (None values = not given)."""
    cls = registry.get(name)
    allowed = [f.name for f in dataclasses.fields(cls.Options)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise PluginOptionsError(f"{key}: {registry.kind} {name!r} has no option(s) {unknown}; allowed: {allowed or 'none'}")
    try:
        return cls.Options(**values)
    except (TypeError, ValueError) as exc:
        raise PluginOptionsError(f"{key} ({registry.kind} {name!r}): {exc}") from None


def chosen_policy_options(policy: str, values: dict[str, Any]) -> Any:
    """The chosen policy's Options from the merged node: fields of other policies must stay null."""
    cls = POLICIES.get(policy)
    mine = {f.name for f in dataclasses.fields(cls.Options)}
    stray = sorted(k for k, v in values.items() if v is not None and k not in mine)
    if stray:
        raise PluginOptionsError(f"cache.policy_options: {stray} do not apply to cache.policy={policy}; "
                                 f"its options: {sorted(mine) or 'none'}")
    return parse(POLICIES, policy, {k: v for k, v in values.items() if k in mine and v is not None},
                 "cache.policy_options")


@dataclass(frozen=True)
class PluginGroup:
    group: str            # the Hydra group
    registry: Registry
    nested: bool          # options under `<group>.options` (prefetch) or flat in the group node


def plugin_groups() -> list[PluginGroup]:
    from harness.engines.registry import ENGINES
    return [PluginGroup("placement", PLACEMENTS, False), PluginGroup("prefetch", PREFETCHERS, True),
            PluginGroup("engine", ENGINES, False)]


class LazyNode(ConfigNode):
    """One plugin's option in its Hydra group, its node built from the plugin's `Options` when
    Hydra first reads it. Hydra reads the node only of the options a config chooses, so listing a
    group (`moebench --help`, an unknown option's error) or composing the default config imports
    no other plugin: an adapter that loads torch or llama.cpp's tooling costs its import only to
    a run that chooses it. It stands where ConfigStore.store would put a ConfigNode; Hydra's
    ConfigStore.load copies it (`copy.copy`) and reads `node`, so the built node is kept in a
    dict every copy shares."""

    def __init__(self, fam: PluginGroup, plugin: str) -> None:     # no `node` yet: __getattr__ builds it
        self.name, self.group, self.package, self.provider = f"{plugin}.yaml", fam.group, None, None
        self.fam, self.plugin, self.built = fam, plugin, {}

    def __getattr__(self, attr: str) -> Any:       # only for what __init__ did not set: `node`
        if attr != "node":
            raise AttributeError(attr)
        if "node" not in self.built:
            from omegaconf import OmegaConf
            make = nested_schema if self.fam.nested else flat_schema
            self.built["node"] = OmegaConf.structured(make(self.fam.group, self.plugin,
                                                           self.fam.registry.get(self.plugin).Options))
        return self.built["node"]


def register(store: Any) -> None:
    """Store every registered plugin of every family as an option of its Hydra group, its node
    built when first read (LazyNode)."""
    for fam in plugin_groups():
        store.repo[fam.group] = {f"{name}.yaml": LazyNode(fam, name) for name in fam.registry.names()}
