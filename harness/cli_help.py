"""`moebench --help`: the usage lines and sub-commands, the pass list, the config groups with
their options, and the config a run would compose -- without loading what a run loads.

Owns: the help text (each registered engine's sub-commands from its adapter's declaration). Hydra's own `--help` lists every group, its own included, by copying its
whole config repository once per group (seconds for moebench's), and a run's modules (torch,
pandas, the llama.cpp adapter) are loaded by neither this nor composing the config: a plugin
group's options are registry names, each plugin's schema built only for the option a config
chooses (harness.plugins.LazyNode). Does not own: the sub-commands (harness.cli.COMMANDS, whose
usage lines are harness.cli's docstring), the passes (harness.passes.describe), the groups and
their schemas (harness.config, conf/).

    moebench --help                     # the default config
    moebench --help placement=hybrid    # the config these overrides compose (sweeps: their first value)
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def usage(cli_doc: str) -> str:
    """The usage paragraph of harness.cli's docstring (one line per command), the registered
    engines' sub-commands in the same layout, and the pass list."""
    from harness.engines.registry import commands
    from harness.passes import describe
    lines = cli_doc.split("\n\n")[1].splitlines()
    column = min(line.index("#") for line in lines if "#" in line)
    for words, command in commands().items():
        lines.append(f"    moebench {words} {command.args}".rstrip().ljust(column) + f"# {command.summary}")
    text = "\n".join(lines)
    return (f"== Usage ==\n{text}\n\n`moebench <command> --help` shows a command's own options; a run's options are "
            f"the overrides below (group=option, key=value).\n\n{describe()}\n")


def group_options(conf_dir: str, groups: Sequence[str]) -> dict[str, list[str]]:
    """Each group's options: those in Hydra's ConfigStore (schemas, registered plugins) and the
    group's YAML files under `conf_dir`."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.object_type import ObjectType
    store = ConfigStore.instance()
    out = {}
    for group in groups:
        stored = store.list(group) if store.get_type(group) == ObjectType.GROUP else []
        files = [p.name for p in (Path(conf_dir) / group).glob("*.yaml")]
        out[group] = sorted({n.removesuffix(".yaml") for n in [*stored, *files]})
    return out


def first_values(overrides: Sequence[str]) -> list[str]:
    """The overrides as one job: a sweep's first value (`placement=fetch,cpu` -> placement=fetch)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    out = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        out.append(f"{o.key_or_group}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                   else o.input_line)
    return out


def config_help(cfg: DictConfig, conf_dir: str) -> str:
    """The groups (those the composed config chose an option of) and the config itself."""
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
    options = group_options(conf_dir, sorted(choices))
    groups = "\n".join(f"{g} (now {choices[g] or 'none'}): {', '.join(opts)}" for g, opts in options.items())
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return ("== Configuration groups ==\nCompose the configuration from these groups (group=option)\n\n"
            f"{groups}\n\n== Config ==\nOverride anything in the config (key=value; -m and a,b,c sweep it)\n\n"
            f"{OmegaConf.to_yaml(job)}")
