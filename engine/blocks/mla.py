"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) over its compressed state.

Owns: `LatentKV`, the state MLA keeps per session -- per token the normed KV latent
(kv_lora_rank) and the roped key shared by every head (qk_rope_head_dim), one
[B, S, rank + rope] buffer, never the per-head keys and values it stands for -- and
`MLAAttention`, the attention block that reads it: queries straight from the hidden state
or through a low-rank `q_lora_rank` bottleneck, interleaved or half-split rotary on the rope
dims (`rope_interleave`), the softmax scale given by the family (DeepSeek-V3's YaRN
correction). Does not own: the rope (engine.blocks.rope: Yarn), the state mechanics every kind
shares (engine.kv: Session, grown_capacity) or the family's config (engine.families.deepseek_v3).

Two kernels compute the same attention from the latent (tests/engine/test_sigmoid_families.py
holds both within 1e-4 of transformers and 1e-5 of each other):
- `absorbed` (default): the key up-projection is absorbed into the query and the value
  up-projection applied after the softmax, so attention runs in latent space as multi-query
  attention whose one key/value head *is* the state buffer: q' = [q_nope W_uk | q_rope]
  (rank + rope dims) against [latent | k_rope], and the same rows, of which the first `rank`
  dims are the values. Nothing per context token is expanded: the workspace is one
  scaled_dot_product_attention at head dim rank + rope (the value is passed as the whole row
  so the kernel sees equal head dims -- torch's CPU flash kernel needs them -- and its rope
  columns are dropped from the output).
- `expanded`: transformers' order, the slow obvious reference -- every held token's latent
  up-projected to per-head keys and values each pass (`kv_b_proj`), then attention at head
  dim nope + rope. Its workspace grows with the whole context times the heads.

    attn = MLAAttention(3, "model.layers.3.self_attn.", 7168, 128, 1536, 512, 128, 64, 128,
                        Yarn(64, 1e4, factor=40.0, ...), scale=..., interleave=True)

Dimension legend: B=batch, T=new tokens, S=tokens held, D=hidden, H=heads, n=qk nope dims,
d=qk rope dims, v=value dims, r=kv_lora_rank, q=q_lora_rank, N=B*T rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.attention import AttentionBlock, KernelCost, score_pairs, sdpa_workspace_bytes
from engine.blocks.base import Block, Pass, TensorSpec, Transient
from engine.blocks.norms import RMSNorm, norm_temp_bytes
from engine.blocks.rope import Rope
from engine.devices import Device
from engine.kv import LayerState, StateTerm, grown_capacity
from engine.layers import apply_rope, causal_mask, heads_last, plain_causal, sdpa
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

MLA_KERNELS = ("absorbed", "expanded")
LORA_NORM_EPS = 1e-6        # transformers' DeepseekV3RMSNorm default: q_a/kv_a_layernorm ignore rms_norm_eps


class LatentKV(LayerState):
    """[B, capacity, rank + rope] per layer: the normed latent, then the roped shared key, of
    every token; allocated once for the planned context (unplanned: grown by doubling)."""

    def __init__(self, device: Device, label: str, batch: int, rank: int, rope_dim: int, dtype: torch.dtype,
                 max_tokens: int | None) -> None:
        super().__init__(device, label)
        self.batch, self.rank, self.rope_dim, self.dtype, self.max_tokens = batch, rank, rope_dim, dtype, max_tokens
        self.capacity = 0
        self._buf: torch.Tensor | None = None

    @classmethod
    def term(cls, rank: int, rope_dim: int, dtype_bytes: int) -> StateTerm:
        return StateTerm(f"MLA latent ({rank} + {rope_dim} rope)", per_token=(rank + rope_dim) * dtype_bytes)

    @property
    def latent(self) -> torch.Tensor | None:
        """The buffer (its host copy while displaced)."""
        return self.host[0] if self.host is not None else self._buf

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._buf is None else [self._buf]

    def reserve(self, tokens: int, filled: int) -> None:
        cap = grown_capacity(tokens, self.capacity, self.max_tokens)
        if cap is None:
            return
        new = self.device.empty((self.batch, cap, self.rank + self.rope_dim), self.dtype, self.label)
        if self._buf is not None:
            new[:, :filled].copy_(self._buf[:, :filled])
            self.device.release(self.label, self._buf)
        self._buf, self.capacity = new, cap

    def append(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """Add [B, T, rank + rope] at positions [start, start+T); return every held row [B, S, rank + rope]."""
        end = start + rows.shape[1]
        self.reserve(end, start)
        self._buf[:, start:end].copy_(rows)
        return self._buf[:, :end]

    def snapshot(self, length: int) -> list[torch.Tensor]:
        return [t[:, :length] for t in self.tensors()]

    def _forget(self) -> None:
        self._buf = None
        self.capacity = 0


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary on x [..., T, d] with cos/sin [T, d] (cat(freqs, freqs)). interleave: the pairs are
    (x0, x1), (x2, x3), ... and come out half-split, as transformers' apply_rotary_pos_emb_interleave."""
    if not interleave:
        return apply_rope(x, cos, sin)
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAAttention(AttentionBlock):
    state_kind = "an MLA latent (LatentKV)"

    def __init__(self, layer: int, prefix: str, hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 nope_dim: int, rope_dim: int, v_dim: int, rope: Rope, scale: float, interleave: bool = True,
                 bias: bool = False, kernel: str = "absorbed") -> None:
        """prefix: e.g. "model.layers.3.self_attn."; q_lora_rank None: a plain q_proj; rope: over
        `rope_dim` dims; scale: of the scores (nope + rope)^-0.5 times any YaRN correction; bias:
        transformers' attention_bias (q_a_proj, kv_a_proj_with_mqa and o_proj)."""
        super().__init__(layer)
        if kernel not in MLA_KERNELS:
            raise ValueError(f"mla_kernel must be one of {MLA_KERNELS}, got {kernel!r}")
        if rope.dim != rope_dim:
            raise ValueError(f"the rope rotates {rope.dim} dims, qk_rope_head_dim is {rope_dim}")
        self.prefix, self.D, self.H, self.q, self.r = prefix, hidden, heads, q_lora_rank, kv_lora_rank
        self.n, self.d, self.v, self.rope, self.scale = nope_dim, rope_dim, v_dim, rope, scale
        self.interleave, self.bias, self.kernel = interleave, bias, kernel
        self.q_norm = RMSNorm(prefix + "q_a_layernorm.weight", q_lora_rank, LORA_NORM_EPS) if q_lora_rank else None
        self.kv_norm = RMSNorm(prefix + "kv_a_layernorm.weight", kv_lora_rank, LORA_NORM_EPS)

    def tensors(self) -> dict[str, TensorSpec]:
        a, D, H, q, r, n, d, v = self.prefix, self.D, self.H, self.q, self.r, self.n, self.d, self.v
        if q is None:
            t = {"q": TensorSpec(a + "q_proj.weight", (H * (n + d), D))}
        else:
            t = {"q_a": TensorSpec(a + "q_a_proj.weight", (q, D)), "q_b": TensorSpec(a + "q_b_proj.weight", (H * (n + d), q))}
        t |= {"kv_a": TensorSpec(a + "kv_a_proj_with_mqa.weight", (r + d, D)),
              "kv_b": TensorSpec(a + "kv_b_proj.weight", (H * (n + v), r)),
              "o": TensorSpec(a + "o_proj.weight", (D, H * v))}
        if self.bias:
            t |= {"kv_a_b": TensorSpec(a + "kv_a_proj_with_mqa.bias", (r + d,)), "o_b": TensorSpec(a + "o_proj.bias", (D,))}
            if q is not None:
                t["q_a_b"] = TensorSpec(a + "q_a_proj.bias", (q,))
        return t

    def children(self) -> tuple[Block, ...]:
        return (self.kv_norm,) if self.q_norm is None else (self.q_norm, self.kv_norm)

    def forward(self, x: torch.Tensor, state: LatentKV, p: Pass) -> torch.Tensor:
        w, H, n, d, r = self.w, self.H, self.n, self.d, self.r
        B, T, _ = x.shape
        if self.q is None:
            q = F.linear(x, w["q"])                                                      # [B, T, H*(n+d)]
        else:
            q = F.linear(self.q_norm(F.linear(x, w["q_a"], w.get("q_a_b"))), w["q_b"])
        q_nope, q_rot = q.view(B, T, H, n + d).transpose(1, 2).split([n, d], dim=-1)     # [B, H, T, n|d]
        latent, k_rot = F.linear(x, w["kv_a"], w.get("kv_a_b")).split([r, d], dim=-1)   # [B, T, r|d]
        cos, sin = self.rope.tables(p)
        q_rot = rotate(q_rot, cos, sin, self.interleave)
        k_rot = rotate(k_rot.unsqueeze(1), cos, sin, self.interleave).squeeze(1)        # [B, T, d]
        held = state.append(torch.cat((self.kv_norm(latent), k_rot), dim=-1), p.past)  # [B, S, r+d]
        mask = p.cached(("mask", None, 0), lambda: causal_mask(T, p.past, None, p.device))
        out = self.absorbed(q_nope, q_rot, held, mask) if self.kernel == "absorbed" else \
            self.expanded(q_nope, q_rot, held, mask)                                     # [B, T, H*v]
        return F.linear(out, w["o"], w.get("o_b"))                                       # [B, T, D]

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj per head: W_uk [H, n, r] (latent -> key) and W_uv [H, v, r] (latent -> value)."""
        up = self.w["kv_b"].view(self.H, self.n + self.v, self.r)
        return up[:, : self.n], up[:, self.n:]

    def absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, held: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """Attention in latent space: one key/value head, the held rows themselves."""
        B, H, T, _ = q_nope.shape
        w_uk, w_uv = self._up()
        q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rot), dim=-1)      # [B, H, T, r+d]
        kv = held.unsqueeze(1)                                                           # [B, 1, S, r+d]
        o = sdpa(q, kv, kv, mask, self.scale, enable_gqa=H > 1)
        out = torch.einsum("bhtr,hvr->bthv", o[..., : self.r], w_uv)                     # [B, T, H, v]
        return out.reshape(B, T, H * self.v)

    def expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, held: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """transformers' order: every held latent up-projected to per-head keys and values."""
        B, H, T, _ = q_nope.shape
        S = held.shape[1]
        latent, k_rot = held.split([self.r, self.d], dim=-1)                             # [B, S, r|d]
        kv = F.linear(latent, self.w["kv_b"]).view(B, S, H, self.n + self.v).transpose(1, 2)  # [B, H, S, n+v]
        k_nope, v = kv.split([self.n, self.v], dim=-1)
        k = torch.cat((k_nope, k_rot.unsqueeze(1).expand(B, H, S, self.d)), dim=-1)    # [B, H, S, n+d]
        o = sdpa(torch.cat((q_nope, q_rot), dim=-1), k, v, mask, self.scale)
        return heads_last(o)                                                             # [B, T, H*v]

    # --- state and plan ----------------------------------------------------------------------
    def new_state(self, batch: int, max_tokens: int | None, device: Device, dtype: torch.dtype,
                  label: str, kv_dtype: str | None = None) -> LatentKV:
        self.require_exact_state(kv_dtype)
        return LatentKV(device, label, batch, self.r, self.d, dtype, max_tokens)

    def state_term(self, dtype_bytes: int, kv_dtype: str | None = None) -> StateTerm:
        self.require_exact_state(kv_dtype)
        return LatentKV.term(self.r, self.d, dtype_bytes)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        N, db, D, H, q, r, n, d, v = rows, dtype_bytes, self.D, self.H, self.q, self.r, self.n, self.d, self.v
        q_path = N * H * (n + d) * db + (2 * N * q * db + norm_temp_bytes(N, q, db) if q else 0)
        kv_path = N * (r + d) * db * 3 + norm_temp_bytes(N, r, db)                       # kv_a, normed latent, row
        rope = 4 * N * (H + 1) * d * db                                                  # rotated halves, products
        if self.kernel == "absorbed":
            # q_nope W_uk [r], its cat with q_rope [r+d], the attention output [r+d], its latent part made
            # contiguous for the einsum [r], the per-head values and their reshape [v each]
            heads = N * H * (r + (r + d) + (r + d) + r + 2 * v) * db
        else:
            heads = N * H * (2 * (n + d) + 3 * v) * db      # query cat (and a copy); output, transpose, reshape
        return Transient(q_path + kv_path + rope + heads + N * D * db)                  # + o_proj

    def kernel_cost(self, batch: int, tokens: int, past: int, dtype_bytes: int,
                    kv_dtype: str | None = None) -> KernelCost:
        # absorbed: multi-query attention in latent space, the whole [latent | rope] row (r + d)
        # as key and as value, so scores and weighted sum both over r + d dims; the latent read
        # once (the up-projections are weights, applied per query token); expanded: every pass
        # re-expands the whole latent to per-head keys and values (written and read) before
        # attention at n + d / v dims. Pairs: the causal triangle of a fresh pass (is_causal)
        B, T, S, H, r, d, n, v, db = batch, tokens, past + tokens, self.H, self.r, self.d, self.n, self.v, dtype_bytes
        pairs = B * H * score_pairs(T, S, causal=plain_causal(T, past, 0, None))   # its mask: every key, no window
        latent = self.state_term(db, kv_dtype).per_token * S * B
        if self.kernel == "absorbed":
            return KernelCost(flops=4.0 * pairs * (r + d), bytes=float(latent + B * T * H * (2 * r + d) * db),
                              scores=float(pairs))
        # kv_b over the S - T held rows: the new rows' is counted with the per-token weights
        expand_flops = 2.0 * B * (S - T) * r * H * (n + v)
        expanded = 2 * B * S * H * (n + d + v) * db
        return KernelCost(flops=expand_flops + 2.0 * pairs * (n + d + v),
                          bytes=float(latent + expanded + B * T * H * (n + d + v) * db), scores=float(pairs))

    def workspace_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str) -> int:
        B, S, H, db = batch, context, self.H, dtype_bytes
        if self.kernel == "absorbed":
            return sdpa_workspace_bytes(B, H, self.r + self.d, tokens, S, db, device_kind, kv_heads=1)   # one latent head
        expansion = B * S * H * ((self.n + self.v) + (self.n + self.d)) * db             # kv_b output, key cat
        # unequal q/k and v head dims: the math kernel on every device (sdpa's "cuda" bound)
        return expansion + sdpa_workspace_bytes(B, H, self.n + self.d, tokens, S, db, "cuda")
