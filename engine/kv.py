"""Sessions and their KV cache.

Owns: per-sequence key/value tensors (one [B, K, capacity, h] buffer pair per layer,
allocated once at the planned context, or grown by doubling when unplanned), the
session's token bookkeeping, and moving the KV to host RAM and back (counted as
d2h/h2d `kv` bytes). Does not own: attention math (engine.layers) or when a
session is displaced (the caller decides).

Displaced KV lives in one exact-size host buffer per displacement, page-locked on CUDA
(engine.hostmem: registered in place, not torch's power-of-two pinned pool). Pinned because
`restore` is a measured phase (`restore_s`): from pinned memory the host->device copies are
asynchronous DMA at link speed, as in a serving engine's pinned swap space, while from
pageable memory the driver stages every copy through a bounce buffer synchronously, so
restore_s would time a CPU memcpy rather than the link; the device->host copies of
`offload` go to the same pinned buffer for the same reason. One buffer for all layers, so
the registration (about as costly as touching the pages once) is paid once per
displacement, between turns, outside the phase that restores it.

    sess = engine.new_session(batch=2)
    engine.generate(prompts, 8, session=sess)     # KV stays on the device
    sess.offload()                                # KV -> host RAM (d2h bytes counted)
    sess.restore()                                # host -> device (h2d bytes counted)
"""
from __future__ import annotations

import torch

from engine.counters import Counters
from engine.devices import Device

MIN_CAPACITY = 256


class Session:
    """One batch of sequences that advance together (equal lengths)."""

    def __init__(self, device: Device, counters: Counters, n_layers: int, batch: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, max_tokens: int | None = None) -> None:
        self.device, self.counters = device, counters
        self.batch, self.kv_heads, self.head_dim, self.dtype = batch, kv_heads, head_dim, dtype
        self.n_layers = n_layers
        self.max_tokens = max_tokens                      # the planned context: KV never grows past it
        self.length = 0                                   # tokens whose KV is held
        self.capacity = 0
        self.k: list[torch.Tensor] = []                   # per layer [B, K, capacity, h]
        self.v: list[torch.Tensor] = []
        self.pending: list[int] | None = None             # last generated token per row, not yet in the KV
        self.on_device = True
        self._label = f"kv:{id(self)}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def used_bytes(self) -> int:
        """Bytes of KV actually filled (length, not capacity)."""
        return 2 * self.n_layers * self.batch * self.kv_heads * self.length * self.head_dim * self.dtype.itemsize

    def _grow(self, needed: int) -> None:
        if self.max_tokens is not None and needed > self.max_tokens:
            raise ValueError(f"session needs KV for {needed} tokens but the engine was planned for "
                             f"max_context={self.max_tokens}; pass a larger max_context to Engine.from_pretrained")
        if self.max_tokens is not None:
            cap = self.max_tokens   # planned: allocate the whole context once, as llama.cpp does for n_ctx
        else:
            cap = max(MIN_CAPACITY, self.capacity)
            while cap < needed:
                cap *= 2
        shape = (self.batch, self.kv_heads, cap, self.head_dim)
        new_k = [self.device.empty(shape, self.dtype, self._label) for _ in range(self.n_layers)]
        new_v = [self.device.empty(shape, self.dtype, self._label) for _ in range(self.n_layers)]
        for old, new in zip((*self.k, *self.v), (*new_k, *new_v)):
            new[:, :, : self.length].copy_(old[:, :, : self.length])
            self.device.release(self._label, old)
        self.k, self.v, self.capacity = new_k, new_v, cap

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, K, T, h] after the current length; return all keys/values [B, K, S, h]."""
        if not self.on_device:
            raise RuntimeError("session KV is offloaded to host RAM; call session.restore() first")
        T = k.shape[2]
        if self.length + T > self.capacity:
            self._grow(self.length + T)
        end = self.length + T
        self.k[layer][:, :, self.length:end].copy_(k)
        self.v[layer][:, :, self.length:end].copy_(v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, T: int) -> None:
        """Called once per forward pass, after every layer appended its T tokens."""
        self.length += T

    # --- displacement to host RAM -------------------------------------------------------
    def offload(self) -> None:
        """Move the filled KV to host RAM (one pinned buffer on CUDA) and free the device buffers."""
        if not self.on_device:
            return
        filled = [t[:, :, : self.length] for pair in zip(self.k, self.v) for t in pair]   # k0, v0, k1, v1, ...
        per = [t.numel() for t in filled]
        host = self.device.host_empty((sum(per),), self.dtype, pin=True).split(per)     # views of one buffer
        host_k, host_v = [], []
        for i, (src, h) in enumerate(zip(filled, host)):
            h = h.view(src.shape)
            h.copy_(src)
            layer = i // 2
            self.counters.transfer("d2h", "kv", h.numel() * h.element_size(), layer)
            (host_k if i % 2 == 0 else host_v).append(h)
        for t in (*self.k, *self.v):
            self.device.release(self._label, t)
        self.k, self.v, self.capacity, self.on_device = host_k, host_v, 0, False

    def restore(self) -> None:
        """Bring an offloaded KV back to the device."""
        if self.on_device:
            return
        host_k, host_v = self.k, self.v
        self.k, self.v, self.capacity, self.on_device = [], [], 0, True
        n = self.length
        self.length = 0
        self._grow(n)
        self.length = n
        nbytes = sum(h.numel() * h.element_size() for h in (*host_k, *host_v))
        with self.device.sync_copy(nbytes, {"what": "kv_restore", "direction": "h2d"}):
            for layer in range(self.n_layers):
                for h, d in ((host_k[layer], self.k[layer]), (host_v[layer], self.v[layer])):
                    d[:, :, :n].copy_(h, non_blocking=True)
                    self.counters.transfer("h2d", "kv", h.numel() * h.element_size(), layer)
        self.device.synchronize()    # the host buffer is freed when this returns: no copy may still read it

    def close(self) -> None:
        """Free the device buffers."""
        if self.on_device:
            for t in (*self.k, *self.v):
                self.device.release(self._label, t)
        self.k, self.v, self.capacity, self.length = [], [], 0, 0
