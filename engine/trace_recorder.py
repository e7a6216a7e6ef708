"""Recording a routing trace from a running engine: `TraceRecorder`, a routing hook of its model
that collects every forward pass's routed experts (and weights) into an `engine.trace.RoutingTrace`.

Owns: the per-pass bookkeeping (step, sequence, the model's meta). Does not own: the trace
container and its file format (engine.trace), the hook interface (engine.hooks).

    with TraceRecorder(eng) as rec:             # detached on exit; the recorded passes stay
        eng.generate(prompts, 8)
    save_trace("run.npz", rec.trace())
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from engine.hooks import RoutingHook
from engine.trace import RoutingTrace

log = logging.getLogger(__name__)

__all__ = ["TraceRecorder"]


class TraceRecorder(RoutingHook):
    """Records every forward pass's routing from an engine, as a routing hook of its model.

    A pass is the `route` calls for the model's MoE layers in order, opened by `begin_pass`,
    which also gives the batch B. Token order inside a pass is row-major over [B, T]; each token
    gets the pass index as `step` and its batch row as `sequence`. Recording copies ids to the
    CPU once per layer and pass (a device sync on CUDA), so it is for trace runs, not timed
    runs. Other hooks on the model keep hearing the routing.

        rec = TraceRecorder(eng); eng.generate(prompts, 8); tr = rec.trace(); rec.detach()
    """

    def __init__(self, engine: Any, weights: bool = True) -> None:
        self.engine = engine
        self.model = engine.model
        cfg = engine.cfg
        self.moe_layers: list[int] = list(cfg.moe_layers)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.keep_weights = weights
        self._ids: list[np.ndarray] = []         # per finished pass: [N, L, k]
        self._w: list[np.ndarray] = []
        self._steps: list[np.ndarray] = []
        self._seqs: list[np.ndarray] = []
        self._pending: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._rows = 0
        self.passes = 0
        self._batch = 1                          # B of the pass in flight (begin_pass)
        self.model.add_routing_hook(self)
        meta: dict[str, Any] = {
            "n_experts": int(cfg.n_experts), "expert_bytes": int(self.model.store.expert_bytes),
            "model": cfg.name, "family": cfg.family, "num_layers": int(cfg.num_layers),
            "moe_layers": self.moe_layers, "top_k": int(cfg.top_k), "hidden_size": int(cfg.hidden_size),
            "dtype": str(self.model.dtype).replace("torch.", ""), "source": "engine",
        }
        store = self.model.store
        if len({store.expert_nbytes(layer, e) for layer in self.moe_layers for e in range(cfg.n_experts)}) > 1:
            meta["expert_bytes_vary"] = True     # a mixed treatment: expert_bytes is the slot, not each expert
        options = getattr(engine, "options", {}) or {}
        if "ubatch" in options:
            meta["ubatch"] = int(options["ubatch"])
        self.meta = meta

    def detach(self) -> None:
        """Stop recording (the recorded passes stay)."""
        self.model.remove_routing_hook(self)

    def begin_pass(self, batch: int, tokens: int) -> None:
        self._batch = int(batch)

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def route(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        i = self._index.get(layer)
        if i is None:
            raise ValueError(f"route called for layer {layer}, which is not an MoE layer of this model "
                             f"(moe_layers={self.moe_layers})")
        if i == 0:
            if self._pending:
                log.warning("trace recorder: dropping an incomplete forward pass (layers %s of %s seen)",
                            sorted(self._pending), self.moe_layers)
            self._pending = {}
            self._rows = int(ids.shape[0])
        elif i != len(self._pending) or int(ids.shape[0]) != self._rows:
            raise RuntimeError(f"trace recorder: MoE layer {layer} routed {ids.shape[0]} rows after layers "
                               f"{[self.moe_layers[j] for j in sorted(self._pending)]} of a pass with {self._rows} "
                               f"rows; expected the MoE layers {self.moe_layers} in order, once per pass")
        w = weights.detach().float().cpu().numpy() if self.keep_weights else None
        self._pending[i] = (ids.detach().cpu().numpy().astype(np.int32), w)
        if i == len(self.moe_layers) - 1:
            self._close_pass()

    def _close_pass(self) -> None:
        # N=rows of this pass (B*T, row-major over [B, T]), L=MoE layers, k=top-k
        parts = [self._pending[i] for i in range(len(self.moe_layers))]
        self._ids.append(np.stack([p[0] for p in parts], axis=1))                      # [N, L, k]
        if self.keep_weights:
            self._w.append(np.stack([p[1] for p in parts], axis=1).astype(np.float32))  # [N, L, k]
        n = self._rows
        self._steps.append(np.full(n, self.passes, dtype=np.int32))
        batch = self._batch if n % self._batch == 0 else 1
        self._seqs.append(np.arange(n, dtype=np.int32) // max(n // batch, 1))            # row b of [B, T]
        self._pending = {}
        self.passes += 1

    def trace(self) -> RoutingTrace:
        """The trace of every complete pass recorded so far (validated)."""
        k = int(self.engine.cfg.top_k)
        L = len(self.moe_layers)
        experts = np.concatenate(self._ids) if self._ids else np.zeros((0, L, k), np.int32)
        tr = RoutingTrace(
            experts=experts, meta=dict(self.meta),
            weights=(np.concatenate(self._w) if self._w else np.zeros((0, L, k), np.float32))
            if self.keep_weights else None,
            step=np.concatenate(self._steps) if self._steps else np.zeros(0, np.int32),
            sequence=np.concatenate(self._seqs) if self._seqs else np.zeros(0, np.int32),
            source="recorded trace")
        return tr.validate()
