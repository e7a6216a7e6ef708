"""The MoE transformer: the family's blocks filled with weights, and the forward pass.

Owns: loading every tensor the blocks declare (from a checkpoint, or seeded random for
presets) into its home -- non-expert weights on the device, routed experts packed by the
family's ExpertLayout into the ExpertStore on the device or in host RAM as the placement
asks -- then the refusal of a checkpoint whose weights held NaN or inf (engine.checkpoint), and
one warning naming the checkpoint tensors nothing read that the family does not skip on purpose
(`Family.skipped`); sessions with one state per layer (each created by the
layer's attention block), and one forward pass over a chunk of tokens: embedding, each decoder
layer, the head. The routed experts of every MoE block are handed over here (`_run_experts`):
routing hooks and the step log hear the routing, the prefetcher guesses ahead, the placement
runs them. A diagnostic replay (engine.finite) sets `probe`, which checks every layer's output.
Does not own: what a layer computes (the family's blocks: engine.families, engine.blocks),
generation loops and micro-batching (engine.engine), memory planning.

Dimension legend: B=batch, T=new tokens, D=hidden, N=B*T rows, k=top-k, V=vocab.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import torch

from engine.blocks.base import Pass, StaticStep, TensorSpec
from engine.blocks.experts import ExpertLayout
from engine.blocks.routers import Router
from engine.cache import ExpertStore
from engine.checkpoint import Checkpoint
from engine.config import ModelConfig
from engine.counters import Counters
from engine.devices import Device
from engine.finite import LayerProbe, check_sum
from engine.hooks import Instrument, Progress, RoutingHook
from engine.kv import Session
from engine.prefetch.base import Prefetcher

INIT_STD = {"normal": 0.02, "router": 1.0}      # "fan_in": 1/sqrt(shape[-1])


class TensorSource:
    """TensorSpec -> tensor: a checkpoint, or deterministic seeded random weights for a preset."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint | None, seed: int) -> None:
        self.cfg, self.ckpt, self.seed = cfg, ckpt, seed

    def random(self, name: str, shape: tuple[int, ...], init: str = "normal") -> torch.Tensor:
        """Seeded per name, so a tensor's values do not depend on load order."""
        if init == "ones":
            return torch.ones(shape)
        if init == "zeros":
            return torch.zeros(shape)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(hashlib.sha1(name.encode()).hexdigest()[:12], 16))
        return torch.randn(shape, generator=g) * (shape[-1] ** -0.5 if init == "fan_in" else INIT_STD[init])

    def get(self, spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
        if self.ckpt is None:
            return self.random(spec.name, spec.shape, spec.init).to(dtype)
        return self.ckpt.weight(spec.name, spec.shape, dtype=dtype)

    def expert_into(self, layout: ExpertLayout, layer: int, e: int, out: torch.Tensor) -> None:
        if self.ckpt is None:
            layout.random_into(self.random, layer, e, out)
        else:
            layout.read_into(self.ckpt, layer, e, out)


class MoEModel:
    def __init__(self, cfg: ModelConfig, device: Device, dtype: torch.dtype, instrument: Instrument) -> None:
        self.cfg, self.device, self.dtype, self.instrument = cfg, device, dtype, instrument
        self.arch = cfg.architecture()
        if self.arch.moe_layers != tuple(cfg.moe_layers):
            raise ValueError(f"family {cfg.family!r} built MoE blocks at layers {self.arch.moe_layers}, "
                             f"the config says moe_layers={tuple(cfg.moe_layers)}")
        self.layers = self.arch.layers
        layout = self.arch.experts
        self.store = ExpertStore(cfg.n_experts, layout.numel, layout.storage_dtype(dtype), layout)
        self.placement = None  # set by the engine
        self.prefetcher = None  # set by the engine when prefetch != "none"
        self.routing_hooks: list[RoutingHook] = []      # hear each pass's routing (trace recorders)
        self.step_log: dict[int, list[list[int]]] | None = None   # per layer, experts of each pass
        self.probe: LayerProbe | None = None            # checks every layer's output (a diagnostic replay only)

    def add_routing_hook(self, hook: RoutingHook) -> None:
        self.routing_hooks.append(hook)

    def remove_routing_hook(self, hook: RoutingHook) -> None:
        if hook in self.routing_hooks:
            self.routing_hooks.remove(hook)

    # the tensors at the stack's ends, by their old names (fault-injection tests write into them)
    @property
    def embed(self) -> torch.Tensor:
        return self.arch.embedding.w["weight"]

    @property
    def norm(self) -> torch.Tensor:
        return self.arch.head.norm.w["weight"]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.arch.head.w["weight"]

    @property
    def routers(self) -> dict[int, Router]:
        """MoE layer -> its router (what the next_layer_gate prefetcher applies ahead)."""
        return {layer.index: layer.moe.router for layer in self.layers if layer.moe is not None}

    # --- loading -------------------------------------------------------------------------
    def load(self, src: TensorSource, expert_on_device: Callable[[int], bool], pin_host: bool = False,
             progress: Progress | None = None) -> None:
        """Every tensor into its home, then one warning naming the checkpoint tensors never read
        (`Checkpoint.warn_unread`); host expert rows page-locked on CUDA with `pin_host` (for
        placements that copy experts to the device). `progress` hears ("load", layer, layers)
        after each MoE layer's experts (the bulk of a big model's load)."""
        dev, dt = self.device, self.dtype
        for block, key, spec in self.arch.walk():
            block.w[key] = dev.adopt(src.get(spec, dt if spec.dtype is None else torch.float32), "weights")
        if self.arch.head.tied:
            self.arch.head.w["weight"] = self.embed
        store, layout = self.store, self.arch.experts
        staging = torch.empty(layout.numel, dtype=store.dtype)
        for i in self.cfg.moe_layers:
            rows = store.allocate(i, dev, expert_on_device(i), pin=pin_host)
            for e in range(self.cfg.n_experts):
                src.expert_into(layout, i, e, staging)   # one expert at a time: never two copies of the weights
                rows[e].copy_(staging)
            if progress is not None:
                progress("load", self.cfg.moe_layers.index(i) + 1, len(self.cfg.moe_layers))
        if src.ckpt is not None:   # everything is read by now (no placement reads the checkpoint later)
            src.ckpt.refuse_nonfinite()
            src.ckpt.warn_unread(self.cfg.family, self.cfg.family_class.skipped(self.cfg))

    # --- sessions and the forward pass ------------------------------------------------------
    def new_session(self, counters: Counters, batch: int, max_tokens: int | None,
                    kv_dtype: str | None = None) -> Session:
        """A session whose layers store their KV in `kv_dtype` (engine.kvquant; None: exact)."""
        label = Session.new_label()
        states = [layer.attention.new_state(batch, max_tokens, self.device, self.dtype, label, kv_dtype)
                  for layer in self.layers]
        return Session(self.device, counters, batch, states, max_tokens)

    def forward(self, ids: torch.Tensor, sess: Session, all_logits: bool = False,
                static: StaticStep | None = None, sums: list[torch.Tensor] | None = None) -> torch.Tensor:
        """ids [B, T] -> logits [B, V] for the last position ([B, T, V] with all_logits). A
        `static` step (engine.static_decode: T = 1, position on the device) leaves the session's
        token count to its caller, which advances it once per step whether the step ran or was
        replayed. `sums` hears the check sum of every position's final hidden state (engine.finite:
        the positions whose logits a prefill does not compute), on the device."""
        span = self.instrument.span
        B, T = ids.shape
        p = Pass(B, T, None if static else sess.length, ids.device, self.dtype, span, self._begin(B, T), static)
        probe = self.probe
        x = self.arch.embedding(ids, p)                                            # [B, T, D]
        if probe is not None:
            probe.check("the embedding (model.embed_tokens)", x)
        for i, layer in enumerate(self.layers):
            with span("layer", layer=i):
                x = layer(x, sess.state(i), p)
            if probe is not None:
                probe.check("layer", x, layer=i)
        if static is None:
            sess.advance(T)
        if sums is not None:
            sums.append(check_sum(x))
        logits = self.arch.head(x, all_logits)                                     # [B, V] or [B, T, V]
        if probe is not None:
            probe.check("the head (final norm and lm_head)", logits)
        return logits

    def _begin(self, B: int, T: int) -> Callable:
        """Start a forward pass of B x T tokens: the placement, routing hooks and prefetcher hear
        it; returns the pass's expert runner."""
        self.placement.begin_forward(B * T)
        for hook in self.routing_hooks:
            hook.begin_pass(B, T)
        prefetcher = self.prefetcher
        if prefetcher is not None:
            prefetcher.begin_forward()               # counts passes even when this one is not prefetched
            if not self.placement.prefetchable():
                prefetcher = None
        return functools.partial(self._run_experts, prefetcher)

    def forward_ragged(self, items: list[tuple[torch.Tensor, Session]]) -> torch.Tensor:
        """One step over sequences of different lengths and positions: items (ids [T_i], a
        session of one sequence) -> the last position's logits of each [n, V]. Each layer's
        attention runs once per sequence, on its own state at its own positions (`attend`); the
        rest of the layer -- norms, router, experts -- once over every sequence's rows together
        (`feed`), so the placement sees the union of the step's routed experts, as one pass of
        N = sum T_i tokens. Every session advances by its T_i."""
        span = self.instrument.span
        sizes = [int(ids.shape[0]) for ids, _ in items]
        N, dev = sum(sizes), items[0][0].device
        run = self._begin(1, N)
        rows = Pass(1, N, None, dev, self.dtype, span, run)        # per token: no position to read
        seqs = [Pass(1, t, sess.length, dev, self.dtype, span, run) for t, (_, sess) in zip(sizes, items)]
        x = self.arch.embedding(torch.cat([ids for ids, _ in items]).view(1, N), rows)     # [1, N, D]
        for i, layer in enumerate(self.layers):
            with span("layer", layer=i):
                parts = x.split(sizes, dim=1)
                x = layer.feed(torch.cat([layer.attend(part, sess.state(i), q)
                                          for part, (_, sess), q in zip(parts, items, seqs)], dim=1), rows)
        for t, (_, sess) in zip(sizes, items):
            sess.advance(t)
        ends = torch.tensor(sizes, device=dev).cumsum(0) - 1
        return self.arch.head(x[0, ends].unsqueeze(1), False)                            # [n, V]

    def _run_experts(self, prefetcher: Prefetcher | None, layer: int, h: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """A MoE block's routed experts: h [N, D], ids/weights [N, k] -> [N, D]. A prefetcher
        hears the routing before the experts run (the cache queues its copies behind this
        layer's own)."""
        for hook in self.routing_hooks:
            hook.route(layer, ids, weights)
        if self.step_log is not None:
            self.step_log.setdefault(layer, []).append(ids.unique().tolist())
        if prefetcher is not None:
            prefetcher.after_route(layer, h, ids)
        out = self.placement.run(layer, h, ids, weights)
        if self.probe is not None:
            self.probe.route(layer, h, out)
        return out
