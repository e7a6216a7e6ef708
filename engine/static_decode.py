"""Decode steps of fixed shape, captured as CUDA graphs on CUDA (`resident_grouped` with
`cuda_graph=True`).

Owns: `StaticDecoder`, one per session, which runs each batch-B decode step through static
buffers -- the token ids [B, 1] and the position [1] live on the device and are written before
the step, every layer writes its new K/V at that device position (`FullKV.write_at`) and attends
the first `keys` positions of its buffers under a mask computed on the device, and the routed
experts run as grouped GEMMs from routing kept on the device (`Placement.combine_grouped`). No
kernel's shape or argument depends on the host's token count and nothing is read back to the
host inside a step, so on CUDA the step is captured once per key bucket and replayed
(`torch.cuda.CUDAGraph`: one launch instead of hundreds); elsewhere it runs eagerly, the same
kernels (how the CPU tests check it: `tests/engine/test_static_decode.py` records every op of
two steps at different positions and finds them identical, with no host read).

The positions past the context hold zeros (written when the decoder is built, on buffers
allocated once for the planned context): a masked key weighs 0 in the softmax, but an
uninitialised NaN there would still make 0 * NaN = NaN.

Key buckets: a step attends `keys` = the next power of two at or above the context (at least
MIN_KEYS, at most the session's planned capacity), so a graph is captured per bucket and a step
reads at most twice the keys it needs (an eager step reads exactly its context).

Numerics: the same as an eager step except inside the attention kernel, which sums the softmax
over the bucket with masked keys at zero weight instead of over exactly the held keys -- equal
up to fp32 rounding (the vectorised sums group terms differently; 4e-7 measured on the CPU), not
bitwise. Greedy tokens agree with the eager engine's in the tests.

Does not own: prefill (eager: its shapes change with the prompt), sampling (the caller reads
the logits: one host read per step, after the step), routing traces (refused: a replayed step
cannot report its routing to the host). A graph is captured with the instruments off, so a
timeline of a CUDA graph decode has the step's span and none inside it.

Unverified on a GPU: no GPU in this project's CI (scripts/gpu_check.sh checks it when lent).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from engine.blocks.base import StaticStep
from engine.hooks import NULL
from engine.kv import Session
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

MIN_KEYS = 256


def keys_bucket(context: int, capacity: int) -> int:
    """Key positions a static step attends once the session holds `context` tokens (the new one
    included): the next power of two, at least MIN_KEYS, capped at the planned `capacity`."""
    if context > capacity:
        raise ValueError(f"static decode step needs {context} key positions; the session holds {capacity}")
    keys = MIN_KEYS
    while keys < context:
        keys *= 2
    return min(keys, capacity)


def check_model(arch) -> None:
    """Refuse, naming the state kind, a model whose layers a static step cannot write at a device
    position (each attention block's `static_refusal`)."""
    kinds = sorted({k for k in (layer.attention.static_refusal() for layer in arch.layers) if k is not None})
    if kinds:
        raise ValueError(f"cuda_graph: decode steps of fixed shape need a full KV cache in every layer; "
                         f"this model's layers also keep {', '.join(kinds)}, written at host positions; "
                         "allowed for this model: cuda_graph=false")


@contextlib.contextmanager
def instruments_off(model):
    """The model's, its device's and its placement's instruments off inside the block: a capture
    hears no spans (a replay would not repeat them, and event records inside a capture are not the
    step's timing; the caller's span around the replay is the step's), nor does a diagnostic
    replay (engine.finite)."""
    owners = (model, model.device, model.placement.ctx)
    saved = [o.instrument for o in owners]
    for o in owners:
        o.instrument = NULL
    try:
        yield
    finally:
        for o, inst in zip(owners, saved):
            o.instrument = inst


class StaticDecoder:
    """Batch decode steps of one session through static buffers (module docstring)."""

    def __init__(self, model, sess: Session) -> None:
        check_model(model.arch)
        if sess.max_tokens is None:
            raise ValueError("a static decode step needs a session planned for a context (Engine.new_session)")
        self.model, self.sess = model, sess
        dev = model.device.torch_device
        self.capture = dev.type == "cuda"
        self.ids = torch.zeros(sess.batch, 1, dtype=torch.long, device=dev)      # [B, 1]
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)                  # [1]
        # keys -> graph, its logits [B, V]; they read the states' buffers, which stay put for the
        # session's life (allocated once for the planned context) until offload or close, which drop
        # this decoder with them (Session.static_decoder)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._side: torch.cuda.Stream | None = None   # the captures' warm-up stream, one per decoder
        for state in sess.states:
            state.reserve(sess.max_tokens, sess.length)
            for t in state.tensors():             # masked keys weigh 0, but 0 * NaN is NaN: no garbage there
                t[:, :, sess.length:].zero_()

    def _refuse_listeners(self) -> None:
        m = self.model
        if m.routing_hooks or m.step_log is not None or m.prefetcher is not None:
            raise ValueError("cuda_graph decode keeps routing on the device, so it cannot feed routing hooks, "
                             "record_lookups or a prefetcher; use cuda_graph=false for routing traces")

    def prepare(self, ids: torch.Tensor) -> int:
        """Write the step's inputs into the static buffers (ids [B, 1] on the device, the position)
        and return the key bucket it attends; the host work before a step or a replay."""
        self._refuse_listeners()
        sess = self.sess
        self.ids.copy_(ids)
        self.pos.fill_(sess.length)
        return keys_bucket(sess.length + 1, sess.max_tokens)

    def run(self, keys: int) -> torch.Tensor:
        """The step itself, on the static buffers -> logits [B, V]: what a CUDA graph captures."""
        return self.model.forward(self.ids, self.sess, static=StaticStep(self.pos, keys))

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] on the device -> logits [B, V] (a fresh tensor); advances the session by one."""
        with torch.inference_mode():
            keys = self.prepare(ids)
            logits = self._replay(keys) if self.capture else self.run(keys)
            self.sess.advance(1)
        return logits

    def _replay(self, keys: int) -> torch.Tensor:
        if keys not in self.graphs:
            # one side stream for every capture: each new stream would get its own cuBLAS workspace
            side = self._side = self._side or torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                     # warm-up off the capture (lazy inits, workspaces)
                self.run(keys)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with instruments_off(self.model), torch.cuda.graph(graph):
                out = self.run(keys)
            self.graphs[keys] = (graph, out)
        graph, out = self.graphs[keys]
        graph.replay()
        return out.clone()


__all__ = ["MIN_KEYS", "StaticDecoder", "check_model", "instruments_off", "keys_bucket"]
