"""Lazy plugin registries: name -> "module:Class".

Owns: looking up placement strategies, eviction policies, prefetchers and model families by
name, including third-party ones declared through the entry-point groups
`moebench.placements`, `moebench.policies`, `moebench.prefetchers` and `moebench.families`
(a family also names the Hugging Face architectures it reads: engine.families), and `NoOptions`,
the options of a plugin that takes none (each plugin declares an `Options` dataclass: the
harness turns it into the plugin's Hydra schema). Does not own: constructing them with
options (callers do).

    from engine.registry import PLACEMENTS
    cls = PLACEMENTS.get("fetch")          # imports engine.placements.fetch lazily
    PLACEMENTS.names()                     # ['cpu', 'fetch', 'hybrid', 'resident', 'resident_grouped', 'stream', ...]

An unknown name raises `UnknownPluginError` listing the known ones.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points


class UnknownPluginError(ValueError):
    """A plugin name that no registry entry or entry point provides."""


@dataclass(frozen=True)
class NoOptions:
    """The `Options` of a plugin that takes none (every plugin family's default)."""


def require_bool(name: str, value: object) -> None:
    """An `Options` field that must be a bool (a config's "yes" or 1 is refused, not read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


class Registry:
    def __init__(self, kind: str, group: str, builtins: dict[str, str]) -> None:
        self.kind = kind
        self.group = group
        self._targets: dict[str, str] = dict(builtins)
        self._loaded: dict[str, type] = {}
        self._scanned = False

    def register(self, name: str, target: str | type) -> None:
        """Add a plugin: `target` is a class or a "module:Class" string."""
        if isinstance(target, str):
            self._targets[name] = target
            self._loaded.pop(name, None)
        else:
            self._targets[name] = f"{target.__module__}:{target.__qualname__}"
            self._loaded[name] = target

    def _scan_entry_points(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        for ep in entry_points(group=self.group):
            self._targets.setdefault(ep.name, ep.value)

    def names(self) -> list[str]:
        self._scan_entry_points()
        return sorted(self._targets)

    def get(self, name: str) -> type:
        if name in self._loaded:
            return self._loaded[name]
        self._scan_entry_points()
        if name not in self._targets:
            raise UnknownPluginError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())} "
                f"(third-party plugins register in the entry-point group {self.group!r})"
            )
        module, _, attr = self._targets[name].partition(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        self._loaded[name] = obj
        return obj


PLACEMENTS = Registry(
    "placement",
    "moebench.placements",
    {
        "resident": "engine.placements.resident:Resident",
        "resident_grouped": "engine.placements.resident_grouped:ResidentGrouped",
        "fetch": "engine.placements.fetch:Fetch",
        "cpu": "engine.placements.cpu:CPUExperts",
        "hybrid": "engine.placements.hybrid:Hybrid",
        "stream": "engine.placements.stream:Stream",
    },
)

POLICIES = Registry(
    "cache policy",
    "moebench.policies",
    {
        "lru": "engine.policies.lru:LRU",
        "lfu": "engine.policies.lfu:LFU",
        "fifo": "engine.policies.fifo:FIFO",
        "static": "engine.policies.static:Static",
        "belady": "engine.policies.belady:Belady",
        "lfru": "engine.policies.lfru:LFRU",
    },
)

PREFETCHERS = Registry(
    "prefetch",
    "moebench.prefetchers",
    {
        "none": "engine.prefetch.none:NoPrefetch",
        "next_layer_gate": "engine.prefetch.next_layer_gate:NextLayerGate",
        "trace_oracle": "engine.prefetch.trace_oracle:TraceOracle",
    },
)

FAMILIES = Registry(
    "model family",
    "moebench.families",
    {
        "mixtral": "engine.families.mixtral:Mixtral",
        "qwen2_moe": "engine.families.qwen2_moe:Qwen2Moe",
        "qwen3_moe": "engine.families.qwen3_moe:Qwen3Moe",
        "olmoe": "engine.families.olmoe:Olmoe",
        "deepseek_v3": "engine.families.deepseek_v3:DeepseekV3",
        "glm4_moe": "engine.families.glm4_moe:Glm4Moe",
        "qwen3_next": "engine.families.qwen3_next:Qwen3Next",
        "qwen3_5_moe": "engine.families.qwen3_next:Qwen35Moe",
        "gpt_oss": "engine.families.gpt_oss:GptOss",
        "gemma4": "engine.families.gemma4:Gemma4",
    },
)
