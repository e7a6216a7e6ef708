"""Linear attention with a recurrent state: the gated DeltaNet layer of Qwen3-Next and Qwen3.5-MoE,
and the fixed per-sequence state it keeps instead of a KV cache.

Owns:
- `RecurrentState`: one layer's state of one session -- the last K-1 inputs of the short causal
  convolution [B, C, K-1] (activation dtype) and the delta-rule state [B, H, dk, dv] (fp32, as
  transformers keeps it) -- allocated once whatever the context, zero at the start, displaced
  and restored whole by `Session.offload/restore` like any state.
- `GatedDeltaNet`: the block -- input projections (Qwen3-Next's fused `in_proj_qkvz` /
  `in_proj_ba` grouped per key head, or Qwen3.5's separate `in_proj_qkv/z/b/a`), the causal
  conv + SiLU over [q | k | v], the decay g = -exp(A_log) softplus(a + dt_bias) and the write
  strength beta = sigmoid(b), the gated delta rule (the chunked form for a prefill chunk, the
  step form for a decode step: engine.blocks.delta_rule), the gated RMSNorm (norm(o) * silu(z))
  and the output projection -- with its plan term (`fixed` bytes per sequence) and transient bounds.
Does not own: the recurrence's arithmetic (engine.blocks.delta_rule) or sessions (engine.kv).

    GatedDeltaNet(0, "model.layers.0.linear_attn.", hidden=2048, k_heads=16, v_heads=32, dk=128, dv=128,
                  kernel=4, eps=1e-6, act="silu", projections="qkvz")

Dimension legend: B=batch, T=new tokens, D=hidden, Hk/H=key/value heads, dk/dv=head dims,
r=H/Hk, C=2*Hk*dk + H*dv conv channels, K=conv kernel, N=B*T rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.attention import AttentionBlock, KernelCost
from engine.blocks.base import Pass, TensorSpec, Transient
from engine.blocks.delta_rule import CHUNK, causal_conv, chunk_workspace_bytes, chunked_delta_rule, recurrent_delta_rule
from engine.devices import Device
from engine.kv import LayerState, StateTerm
from engine.layers import ACT
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

PROJECTIONS = ("qkvz", "split")       # Qwen3-Next's fused per-key-head layout | Qwen3.5's separate projections


class RecurrentState(LayerState):
    """The conv inputs [B, C, K-1] (activation dtype) and the delta-rule state [B, H, dk, dv] (fp32)."""

    KIND = "recurrent state, fixed per sequence (conv + delta rule)"

    def __init__(self, device: Device, label: str, batch: int, channels: int, kernel: int, heads: int, dk: int,
                 dv: int, dtype: torch.dtype) -> None:
        super().__init__(device, label)
        self.shapes = ((batch, channels, kernel - 1), (batch, heads, dk, dv))
        self.dtype = dtype
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None

    @classmethod
    def term(cls, channels: int, kernel: int, heads: int, dk: int, dv: int, dtype_bytes: int) -> StateTerm:
        return StateTerm(cls.KIND, fixed=channels * (kernel - 1) * dtype_bytes + heads * dk * dv * 4)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.conv is None else [self.conv, self.ssm]

    def reserve(self, tokens: int, filled: int) -> None:
        if self.conv is None:          # fixed: one allocation whatever the context, zero = no history
            self.conv = self.device.empty(self.shapes[0], self.dtype, self.label).zero_()
            self.ssm = self.device.empty(self.shapes[1], torch.float32, self.label).zero_()

    def snapshot(self, length: int) -> list[torch.Tensor]:
        return self.tensors()

    def _forget(self) -> None:
        self.conv = self.ssm = None


def step_form(tokens: int, past: int) -> bool:
    """Whether a pass runs the recurrent step form (one token after a prefix) rather than the
    chunked one -- as transformers chooses."""
    return tokens == 1 and past > 0


class GatedDeltaNet(AttentionBlock):
    state_kind = "a recurrent DeltaNet state (RecurrentState)"

    def __init__(self, layer: int, prefix: str, hidden: int, k_heads: int, v_heads: int, dk: int, dv: int,
                 kernel: int, eps: float, act: str, projections: str = "qkvz") -> None:
        """prefix: e.g. "model.layers.0.linear_attn."; projections: "qkvz" (Qwen3-Next) | "split" (Qwen3.5)."""
        super().__init__(layer)
        if projections not in PROJECTIONS:
            raise ValueError(f"projections must be one of {PROJECTIONS}, got {projections!r}")
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
        self.prefix, self.D, self.Hk, self.H, self.dk, self.dv = prefix, hidden, k_heads, v_heads, dk, dv
        self.K, self.eps, self.act, self.projections = kernel, eps, act, projections
        self.C = 2 * k_heads * dk + v_heads * dv

    def tensors(self) -> dict[str, TensorSpec]:
        a, D, H, Kd, Vd = self.prefix, self.D, self.H, self.Hk * self.dk, self.H * self.dv
        if self.projections == "qkvz":
            t = {"qkvz": TensorSpec(a + "in_proj_qkvz.weight", (2 * Kd + 2 * Vd, D)),
                 "ba": TensorSpec(a + "in_proj_ba.weight", (2 * H, D))}
        else:
            t = {"qkv": TensorSpec(a + "in_proj_qkv.weight", (2 * Kd + Vd, D)),
                 "z": TensorSpec(a + "in_proj_z.weight", (Vd, D)), "b": TensorSpec(a + "in_proj_b.weight", (H, D)),
                 "a": TensorSpec(a + "in_proj_a.weight", (H, D))}
        return t | {"conv": TensorSpec(a + "conv1d.weight", (self.C, 1, self.K)),
                    "dt_bias": TensorSpec(a + "dt_bias", (H,), "ones"), "A_log": TensorSpec(a + "A_log", (H,)),
                    "norm": TensorSpec(a + "norm.weight", (self.dv,), "ones"),
                    "out": TensorSpec(a + "out_proj.weight", (D, Vd))}

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (mixed [B, T, C] = [q | k | v], z [B, T, H, dv], b [B, T, H], a [B, T, H])."""
        w, B, T = self.w, x.shape[0], x.shape[1]
        Hk, H, dk, dv, r = self.Hk, self.H, self.dk, self.dv, self.H // self.Hk
        if self.projections == "split":
            return (F.linear(x, w["qkv"]), F.linear(x, w["z"]).view(B, T, H, dv), F.linear(x, w["b"]),
                    F.linear(x, w["a"]))
        qkvz = F.linear(x, w["qkvz"]).view(B, T, Hk, 2 * dk + 2 * r * dv)             # grouped per key head
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=3)
        b, a = torch.split(F.linear(x, w["ba"]).view(B, T, Hk, 2 * r), [r, r], dim=3)
        mixed = torch.cat((q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)), dim=-1)  # [B, T, C]
        return mixed, z.reshape(B, T, H, dv), b.reshape(B, T, H), a.reshape(B, T, H)

    def forward(self, x: torch.Tensor, state: RecurrentState, p: Pass) -> torch.Tensor:
        w, B, T = self.w, x.shape[0], x.shape[1]
        H, dk, dv, Kd = self.H, self.dk, self.dv, self.Hk * self.dk
        mixed, z, b, a = self._project(x)
        state.reserve(1, 0)
        conv, held = causal_conv(mixed.transpose(1, 2), state.conv, w["conv"].squeeze(1))    # [B, C, T]
        state.conv.copy_(held)
        mixed = ACT[self.act](conv).to(x.dtype).transpose(1, 2)                               # [B, T, C]
        q, k, v = torch.split(mixed, [Kd, Kd, H * dv], dim=-1)
        q, k, v = q.reshape(B, T, -1, dk), k.reshape(B, T, -1, dk), v.reshape(B, T, H, dv)
        beta = b.sigmoid()
        g = -w["A_log"].float().exp() * F.softplus(a.float() + w["dt_bias"])               # [B, T, H] fp32
        if H > self.Hk:
            q, k = q.repeat_interleave(H // self.Hk, dim=2), k.repeat_interleave(H // self.Hk, dim=2)
        rule = recurrent_delta_rule if step_form(T, p.past) else chunked_delta_rule
        o, ssm = rule(q, k, v, g, beta, state.ssm)                                        # [B, T, H, dv]
        state.ssm.copy_(ssm)
        o = gated_rms_norm(o.reshape(-1, dv), z.reshape(-1, dv), w["norm"], self.eps)
        return F.linear(o.view(B, T, H * dv), w["out"])                                   # [B, T, D]

    def new_state(self, batch: int, max_tokens: int | None, device: Device, dtype: torch.dtype,
                  label: str, kv_dtype: str | None = None) -> RecurrentState:
        self.require_exact_state(kv_dtype)
        return RecurrentState(device, label, batch, self.C, self.K, self.H, self.dk, self.dv, dtype)

    def state_term(self, dtype_bytes: int, kv_dtype: str | None = None) -> StateTerm:
        self.require_exact_state(kv_dtype)
        return RecurrentState.term(self.C, self.K, self.H, self.dk, self.dv, dtype_bytes)

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        N, db, H, dk, dv, C, f32 = rows, dtype_bytes, self.H, self.dk, self.dv, self.C, 4
        Vd = H * dv
        projections = N * (C + Vd + 2 * H) * db * 2                       # the projections and their reshaped copies
        conv = 4 * N * C * db + 2 * N * H * dk * db                        # conv in/out/activation/split; q, k repeated
        rule = N * H * (2 * (2 * dk + dv) + 2 * dv) * f32 + N * Vd * db    # fp32 q/k/v, their normed copies, out; cast
        norm = N * Vd * (4 * f32 + db) + N * self.D * db                   # the gated norm's fp32 steps; out_proj
        return Transient(held=projections + conv, peak=max(rule, norm) + N * H * 3 * f32)   # + g, beta

    def workspace_bytes(self, batch: int, tokens: int, context: int, dtype_bytes: int, device_kind: str) -> int:
        return chunk_workspace_bytes(batch, self.H, self.dk, self.dv, tokens)

    def kernel_cost(self, batch: int, tokens: int, past: int, dtype_bytes: int,
                    kv_dtype: str | None = None) -> KernelCost:
        # per token and value head the step form (one token after a prefix) decays the [dk, dv]
        # state, reads it with k, adds the outer-product update and reads it with q (7 dk dv); the
        # chunked form (engine.blocks.delta_rule.chunked_delta_rule, chunks of c) reads the state
        # with w and q and updates it once per chunk (6 dk dv per token), forms the chunk's [c, c]
        # products k k^T, q k^T and (q k^T) u (c (4 dk + 2 dv)) and solves the two unit-triangular
        # systems (c (dk + dv)); the causal conv 2 K per channel. The fixed state is read and
        # written once per pass, whatever the context.
        B, T, H, dk, dv = batch, tokens, self.H, self.dk, self.dv
        c = min(CHUNK, T)
        per_head = 7 * dk * dv if step_form(T, past) else 6 * dk * dv + c * (5 * dk + 3 * dv)
        flops = B * T * (H * per_head + 2 * self.C * self.K)
        state = 2 * self.state_term(dtype_bytes, kv_dtype).bytes(past + T, B)
        return KernelCost(flops=float(flops), bytes=float(state + 2 * B * T * self.C * dtype_bytes))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNormGated: w * norm(x) in x's dtype, times silu(gate) in fp32, cast back; x, gate [N, dv]."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(gate.to(torch.float32))).to(dtype)
