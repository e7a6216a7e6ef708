"""The MoE transformer: non-expert weights on the device and the forward pass.

Owns: loading every tensor (from a checkpoint, or seeded random for presets) into its
home -- non-expert weights on the device, routed experts packed into the ExpertStore on
the device or in host RAM as the placement asks -- and one forward pass over a chunk of
tokens that appends to a Session's KV. Routed experts are handed to the placement.
Does not own: generation loops and micro-batching (engine.engine), memory planning.

Dimension legend: B=batch, T=new tokens, D=hidden, H/K=query/kv heads, h=head dim,
N=B*T rows, k=top-k, V=vocab.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache import ExpertStore
from engine.checkpoint import Checkpoint, MissingTensorError, read_expert_into, router_name
from engine.config import ModelConfig
from engine.devices import Device
from engine.hooks import Instrument, RoutingHook
from engine.kv import Session
from engine.layers import apply_rope, attention, causal_mask, dense_mlp, rms_norm, rope_cos_sin, route


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    ln2: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_b: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    o_b: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # gate, up, down
    shared_gate: torch.Tensor | None = None
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None    # gate, up, down


class TensorSource:
    """Name -> tensor: a checkpoint, or deterministic seeded random weights for a preset."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint | None, seed: int) -> None:
        self.cfg, self.ckpt, self.seed = cfg, ckpt, seed

    def _random(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # seeded per name, so a tensor's values do not depend on load order
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(hashlib.sha1(name.encode()).hexdigest()[:12], 16))
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            return torch.ones(shape)
        std = 1.0 if name.endswith("gate.weight") and "shared" not in name else 0.02
        return torch.randn(shape, generator=g) * std

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.ckpt is None:
            return self._random(name, shape).to(dtype)
        t = self.ckpt.get(name, dtype)
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        return t

    def expert_into(self, layer: int, e: int, out: torch.Tensor) -> None:
        if self.ckpt is None:
            cfg = self.cfg
            D, I = cfg.hidden_size, cfg.moe_intermediate_size
            out.copy_(self._random(f"model.layers.{layer}.experts.{e}", (3 * I * D,)))
        else:
            read_expert_into(self.ckpt, self.cfg, layer, e, out)


class MoEModel:
    def __init__(self, cfg: ModelConfig, device: Device, dtype: torch.dtype, instrument: Instrument) -> None:
        self.cfg, self.device, self.dtype, self.instrument = cfg, device, dtype, instrument
        self.layers: list[LayerWeights] = []
        self.store = ExpertStore(cfg.n_experts, cfg.expert_params, dtype)
        self.placement = None  # set by the engine
        self.prefetcher = None  # set by the engine when prefetch != "none"
        self.routing_hooks: list[RoutingHook] = []      # hear each pass's routing (trace recorders)
        self.step_log: dict[int, list[list[int]]] | None = None   # per layer, experts of each pass

    def add_routing_hook(self, hook: RoutingHook) -> None:
        self.routing_hooks.append(hook)

    def remove_routing_hook(self, hook: RoutingHook) -> None:
        if hook in self.routing_hooks:
            self.routing_hooks.remove(hook)

    # --- loading -------------------------------------------------------------------------
    def load(self, src: TensorSource, expert_on_device: Callable[[int], bool], pin_host: bool = False) -> None:
        """Every tensor into its home; host expert rows page-locked on CUDA with `pin_host`
        (for placements that copy experts to the device)."""
        cfg, dev, dt = self.cfg, self.device, self.dtype
        D, H, K, hd, V = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size

        def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return dev.adopt(src.get(name, shape, dt), "weights")

        self.embed = w("model.embed_tokens.weight", (V, D))
        self.norm = w("model.norm.weight", (D,))
        tied = cfg.tie_word_embeddings or (src.ckpt is not None and not src.ckpt.has("lm_head.weight"))
        if tied and src.ckpt is not None and not cfg.tie_word_embeddings:
            raise MissingTensorError(f"tensor 'lm_head.weight' is missing from checkpoint {src.ckpt.path} "
                                     "(and tie_word_embeddings is false)")
        self.lm_head = self.embed if tied else w("lm_head.weight", (V, D))
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            L = LayerWeights(
                ln1=w(p + "input_layernorm.weight", (D,)), ln2=w(p + "post_attention_layernorm.weight", (D,)),
                q=w(a + "q_proj.weight", (H * hd, D)), k=w(a + "k_proj.weight", (K * hd, D)),
                v=w(a + "v_proj.weight", (K * hd, D)), o=w(a + "o_proj.weight", (D, H * hd)))
            if cfg.qkv_bias:
                L.q_b, L.k_b, L.v_b = (w(a + "q_proj.bias", (H * hd,)), w(a + "k_proj.bias", (K * hd,)),
                                       w(a + "v_proj.bias", (K * hd,)))
            if cfg.o_bias:
                L.o_b = w(a + "o_proj.bias", (D,))
            if cfg.qk_norm == "head":
                L.q_norm, L.k_norm = w(a + "q_norm.weight", (hd,)), w(a + "k_norm.weight", (hd,))
            elif cfg.qk_norm == "full":
                L.q_norm, L.k_norm = w(a + "q_norm.weight", (H * hd,)), w(a + "k_norm.weight", (K * hd,))
            if cfg.is_moe_layer(i):
                L.router = w(router_name(cfg, i), (cfg.n_experts, D))
                S = cfg.shared_expert_intermediate_size
                if S:
                    m = p + "mlp.shared_expert."
                    L.shared = (w(m + "gate_proj.weight", (S, D)), w(m + "up_proj.weight", (S, D)),
                                w(m + "down_proj.weight", (D, S)))
                    L.shared_gate = w(p + "mlp.shared_expert_gate.weight", (1, D))
                rows = self.store.allocate(i, dev, expert_on_device(i), pin=pin_host)
                staging = torch.empty(cfg.expert_params, dtype=dt)
                for e in range(cfg.n_experts):
                    src.expert_into(i, e, staging)   # one expert at a time: never two copies of the weights
                    rows[e].copy_(staging)
            else:
                I = cfg.intermediate_size
                m = p + "mlp."
                L.dense = (w(m + "gate_proj.weight", (I, D)), w(m + "up_proj.weight", (I, D)),
                           w(m + "down_proj.weight", (D, I)))
            self.layers.append(L)

    # --- forward -------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, sess: Session, all_logits: bool = False) -> torch.Tensor:
        """ids [B, T] -> logits [B, V] for the last position ([B, T, V] with all_logits)."""
        cfg, span = self.cfg, self.instrument.span
        B, T = ids.shape
        past = sess.length
        positions = torch.arange(past, past + T, device=ids.device)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, self.dtype)
        mask = causal_mask(T, past, cfg.sliding_window, ids.device)
        x = F.embedding(ids, self.embed)                                           # [B, T, D]
        self.placement.begin_forward(B * T)
        for hook in self.routing_hooks:
            hook.begin_pass(B, T)
        prefetcher = self.prefetcher
        if prefetcher is not None:
            prefetcher.begin_forward()               # counts passes even when this one is not prefetched
            if not self.placement.prefetchable():
                prefetcher = None
        for i, L in enumerate(self.layers):
            with span("layer", layer=i):
                with span("attention", layer=i):
                    x = x + self._attention(i, L, rms_norm(x, L.ln1, cfg.rms_norm_eps), sess, cos, sin, mask)
                h = rms_norm(x, L.ln2, cfg.rms_norm_eps)
                x = x + self._mlp(i, L, h.view(B * T, -1), prefetcher).view(B, T, -1)
        sess.advance(T)
        x = rms_norm(x if all_logits else x[:, -1], self.norm, cfg.rms_norm_eps)  # [B, T, D] or [B, D]
        return F.linear(x, self.lm_head)

    def _attention(self, i: int, L: LayerWeights, x: torch.Tensor, sess: Session, cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        hd = cfg.head_dim
        q, k, v = F.linear(x, L.q, L.q_b), F.linear(x, L.k, L.k_b), F.linear(x, L.v, L.v_b)  # [B, T, H*h] / [B, T, K*h]
        if cfg.qk_norm == "full":    # OLMoE: norm over the whole projection, before the head split
            q, k = rms_norm(q, L.q_norm, cfg.rms_norm_eps), rms_norm(k, L.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = (t.view(B, T, -1, hd) for t in (q, k, v))                       # [B, T, H|K, h]
        if cfg.qk_norm == "head":    # Qwen3: per-head norm over h
            q, k = rms_norm(q, L.q_norm, cfg.rms_norm_eps), rms_norm(k, L.k_norm, cfg.rms_norm_eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                          # [B, H|K, T, h]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all, v_all = sess.append(i, k, v)                                        # [B, K, S, h]
        return F.linear(attention(q, k_all, v_all, mask), L.o, L.o_b)            # [B, T, D]

    def _mlp(self, i: int, L: LayerWeights, h: torch.Tensor, prefetcher=None) -> torch.Tensor:
        """h [N, D] -> [N, D]. A prefetcher hears the routing before the experts run (the
        cache queues its copies behind this layer's own)."""
        cfg = self.cfg
        if L.dense is not None:
            return dense_mlp(h, *L.dense, cfg.hidden_act)
        with self.instrument.span("router", layer=i):
            ids, weights = route(h, L.router, cfg.top_k, cfg.norm_topk_prob, cfg.family == "mixtral")  # [N, k]
        for hook in self.routing_hooks:
            hook.route(i, ids, weights)
        if self.step_log is not None:
            self.step_log.setdefault(i, []).append(ids.unique().tolist())
        if prefetcher is not None:
            prefetcher.after_route(i, h, ids)
        out = self.placement.run(i, h, ids, weights)
        if L.shared is not None:     # Qwen2-MoE: shared expert scaled by a sigmoid gate
            out = out + torch.sigmoid(F.linear(h, L.shared_gate)) * dense_mlp(h, *L.shared, cfg.hidden_act)
        return out
