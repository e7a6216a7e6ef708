"""What one forward pass reads and computes: its FLOPs and bytes by where they run (`pass_flops`)
and the event counts the fitted software overheads multiply (`pass_events`), from the pass's
shape and expert-cache counts (harness.costmodel.work's `PassWork`).

Owns no architecture's shape: every figure is asked of the blocks the model's family builds
(`cfg.architecture()`): the dense weights are its non-expert tensors (shared experts, dense first
layers, routers, MLA projections included; `dense_weights`), each layer's attention kernel
reports its own FLOPs and bytes (`AttentionBlock.kernel_cost`: GQA over the held keys, a sliding
window's bounded keys, MLA's latent, a DeltaNet's fixed state; `attention_cost`), an expert costs
its stored bytes (`expert_bytes`: MXFP4's packed bytes), a routed slot shipped to a CPU layer its
router's id and weight (`routed_slot_bytes`) and a restore the planner's state bytes
(`kv_bytes`). Does not own: the passes of a phase or their cache counts
(harness.costmodel.work), time (harness.costmodel.timemodel).

    f = pass_flops(cfg, work["decode"].passes[0], dtype_bytes=2)
    f.cpu_expert_bytes                          # [M] per MoE layer
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.architecture import Architecture
from engine.blocks.attention import KernelCost
from engine.config import ModelConfig
from harness.costmodel.work import PassWork

@dataclass(frozen=True)
class PassFlops:
    """FLOPs and bytes of one pass, split by where they run and what bounds them."""

    dense_flops: float          # device: attention projections, router, dense/shared MLPs, lm_head
    dense_bytes: float          # device: their weights and activations
    attn_flops: float           # device: scores and weighted sum over the KV (score_pairs: triangle or rectangle)
    attn_bytes: float           # device: K/V read once at K heads, q read and output written at H heads
    dev_expert_flops: np.ndarray    # [M] routed experts run on the device
    dev_expert_bytes: np.ndarray    # [M] their weights (U experts each)
    cpu_expert_flops: np.ndarray    # [M] routed experts run on the CPU
    cpu_expert_bytes: np.ndarray    # [M]
    act_d2h_bytes: float        # activations device->CPU (cpu/hybrid layers)
    act_h2d_bytes: float        # results CPU->device
    miss_bytes: np.ndarray      # [M] expert copies on cache misses
    stream_bytes: np.ndarray    # [M] expert copies through stream buffers


@functools.lru_cache(maxsize=64)
def _architecture(cfg: ModelConfig) -> Architecture:
    """The model's blocks (no weights), built once per config: every shape below is asked of them."""
    return cfg.architecture()


def expert_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """The stored bytes of one expert (ModelConfig.expert_bytes: a quantised or MXFP4 expert's packed
    buffer, not params x dtype), what a copy moves and a device GEMM reads."""
    return cfg.expert_bytes(dtype_bytes)


@functools.lru_cache(maxsize=256)
def routed_slot_bytes(cfg: ModelConfig, dtype_bytes: int) -> np.ndarray:
    """int [M]: bytes of one routed slot per MoE layer, as that layer's router returns it (an int64
    id and a weight, fp32 or in the activation dtype: `Router.slot_bytes`) -- what a CPU layer
    ships device->CPU beside the activations, per row and slot."""
    out = np.array([layer.moe.router.slot_bytes(dtype_bytes) for layer in _architecture(cfg).layers
                    if layer.moe is not None], dtype=np.int64)
    out.flags.writeable = False              # cached: shared by every caller
    return out


@dataclass(frozen=True)
class DenseWeights:
    """The non-expert weights one pass reads and the parameters it multiplies per token: every
    layer's attention projections, norms, routers, dense and shared MLPs, what the embedding
    multiplies (Gemma 4's per-layer projection: `Embedding.applied`) and the head (a tied head
    reads the embedding); the embedding tables themselves are only looked up."""

    per_token_params: int       # multiplied by every token of the pass (2 FLOPs each)
    head_params: int            # the vocabulary projection, at the last position only
    bytes: int                  # read once per pass


@functools.lru_cache(maxsize=256)
def dense_weights(cfg: ModelConfig, dtype_bytes: int) -> DenseWeights:
    arch = _architecture(cfg)
    layer_specs = [spec for layer in arch.layers for _, _, spec in layer.walk()] + arch.embedding.applied()
    head = arch.head.vocab * arch.head.hidden
    norm_specs = [spec for _, _, spec in arch.head.norm.walk()]
    dense = sum(s.nbytes(dtype_bytes) for s in layer_specs + norm_specs) + head * dtype_bytes
    if cfg.weight_bytes is not None:       # held in another format (engine.formats): its bytes, tensor for tensor
        dense = int(round(dense * cfg.weight_bytes.scale(arch.non_expert_bytes(dtype_bytes))))     # in proportion
    return DenseWeights(per_token_params=sum(s.numel for s in layer_specs + norm_specs), head_params=head, bytes=dense)


@functools.lru_cache(maxsize=4096)
def attention_cost(cfg: ModelConfig, batch: int, tokens: int, past: int, dtype_bytes: int,
                   kv_dtype: str | None = None) -> KernelCost:
    """Every layer's attention kernel, summed (each block's own arithmetic: GQA, a window, MLA's
    latent, a recurrence), its state read in the stored `kv_dtype` (payload + scales). Cached: a
    long prompt's passes ask it twice each (FLOPs and events), and every placement of one
    prediction asks it for the same passes."""
    costs = [layer.attention.kernel_cost(batch, tokens, past, dtype_bytes, kv_dtype)
             for layer in _architecture(cfg).layers]
    return KernelCost(flops=sum(c.flops for c in costs), bytes=sum(c.bytes for c in costs),
                      scores=sum(c.scores for c in costs))


def pass_flops(cfg: ModelConfig, p: PassWork, dtype_bytes: int, kv_dtype: str | None = None) -> PassFlops:
    D, k, L = cfg.hidden_size, cfg.top_k, cfg.num_layers
    B, T = p.batch, p.new
    N = B * T
    dt = dtype_bytes
    w = dense_weights(cfg, dt)
    dense_flops = 2.0 * N * w.per_token_params + 2.0 * B * w.head_params         # lm_head: last position only
    dense_bytes = float(w.bytes + L * 6 * N * D * dt)                            # weights + activations in/out
    attn = attention_cost(cfg, B, T, p.past, dt, kv_dtype)
    ex_flops = 2.0 * N * k * _architecture(cfg).experts.params                  # per MoE layer
    ex_bytes = p.unique * expert_bytes(cfg, dt)                                  # [M]
    ex_f = np.full(cfg.n_moe_layers, ex_flops)
    on_cpu = p.on_cpu
    n_cpu = int(on_cpu.sum())
    slots_d2h = float((on_cpu * routed_slot_bytes(cfg, dt)).sum())              # per row: k slots of each CPU layer
    return PassFlops(
        dense_flops=dense_flops, dense_bytes=dense_bytes, attn_flops=attn.flops, attn_bytes=attn.bytes,
        dev_expert_flops=np.where(on_cpu, 0.0, ex_f), dev_expert_bytes=np.where(on_cpu, 0.0, ex_bytes),
        cpu_expert_flops=np.where(on_cpu, ex_f, 0.0), cpu_expert_bytes=np.where(on_cpu, ex_bytes, 0.0),
        act_d2h_bytes=float(n_cpu * N * D * dt + N * k * slots_d2h), act_h2d_bytes=float(n_cpu * N * D * dt),
        miss_bytes=p.misses * expert_bytes(cfg, dt),
        stream_bytes=p.streamed * expert_bytes(cfg, dt))


EVENTS = ("pass_s", "layer_s", "expert_s", "row_s", "slot_s", "score_s", "lookup_s", "miss_s", "cpu_layer_s",
          "restore_s")


def pass_events(cfg: ModelConfig, p: PassWork) -> dict[str, float]:
    """How many times each fitted overhead (harness.costmodel.profiles.Overheads) is paid in one pass."""
    L = cfg.num_layers
    return {"pass_s": 1.0, "layer_s": float(L), "expert_s": float(p.unique.sum()), "row_s": float(p.rows * L),
            "slot_s": float(p.rows * cfg.top_k * cfg.n_moe_layers),
            "score_s": attention_cost(cfg, p.batch, p.new, p.past, 4).scores,
            "lookup_s": float((p.hits + p.misses).sum()), "miss_s": float(p.misses.sum() + p.streamed.sum()),
            "cpu_layer_s": float(p.on_cpu.sum()), "restore_s": 0.0}


def kv_bytes(cfg: ModelConfig, tokens: int, batch: int, dtype_bytes: int, kv_dtype: str | None = None) -> int:
    """The session state of `batch` sequences of `tokens` (what a restore copies back): every
    layer's term as the planner counts it (per token, a window, a fixed recurrent state), its KV
    stored in `kv_dtype` (payload + scales) -- one formula, ModelConfig.state_bytes."""
    return cfg.state_bytes(tokens, batch, dtype_bytes, kv_dtype)
