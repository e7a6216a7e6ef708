"""Device memory planning: will this placement, cache and context fit, and how many cache
slots does the budget leave?

Owns: the arithmetic -- non-expert weights + KV for the requested context + activations
+ expert bytes held by the placement + reserve -- against a device budget, `auto` cache
sizing, and refusing a plan that does not fit with an error that prints the arithmetic.
Does not own: allocation (engine.devices accounts real allocations against the same budget).

    plan = plan_memory(cfg, "fetch", capacity="auto", budget=2 << 30, context=4096, batch=1,
                       ubatch=512, dtype_bytes=2)
    plan.capacity, print(plan)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ModelConfig
from engine.devices import fmt_bytes
from engine.registry import PLACEMENTS

DEFAULT_RESERVE_FRACTION = 0.05   # headroom for allocator fragmentation and temporaries


class PlanError(ValueError):
    """The requested configuration does not fit the device budget (message shows the arithmetic)."""


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

    @property
    def total(self) -> int:
        return self.non_expert + self.kv + self.activations + self.experts + self.reserve

    def lines(self) -> list[str]:
        cap = f" ({self.capacity} slots/layer)" if self.capacity is not None else ""
        rows = [("non-expert weights", self.non_expert),
                (f"KV cache ({self.batch} x {self.context} tokens)", self.kv),
                ("activations (one micro-batch)", self.activations),
                (f"experts [{self.placement}]{cap}", self.experts),
                ("reserve", self.reserve)]
        out = [f"  {name:<40} {fmt_bytes(v):>12}" for name, v in rows]
        out.append(f"  {'= total':<40} {fmt_bytes(self.total):>12}")
        out.append(f"  {'budget':<40} {fmt_bytes(self.budget) if self.budget is not None else 'unlimited':>12}")
        return out

    def __str__(self) -> str:
        return "memory plan:\n" + "\n".join(self.lines())


def activation_bytes(cfg: ModelConfig, tokens: int, batch: int, dtype_bytes: int) -> int:
    """Peak transient bytes of one forward pass over `tokens` rows (an upper estimate):
    residual + normed input + q/k/v/attn out + router probs + one expert's intermediates
    + attention scores for the chunk + last-position logits."""
    D, I, E = cfg.hidden_size, max(cfg.moe_intermediate_size, cfg.intermediate_size), cfg.n_experts
    per_row = (4 * D + 2 * cfg.num_heads * cfg.head_dim + 3 * I + E) * dtype_bytes + 2 * E * 4
    return tokens * per_row + batch * cfg.vocab_size * 4


def plan_memory(cfg: ModelConfig, placement: str, capacity: int | str | None, budget: int | None,
                context: int, batch: int, ubatch: int, dtype_bytes: int,
                placement_options: dict[str, Any] | None = None, reserve: int | None = None) -> MemoryPlan:
    options = placement_options or {}
    cls = PLACEMENTS.get(placement)
    expert_bytes = cfg.expert_params * dtype_bytes
    non_expert = cfg.non_expert_params() * dtype_bytes
    kv = cfg.kv_bytes_per_token(dtype_bytes) * context * batch
    act = activation_bytes(cfg, min(ubatch, context) * batch, batch, dtype_bytes)
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
                fixed = non_expert + kv + act + reserve + cls.device_expert_bytes(cfg, expert_bytes, 0, options)
                per_slot = cfg.n_moe_layers * expert_bytes
                cap = min(cfg.n_experts, max(0, (budget - fixed) // per_slot))
                if cap < cfg.top_k:
                    plan = MemoryPlan(placement, budget, non_expert, kv, act, cfg.top_k * per_slot, reserve,
                                      cfg.top_k, expert_bytes, context, batch)
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
    plan = MemoryPlan(placement, budget, non_expert, kv, act, experts, reserve, cap, expert_bytes, context, batch)
    if budget is not None and plan.total > budget:
        raise PlanError(f"placement {placement!r} does not fit the device budget: "
                        f"{fmt_bytes(plan.total)} > {fmt_bytes(budget)}\n" + "\n".join(plan.lines()))
    return plan
