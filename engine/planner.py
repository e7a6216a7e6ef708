"""Device memory planning: will this placement, cache and context fit, and how many cache
slots does the budget leave?

Owns: the arithmetic -- non-expert weights + KV for the requested context + activations
+ attention workspace + expert bytes held by the placement + allocator slack + reserve --
against a device budget, `auto` cache sizing, and refusing a plan that does not fit with an
error that prints the arithmetic. Does not own: allocation (engine.devices accounts real
allocations against the same budget, and on CUDA caps torch's allocator at it).

    plan = plan_memory(cfg, "fetch", capacity="auto", budget=2 << 30, context=4096, batch=1,
                       ubatch=512, dtype_bytes=2, device_kind="cuda")
    plan.capacity, print(plan)

Transient memory of one forward pass over a micro-batch (`activation_bytes`) is an upper
bound built from the tensors this engine's forward really creates (engine.model,
engine.layers): the largest of the attention block, the MoE block (one expert's
intermediates for every row at once) and a dense MLP, plus logits. The attention
*workspace* (`attention_workspace_bytes`) depends on which scaled_dot_product_attention
kernel runs, so it is the worst case for the device:
- cuda: the math kernel, which materialises the [B, H, T, S] scores and their softmax (in
  fp32: torch upcasts fp16/bf16 there) plus K/V repeated to H heads. Prefill always passes
  a boolean mask, which rules out the flash kernel, and whether the memory-efficient
  kernel takes `enable_gqa` depends on the torch version; so we plan for math. Where
  efficient attention does run, the plan is high by that term, which is the safe side.
- cpu (the emulated device): torch's CPU flash kernel, which this call always takes (dense
  mask, no dropout): the mask converted to an additive float [T, S], and per thread one
  block of scores [min(T, 256), min(S, 512)] with its row maxima, sums and output block
  (fp32; another block in the activation dtype for fp16/bf16). tests/engine/
  test_planner_memory.py measures the real allocations against this plan.
Allocator slack (cuda): the caching allocator rounds each block up to 512 B and carves
blocks out of 2 MiB (small) and 20 MiB (large) segments, so its reserved memory, which is
what the budget caps on CUDA, exceeds what is allocated by up to one partly used segment of
each kind plus the rounding of every tensor; the emulated device counts exact bytes (0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig
from engine.devices import fmt_bytes
from engine.registry import PLACEMENTS

DEFAULT_RESERVE_FRACTION = 0.05   # headroom for allocator fragmentation and temporaries


class PlanError(ValueError):
    """The requested configuration does not fit the device budget (message shows the arithmetic)."""


SMALL_SEGMENT, LARGE_SEGMENT, BLOCK_ROUND = 2 << 20, 20 << 20, 512   # torch's CUDA caching allocator
FLASH_CPU_Q_BLOCK, FLASH_CPU_KV_BLOCK = 256, 512                      # torch's CPU flash-attention blocking


@dataclass(frozen=True)
class MemoryPlan:
    placement: str
    budget: int | None
    non_expert: int
    kv: int
    activations: int
    experts: int
    reserve: int
    capacity: int | None
    expert_bytes: int
    context: int
    batch: int
    attention: int = 0          # attention workspace of one micro-batch (worst case for the device)
    slack: int = 0              # allocator rounding and segments (cuda)

    @property
    def transient(self) -> int:
        """Bytes one forward pass allocates and frees again: activations + attention workspace."""
        return self.activations + self.attention

    @property
    def total(self) -> int:
        return self.non_expert + self.kv + self.transient + self.experts + self.slack + self.reserve

    def lines(self) -> list[str]:
        cap = f" ({self.capacity} slots/layer)" if self.capacity is not None else ""
        rows = [("non-expert weights", self.non_expert),
                (f"KV cache ({self.batch} x {self.context} tokens)", self.kv),
                ("activations (one micro-batch)", self.activations),
                ("attention workspace (worst case)", self.attention),
                (f"experts [{self.placement}]{cap}", self.experts),
                ("allocator slack", self.slack),
                ("reserve", self.reserve)]
        out = [f"  {name:<40} {fmt_bytes(v):>12}" for name, v in rows]
        out.append(f"  {'= total':<40} {fmt_bytes(self.total):>12}")
        out.append(f"  {'budget':<40} {fmt_bytes(self.budget) if self.budget is not None else 'unlimited':>12}")
        return out

    def __str__(self) -> str:
        return "memory plan:\n" + "\n".join(self.lines())


def activation_bytes(cfg: ModelConfig, tokens: int, batch: int, dtype_bytes: int) -> int:
    """Peak transient bytes of one forward pass over `tokens` rows (B*T), attention workspace
    excluded (`attention_workspace_bytes`): an upper bound from the tensors engine.model creates.

    N=rows, D=hidden, H/K=query/kv heads, h=head dim, I=expert intermediate, E=experts, k=top-k."""
    N, db, f32 = tokens, dtype_bytes, 4
    D, H, K, hd, E, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.n_experts, cfg.top_k
    norm_tmp = N * D * (2 * f32 + db)                                  # rms_norm: fp32 copy, square/product, cast
    qkv = N * (H + 2 * K) * hd * db * (2 if cfg.qk_norm else 1)        # q/k/v (+ their norms)
    attn = (N * 2 * D * db + norm_tmp + qkv                            # residual, normed input
            + 3 * N * H * hd * db                                      # rotary temporaries (x*cos, rotated, *sin)
            + 2 * N * H * hd * db + N * D * db)                        # attention output, its [N, H*h] copy, o-proj
    I, S = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    moe = (N * 3 * D * db                                              # residual, normed input, expert sum buffer
           + N * k * (db + f32 + 8 + 4 * 8)                            # top-k weights/ids, sort, rows/slots per expert
           + max(norm_tmp, N * E * (db + f32),                         # one of, in turn: the norm, the router,
                 N * (2 * D + 4 * I) * db,                             # one expert over every row (rows, gate|up,
                 N * (3 * S + 2 * D) * db if S else 0))                # act, act*up / down, *weight), shared expert
    dense = N * (3 * D + 3 * cfg.intermediate_size) * db + norm_tmp if cfg.n_moe_layers < cfg.num_layers else 0
    logits = batch * cfg.vocab_size * max(db, f32) + N * D * db
    return max(attn, moe, dense, logits)


def attention_workspace_bytes(cfg: ModelConfig, batch: int, tokens: int, context: int, dtype_bytes: int,
                              device_kind: str) -> int:
    """Worst-case scaled_dot_product_attention workspace for `tokens` new tokens per sequence
    attending to `context` keys (see the module docstring for which kernel and why).

    B=batch, T=tokens, S=context, H=query heads, h=head dim."""
    B, T, S, H, hd, db = batch, tokens, context, cfg.num_heads, cfg.head_dim, dtype_bytes
    f32 = 4
    mask = T * S * (1 + max(db, f32)) if T > 1 else 0                  # bool [T, S] and its additive float form
    if device_kind == "cuda":                                           # math kernel: materialised, fp32
        scores = 2 * B * H * T * S * f32                                # scores and softmax(scores)
        upcast = B * H * (T + 2 * S) * hd * f32                         # q, and k/v repeated to H heads
        return scores + upcast + mask
    if device_kind != "cpu":
        raise ValueError(f"device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
    qb, kb = min(T, FLASH_CPU_Q_BLOCK), min(S, FLASH_CPU_KV_BLOCK)
    per_thread = (qb * kb + 2 * qb + qb * hd) * f32 + (qb * kb * db if db < f32 else 0)
    return torch.get_num_threads() * per_thread + B * H * T * f32 + mask  # + logsumexp [B, H, T]


def allocator_slack(n_tensors: int, device_kind: str) -> int:
    """What the CUDA caching allocator reserves beyond the bytes allocated (module docstring)."""
    if device_kind != "cuda":
        return 0
    return SMALL_SEGMENT + LARGE_SEGMENT + n_tensors * BLOCK_ROUND


def plan_memory(cfg: ModelConfig, placement: str, capacity: int | str | None, budget: int | None,
                context: int, batch: int, ubatch: int, dtype_bytes: int,
                placement_options: dict[str, Any] | None = None, reserve: int | None = None,
                device_kind: str = "cuda") -> MemoryPlan:
    """The plan for `device_kind` ('cuda': a real card, the default; 'cpu': the emulated device)."""
    options = placement_options or {}
    cls = PLACEMENTS.get(placement)
    expert_bytes = cfg.expert_params * dtype_bytes
    non_expert = cfg.non_expert_params() * dtype_bytes
    kv = cfg.kv_bytes_per_token(dtype_bytes) * context * batch
    chunk = min(ubatch, context)
    act = activation_bytes(cfg, chunk * batch, batch, dtype_bytes)
    attn = attention_workspace_bytes(cfg, batch, chunk, context, dtype_bytes, device_kind)
    slack = allocator_slack(_n_tensors(cfg), device_kind)
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
                                      cfg.top_k, expert_bytes, context, batch, attn, slack)
                    raise PlanError(
                        f"cache_capacity='auto' leaves {cap} slots per layer, fewer than top_k={cfg.top_k}: "
                        f"budget {fmt_bytes(budget)} - fixed {fmt_bytes(fixed)} = {fmt_bytes(budget - fixed)} "
                        f"for {cfg.n_moe_layers} layers x {fmt_bytes(expert_bytes)} per expert slot\n"
                        + "\n".join(plan.lines()))
        else:
            if isinstance(capacity, bool) or not isinstance(capacity, int):
                raise ValueError(f"cache_capacity must be an int or 'auto', got {capacity!r}")
            if not cfg.top_k <= capacity <= cfg.n_experts:
                raise ValueError(f"cache_capacity must be in [top_k={cfg.top_k}, n_experts={cfg.n_experts}] "
                                 f"(one decode step needs top_k experts on the device), got {capacity}")
            cap = capacity
    experts = cls.device_expert_bytes(cfg, expert_bytes, cap, options)
    plan = MemoryPlan(placement, budget, non_expert, kv, act, experts, reserve, cap, expert_bytes, context, batch,
                      attn, slack)
    if budget is not None and plan.total > budget:
        raise PlanError(f"placement {placement!r} does not fit the device budget: "
                        f"{fmt_bytes(plan.total)} > {fmt_bytes(budget)}\n" + "\n".join(plan.lines()))
    return plan


def _n_tensors(cfg: ModelConfig) -> int:
    """Device tensors the engine allocates: per layer its weights (at most 16), KV pair and
    expert rows/slots; plus embeddings, final norm and head."""
    return cfg.num_layers * (16 + 2 + 1) + 3
