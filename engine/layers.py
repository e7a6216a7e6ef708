"""Functional transformer pieces shared by every family: RMSNorm (both cast orders),
rotary embedding, causal masks, attention over a KV cache, the SwiGLU expert FFN on a packed
buffer, the dense MLP and the softmax top-k router.

Owns: the numerics, written to match Hugging Face transformers op for op (dtype casts
included) so logits agree to fp32 rounding. Does not own: weights, which tensors a layer has
(engine.blocks: the blocks that call these) or where experts live.

Dimension legend: B=batch, T=new tokens, S=tokens in the KV cache, H=query heads,
K=kv heads, h=head dim, D=hidden, I=expert intermediate, E=experts, k=top-k, N=B*T rows.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.kernels import cpu as kernels
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


# each reads F when it runs, not when this module is imported (families validate against the names
# without loading torch: engine.lazy)
ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda x: F.silu(x),
    "relu": lambda x: F.relu(x),
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def memo(t: torch.Tensor, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, computed once per tensor object `t` and kept on it: what a per-pass table (rope's
    sin) or a stored buffer (a packed expert's views) derives for every call that reads it, where
    recomputing it per call would be ops of dispatch each time (a decode step's cost is mostly
    per-op dispatch: benchmarks/profile_decode.py). What it keeps is a value (then `t` must not be
    written in place afterwards) or aliases of `t`'s memory (`alias`: they see every write). Never
    views of `t`: a view holds `t` itself from C++, so `t` -> its memo -> the view -> `t` would be a
    reference cycle Python's garbage collector cannot see, and `t` (a store's or cache's buffer)
    would outlive every engine that used it."""
    d = t.__dict__
    if key not in d:
        d[key] = make()
    return d[key]


def alias(t: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """A tensor over `t`'s memory -- `shape` and `stride` from element `offset` of `t` -- that,
    unlike a view, holds `t`'s storage and not `t` (what a memo on `t` may keep: `memo`)."""
    with torch.inference_mode(t.is_inference()):     # an inference tensor exactly when `t` is, as a view
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(t.untyped_storage(), t.storage_offset() + offset, shape, stride)


def rows(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`t.unbind(0)` as aliases (`alias`)."""
    return tuple(alias(t, t.shape[1:], t.stride()[1:], i * t.stride(0)) for i in range(t.shape[0]))


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without the call when it is already `dtype` (the same tensor either way)."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the weight multiplies the normed x cast back to x's dtype. On the CPU
    one kernel op (engine.kernels.cpu.rms_norm: a decode step's norm is 5 ops of dispatch here)."""
    if _norm_weight_ok(x, weight) and kernels.takes(x):
        return kernels.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = cast(x, torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * cast(x32, dtype)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm scaled in fp32 before the cast back: `(x32 * (offset + w)).to(dtype)` (GPT-OSS with
    offset 0; Qwen3-Next's and Gemma's zero-centred `1 + w` with offset 1; no weight: plain norm).
    On the CPU one kernel op, as `rms_norm`."""
    if (weight is None or _norm_weight_ok(x, weight)) and kernels.takes(x):
        return kernels.rms_norm(x, weight, eps, offset, scale_fp32=True)
    dtype = x.dtype
    x32 = cast(x, torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        x32 = x32 * (offset + weight.float()) if offset else x32 * weight.float()
    return cast(x32, dtype)


def _norm_weight_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel's RMSNorm takes this weight for x: x's dtype, [D] contiguous on the CPU."""
    return (weight.dtype == x.dtype and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and weight.device.type == "cpu" and weight.is_contiguous())


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, linear_factor: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for absolute `positions` [T]; each [T, h]."""
    freqs = positions.float()[:, None] * _inv_freq(head_dim, theta, linear_factor, positions.device)   # [T, h/2]
    emb = torch.cat((freqs, freqs), dim=-1)                          # [T, h]
    return cast(emb.cos(), dtype), cast(emb.sin(), dtype)


@functools.cache
def _inv_freq(head_dim: int, theta: float, linear_factor: float, device: torch.device) -> torch.Tensor:
    """[1, h/2] fp32 inverse frequencies (transformers' default rope), made once per rope and device:
    every pass's tables start from them (half a dozen ops of dispatch per decode step otherwise)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    return inv_freq[None, :]


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [T, r] with its first half negated: `rotate_half(x) * sin == x.roll(r/2) * signed`,
    bitwise (a product's sign is the xor of its factors' signs), in one op instead of four; made
    once per sin table (`memo`)."""
    def make() -> torch.Tensor:
        half = sin.shape[-1] // 2
        return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return memo(sin, "signed_sin", make)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, h]; cos/sin [T, r] with r <= h: the first r dims rotate (partial rotary), the rest pass.
    transformers' `x * cos + rotate_half(x) * sin`, bitwise, with the rotation a roll against a
    sin whose first half is negated (made once per sin table: `memo`)."""
    r = cos.shape[-1]
    signed = _signed_sin(sin)
    if x.is_contiguous() and cos.dim() == 2 and cos.dtype == x.dtype and kernels.takes(x):
        return kernels.rope(x, cos, signed)                         # on the CPU one kernel op, the same bits
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, -1) * signed
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rot.roll(r // 2, -1) * signed, rest), dim=-1)


def _attention_kernel_takes(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels' decode attention takes q [B, H, 1, h] and v's head dim: multiples of 8,
    q on the CPU with the kernels on."""
    return q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0 and kernels.takes(q)


def fused_decode_ok(q: torch.Tensor, v: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope_attention` takes a decode step's q [B, H, 1, h] / v and its rope tables: one
    fp32 token per sequence, one table row, the kernels' attention (`_attention_kernel_takes`)."""
    return (q.shape[2] == 1 and q.dtype == torch.float32 and cos.dim() == 2 and cos.dtype == q.dtype
            and _attention_kernel_takes(q, v))


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_buf: torch.Tensor, v_buf: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A decode step's `apply_rope`, KV write and `attention` (no mask) in one kernel op
    (`fused_decode_ok`): q [B, H, 1, h] and k/v [B, K, 1, h] (projected and normed), k and v written
    at position `start` of the exact KV buffers [B, K, capacity, h], q attending to positions
    0..start -> [B, 1, H*h]; the rotation bit for bit, the attention up to fp32 rounding."""
    return heads_last(kernels.rope_attention(q, k, v, cos, _signed_sin(sin), k_buf, v_buf, start, scale))


def plain_causal(T: int, past: int, kv_start: int, window: int | None) -> bool:
    """Whether T queries at positions past.. over the keys kv_start..past+T-1 are a plain
    lower-triangular mask (queries and keys the same positions, no window cut): `sdpa` passes it
    as is_causal, and the kernel skips the keys above the diagonal."""
    return past == kv_start and (window is None or window >= T)


def causal_mask(T: int, past: int, window: int | None, device: torch.device,
                kv_start: int = 0) -> torch.Tensor | None:
    """Boolean [T, S] mask (True = may attend) of T queries at positions past.. over the keys at
    positions kv_start..past+T-1 (S of them), or None when plain decode needs none."""
    if T == 1 and (window is None or past - kv_start + 1 <= window):
        return None
    q = torch.arange(past, past + T, device=device)[:, None]        # [T, 1]
    kv = torch.arange(kv_start, past + T, device=device)[None, :]   # [1, S]
    mask = kv <= q
    if window is not None:
        mask &= kv > q - window
    mask.plain_causal = plain_causal(T, past, kv_start, window)        # sdpa says is_causal
    return mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
         enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention under `mask`; a plain causal one (`causal_mask` marks it) is
    passed as is_causal instead, which the CPU flash kernel computes bitwise as the masked form
    while skipping the key blocks above the diagonal (half the work of a long fresh prefill;
    tests/engine/test_blocks.py)."""
    if mask is not None and getattr(mask, "plain_causal", False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def heads_first(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x [B, T, H*h] or [B, T, H, h] (contiguous) -> [B, H, T, h]: `view(B, T, H, h).transpose(1, 2)`;
    for one token (decode) one view of the same elements instead (T = 1: the two place every
    element at the same address; one op of dispatch less per tensor)."""
    B, T = x.shape[:2]
    if T == 1:
        return x.view(B, -1, 1, head_dim)
    return x.view(B, T, -1, head_dim).transpose(1, 2)


def heads_last(x: torch.Tensor) -> torch.Tensor:
    """An attention output x [B, H, T, h] -> [B, T, H*h]: `transpose(1, 2).reshape`; for one token
    (decode) the reshape alone ([B, H, 1, h] flattens in the transposed order as it is)."""
    B, H, T, hd = x.shape
    return x.reshape(B, 1, H * hd) if T == 1 else x.transpose(1, 2).reshape(B, T, H * hd)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None) -> torch.Tensor:
    """q [B, H, T, h], k/v [B, K, S, h] -> [B, T, H*h]; scores scaled by `scale` (default h^-0.5)."""
    B, H, T, hd = q.shape
    scale = hd ** -0.5 if scale is None else scale
    if decode_on_cpu(q, mask):
        return heads_last(decode_attention(q, k, v, scale))
    # grouped-query attention without materialising repeated K/V (a copy of the whole cache per layer per step)
    out = sdpa(q, k, v, mask, scale, enable_gqa=H != k.shape[1])   # [B, H, T, h]
    return heads_last(out)                                          # [B, T, H*h]


def decode_on_cpu(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attention` takes `decode_attention`: one fp32 query per sequence over every held key
    (no mask), on the CPU."""
    return q.shape[2] == 1 and mask is None and q.dtype == torch.float32 and q.device.type == "cpu"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode step's attention on the CPU as three ops: q [B, H, 1, h] grouped by key head
    [B, K, G, h] (G = H/K), scores against k [B, K, S, h], softmax, times v [B, K, S, hv] -> [B, H, 1, hv].
    Why not SDPA: CPU flash attention walks the keys in blocks for one query, and reads K/V that a
    decode step's weight reads have pushed out of the cache more slowly than these matrix products
    do (docs/cpu_experts.md has the measurement). The scores, [B, H, S] fp32, exist twice at once
    (scaled in place, then their softmax: the plan's workspace, engine.blocks.attention.
    sdpa_workspace_bytes); the sums group terms differently from the flash kernel's, so equal to
    it up to fp32 rounding."""
    if k.dtype == v.dtype == q.dtype and k.stride(-1) == 1 and v.stride(-1) == 1 and _attention_kernel_takes(q, v):
        return kernels.decode_attention(q, k, v, scale)             # one kernel op, threaded over key heads
    B, H, _, h = q.shape
    K = k.shape[1]
    scores = torch.matmul(q.reshape(B, K, H // K, h), k.transpose(-1, -2)).mul_(scale)   # [B, K, G, S]
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(B, H, 1, v.shape[-1])


def gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """`ACT[act](gate) * up` (gate, up [n, I]): for SiLU on the CPU one kernel op (engine.kernels.
    cpu.silu_mul: equal up to fp32 rounding), else torch's two."""
    if (act == "silu" and gate.dim() == 2 and up.dtype == gate.dtype and gate.stride(-1) == 1 and up.stride(-1) == 1
            and up.shape == gate.shape and kernels.takes(gate)):
        return kernels.silu_mul(gate, up)
    return ACT[act](gate) * up


def swiglu_matrices(packed: torch.Tensor, D: int, I: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed SwiGLU expert [gate (I*D) | up (I*D) | down (D*I)] as its two matrices, gate|up
    [2I, D] and down [D, I] (aliases of its memory, made once per buffer: `memo`)."""
    return memo(packed, f"swiglu {D}x{I}", lambda: (alias(packed, (2 * I, D), (D, 1)),          # [2I, D]
                                                    alias(packed, (D, I), (I, 1), 2 * I * D)))  # [D, I]


def expert_ffn(x: torch.Tensor, packed: torch.Tensor, D: int, I: int, act: str,
               linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """SwiGLU expert on a packed buffer [gate (I*D) | up (I*D) | down (D*I)]; x [n, D] -> [n, D].
    linear(x, w): the matrix product (default F.linear; engine.kernels.cpu's on the CPU)."""
    linear = linear or F.linear
    gate_up, down = swiglu_matrices(packed, D, I)
    gate, up = linear(x, gate_up).chunk(2, dim=-1)                 # [n, I] each
    return linear(gated(gate, up, act), down)                      # [n, D]


@functools.cache
def grouped_mm() -> Callable[..., torch.Tensor] | None:
    """The public name where this torch has it, else the operator it calls (torch._grouped_mm, the
    same signature): the lent GPU machine runs torch 2.11, the CI 2.13, and whether 2.11 has the
    public name is unverified. None: neither."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `F.grouped_mm` takes this dtype on this device: any float dtype on the CPU (a loop of
    mm per group, bitwise equal to F.linear on each group: tests/engine/test_dispatch.py), bf16 on
    CUDA (its documented kernel, SM >= 80; unverified here: no GPU in this project's CI)."""
    if grouped_mm() is None:
        return False
    return device.type == "cpu" or (device.type == "cuda" and dtype == torch.bfloat16)


def expert_ffn_grouped(x: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor, D: int, I: int,
                       act: str, linear: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """`expert_ffn` of every expert of a layer at once: x [M, D] grouped by expert, rows [E, P] the
    packed experts, offs [E] int32 end of each group in x -> [M, D]. No host sync: the group
    sizes stay on the device (grouped GEMMs with device offsets). linear(x, w [E, O, K], offs):
    the grouped product (default F.grouped_mm on w transposed)."""
    E = rows.shape[0]
    gate_up = rows[:, : 2 * I * D].view(E, 2 * I, D)                  # [E, 2I, D]
    down = rows[:, 2 * I * D:].view(E, D, I)                           # [E, D, I]
    if linear is None:
        mm = grouped_mm()
        linear = lambda a, w, offs: mm(a, w.transpose(1, 2), offs=offs)   # noqa: E731
    gate, up = linear(x, gate_up, offs).chunk(2, dim=-1)                # [M, I] each
    return linear(gated(gate, up, act), down, offs)                     # [M, D]


def dense_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    return F.linear(gated(F.linear(x, gate), F.linear(x, up), act), down)


def route(h: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk: bool,
          keep_fp32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, D] -> (expert ids [N, k] int64, weights [N, k]) exactly as transformers' TopKRouter;
    a decode step's few rows on the CPU in one kernel op (up to fp32 rounding)."""
    if h.dim() == 2 and h.shape[0] <= kernels.MAX_ROWS and kernels.usable(h, router_w):
        top_i, top_w = kernels.softmax_topk(h, router_w, top_k, norm_topk)
        return top_i, top_w if keep_fp32_weights else top_w.to(h.dtype)
    logits = F.linear(h, router_w)                                   # [N, E]
    probs = torch.softmax(cast(logits, torch.float32), dim=-1)       # [N, E] fp32
    top_w, top_i = torch.topk(probs, top_k, dim=-1)                  # [N, k]
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if not keep_fp32_weights:  # Qwen/OLMoE cast back to the activation dtype; Mixtral keeps fp32
        top_w = top_w.to(logits.dtype)
    return top_i, top_w
