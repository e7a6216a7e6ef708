"""Sessions and their per-layer state (KV cache and kin).

Owns:
- `StateTerm`: what one layer's state costs, as the planner counts it -- bytes per token of a
  sequence (full KV, a compressed latent), a cap on the tokens held (a sliding window), bytes
  per sequence whatever the context (a recurrent state) -- and its name in the plan printout.
- `LayerState`: one layer's state of one session, created by that layer's attention block
  (`AttentionBlock.new_state`). Every kind says which device tensors it holds (`tensors`:
  their bytes are `nbytes`), makes room for a number of tokens (`reserve`; allocated once for
  the planned context), and names the views that carry the session (`snapshot`) -- which is
  all displacement to host RAM needs, so `Session.offload/restore` work for every kind.
- `FullKV`: the [B, K, S, h] key/value pair of grouped-query attention, stored in a
  `kv_dtype` format (engine.kvquant: exact by default; a cast or block-quantised codes +
  scales, quantised on write, dequantised on read).
- `SlidingKV`: the same for a sliding-window layer, bounded: only the last window - 1 tokens
  (all a later query can see) are kept, as transformers' sliding-window cache does.
- `Session`: one batch of sequences that advance together, its states, its token count, and
  moving all its states to host RAM and back (counted as d2h/h2d `kv` bytes per layer).
Does not own: attention math (engine.blocks.attention, engine.layers) or when a session is
displaced (the caller decides).

Other kinds are subclasses beside the block that uses them: an MLA latent
(engine.blocks.mla.LatentKV: one [B, S, rank + rope] buffer, grown like FullKV by
`grown_capacity`), a recurrent/conv state (`fixed` bytes, `reserve` allocates once whatever
the tokens, `snapshot` returns the whole tensors: tests/engine/test_kv.py has one).

Displaced state lives in one exact-size host buffer per displacement, page-locked on CUDA
(engine.hostmem: registered in place, not torch's power-of-two pinned pool). Pinned because
`restore` is a measured phase (`restore_s`): from pinned memory the host->device copies are
asynchronous DMA at link speed, as in a serving engine's pinned swap space, while from
pageable memory the driver stages every copy through a bounce buffer synchronously, so
restore_s would time a CPU memcpy rather than the link; the device->host copies of
`offload` go to the same pinned buffer for the same reason. One buffer for all layers (a
byte buffer, each state's views carved out at their dtype's alignment), so the registration
(about as costly as touching the pages once) is paid once per displacement, between turns,
outside the phase that restores it.

    sess = engine.new_session(batch=2)
    engine.generate(prompts, 8, session=sess)     # KV stays on the device
    sess.offload()                                # every layer's state -> host RAM (d2h bytes counted)
    sess.restore()                                # host -> device (h2d bytes counted)
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.counters import Counters
from engine.devices import Device
from engine.kvquant import KVFormat, dequantise_reference, kv_format
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from engine.blocks.base import StaticStep
else:
    torch = lazy_module("torch", globals())

MIN_CAPACITY = 256          # unplanned full KV starts here and doubles
_labels = itertools.count()


@dataclass(frozen=True)
class StateTerm:
    """One layer's state in the memory plan (bytes for `batch` sequences of `context` tokens)."""

    kind: str                      # plan printout name: "KV cache", "sliding-window KV (4096-token window)", ...
    per_token: int = 0             # bytes per token of one sequence
    max_tokens: int | None = None  # tokens held at most (a window); None: the whole context
    fixed: int = 0                 # bytes per sequence whatever the context

    def bytes(self, context: int, batch: int) -> int:
        held = context if self.max_tokens is None else min(context, self.max_tokens)
        return batch * (self.per_token * held + self.fixed)


def check_planned(tokens: int, max_tokens: int) -> None:
    """Refuse a session of `tokens` tokens in an engine planned for `max_tokens` (its max_context)."""
    if tokens > max_tokens:
        raise ValueError(f"session needs KV for {tokens} tokens but the engine was planned for "
                         f"max_context={max_tokens}; pass a larger max_context to Engine.from_pretrained")


def grown_capacity(tokens: int, capacity: int, max_tokens: int | None) -> int | None:
    """The capacity a per-token state (full KV, an MLA latent) grows to so that it holds
    `tokens`: None when it already does; planned (`max_tokens`), the whole context at once, as
    llama.cpp allocates n_ctx; unplanned, doubling from MIN_CAPACITY."""
    if tokens <= capacity:
        return None
    if max_tokens is not None:
        check_planned(tokens, max_tokens)
        return max_tokens
    cap = max(MIN_CAPACITY, capacity)
    while cap < tokens:
        cap *= 2
    return cap


def nbytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LayerState(ABC):
    """One layer's per-session state on the device (see the module docstring)."""

    def __init__(self, device: Device, label: str) -> None:
        self.device, self.label = device, label
        self.host: list[torch.Tensor] | None = None     # the snapshot's host copies while displaced

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The device tensors allocated now (empty before the first use and while displaced)."""

    @abstractmethod
    def reserve(self, tokens: int, filled: int) -> None:
        """Make room for `tokens` tokens, keeping the first `filled` (allocates once when planned)."""

    @abstractmethod
    def snapshot(self, length: int) -> list[torch.Tensor]:
        """Device views of what a session of `length` tokens keeps (what offload copies out and
        restore copies back into, after `reserve(length, 0)`)."""

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.tensors())

    def drop(self) -> None:
        """Free the device tensors."""
        for t in self.tensors():
            self.device.release(self.label, t)
        self._forget()

    @abstractmethod
    def _forget(self) -> None:
        """Drop the references to the (released) device tensors."""


class KVState(LayerState):
    """A key/value pair [B, K, capacity, h] (the common part of full and sliding-window KV),
    stored in a `kv_dtype` format (engine.kvquant): the model's dtype (exact, the default), a
    cast, or block-quantised codes with their scales -- then each of K and V is two tensors,
    [B, K, capacity, codes] and [B, K, capacity, h/32], both indexed by position on dim 2, so
    growing, windowing and displacement treat every part alike. Writes quantise; reads
    dequantise only the positions a pass attends to (`reference=True`: the whole buffer, by the
    slow per-value reference dequantiser, then sliced -- tests hold both equal)."""

    reference = False

    def __init__(self, device: Device, label: str, batch: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, kv_dtype: str | KVFormat | None = None) -> None:
        super().__init__(device, label)
        self.batch, self.kv_heads, self.head_dim, self.dtype = batch, kv_heads, head_dim, dtype
        self.fmt = kv_format(kv_dtype)
        self.fmt.check(head_dim, device.torch_device)
        self.capacity = 0
        self._parts: list[torch.Tensor] = []          # K's parts, then V's

    @property
    def k(self) -> torch.Tensor | None:
        """The key buffer, its payload when quantised (its host copy while displaced)."""
        parts = self.host if self.host is not None else self._parts
        return parts[0] if parts else None

    @property
    def v(self) -> torch.Tensor | None:
        parts = self.host if self.host is not None else self._parts
        return parts[self.fmt.n_parts] if parts else None

    def tensors(self) -> list[torch.Tensor]:
        return list(self._parts)

    def _allocate(self, cap: int) -> list[torch.Tensor]:
        lead = (self.batch, self.kv_heads, cap)
        return [self.device.empty((*lead, n), dt, self.label) for _ in range(2)      # K's parts, then V's
                for dt, n in self.fmt.parts(self.head_dim, self.dtype)]

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """k/v [B, K, T, h] -> their stored parts (K's, then V's)."""
        return [*self.fmt.quantise(k), *self.fmt.quantise(v)]

    def _decode(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored parts -> k/v [B, K, S, h] in the compute dtype (a view when stored exactly)."""
        n = self.fmt.n_parts
        if self.fmt.cast is None and not self.fmt.blocked:
            return parts[0], parts[1]
        return self.fmt.dequantise(parts[:n], self.dtype), self.fmt.dequantise(parts[n:], self.dtype)

    def _read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `end` positions' keys and values, dequantised (module docstring: both paths)."""
        if not self.reference:
            return self._decode([t[:, :, :end] for t in self._parts])
        n = self.fmt.n_parts
        k, v = (dequantise_reference(self.fmt, ps, self.dtype) for ps in (self._parts[:n], self._parts[n:]))
        return k[:, :, :end], v[:, :, :end]

    @abstractmethod
    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add k/v [B, K, T, h] at positions [start, start+T); return the keys/values this pass's
        queries may see [B, K, S, h] and the position of the first of them."""

    def decode_buffers(self, start: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a one-token pass at `start` into every position before it, stored exactly: the key
        and value buffers [B, K, capacity, h], reserved for it (a fused kernel writes the token and
        reads 0..start: engine.layers.rope_attention); None where `append` must run instead."""
        return None

    def _forget(self) -> None:
        self._parts = []
        self.capacity = 0


class FullKV(KVState):
    """Keys and values of every token, allocated once for the planned context (unplanned: grown
    by doubling from MIN_CAPACITY)."""

    KIND = "KV cache"

    def __init__(self, device: Device, label: str, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_tokens: int | None, kv_dtype: str | KVFormat | None = None) -> None:
        super().__init__(device, label, batch, kv_heads, head_dim, dtype, kv_dtype)
        self.max_tokens = max_tokens          # the planned context: never grows past it

    @classmethod
    def term(cls, kv_heads: int, head_dim: int, dtype_bytes: int, kv_dtype: str | KVFormat | None = None) -> StateTerm:
        fmt = kv_format(kv_dtype)
        return StateTerm(kind_name(cls.KIND, fmt), per_token=2 * kv_heads * fmt.row_bytes(head_dim, dtype_bytes))

    def reserve(self, tokens: int, filled: int) -> None:
        cap = grown_capacity(tokens, self.capacity, self.max_tokens)
        if cap is None:
            return
        new = self._allocate(cap)
        for old, fresh in zip(self.tensors(), new):
            fresh[:, :, :filled].copy_(old[:, :, :filled])
            self.device.release(self.label, old)
        self._parts, self.capacity = new, cap

    def decode_buffers(self, start: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.fmt.cast is not None or self.fmt.blocked or self.reference:
            return None
        self.reserve(start + 1, start)
        return self._parts[0], self._parts[1]

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        end = start + k.shape[2]
        self.reserve(end, start)
        for buf, part in zip(self._parts, self._encode(k, v)):
            buf[:, :, start:end].copy_(part)
        k_all, v_all = self._read(end)
        return k_all, v_all, 0

    def write_at(self, k: torch.Tensor, v: torch.Tensor, step: StaticStep) -> tuple[torch.Tensor, torch.Tensor]:
        """A static decode step's append (engine.static_decode): k/v [B, K, 1, h] written at the
        device position `step.pos`, and the first `step.keys` positions read back -- shapes and
        arguments that do not depend on the token count. The buffers must already hold them."""
        if self.capacity < step.keys:
            raise RuntimeError(f"static decode step reads {step.keys} key positions of a KV cache allocated "
                               f"for {self.capacity}; reserve them before the step")
        for buf, part in zip(self._parts, self._encode(k, v)):
            buf.index_copy_(2, step.pos, part)
        return self._decode([t[:, :, :step.keys] for t in self._parts])

    def snapshot(self, length: int) -> list[torch.Tensor]:
        return [t[:, :, :length] for t in self.tensors()]


class SlidingKV(KVState):
    """Keys and values of the last `window - 1` tokens only (all a later query can see), in
    position order: [B, K, min(window - 1, max_tokens), h] each, allocated once."""

    def __init__(self, device: Device, label: str, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_tokens: int | None, window: int, kv_dtype: str | KVFormat | None = None) -> None:
        super().__init__(device, label, batch, kv_heads, head_dim, dtype, kv_dtype)
        self.window = window
        self.keep = window - 1 if max_tokens is None else min(window - 1, max_tokens)

    @classmethod
    def term(cls, kv_heads: int, head_dim: int, dtype_bytes: int, window: int,
             kv_dtype: str | KVFormat | None = None) -> StateTerm:
        fmt = kv_format(kv_dtype)
        return StateTerm(kind_name(f"sliding-window KV ({window}-token window)", fmt),
                         per_token=2 * kv_heads * fmt.row_bytes(head_dim, dtype_bytes), max_tokens=window - 1)

    def held(self, length: int) -> int:
        """Tokens held after `length` tokens went by."""
        return min(length, self.keep)

    def reserve(self, tokens: int, filled: int) -> None:
        if self.capacity == 0 and self.keep > 0:     # bounded: one allocation whatever the context
            self._parts, self.capacity = self._allocate(self.keep), self.keep

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.reserve(1, 0)
        held = self.held(start)
        new = self._encode(k, v)
        if held:   # new tensors: the buffer is free to overwrite below
            every = [torch.cat((buf[:, :, :held], part), dim=2) for buf, part in zip(self._parts, new)]
        else:
            every = new
        n = min(self.keep, every[0].shape[2])
        if n:
            for buf, part in zip(self._parts, every):
                buf[:, :, :n].copy_(part[:, :, -n:])
        if self.reference:
            k_all, v_all = (dequantise_reference(self.fmt, ps, self.dtype)
                            for ps in (every[:self.fmt.n_parts], every[self.fmt.n_parts:]))
        else:
            k_all, v_all = self._decode(every)
        return k_all, v_all, start - held

    def snapshot(self, length: int) -> list[torch.Tensor]:
        return [t[:, :, : self.held(length)] for t in self.tensors()]


def kind_name(kind: str, fmt: KVFormat) -> str:
    """The plan printout name of a KV kind, with its storage format when it is not the model's."""
    return kind if fmt.name == "model" else f"{kind} [{fmt.name}]"


def _carve(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the byte buffer `buf` shaped and typed like `like`, each at its dtype's alignment."""
    out, off = [], 0
    for t in like:
        size = t.element_size()
        off = -(-off // size) * size
        n = t.numel() * size
        out.append(buf[off:off + n].view(t.dtype).view(t.shape))
        off += n
    return out


def _carved_bytes(like: list[torch.Tensor]) -> int:
    off = 0
    for t in like:
        off = -(-off // t.element_size()) * t.element_size() + t.numel() * t.element_size()
    return off


class Session:
    """One batch of sequences that advance together (equal lengths), with one state per layer."""

    def __init__(self, device: Device, counters: Counters, batch: int, states: list[LayerState],
                 max_tokens: int | None = None) -> None:
        self.device, self.counters, self.batch = device, counters, batch
        self.states = states
        self.max_tokens = max_tokens                      # the planned context
        self.length = 0                                   # tokens whose state is held
        self.pending: list[int] | None = None             # last generated token per row, not yet in the state
        self.on_device = True
        self.static_decoder = None                        # engine.static_decode's, built on its first step

    @staticmethod
    def new_label() -> str:
        """A device-ledger label for one session's state tensors."""
        return f"kv:{next(_labels)}"

    @property
    def n_layers(self) -> int:
        return len(self.states)

    @property
    def nbytes(self) -> int:
        """Device bytes the states hold now (allocated, not filled)."""
        return sum(s.nbytes for s in self.states)

    def used_bytes(self) -> int:
        """Bytes of state that carry the session (what offload moves)."""
        if not self.on_device:
            return sum(nbytes_of(s.host) for s in self.states)
        return sum(nbytes_of(s.snapshot(self.length)) for s in self.states)

    @property
    def k(self) -> list[torch.Tensor]:
        """Key buffers of the KV layers (host copies while displaced)."""
        return [s.k for s in self.states if isinstance(s, KVState) and s.k is not None]

    @property
    def v(self) -> list[torch.Tensor]:
        return [s.v for s in self.states if isinstance(s, KVState) and s.v is not None]

    def state(self, layer: int) -> LayerState:
        if not self.on_device:
            raise RuntimeError("session state is offloaded to host RAM; call session.restore() first")
        return self.states[layer]

    def advance(self, T: int) -> None:
        """Called once per forward pass, after every layer appended its T tokens."""
        self.length += T

    # --- displacement to host RAM -------------------------------------------------------
    def offload(self) -> None:
        """Move every layer's state to host RAM (one pinned buffer on CUDA) and free the device tensors."""
        if not self.on_device:
            return
        parts = [s.snapshot(self.length) for s in self.states]
        flat = [t for p in parts for t in p]
        buf = self.device.host_empty((_carved_bytes(flat),), torch.uint8, pin=True)
        hosts = iter(_carve(buf, flat))
        with self.device.sync_copy(nbytes_of(flat), {"what": "kv_offload", "direction": "d2h"}):   # timed, as restore
            for layer, (state, part) in enumerate(zip(self.states, parts)):
                state.host = [next(hosts) for _ in part]
                for src, h in zip(part, state.host):
                    h.copy_(src)
                    self.counters.transfer("d2h", "kv", h.numel() * h.element_size(), layer)
        for state in self.states:
            state.drop()
        self.on_device = False
        self.static_decoder = None       # its graphs read the freed buffers

    def restore(self) -> None:
        """Bring an offloaded session back to the device."""
        if self.on_device:
            return
        for state in self.states:
            state.reserve(self.length, 0)
        nbytes = sum(nbytes_of(s.host) for s in self.states)
        with self.device.sync_copy(nbytes, {"what": "kv_restore", "direction": "h2d"}):
            for layer, state in enumerate(self.states):
                for h, d in zip(state.host, state.snapshot(self.length)):
                    d.copy_(h, non_blocking=True)
                    self.counters.transfer("h2d", "kv", h.numel() * h.element_size(), layer)
        self.device.synchronize()    # the host buffer is freed below: no copy may still read it
        for state in self.states:
            state.host = None
        self.on_device = True

    def copy_to(self, other: Session) -> None:
        """Make `other` (an empty session of the same model and batch) hold what this one holds: every
        layer's state copied on the device, as a restore copies it back (exact for every kind: a
        full or windowed KV, a latent, a recurrent state). What a prefix cache hands a request
        that begins with this session's tokens."""
        if not (self.on_device and other.on_device) or other.length or other.batch != self.batch:
            raise ValueError("copy_to needs both sessions on the device and an empty target of the same batch")
        for mine, theirs in zip(self.states, other.states):
            theirs.reserve(self.length, 0)
            for src, dst in zip(mine.snapshot(self.length), theirs.snapshot(self.length)):
                dst.copy_(src)
        other.length = self.length

    def close(self) -> None:
        """Free the device tensors."""
        for state in self.states:
            if self.on_device:
                state.drop()
            state.host = None
        self.length, self.on_device, self.static_decoder = 0, True, None
