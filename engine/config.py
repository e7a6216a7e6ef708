"""Model shapes: the fields every consumer reads, plus the family's own frozen dataclass.

Owns: `ModelConfig` -- common fields (family, sizes, experts, top-k, MoE layers, context,
dtype, name) and `arch`, the family-specific dataclass (`Family.Config`) whose fields read
through as attributes (`cfg.num_heads` on a GQA family) -- its validation, `replace` across
both parts, the sizes derived from the family's blocks (`expert_params`,
`non_expert_params()`, `kv_bytes_per_token()`, `state_bytes()`), and reading a Hugging Face `config.json`
(the registered family that names its architecture parses it, after `check_hf_numbers` has
checked every number in it against the types the families write). `PRESETS`: every registered
family's presets (real shapes, seeded random weights), looked up by exact name.
Does not own: any family's fields or parsing (engine.families), weights (engine.model),
memory planning (engine.planner).

    cfg = ModelConfig.from_hf_dir("path/to/checkpoint")     # reads config.json
    cfg = preset("qwen3-30b-a3b")                            # real shapes, no weights
    cfg.expert_params, cfg.kv_bytes_per_token(2), cfg.num_kv_heads
    cfg.replace(num_layers=2, moe_layers=(0, 1), num_heads=8)    # common and family fields alike
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.architecture import Architecture
    from engine.families.base import Family


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclass(frozen=True)
class ModelConfig:
    family: str                      # a name registered in engine.registry.FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    n_experts: int
    top_k: int
    moe_intermediate_size: int       # per routed expert
    arch: Any                        # the family's frozen dataclass (Family.Config): everything else
    moe_layers: tuple[int, ...] = ()  # layers with routed experts; () = all
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"     # dtype the weights were saved in
    name: str = ""
    expert_quant: Any = None         # a lossy treatment of the routed experts (engine.blocks.quant_experts.
                                     # ExpertQuant), None: exact; applied at load, after the checkpoint is read
    weight_format: str = ""          # the format the weights are published in (engine.formats; "": torch_dtype),
                                     # e.g. "fp8" for DeepSeek-V3's block-scaled FP8
    # the bytes of the weights in the format an engine holds them in (engine.formats.WeightBytes), which the
    # planner and the cost model count in place of the blocks' dense bytes; None: the blocks' own. Only a
    # config that is planned or predicted carries it, never one an engine loads
    weight_bytes: Any = None

    def __post_init__(self) -> None:
        fam = family_class(self.family)
        if not isinstance(self.arch, fam.Config):
            raise TypeError(f"family {self.family!r} takes arch={fam.Config.__name__}(...), "
                            f"got {type(self.arch).__name__}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))
        if any(not 0 <= l < self.num_layers for l in self.moe_layers):
            raise ValueError(f"moe_layers must lie in [0, num_layers={self.num_layers}), got {self.moe_layers}")

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: the family's fields read through
        if name.startswith("__") or "arch" not in self.__dict__:
            raise AttributeError(name)
        arch = self.__dict__["arch"]
        if name in {f.name for f in dataclasses.fields(arch)}:
            return getattr(arch, name)
        raise AttributeError(f"{self.family} model config has no field {name!r}; common fields: "
                             f"{', '.join(COMMON_FIELDS)}; {self.family} fields: {', '.join(_fields(arch))}")

    # --- building and changing ---------------------------------------------------------
    @classmethod
    def of(cls, family: str, **fields: Any) -> "ModelConfig":
        """A config from flat fields: common ones here, the rest into the family's dataclass."""
        fam = family_class(family)
        common, own = _split(fields, fam.Config, family)
        return cls(family=family, arch=fam.Config(**own), **common)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with common and family fields changed alike; a new `family` keeps the fields its
        dataclass shares with the old one (the same shape in another family)."""
        family = changes.pop("family", self.family)
        fam = family_class(family)
        arch = changes.pop("arch", None)
        common, own = _split(changes, fam.Config, family)
        if arch is None:
            if isinstance(self.arch, fam.Config):
                arch = dataclasses.replace(self.arch, **own)
            else:
                carried = {k: v for k, v in dataclasses.asdict(self.arch).items() if k in _fields(fam.Config)}
                arch = fam.Config(**{**carried, **own})
        return dataclasses.replace(self, family=family, arch=arch, **common)

    # --- what the family's blocks say ------------------------------------------------------
    @property
    def family_class(self) -> "type[Family]":
        return family_class(self.family)

    def architecture(self) -> "Architecture":
        """This model's blocks, without weights (fresh each call: the model fills them)."""
        return self.family_class.architecture(self)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return _sizes(self)[0]

    def non_expert_params(self) -> int:
        """Everything except routed experts: embeddings, attention, norms, routers, dense and shared MLPs."""
        return _sizes(self)[1]

    def expert_bytes(self, dtype_bytes: int) -> int:
        """Stored bytes one routed expert moves at `dtype_bytes` per element, under `expert_quant`
        (a quantised expert's packed buffer; a mixed treatment's mean over every expert, rounded):
        the one figure the cost model and the roofline use. The planner's slot size is
        `architecture().experts.nbytes`, the largest expert. With `weight_bytes`: its mean expert."""
        if self.weight_bytes is not None:
            return int(round(self.weight_bytes.expert_mean))
        return _expert_bytes(self, dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int, kv_dtype: str | None = None) -> int:
        """State bytes per token of one sequence over the layers whose state grows with the whole
        context (full KV, a latent), stored in `kv_dtype` (engine.kvquant: payload + scales); a
        sliding window's bounded KV and a recurrent layer's fixed state are not per token:
        `state_bytes` counts every layer's term."""
        return sum(t.per_token for t in self.architecture().state_terms(dtype_bytes, kv_dtype) if t.max_tokens is None)

    def state_bytes(self, context: int, batch: int, dtype_bytes: int, kv_dtype: str | None = None) -> int:
        """Every layer's session state for `batch` sequences of `context` tokens, as the planner
        counts it (per token, bounded by a window, or fixed per sequence)."""
        return sum(t.bytes(context, batch) for t in self.architecture().state_terms(dtype_bytes, kv_dtype))

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    # --- Hugging Face config.json ---------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "", source: str = "config.json") -> "ModelConfig":
        """ValueError naming `source` and the key for a number of the wrong type or range."""
        from engine.quant import block_fp8
        check_hf_numbers(d, source)
        cfg = family_for_hf(d).parse(d, name)
        return cfg.replace(weight_format="fp8") if block_fp8(d) is not None else cfg

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: cannot read it ({exc})") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
        if not isinstance(d, dict):
            raise ValueError(f"{p}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_hf_dict(d, name=Path(path).name, source=str(p))
        except KeyError as exc:
            raise ValueError(f"{p}: missing key {exc} that the {d.get('model_type')!r} family needs") from None
        except (TypeError, AttributeError) as exc:  # a value of a type the checks above do not know the key of
            raise ValueError(f"{p}: a value has a type the {d.get('model_type')!r} family cannot read "
                             f"({exc})") from None


COMMON_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("family", "arch"))


def _fields(cls_or_obj: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls_or_obj))


def _split(fields: dict[str, Any], config_cls: type, family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    own_names = _fields(config_cls)
    unknown = sorted(set(fields) - set(COMMON_FIELDS) - set(own_names))
    if unknown:
        raise TypeError(f"unknown model field(s) {unknown}; common fields: {', '.join(COMMON_FIELDS)}; "
                        f"{family} fields: {', '.join(own_names)}")
    return ({k: v for k, v in fields.items() if k in COMMON_FIELDS},
            {k: v for k, v in fields.items() if k in own_names})


@functools.lru_cache(maxsize=256)
def _sizes(cfg: ModelConfig) -> tuple[int, int]:
    arch = cfg.architecture()
    return arch.experts.params, arch.non_expert_params()


@functools.lru_cache(maxsize=256)
def _expert_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    return int(round(cfg.architecture().experts.mean_nbytes(dtype_bytes, cfg.n_experts, cfg.moe_layers)))


# --- numbers in config.json ------------------------------------------------------------
# keys whose absence a parser may default but whose null or value below 1 no parser can use
HF_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
               "num_local_experts", "num_experts", "n_routed_experts", "max_position_embeddings")
_NUMBER_KEYS: dict[tuple[str, ...], dict[str, type]] = {}


def hf_number_keys() -> dict[str, type]:
    """config.json keys the registered families read as numbers (a nested key as `outer.inner`) ->
    int or float: the types the families' own `hf_config` write them with for their presets, so the
    table grows with the families and never lists a key by hand (int wherever written: int; a float
    anywhere: float; a key some family writes as a bool, string or list is not a number key)."""
    from engine.registry import FAMILIES
    names = tuple(FAMILIES.names())
    if names not in _NUMBER_KEYS:
        seen: dict[str, set[type]] = {}
        for cfg in PRESETS.values():
            for key, value in _flat(cfg.family_class.hf_config(cfg)):
                if value is not None:
                    seen.setdefault(key, set()).add(type(value))
        _NUMBER_KEYS[names] = {k: float if float in t else int for k, t in seen.items() if t <= {int, float}}
    return _NUMBER_KEYS[names]


def _flat(d: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in d.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def check_hf_numbers(d: Mapping[str, Any], source: str = "config.json") -> None:
    """Every number key (`hf_number_keys`) present in config.json `d` holds a number of its kind:
    an int (>= 1 for `HF_POSITIVE`, >= 0 otherwise) or a finite float >= 0; null only where a
    parser defaults it. ValueError naming `source`, the key, the value and what is allowed."""
    kinds = hf_number_keys()
    for key, value in _flat(d):
        kind = kinds.get(key)
        if kind is None:
            continue
        positive = key in HF_POSITIVE
        if value is None and not positive:
            continue
        low = 1 if positive else 0
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            allowed = f"an integer >= {low}"
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and value >= low
            allowed = f"a finite number >= {low}"
        if not ok:
            raise ValueError(f"{source}: {key} must be {allowed}{'' if positive else ' or null'}, "
                             f"got {json.dumps(value)}")
    check_hf_objects(d, source)


# object keys of config.json's older Hub form, which no family's `hf_config` writes (so
# `hf_number_keys` cannot find them) but whose parsers read inside them
HF_OLD_OBJECTS = ("rope_scaling",)


def check_hf_objects(d: Mapping[str, Any], source: str = "config.json") -> None:
    """Every key the families read numbers inside (`rope_parameters` of `rope_parameters.rope_theta`,
    and `HF_OLD_OBJECTS`) holds a JSON object or null, never a string or number a parser would
    call `.get` on. ValueError naming `source`, the key and the value."""
    outer = {k.rsplit(".", i)[0] for k in hf_number_keys() for i in range(1, k.count(".") + 1)}
    for key in sorted(outer | set(HF_OLD_OBJECTS), key=lambda k: (k.count("."), k)):   # outer keys first
        value: Any = d
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{source}: {key} must be a JSON object or null, got {json.dumps(value)}")


# --- families ------------------------------------------------------------------------
def family_class(name: str) -> "type[Family]":
    """The registered family `name` (UnsupportedModelError listing the registered ones)."""
    from engine.registry import FAMILIES, UnknownPluginError
    try:
        return FAMILIES.get(name)
    except UnknownPluginError as exc:
        raise UnsupportedModelError(str(exc)) from None


def family_for_hf(d: dict[str, Any]) -> "type[Family]":
    """The registered family whose `architectures` (first) or `model_types` name this config.json."""
    from engine.registry import FAMILIES
    fams = [FAMILIES.get(n) for n in FAMILIES.names()]
    archs = d.get("architectures") or []
    for a in archs:
        for fam in fams:
            if a in fam.architectures:
                return fam
    for fam in fams:
        if d.get("model_type") in fam.model_types:
            return fam
    raise UnsupportedModelError(
        f"unsupported architecture {archs or d.get('model_type')!r}; registered: "
        f"{sorted(a for f in fams for a in f.architectures)} "
        f"(model_type {sorted(t for f in fams for t in f.model_types)}); a new family registers in "
        f"engine.registry.FAMILIES or the entry-point group 'moebench.families' (engine/families/README.md)")


# --- presets: real shapes for sizing runs, seeded random weights ---------------------
class _Presets(Mapping[str, ModelConfig]):
    """Every registered family's presets, gathered on first use (families import lazily)."""

    def __init__(self) -> None:
        self._table: dict[str, ModelConfig] = {}
        self._families: list[str] | None = None      # the families the table was gathered from

    def _load(self) -> dict[str, ModelConfig]:
        from engine.registry import FAMILIES
        names = FAMILIES.names()
        if names != self._families:                  # first use, or a family registered since
            table: dict[str, ModelConfig] = {}
            for name in names:
                for key, cfg in FAMILIES.get(name).presets().items():
                    if key in table:
                        raise ValueError(f"preset {key!r} is defined by families {table[key].family!r} and {name!r}")
                    table[key] = cfg
            self._table, self._families = table, names
        return self._table

    def __getitem__(self, name: str) -> ModelConfig:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


PRESETS: Mapping[str, ModelConfig] = _Presets()


def preset(name: str) -> ModelConfig:
    """Exact-name lookup in PRESETS, then in the checkpoints shipped with moebench (engine.shipped:
    their config.json, so a shipped model is planned and predicted by name like a preset)."""
    if name not in PRESETS:
        from engine.shipped import shipped_checkpoint
        ckpt = shipped_checkpoint(name)
        if ckpt is not None:
            return ModelConfig.from_hf_dir(ckpt).replace(name=name)
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))} "
                         "(or pass a Hugging Face checkpoint directory)")
    return PRESETS[name]
