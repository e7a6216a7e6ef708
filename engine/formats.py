"""Weight formats: how many bytes a model's weights take in the format an engine holds them in.

Owns:
- `TYPES`: each format's bytes per block of weights along a row -- the GGUF types at the sizes
  the pinned gguf-py's GGML_QUANT_SIZES gives (tests/llamacpp/test_gguf_formats.py checks every one
  against it), plus DeepSeek-V3's block-scaled FP8 (e4m3 values, one fp32 scale per 128 x 128
  block: `FP8_BLOCK`) and MXFP4 (as gpt-oss publishes: 4-bit values, one E8M0 exponent byte per
  32, the same bytes as GGUF's MXFP4).
- `RECIPES`: llama-quantize's mixed file types (q4_k_m, q5_k_m, ...) as a per-tensor-role rule
  (`tensor_type`): which type each role gets, taken from llama.cpp's `llama_tensor_get_type`
  (src/llama-quant.cpp of the pinned tree) -- e.g. q4_k_m: Q4_K everywhere, Q6_K for ffn_down
  (routed experts' down projections too) and attn_v in the layers `use_more_bits` picks, and for
  the output head; Q8_0 for attn_k/attn_v and Q5_K for attn_output of an 8-expert model
  (Mixtral); a row length a 256-block type cannot split falls back as llama.cpp does. A type
  name alone (`q4_k`) is every quantisable tensor in it (llama-quantize --pure).
- `WeightFormat` (a format or recipe for the weights, and one for the routed experts) with the
  model's published one (`published`: the preset's or config.json's, e.g. fp8 for DeepSeek-V3,
  MXFP4 experts for gpt-oss), and `weight_bytes` -> `WeightBytes`: the non-expert bytes and the
  largest and mean routed expert in that format, what the planner and the cost model count in
  place of the architecture's dense bytes when a config carries them (ModelConfig.weight_bytes).
What a GGUF type keeps unquantised follows llama.cpp: 1-D tensors (norms, biases) and the
router (`ffn_gate_inp`) in F32; a dtype format keeps them in that dtype, a tensor the model keeps
in fp32 in fp32. Does not own: which format an engine holds (its adapter's `held_weights`),
reading a GGUF file's header (harness.gguf_header), running anything in these formats.

    fmt = WeightFormat("q4_k_m")                         # or published(cfg), WeightFormat("bf16", experts="mxfp4")
    wb = weight_bytes(cfg, fmt)                          # .non_expert, .expert_slot, .expert_mean
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

# name -> (weights per block along a row, bytes per block): GGML_QUANT_SIZES of the pinned gguf-py
GGUF_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "iq1_s": (256, 50), "iq1_m": (256, 56), "iq2_xxs": (256, 66), "iq2_xs": (256, 74), "iq2_s": (256, 82),
    "iq3_xxs": (256, 98), "iq3_s": (256, 110), "iq4_nl": (32, 18), "iq4_xs": (256, 136),
    "tq1_0": (256, 54), "tq2_0": (256, 66), "mxfp4": (32, 17),
}
FP8_BLOCK = 128                       # DeepSeek-V3's weight_block_size: one fp32 scale per 128 x 128 weights
TYPES = (*GGUF_TYPES, "fp8")
DTYPE_FORMATS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}   # torch dtype -> its format
ALIASES = {"fp32": "f32", "fp16": "f16", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}

# llama-quantize's file types: the base type, and the roles it raises (llama_tensor_get_type)
RECIPES: dict[str, str] = {"q2_k": "q2_k", "q3_k_m": "q3_k", "q4_k_s": "q4_k", "q4_k_m": "q4_k",
                           "q5_k_s": "q5_k", "q5_k_m": "q5_k", "q6_k": "q6_k", "q8_0": "q8_0", "mxfp4_moe": "mxfp4"}
# a 256-block type whose row length it cannot split -> llama.cpp's fallback (then f16 if that cannot either)
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "tq1_0": "q4_0", "tq2_0": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1",
            "q6_k": "q8_0", **{t: "iq4_nl" for t in ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs",
                                                      "iq3_s", "iq4_xs")}}


def canonical(name: str) -> str:
    """A format or recipe name as this module spells it (lower case, torch dtype names aliased)."""
    n = str(name).strip().lower()
    return ALIASES.get(n, n)


def is_known(name: str) -> bool:
    return canonical(name) in TYPES or canonical(name) in RECIPES


def is_dtype(name: str) -> bool:
    """A plain floating-point format: the weights as a dtype (no blocks, no scales)."""
    return canonical(name) in DTYPE_FORMATS.values()


def known_formats() -> str:
    return f"types {', '.join(TYPES)}; recipes {', '.join(RECIPES)}"


def tensor_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight in type `fmt` (a row of `cols` split into the type's blocks)."""
    fmt = canonical(fmt)
    if fmt == "fp8":
        return rows * cols + 4 * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    block, nbytes = GGUF_TYPES[fmt]
    if cols % block:
        raise ValueError(f"a row of {cols} weights does not split into {fmt}'s blocks of {block}")
    return rows * (cols // block) * nbytes


def fitting(fmt: str, cols: int) -> str:
    """The type llama.cpp stores a row of `cols` in when asked for `fmt` (its fallback when the
    row does not split into fmt's blocks, then f16)."""
    fmt = canonical(fmt)
    if fmt == "fp8" or cols % GGUF_TYPES[fmt][0] == 0:
        return fmt
    alt = FALLBACK.get(fmt, "f16")
    return alt if cols % GGUF_TYPES[alt][0] == 0 else "f16"


# --- roles and recipes -----------------------------------------------------------------------
def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers a *_M recipe gives more bits: the first and last eighth and
    every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(recipe: str, role: str, layer: int, n_layers: int, n_experts: int) -> str:
    """The type `recipe` stores a 2-D tensor of `role` in (roles: token_embd, output, attn_q,
    attn_k, attn_v, attn_output, ffn_down, ffn_gate_up, other), llama_tensor_get_type's rules for
    the recipes in RECIPES; a plain type name is that type for every role."""
    recipe = canonical(recipe)
    if recipe not in RECIPES:
        return recipe
    base = RECIPES[recipe]
    if recipe == "mxfp4_moe":                 # the routed experts are asked for apart (expert_type)
        return "q8_0"
    if role == "output":
        return "q8_0" if base == "q8_0" else "q6_k"
    more = use_more_bits(layer, n_layers)
    eight = n_experts == 8
    if role in ("attn_v", "attn_k") and eight:
        return "q8_0"
    if role == "attn_output" and eight and recipe in ("q2_k", "q3_k_m", "q4_k_s", "q4_k_m"):
        return "q5_k"
    if role == "attn_v":
        return {"q2_k": "q3_k", "q3_k_m": "q5_k" if layer < 2 else "q4_k",
                "q4_k_m": "q6_k" if more else base, "q5_k_m": "q6_k" if more else base,
                "q4_k_s": "q5_k" if layer < 4 else base}.get(recipe, base)
    if role == "ffn_down":
        return {"q2_k": "q3_k", "q3_k_m": "q5_k" if layer < n_layers // 16 else "q4_k",
                "q4_k_m": "q6_k" if more else base, "q5_k_m": "q6_k" if more else base,
                "q4_k_s": "q5_k" if layer < n_layers // 8 else base}.get(recipe, base)
    if role == "attn_output" and recipe in ("q2_k", "q3_k_m"):
        return {"q2_k": "q3_k", "q3_k_m": "q4_k"}[recipe]
    return base


@dataclass(frozen=True)
class WeightFormat:
    """The format the weights are held in: `weights` a type or recipe for every weight, `experts`
    a type for the routed experts' matrices (None: what `weights` gives them)."""

    weights: str
    experts: str | None = None

    def __post_init__(self) -> None:
        for key, name in (("weight_format", self.weights), ("expert_format", self.experts)):
            if name is not None and not is_known(name):
                raise ValueError(f"model.{key}: allowed {known_formats()}; got {name!r}")
        object.__setattr__(self, "weights", canonical(self.weights))
        if self.experts is not None:
            object.__setattr__(self, "experts", canonical(self.experts))
            if self.experts in RECIPES and self.experts not in TYPES:
                raise ValueError(f"model.expert_format: allowed one type ({', '.join(TYPES)}), not a recipe; "
                                 f"got {self.experts!r}")

    @property
    def label(self) -> str:
        return self.weights if self.experts is None else f"{self.weights}, experts {self.experts}"

    def expert_type(self, layer: int, n_layers: int, n_experts: int, role: str = "ffn_gate_up") -> str:
        if self.experts is not None:
            return self.experts
        if self.weights == "mxfp4_moe":
            return "mxfp4"
        return tensor_type(self.weights, role, layer, n_layers, n_experts)

    @property
    def gguf(self) -> bool:
        """Whether every tensor is a GGUF type (what an engine holding GGUF files can hold)."""
        return all(canonical(n) in GGUF_TYPES or canonical(n) in RECIPES for n in (self.weights, self.experts) if n)

    def keeps_dtype(self, dtype: str) -> bool:
        """Whether this is simply `dtype` (a torch dtype name) throughout."""
        own = DTYPE_FORMATS.get(dtype)
        return self.weights == own and self.experts in (None, own)


def published(cfg) -> WeightFormat:
    """The format the model's weights are published in: config.json's / the preset's
    (ModelConfig.weight_format, e.g. fp8), else its saved dtype, with routed experts its layout
    keeps in their own stored format (gpt-oss's MXFP4)."""
    own = DTYPE_FORMATS.get(cfg.torch_dtype, "f32")
    return WeightFormat(cfg.weight_format or own, getattr(cfg.architecture().experts, "stored_format", None))


@dataclass(frozen=True)
class WeightBytes:
    """The bytes a model's weights take in one format: what the planner and cost model count."""

    non_expert: int               # every non-expert weight (embedding and head included)
    expert_slot: int              # the largest routed expert (a cache slot holds any)
    expert_mean: float            # the mean routed expert over the MoE layers (what an average copy moves)
    label: str                    # the format, as plans and predictions print it
    source: str = "recipe"        # recipe (this module's rules) | gguf header (the file's real sizes)
    expert_type: str | None = None  # the routed experts' type (most of their bytes): the rates a profile gives it

    def scale(self, dense_non_expert: int) -> float:
        """This format's non-expert bytes over the dense ones: the cost model's per-pass weight reads scale by it."""
        return self.non_expert / dense_non_expert if dense_non_expert else 1.0


def _roles(cfg) -> Iterator[tuple[str, int, tuple[int, ...], bool]]:
    """(role, layer, shape, kept in fp32) of every non-expert tensor (layer -1: embedding and head)."""
    from engine.blocks.routers import Router
    arch = cfg.architecture()
    for _, _, spec in arch.embedding.walk():
        yield ("token_embd" if len(spec.shape) == 2 else "vector"), -1, spec.shape, spec.dtype == "float32"
    for layer in arch.layers:
        for block, name, spec in layer.walk():
            if len(spec.shape) != 2:
                role = "vector"
            elif isinstance(block, Router):
                role = "router"
            else:
                role = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "down": "ffn_down",
                        "gate": "ffn_gate_up", "up": "ffn_gate_up"}.get(name, "other")
            yield role, layer.index, spec.shape, spec.dtype == "float32"
    for _, _, spec in arch.head.walk():
        yield ("output" if len(spec.shape) == 2 else "vector"), -1, spec.shape, spec.dtype == "float32"


def _kept_format(fmt: WeightFormat, dtype_bytes: int) -> int:
    """Bytes per element of what `fmt` does not quantise (vectors, the router): a dtype format's
    own size, f32 under a quantised GGUF type, else the dtype the weights are published or held
    in (fp8's unquantised tensors: bf16)."""
    if is_dtype(fmt.weights):
        return GGUF_TYPES[fmt.weights][1]
    return 4 if fmt.gguf else dtype_bytes


def _matrix_bytes(t: str, shape: tuple[int, ...]) -> int:
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return tensor_bytes(fitting(t, cols), rows, cols)


def weight_bytes(cfg, fmt: WeightFormat, dtype_bytes: int = 2) -> WeightBytes:
    """The model's weights in `fmt` (module docstring); `dtype_bytes`: the element size of what the
    format keeps unquantised when it is no GGUF type (fp8's embedding, head, norms and router)."""
    n_layers, E = cfg.num_layers, cfg.n_experts
    kept = _kept_format(fmt, dtype_bytes)
    fp8 = fmt.weights == "fp8"
    non_expert = 0
    for role, layer, shape, fp32 in _roles(cfg):
        numel = math.prod(shape)
        if fp32 or role == "vector" or role == "router" or (fp8 and role in ("token_embd", "output")):
            non_expert += numel * (4 if fp32 else kept)
            continue
        non_expert += _matrix_bytes(tensor_type(fmt.weights, role, layer, n_layers, E), shape)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    params = cfg.expert_params
    extra = params - 3 * D * I                    # biases beside a SwiGLU expert's three matrices
    per_layer, types = [], Counter()             # types: the routed experts' parameters per type
    for layer in cfg.moe_layers:
        gate_up, down = fmt.expert_type(layer, n_layers, E), fmt.expert_type(layer, n_layers, E, "ffn_down")
        gate_up, down = fitting(gate_up, D), fitting(down, I)      # the types the rows are stored in
        if extra >= 0:
            b = _matrix_bytes(gate_up, (2 * I, D)) + _matrix_bytes(down, (D, I)) + extra * kept
            types.update({gate_up: 2 * I * D}), types.update({down: D * I})
        else:                                     # another layout: its parameters as rows of `hidden`
            b = _matrix_bytes(gate_up, (params // D, D))
            types.update({gate_up: params})
        per_layer.append(b)
    return WeightBytes(non_expert, max(per_layer), sum(per_layer) / len(per_layer), fmt.label,
                       expert_type=types.most_common(1)[0][0] if types else None)
