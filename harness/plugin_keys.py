"""A plugin's option set beside other plugins of its family in one sweep:
`moebench -m placement=resident,hybrid placement.n_cpu_layers=2`.

Owns: finding the plugin options a command sets (`placement.<option>`, `engine.<option>`,
`prefetch.options.<option>`) that a plugin it chooses does not have, and what happens then. In a
sweep (-m) over several plugins of the group, the option applies to those that have it: the
override is handed to Hydra as its force-add `++key=value` (so every job composes) and each job
whose plugin lacks it runs without it (`drop_not_applicable`; its manifest keeps the override
among its `overrides`, its resolved `config` without it). Anywhere else -- a single run, or a
sweep where no chosen plugin has it -- it is refused in one line that names the plugins which do
have it (Hydra's own hint, `+key=value`, is refused too: a schema's keys are fixed). Written
`++key=value` by hand, it means "where it applies" in a single run as well. Does not own:
composing (Hydra), checking the values (harness.config), the plugin families (harness.plugins).

    overrides = scope_options(["placement=resident,hybrid", "placement.n_cpu_layers=2"], True, compose)
    # ['placement=resident,hybrid', '++placement.n_cpu_layers=2']
    drop_not_applicable(cfg, overrides)   # a resident job's cfg: ['++placement.n_cpu_layers=2']
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, open_dict

from harness.config import ConfigError
from harness.plugins import PluginGroup, plugin_groups

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

FORCE_ADD = "++"


class OptionScopeError(ConfigError):
    """A plugin option that no chosen plugin of its group has; the message names those that do."""


def _prefix(fam: PluginGroup) -> str:
    return f"{fam.group}.options." if fam.nested else f"{fam.group}."


def _option_of(key: str) -> tuple[PluginGroup, str] | None:
    """(family, option) for an override key that sets a plugin's option; None for any other key."""
    for fam in plugin_groups():
        option = key.removeprefix(_prefix(fam))
        if option != key and option and option != "name" and "." not in option:
            return fam, option
    return None


def options_of(fam: PluginGroup, plugin: str) -> list[str]:
    """The option names of `plugin` of family `fam` (its `Options` dataclass)."""
    return [f.name for f in dataclasses.fields(fam.registry.get(plugin).Options)]


def _values(o: Override) -> list[str]:
    return list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]


def scope_options(overrides: Sequence[str], multirun: bool, compose: Callable[[list[str]], DictConfig]) -> list[str]:
    """`overrides` with each plain plugin option that some chosen plugin of its group lacks made
    Hydra's `++key=value`, where `multirun` and another chosen plugin has it; raises
    OptionScopeError otherwise. `compose(overrides)`: the config with Hydra's node (asked only
    for a group the overrides do not choose: its default, or an experiment's). Overrides Hydra
    cannot parse are left to Hydra, which says so."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return list(overrides)
    options = [(i, o, found) for i, o in enumerate(parsed)
               if o.type == OverrideType.CHANGE and not o.key_or_group.startswith("hydra")
               and (found := _option_of(o.key_or_group)) is not None]
    if not options:
        return list(overrides)
    out = list(overrides)
    set_here = {i for i, *_ in options}
    rest = [o.input_line for j, o in enumerate(parsed) if j not in set_here and not o.is_sweep_override()]
    choices: dict[str, list[str]] = {}
    for i, o, (fam, option) in options:
        if fam.group not in choices:
            named = [v for p in parsed if p.key_or_group == fam.group for v in _values(p)]
            choices[fam.group] = named or chosen_by(compose(rest), fam.group)
        chosen = choices[fam.group]
        lacking = [p for p in chosen if option not in options_of(fam, p)]
        if not lacking:
            continue
        if multirun and len(lacking) < len(chosen):
            out[i] = FORCE_ADD + overrides[i]
            continue
        raise OptionScopeError(_refusal(fam, option, overrides[i], lacking))
    return out


def _refusal(fam: PluginGroup, option: str, given: str, lacking: list[str]) -> str:
    kind = fam.registry.kind
    having = [p for p in fam.registry.names() if option in options_of(fam, p)]
    own = "; ".join(f"{p}: {', '.join(options_of(fam, p)) or 'none'}" for p in lacking)
    if not having:
        every = "; ".join(f"{p}: {', '.join(options_of(fam, p)) or 'none'}" for p in fam.registry.names())
        return f"{given}: no {kind} has an option {option!r}; the options of each: {every}"
    value = given.split("=", 1)[1]
    which = f"{kind} {lacking[0]!r} has" if len(lacking) == 1 else \
        f"{kind}s {', '.join(map(repr, lacking[:-1]))} and {lacking[-1]!r} have"
    return (f"{given}: {which} no option {option!r} ({'its' if len(lacking) == 1 else 'their'} options: {own}); "
            f"the {kind}s that have it: {', '.join(having)} (e.g. {fam.group}={having[0]} {_prefix(fam)}{option}="
            f"{value}); beside other {kind}s in a sweep (-m {fam.group}={lacking[0]},{having[0]} "
            f"{_prefix(fam)}{option}={value}) it applies to those that have it")


def chosen_by(cfg: DictConfig, group: str) -> list[str]:
    """The plugins a composed config (with Hydra's node) chooses for `group`: its choice, or the
    ones an experiment's sweep (hydra.sweeper.params) runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = (cfg.hydra.sweeper.params or {}).get(group)
    if swept is not None:
        return _values(OverridesParser.create().parse_overrides([f"{group}={swept}"])[0])
    return [cfg.hydra.runtime.choices[group]]


def drop_not_applicable(cfg: DictConfig, overrides: Sequence[str]) -> list[str]:
    """Remove from `cfg` every option a `++<group>.<option>=...` override added that the job's
    plugin of that group does not have; the overrides that did not apply, as given."""
    dropped = []
    for given in overrides:
        if not given.startswith(FORCE_ADD):
            continue
        key = given[len(FORCE_ADD):].split("=", 1)[0]
        found = _option_of(key)
        if found is None:
            continue
        fam, option = found
        node = cfg.get(fam.group)
        if not isinstance(node, DictConfig) or option in options_of(fam, node.get("name")):
            continue
        target = node.get("options") if fam.nested else node
        if isinstance(target, DictConfig) and option in target:
            with open_dict(target):
                del target[option]
            dropped.append(given)
    return dropped


def not_applicable_line(cfg: Any, dropped: Sequence[str]) -> str:
    """The line a job prints for the options that do not apply to it."""
    shown = ", ".join(d[len(FORCE_ADD):] for d in dropped)
    plugins = {(_option_of(d[len(FORCE_ADD):].split("=", 1)[0]) or (None,))[0] for d in dropped}
    which = ", ".join(f"{f.group}={cfg[f.group].name}" for f in plugins if f is not None)
    return f"not applicable to {which}: {shown} (this job runs without it)"
