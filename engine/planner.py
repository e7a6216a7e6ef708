"""Device memory planning: will this placement, cache and context fit, and how many cache
slots does the budget leave?

Owns: the arithmetic -- non-expert weights + every layer's state for the requested context +
activations + attention workspace + expert bytes held by the placement + allocator slack +
reserve -- against a device budget, `auto` cache sizing, and refusing a plan that does not
fit with an error that prints the arithmetic. Every number is asked of the blocks the
model's family builds (engine.architecture): parameters from the tensors they declare, one
state term per layer from its attention block (bytes per token for full KV or a latent,
bounded by a window, fixed per sequence for a recurrent state), transient bounds from each
block. Each kind of state is its own line of the printout. Does not own: allocation
(engine.devices accounts real allocations against the same budget, and on CUDA caps torch's
allocator at it) or any architecture's formulas (its blocks').

    plan = plan_memory(cfg, "fetch", capacity="auto", budget=2 << 30, context=4096, batch=1,
                       ubatch=512, dtype_bytes=2, device_kind="cuda")
    plan.capacity, print(plan)

Transient memory of one forward pass over a micro-batch (`activation_bytes`) is an upper
bound built from the tensors this engine's forward really creates (each block's
`activation_bytes`): per layer the residual stream and its norm plus the larger of the
attention block and the MLP block (a MoE block: one expert's intermediates for every row at
once), or the head's: the last positions' logits, or with `all_logits` every position's of the
micro-batch, which a quality pass keeps (harness.quality). The attention
*workspace* (`attention_workspace_bytes`) depends on which scaled_dot_product_attention
kernel runs, so it is the worst case for the device:
- cuda: the math kernel, which materialises the [B, H, T, S] scores and, inside its
  `_safe_softmax`, their softmax, a bool mask of the -inf scores and the `where` that zeroes
  fully masked rows (in fp32: torch upcasts fp16/bf16 there), plus q, k and v upcast, K/V
  repeated to H heads and q and k scaled -- its op sequence as `TorchDispatchMode` sees it
  under `sdpa_kernel(SDPBackend.MATH)` on the CPU (the same composite function runs on CUDA;
  the bound is unverified on a GPU: scripts/gpu_check.py measures the peak). Prefill always passes
  a boolean mask, which rules out the flash kernel, and whether the memory-efficient
  kernel takes `enable_gqa` depends on the torch version; so we plan for math. Where
  efficient attention does run, the plan is high by that term, which is the safe side.
- cpu (the emulated device): torch's CPU flash kernel, which this call always takes (dense
  mask, no dropout): the mask converted to an additive float [T, S], and per thread one
  block of scores [min(T, 256), min(S, 512)] with its row maxima, sums and output block
  (fp32; another block in the activation dtype for fp16/bf16); a decode step in fp32 instead
  runs `engine.layers.decode_attention`, whose scores [B, H, S] fp32 exist twice at once
  (scaled in place, then their softmax). tests/engine/test_planner_memory.py measures the real
  allocations against this plan.
Allocator slack (cuda): the caching allocator rounds each block up to 512 B and carves
blocks out of 2 MiB (small) and 20 MiB (large) segments, so its reserved memory, which is
what the budget caps on CUDA, exceeds what is allocated by up to one partly used segment of
each kind plus the rounding of every tensor; the emulated device counts exact bytes (0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from engine.blocks.attention import PLAN_CPU_THREADS
from engine.config import ModelConfig
from engine.devices import fmt_bytes
from engine.kv import StateTerm
from engine.registry import PLACEMENTS

DEFAULT_RESERVE_FRACTION = 0.05   # headroom for allocator fragmentation and temporaries


class PlanError(ValueError):
    """The requested configuration does not fit the device budget (message shows the arithmetic)."""


SMALL_SEGMENT, LARGE_SEGMENT, BLOCK_ROUND = 2 << 20, 20 << 20, 512   # torch's CUDA caching allocator


@dataclass(frozen=True)
class TransientRule:
    """How an engine's transient memory is planned when its forward pass is not this engine's: the
    element size its activations are computed in (None: the model's dtype) and its attention
    workspace (`workspace(arch, batch, tokens, context, dtype_bytes, device_kind, kv_dtype)` -> bytes;
    None: this engine's worst case), each named as the plan prints it."""

    label: str                                   # e.g. "llama.cpp, flash attention: no score matrix"
    activation_bytes: int | None = None
    workspace: Any = None


@dataclass(frozen=True)
class MemoryPlan:
    placement: str
    budget: int | None
    non_expert: int
    kv: int                     # every layer's state (KV and kin), the sum of `states`
    activations: int
    experts: int
    reserve: int
    capacity: int | None
    expert_bytes: int
    context: int
    batch: int
    attention: int = 0          # attention workspace of one micro-batch (worst case for the device)
    slack: int = 0              # allocator rounding and segments (cuda)
    states: tuple[tuple[str, int], ...] = ()   # (printout line, bytes) per kind of layer state
    expert_quant: str = "none"  # the experts' stored treatment (cfg.expert_quant); expert_bytes are its bytes
    all_logits: bool = False    # activations hold a micro-batch's logits at every position (prefill(all_logits=True))
    weights: str = ""           # the format the weights are counted in (engine.formats), "" : the blocks' dtype
    transient_label: str = ""   # whose rule the activations and attention workspace follow ("": this engine's)

    @property
    def transient(self) -> int:
        """Bytes one forward pass allocates and frees again: activations + attention workspace."""
        return self.activations + self.attention

    @property
    def total(self) -> int:
        return self.non_expert + self.kv + self.transient + self.experts + self.slack + self.reserve

    def lines(self) -> list[str]:
        cap = f" ({self.capacity} slots/layer)" if self.capacity is not None else ""
        states = list(self.states) or [(f"KV cache ({self.batch} x {self.context} tokens)", self.kv)]
        rows = [(f"non-expert weights{' [' + self.weights + ']' if self.weights else ''}", self.non_expert), *states,
                ("activations (micro-batch, all logits)" if self.all_logits else "activations (one micro-batch)",
                 self.activations),
                (f"attention workspace ({self.transient_label or 'worst case'})", self.attention),
                (f"experts [{self.placement}{'' if self.expert_quant == 'none' else ', ' + self.expert_quant}"
                 f"{', ' + self.weights if self.weights else ''}]{cap}",
                 self.experts),
                ("allocator slack", self.slack),
                ("reserve", self.reserve)]
        w = max(40, *(len(name) for name, _ in rows))
        out = [f"  {name:<{w}} {fmt_bytes(v):>12}" for name, v in rows]
        out.append(f"  {'= total':<{w}} {fmt_bytes(self.total):>12}")
        out.append(f"  {'budget':<{w}} {fmt_bytes(self.budget) if self.budget is not None else 'unlimited':>12}")
        return out

    def __str__(self) -> str:
        return "memory plan:\n" + "\n".join(self.lines())


def activation_bytes(cfg: ModelConfig, tokens: int, batch: int, dtype_bytes: int) -> int:
    """Peak transient bytes of one forward pass over `tokens` rows (B*T), attention workspace
    excluded (`attention_workspace_bytes`): an upper bound from the tensors the blocks create."""
    return cfg.architecture().activation_bytes(tokens, batch, dtype_bytes)


def attention_workspace_bytes(cfg: ModelConfig, batch: int, tokens: int, context: int, dtype_bytes: int,
                              device_kind: str) -> int:
    """Worst-case attention-kernel workspace of any layer for `tokens` new tokens per sequence
    attending to `context` keys (see the module docstring for which kernel and why)."""
    return cfg.architecture().workspace_bytes(batch, tokens, context, dtype_bytes, device_kind)


def _own_workspace(arch: Any, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str,
                   kv_dtype: str | None) -> int:
    return arch.workspace_bytes(batch, tokens, context, dtype_bytes, device_kind, kv_dtype)


def state_lines(terms: list[StateTerm], context: int, batch: int) -> tuple[tuple[str, int], ...]:
    """One (printout line, bytes) per kind of state, summed over the layers that keep it."""
    groups: dict[str, list] = {}
    for term in terms:
        g = groups.setdefault(term.kind, [0, 0, term])
        g[0] += 1
        g[1] += term.bytes(context, batch)

    def held(term: StateTerm) -> str:     # what the term grows with: tokens (up to a window) or nothing
        if not term.per_token:
            return f"{batch} sequence{'s' if batch > 1 else ''}"
        return f"{batch} x {context if term.max_tokens is None else min(context, term.max_tokens)} tokens"

    return tuple((f"{kind} ({n} layer{'s' if n > 1 else ''}, {held(term)})", b)
                 for kind, (n, b, term) in groups.items())


def allocator_slack(n_tensors: int, device_kind: str) -> int:
    """What the CUDA caching allocator reserves beyond the bytes allocated (module docstring)."""
    if device_kind != "cuda":
        return 0
    return SMALL_SEGMENT + LARGE_SEGMENT + n_tensors * BLOCK_ROUND


def capacity_from_bytes(cfg: ModelConfig, capacity: int | str | None, capacity_bytes: int, expert_bytes: int) -> int:
    """Slots per layer for a cache of `capacity_bytes` over every MoE layer (ValueError with the arithmetic)."""
    if capacity is not None:
        raise ValueError(f"give the expert cache as cache_capacity (slots per layer, or 'auto') or as "
                         f"cache_capacity_bytes, not both; got cache_capacity={capacity!r} and "
                         f"cache_capacity_bytes={capacity_bytes!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(f"cache_capacity_bytes must be a positive number of bytes, got {capacity_bytes!r}")
    per_slot = cfg.n_moe_layers * expert_bytes
    slots = min(cfg.n_experts, capacity_bytes // per_slot)
    if slots < cfg.top_k:
        raise ValueError(f"cache_capacity_bytes {fmt_bytes(capacity_bytes)} holds {slots} slots per layer "
                         f"({cfg.n_moe_layers} MoE layers x {fmt_bytes(expert_bytes)} an expert slot = "
                         f"{fmt_bytes(per_slot)} for each slot per layer), fewer than top_k={cfg.top_k}; give at least "
                         f"{fmt_bytes(cfg.top_k * per_slot)}")
    return slots


def check_capacity(capacity: int, top_k: int, n_experts: int) -> None:
    """The expert cache's range, slots per layer: [top_k, n_experts] -- one decode step needs its
    top_k experts on the device at once (the engine's plan, the simulator and the cost model alike)."""
    if not top_k <= capacity <= n_experts:
        raise ValueError(f"cache_capacity must be in [top_k={top_k}, n_experts={n_experts}] "
                         f"(one decode step needs top_k experts on the device), got {capacity}")


def plan_memory(cfg: ModelConfig, placement: str, capacity: int | str | None, budget: int | None,
                context: int, batch: int, ubatch: int, dtype_bytes: int,
                placement_options: dict[str, Any] | None = None, reserve: int | None = None,
                device_kind: str = "cuda", capacity_bytes: int | None = None,
                kv_dtype: str | None = None, all_logits: bool = False, cpu_threads: int | None = None,
                transient: TransientRule | None = None) -> MemoryPlan:
    """The plan for `device_kind` ('cuda': a real card, the default; 'cpu': the emulated device),
    each layer's KV stored in `kv_dtype` (engine.kvquant; None: the model's dtype) at its real
    stored bytes, payload + scales.

    Expert bytes are the stored bytes of the model's treatment (cfg.expert_quant: a quantised
    expert is smaller, so `auto` and `capacity_bytes` leave more slots); under a mixed treatment a
    slot holds the largest expert. `capacity_bytes`: the cache given in bytes over all MoE layers
    instead of slots (`capacity` must then be None): floor(capacity_bytes / (MoE layers x slot bytes))
    slots per layer, at most n_experts. all_logits: room for a prefill that keeps every position's
    logits, one micro-batch at a time ([batch x ubatch, vocab]: a quality pass, harness.quality).
    cpu_threads: the intra-op threads the emulated device's attention will run with (a flash
    buffer per thread); None: torch's current setting (which loads torch). cfg.weight_bytes (the
    weights in the format an engine holds them in, engine.formats): its non-expert bytes and its
    largest expert replace the blocks' dense ones. transient: another engine's rule for the
    activations and attention workspace (TransientRule); None: this engine's."""
    options = placement_options or {}
    cls = PLACEMENTS.get(placement)
    arch = cfg.architecture()
    held = cfg.weight_bytes
    expert_bytes = arch.experts.nbytes(dtype_bytes) if held is None else held.expert_slot
    if capacity_bytes is not None and cls.uses_cache(options):
        capacity = capacity_from_bytes(cfg, capacity, capacity_bytes, expert_bytes)
    non_expert = arch.non_expert_bytes(dtype_bytes) if held is None else held.non_expert
    states = state_lines(arch.state_terms(dtype_bytes, kv_dtype), context, batch)
    kv = sum(b for _, b in states)
    chunk = min(ubatch, context)
    rule = transient or TransientRule("")
    act = arch.activation_bytes(chunk * batch, batch, rule.activation_bytes or dtype_bytes, all_logits)
    threads = PLAN_CPU_THREADS.set(cpu_threads)
    try:
        attn = (rule.workspace or _own_workspace)(arch, batch, chunk, context, dtype_bytes, device_kind, kv_dtype)
    finally:
        PLAN_CPU_THREADS.reset(threads)
    labels = (held.label if held is not None else "", rule.label)
    slack = allocator_slack(arch.n_device_tensors(kv_dtype), device_kind)
    if reserve is None:
        reserve = int(DEFAULT_RESERVE_FRACTION * budget) if budget is not None else 0
    uses_cache = cls.uses_cache(options)
    cap: int | None = None
    if uses_cache:
        if capacity is None:
            raise ValueError(f"placement {placement!r} needs cache_capacity: an int in "
                             f"[top_k={cfg.top_k}, n_experts={cfg.n_experts}] or 'auto'")
        if capacity == "auto":
            if budget is None:
                cap = cfg.n_experts
            else:
                fixed = non_expert + kv + act + attn + slack + reserve + cls.device_expert_bytes(cfg, expert_bytes, 0,
                                                                                                options)
                per_slot = cfg.n_moe_layers * expert_bytes
                cap = min(cfg.n_experts, max(0, (budget - fixed) // per_slot))
                if cap < cfg.top_k:
                    plan = MemoryPlan(placement, budget, non_expert, kv, act, cfg.top_k * per_slot, reserve,
                                      cfg.top_k, expert_bytes, context, batch, attn, slack, states, arch.experts.quant,
                                      all_logits, *labels)
                    raise PlanError(
                        f"cache_capacity='auto' leaves {cap} slots per layer, fewer than top_k={cfg.top_k}: "
                        f"budget {fmt_bytes(budget)} - fixed {fmt_bytes(fixed)} = {fmt_bytes(budget - fixed)} "
                        f"for {cfg.n_moe_layers} layers x {fmt_bytes(expert_bytes)} per expert slot\n"
                        + "\n".join(plan.lines()))
        else:
            if isinstance(capacity, bool) or not isinstance(capacity, int):
                raise ValueError(f"cache_capacity must be an int or 'auto', got {capacity!r}")
            check_capacity(capacity, cfg.top_k, cfg.n_experts)
            cap = capacity
    experts = cls.device_expert_bytes(cfg, expert_bytes, cap, options)
    plan = MemoryPlan(placement, budget, non_expert, kv, act, experts, reserve, cap, expert_bytes, context, batch,
                      attn, slack, states, arch.experts.quant, all_logits, *labels)
    if budget is not None and plan.total > budget:
        raise PlanError(f"placement {placement!r} does not fit the device budget: "
                        f"{fmt_bytes(plan.total)} > {fmt_bytes(budget)}\n" + "\n".join(plan.lines()))
    return plan
