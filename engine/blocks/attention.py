"""Attention blocks: token mixing with per-session state, one class per kind of attention.

Owns: the `AttentionBlock` interface -- forward over a pass with the layer's `LayerState`,
the state it creates (`new_state`) and what that costs in the plan (`state_term`), and its
transient bounds (`activation_bytes`, `workspace_bytes`) -- and `GQAAttention`, grouped-query
attention with the first wave's options (q/k/v and output biases, per-head or whole-projection
q/k norms, q/k/v clipping, partial rotary, a sliding window: a bounded SlidingKV state). Does not own: the state
mechanics (engine.kv) or the numerics (engine.layers).

Kinds to come are subclasses here or in the family that alone needs them: multi-head latent
attention (a latent state, its own projections), sinks (override `attend`), output gates
(override `forward`'s projection), per-layer windows (construct with or without `window`),
linear/recurrent attention (a fixed state, no KV at all).

Which SDPA kernel runs on the CPU is measured, not assumed (`python benchmarks/sdpa_backends.py`
reads the op names torch.profiler records for the exact calls engine.layers.attention makes --
`enable_gqa=True`, so K/V are never repeated to H heads; a boolean mask for prefill and chunks,
none for decode): CPU flash attention, in fp32, bf16 and fp16 alike, faster than the math kernel
(a dated run: docs/history/2026-12-01-cpu-kernels-and-rates.md) -- except an fp32 decode step on
the CPU, which runs `engine.layers.decode_attention` (three ops: faster than the flash kernel on
K/V that a decode step's weight reads have pushed out of the cache). A plain causal pass (a fresh
prefill chunk: queries and keys the same positions, no window cut) is passed as `is_causal=True`
(engine.layers.sdpa), bitwise the masked form, so the kernel can skip the keys above the
diagonal; chunks after a prefix and sliding windows keep the explicit mask, whose whole rectangle
it computes (`score_pairs` counts either for the cost model and the roofline). On CUDA the mask
rules out the flash kernel (engine.planner plans for math); unmeasured.

Dimension legend: B=batch, T=new tokens, S=tokens attended, D=hidden, H/K=query/kv heads,
h=head dim, N=B*T rows.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.blocks.base import Block, Pass, TensorSpec, Transient
from engine.blocks.rope import Rope
from engine.devices import Device
from engine.kernels.cpu import linear, linears
from engine.kv import FullKV, KVState, LayerState, SlidingKV, StateTerm
from engine.kvquant import DEFAULT_KV_DTYPE, KVFormatError, kv_format
from engine.layers import attention, causal_mask, fused_decode_ok, heads_first, plain_causal, rms_norm, rope_attention
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

QK_NORMS = ("none", "head", "full")
# the CPU threads a plan is made for (engine.planner.plan_memory's cpu_threads), so a plan made
# before torch loads (moebench plan) needs none; unset: the threads torch runs with now
PLAN_CPU_THREADS: ContextVar[int | None] = ContextVar("PLAN_CPU_THREADS", default=None)
FLASH_CPU_Q_BLOCK, FLASH_CPU_KV_BLOCK = 256, 512                      # torch's CPU flash-attention blocking


@dataclass(frozen=True)
class KernelCost:
    """The attention kernel's work in one pass (projections apart: they are weights, counted by
    their parameters): `flops`, the `bytes` it reads and writes (the layer's state, its queries
    and output), and `scores`, the score elements it computes (0 for a recurrence)."""

    flops: float
    bytes: float
    scores: float = 0.0


class AttentionBlock(Block, ABC):
    """x [B, T, D] (normed) -> [B, T, D], reading and appending the layer's state."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    @abstractmethod
    def forward(self, x: torch.Tensor, state: LayerState, p: Pass) -> torch.Tensor: ...

    @abstractmethod
    def new_state(self, batch: int, max_tokens: int | None, device: Device, dtype: torch.dtype,
                  label: str, kv_dtype: str | None = None) -> LayerState:
        """This layer's empty state for a session (allocated on first use; planned: at max_tokens),
        stored in `kv_dtype` (engine.kvquant; None: the model's dtype). A kind that cannot store
        that format refuses it (`require_exact_state`), never ignores it."""

    @abstractmethod
    def state_term(self, dtype_bytes: int, kv_dtype: str | None = None) -> StateTerm:
        """What `new_state`'s state costs in the plan; bytes(max_tokens, batch) == its allocation."""

    def kv_read_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, kv_dtype: str | None) -> int:
        """Transient bytes of reading the state back in the compute dtype (0: read in place)."""
        return 0

    state_kind: ClassVar[str] = ""    # how refusals name this block's state ("an MLA latent (LatentKV)")

    def static_refusal(self) -> str | None:
        """None when a static decode step (engine.static_decode) can write and read this layer's
        state at a device position; else the state kind that it cannot (the refusal names it)."""
        return self.state_kind or f"the state of {type(self).__name__}"

    def require_exact_state(self, kv_dtype: str | None) -> None:
        """Refuse a kv_dtype other than the model's for a state kind stored only exactly."""
        if kv_dtype not in (None, DEFAULT_KV_DTYPE):
            raise KVFormatError(f"kv_dtype={kv_dtype!r} applies to the KV cache of grouped-query attention (full "
                                f"and sliding-window KV); layer {self.layer} keeps {self.state_kind}, which is stored "
                                f"only in the model's dtype; allowed for this model: kv_dtype={DEFAULT_KV_DTYPE!r}")

    @abstractmethod
    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        """Transient bytes of the block's own tensors over `rows` rows (the attention kernel's
        workspace apart)."""

    @abstractmethod
    def workspace_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str) -> int:
        """Worst-case attention-kernel workspace (engine.planner's docstring says which kernel and why)."""

    @abstractmethod
    def kernel_cost(self, batch: int, tokens: int, past: int, dtype_bytes: int,
                    kv_dtype: str | None = None) -> KernelCost:
        """The kernel's work for `tokens` new tokens of `batch` sequences after `past` (the cost
        model's and the roofline's attention term)."""

    def __call__(self, x: torch.Tensor, state: LayerState, p: Pass) -> torch.Tensor:
        return self.forward(x, state, p)


def score_pairs(tokens: int, keys: int, causal: bool) -> int:
    """Query-key pairs per head one SDPA call computes for `tokens` queries over `keys` keys: the
    lower triangle T(T+1)/2 for a plain causal pass (is_causal: the kernel skips what lies above the
    diagonal), else the whole T x S rectangle under its mask."""
    return tokens * (tokens + 1) // 2 if causal else tokens * keys


def sdpa_workspace_bytes(batch: int, heads: int, head_dim: int, tokens: int, context: int, dtype_bytes: int,
                         device_kind: str, kv_heads: int | None = None) -> int:
    """Worst-case scaled_dot_product_attention workspace for `tokens` new tokens per sequence
    attending to `context` keys at `heads` query heads and `kv_heads` key/value heads (None: as
    many; fewer: grouped-query, `enable_gqa`) (engine.planner's docstring)."""
    B, T, S, H, hd, db = batch, tokens, context, heads, head_dim, dtype_bytes
    K = H if kv_heads is None else kv_heads
    f32 = 4
    mask = T * S * (1 + max(db, f32)) if T > 1 else 0                  # bool [T, S] and its additive float form
    if device_kind == "cuda":                                           # math kernel: materialised, fp32
        # its op sequence (traced under SDPBackend.MATH: engine.planner's docstring): the scores, and
        # inside `_safe_softmax` their softmax, a bool [B, H, T, S] of -inf scores and the `where`
        # that zeroes fully masked rows -- 3 fp32 + 1 byte per score at once
        scores = B * H * T * S * (3 * f32 + 1)
        # q upcast and scaled; k and v upcast (K heads), repeated to H heads when K < H, and k scaled
        upcast = B * (2 * H * T + 2 * K * S + (3 if K < H else 1) * H * S) * hd * f32
        return scores + upcast + mask
    if device_kind != "cpu":
        raise ValueError(f"device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
    if T == 1 and db == f32:                                            # engine.layers.decode_attention: the
        return 2 * B * H * S * f32                                      # scores and their softmax, [B, H, S] fp32
    qb, kb = min(T, FLASH_CPU_Q_BLOCK), min(S, FLASH_CPU_KV_BLOCK)
    per_thread = (qb * kb + 2 * qb + qb * hd) * f32 + (qb * kb * db if db < f32 else 0)
    threads = PLAN_CPU_THREADS.get() or torch.get_num_threads()
    return threads * per_thread + B * H * T * f32 + mask  # + logsumexp [B, H, T]


class GQAAttention(AttentionBlock):
    """Grouped-query attention over a full KV cache (Mixtral, Qwen2/3-MoE, OLMoE; GLM-4.5's shape)."""

    causal_skips: ClassVar[bool] = True     # `attend` passes a plain causal mask as is_causal (engine.layers.sdpa)

    def __init__(self, layer: int, prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, rope: Rope,
                 eps: float, qkv_bias: bool = False, o_bias: bool = False, qk_norm: str = "none",
                 clip_qkv: float | None = None, window: int | None = None, scale: float | None = None) -> None:
        """prefix: e.g. "model.layers.3.self_attn."; qk_norm: none | head (Qwen3, per head over h) |
        full (OLMoE, over the whole projection); window: a query sees the last `window` positions
        (itself included) and the state keeps only window - 1 tokens; scale: of the scores
        (default head_dim^-0.5; Gemma 4: 1.0)."""
        super().__init__(layer)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        if heads % kv_heads:
            raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
        self.prefix, self.D, self.H, self.K, self.hd = prefix, hidden, heads, kv_heads, head_dim
        self.rope, self.eps, self.qkv_bias, self.o_bias = rope, eps, qkv_bias, o_bias
        self.qk_norm, self.clip_qkv, self.window, self.scale = qk_norm, clip_qkv, window, scale

    def tensors(self) -> dict[str, TensorSpec]:
        a, D, H, K, hd = self.prefix, self.D, self.H, self.K, self.hd
        t = {"q": TensorSpec(a + "q_proj.weight", (H * hd, D)), "k": TensorSpec(a + "k_proj.weight", (K * hd, D)),
             "v": TensorSpec(a + "v_proj.weight", (K * hd, D)), "o": TensorSpec(a + "o_proj.weight", (D, H * hd))}
        if self.qkv_bias:
            t |= {"q_b": TensorSpec(a + "q_proj.bias", (H * hd,)), "k_b": TensorSpec(a + "k_proj.bias", (K * hd,)),
                  "v_b": TensorSpec(a + "v_proj.bias", (K * hd,))}
        if self.o_bias:
            t["o_b"] = TensorSpec(a + "o_proj.bias", (D,))
        if self.qk_norm != "none":
            full = self.qk_norm == "full"
            t |= {"q_norm": TensorSpec(a + "q_norm.weight", (H * hd if full else hd,), "ones"),
                  "k_norm": TensorSpec(a + "k_norm.weight", (K * hd if full else hd,), "ones")}
        return t

    def forward(self, x: torch.Tensor, state: KVState, p: Pass) -> torch.Tensor:
        w, eps, hd = self.w, self.eps, self.hd
        B, T, _ = x.shape
        # decode's few rows on the CPU: the engine's kernel, on every thread (engine.kernels.cpu)
        if self.qkv_bias:
            q, k, v = (linear(x, w[n], w[n + "_b"]) for n in ("q", "k", "v"))
        else:
            q, k, v = linears(x, (w["q"], w["k"], w["v"]))
        if self.qk_norm == "full":    # OLMoE: norm over the whole projection, before the head split
            q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)     # [B, T, H*h] / [B, T, K*h]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.qk_norm == "head":    # Qwen3: per-head norm over h
            q, k = rms_norm(q.view(B, T, -1, hd), w["q_norm"], eps), rms_norm(k.view(B, T, -1, hd), w["k_norm"], eps)
        q, k, v = (heads_first(t, hd) for t in (q, k, v))                          # [B, H|K, T, h]
        return linear(self.rotate_and_attend(q, k, v, state, p), w["o"], w.get("o_b"))    # [B, T, D]

    def rotate_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: KVState,
                          p: Pass) -> torch.Tensor:
        """q [B, H, T, h], k/v [B, K, T, h] (projected and normed) -> [B, T, H*h]: rope, the
        state's keys and values, the causal (window) mask, `attend` (what a subclass with other
        projections or an output gate reuses)."""
        cos, sin = self.rope.tables(p)
        if p.static is None and self.fused_decode and fused_decode_ok(q, v, cos):
            bufs = state.decode_buffers(p.past)                                    # exact full KV: its buffers
            if bufs is not None:                                                   # one kernel op on the CPU
                scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
                return rope_attention(q, k, v, cos, sin, *bufs, p.past, scale)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        if p.static is not None:      # a fixed-shape decode step: written at a device position, keys masked on the device
            k_all, v_all = state.write_at(k, v, p.static)                          # [B, K, keys, h]
            return self.attend(q, k_all, v_all, p.cached("static mask", p.static.mask))
        k_all, v_all, kv_start = state.append(k, v, p.past)                        # [B, K, S, h]
        mask = p.cached(("mask", self.window, kv_start),
                        lambda: causal_mask(q.shape[2], p.past, self.window, p.device, kv_start))
        return self.attend(q, k_all, v_all, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, T, h], k/v [B, K, S, h] -> [B, T, H*h] (a subclass adds sinks, soft-capping, ...)."""
        return attention(q, k, v, mask, self.scale)

    @property
    def fused_decode(self) -> bool:
        """Whether a decode step may run rope, the KV write and `attend` as engine.layers.rope_attention:
        the plain rotation and attention (a subclass's own `attend` or rope opts out) over a full KV."""
        return (self.window is None and type(self).attend is GQAAttention.attend
                and type(self.rope).apply is Rope.apply)

    def new_state(self, batch: int, max_tokens: int | None, device: Device, dtype: torch.dtype,
                  label: str, kv_dtype: str | None = None) -> KVState:
        if self.window is not None:
            return SlidingKV(device, label, batch, self.K, self.hd, dtype, max_tokens, self.window, kv_dtype)
        return FullKV(device, label, batch, self.K, self.hd, dtype, max_tokens, kv_dtype)

    def static_refusal(self) -> str | None:
        return None if self.window is None else f"a sliding-window KV ({self.window}-token window)"

    def state_term(self, dtype_bytes: int, kv_dtype: str | None = None) -> StateTerm:
        kv_format(kv_dtype).check(self.hd)
        if self.window is not None:
            return SlidingKV.term(self.K, self.hd, dtype_bytes, self.window, kv_dtype)
        return FullKV.term(self.K, self.hd, dtype_bytes, kv_dtype)

    def kv_read_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, kv_dtype: str | None) -> int:
        """A stored format other than the model's is read back as new k/v [B, K, S, h] (the
        attended positions), dequantised through fp32 one buffer at a time (values and their
        product with the scales, 4 + 4 bytes, and q4's unpacked codes, 2), after the new tokens'
        fp32 quantisation temporaries (x, its scaled form, its codes: 12 bytes per value)."""
        fmt = kv_format(kv_dtype)
        if fmt.cast is None and not fmt.blocked:
            return 0
        S = context if self.window is None else min(context, self.window - 1 + tokens)
        n, new = batch * self.K * S * self.hd, batch * self.K * tokens * self.hd
        if not fmt.blocked:
            return 2 * n * dtype_bytes
        return 2 * n * dtype_bytes + 10 * n + 12 * new

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        N, db, H, K, hd = rows, dtype_bytes, self.H, self.K, self.hd
        return Transient(N * (H + 2 * K) * hd * db * 2                 # q/k/v and their normed or clipped copies
                + 3 * N * H * hd * db                         # rotary temporaries (x*cos, rotated, *sin)
                + 2 * N * H * hd * db + N * self.D * db)     # attention output, its [N, H*h] copy, o-proj

    def held_keys(self, tokens: int, past: int) -> int:
        """Keys a pass over `tokens` new tokens after `past` attends: the whole context, or the
        window's held tokens and the new ones."""
        return past + tokens if self.window is None else min(past + tokens, self.window - 1 + tokens)

    def kernel_cost(self, batch: int, tokens: int, past: int, dtype_bytes: int,
                    kv_dtype: str | None = None) -> KernelCost:
        # one SDPA call on q [B, H, T, h] and the state's k/v [B, K, S, h] with enable_gqa: scores
        # and weighted sums over the causal triangle of a fresh pass, else the mask's whole T x S
        # rectangle; K/V read once at K heads, q read and the output written at H heads
        B, T, S, H, hd = batch, tokens, self.held_keys(tokens, past), self.H, self.hd
        causal = self.causal_skips and plain_causal(T, past, past + T - S, self.window)   # S - T keys held
        pairs = score_pairs(T, S, causal)
        state = self.state_term(dtype_bytes, kv_dtype).per_token * S * B
        return KernelCost(flops=4.0 * B * H * hd * pairs, bytes=float(state + 2 * B * T * H * hd * dtype_bytes),
                          scores=float(B * H * pairs))

    def workspace_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str) -> int:
        if self.window is None:
            return sdpa_workspace_bytes(batch, self.H, self.hd, tokens, context, dtype_bytes, device_kind, self.K)
        S = self.held_keys(tokens, context - tokens)                      # held keys and the new ones
        window_copy = 2 * batch * self.K * S * self.hd * dtype_bytes      # their concatenation (SlidingKV.append)
        return sdpa_workspace_bytes(batch, self.H, self.hd, tokens, S, dtype_bytes, device_kind, self.K) + window_copy
