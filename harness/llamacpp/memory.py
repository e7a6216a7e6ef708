"""What llama.cpp holds in device memory, for the plan: its weights' bytes and its transient rule.

Owns, for `engine=llamacpp` (its adapter's `held_weights` and `transient_rule`):
- the weights as llama.cpp holds them: a GGUF file's own per-tensor types and sizes, read from
  its header with the pinned gguf-py's reader (`gguf_weight_bytes`: no tensor data is read), or
  the GGUF type the job converts to (`engine.weights`, else `model.weight_format`, else the model
  dtype's own type, as the converter writes it: a published FP8 checkpoint dequantised, gpt-oss's
  MXFP4 experts kept), counted by engine.formats' recipes;
- its transient memory: ggml computes activations in fp32, and with flash attention (on, or auto:
  llama.cpp's default) no [heads, ubatch, context] score matrix exists, so there is no O(context^2)
  workspace; with `-fa off` the scores are materialised, planned at this engine's worst-case bound.
  Its compute buffer is sized for one micro-batch of min(-ub, -c) tokens, as ours (-ub is
  `workload.ubatch`, checked against -b by its flags).
Does not own: the arithmetic (engine.planner, engine.formats), converting, running llama.cpp.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.formats import WeightBytes
    from engine.planner import TransientRule
    from harness.config.schema import RunSpec

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(?:gate_up|gate|up|down)_exps\.")   # a layer's routed experts


def gguf_weight_bytes(path: str | Path, cfg: ModelConfig) -> WeightBytes:
    """The weights of GGUF file `path` as its header declares them: routed experts (`blk.N.ffn_*_exps.*`)
    per MoE layer over cfg.n_experts, everything else non-expert. ValueError when the file is not a
    GGUF or its experts do not have `cfg`'s shapes (layers, elements per expert)."""
    from engine.formats import WeightBytes
    from harness.llamacpp.source import gguf_module
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"model.gguf: no such file: {str(path)!r}")
    try:
        reader = gguf_module().GGUFReader(str(p), "r")
    except (ValueError, OSError) as exc:
        raise ValueError(f"model.gguf: {p.name} is not a readable GGUF file ({exc})") from None
    per_layer: dict[int, int] = {}
    elements: dict[int, int] = {}
    non_expert = 0
    by_type: Counter[str] = Counter()
    expert_types: Counter[str] = Counter()       # the routed experts' parameters per type
    for t in reader.tensors:
        by_type[t.tensor_type.name.lower()] += int(t.n_bytes)
        m = EXPERT_TENSOR.match(t.name)
        if m is None:
            non_expert += int(t.n_bytes)
            continue
        expert_types[t.tensor_type.name.lower()] += int(t.n_elements)
        layer = int(m.group(1))
        per_layer[layer] = per_layer.get(layer, 0) + int(t.n_bytes)
        elements[layer] = elements.get(layer, 0) + int(t.n_elements)
    E = cfg.n_experts
    if sorted(per_layer) != sorted(cfg.moe_layers):
        raise ValueError(f"model.gguf: {p.name} holds routed experts in layers {sorted(per_layer)}, the model "
                         f"({cfg.name or cfg.family}) in {list(cfg.moe_layers)}; give the model the file was made from")
    bad = {layer: n // E for layer, n in elements.items() if n != E * cfg.expert_params}
    if bad:
        raise ValueError(f"model.gguf: {p.name}'s experts hold {sorted(set(bad.values()))} values each, the model's "
                         f"{cfg.expert_params} ({E} experts per layer); give the model the file was made from")
    slot = max(-(-b // E) for b in per_layer.values())
    mean = sum(per_layer.values()) / (len(per_layer) * E)
    total = sum(by_type.values())
    mix = ", ".join(f"{name} {100 * b / total:.0f}%" for name, b in by_type.most_common())
    return WeightBytes(non_expert, slot, mean, f"GGUF {p.name}: {mix} of bytes", source="gguf header",
                       expert_type=expert_types.most_common(1)[0][0])


def held_weights(spec: RunSpec) -> tuple[WeightBytes, str]:
    """The weights as llama.cpp holds them for this job (module docstring); ValueError for a format it
    does not hold or contradictory keys."""
    from engine.dtypes import dtype_bytes
    from engine.formats import GGUF_TYPES, RECIPES, WeightFormat, canonical, published, weight_bytes

    m, opts = spec.model, spec.engine_options
    if m.gguf:
        given = {k: v for k, v in (("model.weight_format", m.weight_format), ("model.expert_format", m.expert_format),
                                   ("engine.weights", opts.weights)) if v}
        if given:
            raise ValueError(f"model.gguf: the file's header gives the formats; allowed with it: "
                             f"{', '.join(f'{k}=null' for k in given)}; got {given}")
        wb = gguf_weight_bytes(m.gguf, spec.model_config)
        return wb, f"{wb.label} (its header)"
    if opts.weights and m.weight_format and canonical(opts.weights) != canonical(m.weight_format):
        raise ValueError(f"model.weight_format={m.weight_format} and engine.weights={opts.weights} disagree: "
                         "engine=llamacpp converts to one type; give one, or the same in both")
    pub = published(spec.model_config)
    asked = opts.weights or m.weight_format
    if asked is None:
        own = opts.weights_for(spec.dtype)
        experts = m.expert_format or (pub.experts if pub.experts in GGUF_TYPES else None)
        fmt = WeightFormat(own, experts)
        how = "converted at model.dtype" + (f"; published {pub.weights}, dequantised by the converter"
                                             if pub.weights != own else "")
    else:
        fmt = WeightFormat(asked, m.expert_format)
        how = "engine.weights" if opts.weights else "model.weight_format"
    if not fmt.gguf:
        raise ValueError(f"model.weight_format={m.weight_format} model.expert_format={m.expert_format}: engine=llamacpp "
                         f"holds GGUF types; allowed: {', '.join(GGUF_TYPES)} or recipes {', '.join(RECIPES)}")
    return weight_bytes(spec.model_config, fmt, dtype_bytes(spec.dtype)), f"{fmt.label} ({how})"


def transient_rule(spec: RunSpec) -> TransientRule:
    """llama.cpp's activations and attention workspace under the job's -fa (module docstring)."""
    from engine.planner import TransientRule
    fa = spec.engine_options.flags(spec.workload.ubatch, None, None, spec.kv_dtype, spec.dtype).flash_attn
    if fa == "off":
        return TransientRule("llama.cpp -fa off: scores materialised, this engine's bound", activation_bytes=4)
    return TransientRule(f"llama.cpp -fa {fa or 'auto, its default'}: no score matrix", activation_bytes=4,
                         workspace=_no_workspace)


def _no_workspace(*_: Any) -> int:
    return 0
