"""The blocks only Gemma 4's text model uses: its attention, its decoder layer and its embedding.

Owns:
- `Gemma4Attention`: GQAAttention with Gemma 4's q/k norms (weighted, `pow` form), a weightless
  v norm, scores unscaled (the q norm carries the scale: `scale=1.0`), and on global layers with
  `attention_k_eq_v` no v projection -- v is the (v-normed) k projection. Per-layer head dim, KV
  heads, rope and window come from the family (global layers: 512-dim heads, 2 KV heads,
  proportional rope; sliding layers: 256, 8, default rope, a bounded SlidingKV).
- `Gemma4Layer`: the sandwich-normed layer -- attention between an input and a post norm; then a
  dense MLP (pre/post norms) *and* the MoE block: routed on the residual stream, its experts run
  on a separately normed copy, both outputs post-normed, summed and post-normed again; then the
  per-layer input (if the model has one), and a learned scalar on the whole layer output.
- `PerLayerInput`: one layer's share of the per-layer embeddings (gate, GELU, times the layer's
  input, projection, norm), and `Gemma4Embedding`: the scaled token embedding, which also computes
  every layer's input [B, T, L, P] for the pass (token-identity embedding + a normed projection of
  the embedding, times 2^-1/2), handed to the layers through `Pass.cached("per_layer_inputs")`.
Does not own: the shared blocks (GQAAttention, DenseMLP, MoEBlock, the router, the experts) or
the family's choices (engine.families.gemma4).

Dimension legend: B=batch, T=new tokens, D=hidden, N=B*T rows, L=layers, P=per-layer input dim,
H/K=query/kv heads, h=head dim.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blocks.attention import GQAAttention
from engine.blocks.base import Block, Pass, TensorSpec, Transient
from engine.blocks.decoder import DecoderLayer, Embedding, scale_like
from engine.blocks.mlp import DenseMLP, MoEBlock
from engine.blocks.norms import PowRMSNorm, norm_temp_bytes, pow_rms_norm
from engine.kv import KVState
from engine.layers import ACT
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

PER_LAYER_INPUTS = "per_layer_inputs"          # the Pass key of [B, T, L, P]


class Gemma4Attention(GQAAttention):
    def __init__(self, *args, k_eq_v: bool = False, **kwargs) -> None:
        super().__init__(*args, qk_norm="head", scale=1.0, **kwargs)
        self.k_eq_v = k_eq_v

    def tensors(self) -> dict[str, TensorSpec]:
        t = super().tensors()
        if self.k_eq_v:
            t.pop("v")
            t.pop("v_b", None)
        return t

    def forward(self, x: torch.Tensor, state: KVState, p: Pass) -> torch.Tensor:
        w, eps, hd = self.w, self.eps, self.hd
        B, T, _ = x.shape
        q = pow_rms_norm(F.linear(x, w["q"], w.get("q_b")).view(B, T, -1, hd), w["q_norm"], eps)   # [B, T, H, h]
        k = F.linear(x, w["k"], w.get("k_b")).view(B, T, -1, hd)                                    # [B, T, K, h]
        v = k if self.k_eq_v else F.linear(x, w["v"], w.get("v_b")).view(B, T, -1, hd)
        k, v = pow_rms_norm(k, w["k_norm"], eps), pow_rms_norm(v, None, eps)
        o = self.rotate_and_attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), state, p)
        return F.linear(o, w["o"], w.get("o_b"))                                                    # [B, T, D]

    def activation_bytes(self, rows: int, dtype_bytes: int) -> Transient:
        base = super().activation_bytes(rows, dtype_bytes)
        return Transient(base.held + rows * (self.H + 2 * self.K) * self.hd * 4, base.peak)   # a norm's fp32 square


class PerLayerInput(Block):
    """x + norm(proj(act(gate(x)) * per_layer_input)), per_layer_input [B, T, P] this layer's slice."""

    def __init__(self, prefix: str, hidden: int, dim: int, layers: int, act: str, norm: PowRMSNorm) -> None:
        """dim: P; layers: L (every layer's inputs [N, L, P] stay alive through the pass)."""
        super().__init__()
        self.prefix, self.D, self.P, self.L, self.act, self.norm = prefix, hidden, dim, layers, act, norm

    def tensors(self) -> dict[str, TensorSpec]:
        return {"gate": TensorSpec(self.prefix + "per_layer_input_gate.weight", (self.P, self.D)),
                "proj": TensorSpec(self.prefix + "per_layer_projection.weight", (self.D, self.P))}

    def children(self) -> tuple[Block, ...]:
        return (self.norm,)

    def __call__(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        h = ACT[self.act](F.linear(x, self.w["gate"])) * per_layer_input                # [B, T, P]
        return x + self.norm(F.linear(h, self.w["proj"]))

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        return rows * (3 * self.P + 2 * self.D) * dtype_bytes + norm_temp_bytes(rows, self.D, dtype_bytes)

    def inputs_bytes(self, rows: int, dtype_bytes: int) -> int:
        """Every layer's inputs [N, L, P], held through the pass, and the embedding's steps making them
        (token and context parts, the norm's fp32 copies, the sum and its scaled copy)."""
        return rows * self.L * self.P * (6 * dtype_bytes + 2 * 4)


class Gemma4Layer(DecoderLayer):
    def __init__(self, index: int, prefix: str, attention: Gemma4Attention, dense: DenseMLP, moe: MoEBlock,
                 hidden: int, eps: float, per_layer_input: PerLayerInput | None = None) -> None:
        """prefix: "model.layers.{i}."; the layer's seven norms are PowRMSNorms named after their
        Hub tensors (hidden, eps); moe: the routed experts (route on the residual, experts on the
        second pre-norm)."""
        n = {k: PowRMSNorm(prefix + k + ".weight", hidden, eps) for k in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
            "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")}
        super().__init__(index, n["input_layernorm"], attention, n["pre_feedforward_layernorm"], moe)
        self.prefix, self.norms, self.dense, self.per_layer_input = prefix, n, dense, per_layer_input

    def tensors(self) -> dict[str, TensorSpec]:
        return {"scalar": TensorSpec(self.prefix + "layer_scalar", (1,), "ones")}

    def children(self) -> tuple[Block, ...]:
        return (*self.norms.values(), self.attention, self.dense, self.mlp,
                *((self.per_layer_input,) if self.per_layer_input is not None else ()))

    def attend(self, x: torch.Tensor, state, p: Pass) -> torch.Tensor:
        n = self.norms
        with p.span("attention", layer=self.index):
            return x + n["post_attention_layernorm"](self.attention(n["input_layernorm"](x), state, p))

    def feed(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        n, moe = self.norms, self.mlp
        B, T, D = x.shape
        flat = x.view(B * T, D)                                                          # [N, D]
        dense = n["post_feedforward_layernorm_1"](self.dense(n["pre_feedforward_layernorm"](flat), p))
        ids, weights = moe.route(flat, p)                                                # routed on the residual
        routed = n["post_feedforward_layernorm_2"](moe.experts(n["pre_feedforward_layernorm_2"](flat), ids, weights, p))
        x = x + n["post_feedforward_layernorm"](dense + routed).view(B, T, D)
        if self.per_layer_input is not None:
            x = self.per_layer_input(x, p.cached(PER_LAYER_INPUTS, _missing)[:, :, self.index])
        return x * self.w["scalar"]

    def activation_bytes(self, rows: int, dtype_bytes: int) -> int:
        N, D, db = rows, self.attn_norm.dim, dtype_bytes
        norm = norm_temp_bytes(N, D, db)
        attention = self.attention.activation_bytes(N, db).after(norm) + N * D * db + norm      # + its post-norm
        ff = N * D * db + max(self.dense.activation_bytes(N, db).after(norm),        # the normed dense output held
                              self.mlp.activation_bytes(N, db).after(norm) + 2 * N * D * db) + norm   # while routed runs
        ple = self.per_layer_input
        if ple is None:
            return 3 * N * D * db + max(attention, ff)
        return 3 * N * D * db + max(attention, ff, ple.activation_bytes(N, db)) + ple.inputs_bytes(N, db)


def _missing() -> torch.Tensor:
    raise RuntimeError("per-layer inputs are missing from the pass: the model's embedding computes them "
                       "(Gemma4Embedding)")


class Gemma4Embedding(Embedding):
    """The token embedding scaled by sqrt(D); with per-layer inputs (P > 0) also every layer's input."""

    def __init__(self, vocab: int, hidden: int, layers: int = 0, per_layer_dim: int = 0, per_layer_vocab: int = 0,
                 eps: float = 1e-6) -> None:
        super().__init__(vocab, hidden, scale=hidden ** 0.5)
        self.L, self.P, self.Vp = layers, per_layer_dim, per_layer_vocab
        self.norm = PowRMSNorm("model.per_layer_projection_norm.weight", per_layer_dim, eps) if per_layer_dim else None

    def tensors(self) -> dict[str, TensorSpec]:
        t = super().tensors()
        if self.P:
            t |= {"per_layer": TensorSpec("model.embed_tokens_per_layer.weight", (self.Vp, self.L * self.P)),
                  "per_layer_proj": TensorSpec("model.per_layer_model_projection.weight", (self.L * self.P, self.hidden))}
        return t

    def children(self) -> tuple[Block, ...]:
        return () if self.norm is None else (self.norm,)

    def applied(self) -> list[TensorSpec]:
        """The per-layer projection of x and its norm (the per-layer table is looked up)."""
        if not self.P:
            return []
        return [self.tensors()["per_layer_proj"], *(spec for _, _, spec in self.norm.walk())]

    def __call__(self, ids: torch.Tensor, p: Pass | None = None) -> torch.Tensor:
        x = super().__call__(ids, p)                                                     # [B, T, D]
        if self.P and p is not None:
            p.cached(PER_LAYER_INPUTS, lambda: self.per_layer_inputs(ids, x))
        return x

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """ids [B, T], the scaled embedding x [B, T, D] -> [B, T, L, P]."""
        B, T, L, P = *ids.shape, self.L, self.P
        token = (F.embedding(ids, self.w["per_layer"]) * scale_like(P ** 0.5, x)).view(B, T, L, P)
        context = self.norm((F.linear(x, self.w["per_layer_proj"]) * self.hidden ** -0.5).view(B, T, L, P))
        return (context + token) * 2.0 ** -0.5
