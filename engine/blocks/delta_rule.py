"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) and its short causal convolution, in
plain PyTorch: the recurrence a linear-attention layer (Qwen3-Next, Qwen3.5-MoE) runs over a
fixed per-sequence state instead of a KV cache.

Owns: the numerics -- `causal_conv` (a depthwise causal conv1d continuing from the last K-1
inputs), `chunked_delta_rule` (prefill: one chunk of up to CHUNK tokens at a time, the chunk's
delta-rule updates condensed by a unit-lower-triangular solve), `recurrent_delta_rule`
(decode: the step form, token by token) -- written to match transformers' torch fallbacks
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_*`) to fp32
rounding (tests/engine/test_recurrent.py). Does not own: the projections around it or the
state's storage (engine.blocks.deltanet).

The recurrence, per head, with state S [dk, dv], for token t (q, k l2-normed, q scaled by dk^-1/2):

    S <- exp(g_t) S                       decay (g_t <= 0, in log space)
    u_t = beta_t (v_t - S^T k_t)          the part of v_t the state does not predict yet
    S <- S + k_t u_t^T                    delta-rule write
    o_t = S^T q_t

Within a chunk of C tokens starting from state S0, with G_t = g_1 + ... + g_t and
D_tj = exp(G_t - G_j) (j <= t), the writes satisfy (I + A) U = beta*V - (beta*exp(G)*K) S0 with
A_tj = beta_t D_tj k_t.k_j strictly below the diagonal, so one triangular solve gives every u_t;
then O = (exp(G)*Q) S0 + ((Q K^T) * D) U and S_C = exp(G_C) S0 + (exp(G_C - G)*K)^T U.

Dimension legend: B=batch, T=tokens, H=value heads, dk/dv=key/value head dims, C=conv
channels, K=conv kernel, c=tokens in one chunk.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())


CHUNK = 64                      # tokens per chunk of the prefill form (transformers' chunk_size)
L2_EPS = 1e-6                   # the l2 norm of q and k (FLA's and transformers' value)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, held: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C, T] new inputs, held [B, C, K-1] the inputs before them (zeros at the start),
    weight [C, K] -> (conv output [B, C, T], the last K-1 inputs [B, C, K-1] to hold next)."""
    K = weight.shape[1]
    full = torch.cat((held, x), dim=-1).to(weight.dtype)                          # [B, C, K-1+T]
    out = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])             # [B, C, T]
    return out, full[..., full.shape[-1] - (K - 1):]


def _fp32_heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    """[B, T, H, ...] -> [B, H, T, ...] contiguous fp32 (what both forms compute in)."""
    return [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in xs]


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k [B, T, H, dk], v [B, T, H, dv], g/beta [B, T, H], state [B, H, dk, dv] fp32 ->
    (o [B, T, H, dv] in q's dtype, the new state [B, H, dk, dv] fp32)."""
    dtype, T = q.dtype, q.shape[1]
    q, k, v, beta, g = _fp32_heads_first(q, k, v, beta, g)                        # [B, H, T, ...]
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    S = state.to(torch.float32)
    out = torch.empty_like(v)                                                      # [B, H, T, dv]
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        qc, kc, vc, bc = q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta[:, :, a:b, None]
        G = g[:, :, a:b].cumsum(dim=-1)                                            # [B, H, c]
        c = b - a
        later = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)        # j > t
        D = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()  # [B, H, c, c]
        kb = kc * bc                                                               # [B, H, c, dk]
        A = (kb @ kc.transpose(-1, -2)) * D                                        # diagonal ignored below
        eG = G.exp()[..., None]                                                    # [B, H, c, 1]
        u = torch.linalg.solve_triangular(A, vc * bc, upper=False, unitriangular=True)     # [B, H, c, dv]
        w = torch.linalg.solve_triangular(A, kb * eG, upper=False, unitriangular=True)     # [B, H, c, dk]
        u = u - w @ S                                                              # the writes u_t
        out[:, :, a:b] = (qc * eG) @ S + ((qc @ kc.transpose(-1, -2)) * D) @ u
        last = G[..., -1:]                                                         # [B, H, 1]
        S = S * last.exp()[..., None] + (kc * (last - G).exp()[..., None]).transpose(-1, -2) @ u
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), S


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step form, token by token (decode); the same arguments and results as chunked_delta_rule."""
    dtype, T = q.dtype, q.shape[1]
    q, k, v, beta, g = _fp32_heads_first(q, k, v, beta, g)
    q, k = l2norm(q), l2norm(k)
    q = q / q.shape[-1] ** 0.5
    S = state.to(torch.float32)
    out = torch.empty_like(v)
    for t in range(T):
        qt, kt, vt = q[:, :, t], k[:, :, t], v[:, :, t]                            # [B, H, dk|dv]
        S = S * g[:, :, t].exp()[..., None, None]
        u = (vt - (S * kt[..., None]).sum(dim=-2)) * beta[:, :, t, None]          # [B, H, dv]
        S = S + kt[..., None] * u[..., None, :]
        out[:, :, t] = (S * qt[..., None]).sum(dim=-2)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), S


def chunk_workspace_bytes(batch: int, heads: int, dk: int, dv: int, tokens: int, chunk: int = CHUNK) -> int:
    """Bytes chunked_delta_rule allocates beyond its fp32 copies of q/k/v (counted per row by the
    block): one chunk's [c, c] matrices (decay, A, QK^T and its product with D, the mask), its
    [c, d] temporaries and the running state (fp32)."""
    c, f32 = min(chunk, tokens), 4
    square = 5 * batch * heads * c * c * f32 + c * c                  # D (+ its difference), A, QK^T, (QK^T)*D; mask
    rows = batch * heads * c * (6 * dk + 5 * dv) * f32                # kb, kb*eG, qc*eG, kc*decay, w; vc*bc, u, w@S, out
    state = 3 * batch * heads * dk * dv * f32                         # S, the decayed S and the update
    return square + rows + state
