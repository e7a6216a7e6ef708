"""Host RAM for the expert store and displaced KV: exact-size allocations, page-locked in place
on CUDA, and the arithmetic of how many bytes an allocation really takes.

Owns: `host_empty` (a plain host tensor, or one page-locked with `cudaHostRegister` for as
long as any view of it lives), `host_alloc_bytes` (the bytes an allocation of n bytes takes
with a pinning method, so the host-RAM check is testable without a GPU), and the count of
bytes registered right now. Does not own: what is allocated where (engine.devices,
engine.cache, engine.kv) or when host RAM is checked (engine.engine).

    rows = host_empty((8, 1 << 20), torch.bfloat16, pin=True)   # page-locked on CUDA, exact size
    host_alloc_bytes(84 << 30, "caching")  -> 128 GiB            # why torch's pin_memory=True is not used

Why not `torch.empty(..., pin_memory=True)`: torch's CachingHostAllocator rounds every
request up to the next power of two (and keeps freed blocks cached), so one layer's packed
experts of Mixtral-8x7B in bf16 (2.6 GiB) would pin 4 GiB, and the whole store (84 GiB)
128 GiB -- more than the machines this project is for have. Instead a page-aligned
anonymous mapping of exactly the rounded-up page count is made, registered with CUDA
(`cudaHostRegister`, portable flag), and wrapped as a tensor with `torch.frombuffer`; the
tensor (and every view of it) holds the mapping, and a finalizer on the mapping unregisters
it when the last view is gone, just before the pages are unmapped. Registration pins every
page up front (it costs about as much time as touching the memory once), so it is done once
per store layer at load and once per KV displacement, never per copy.
"""
from __future__ import annotations

from collections.abc import Callable
import mmap
import threading
from typing import TYPE_CHECKING
import weakref

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


PAGE = mmap.PAGESIZE
PIN_METHODS = ("none", "register", "caching")   # plain pageable | cudaHostRegister in place | torch pin_memory=True
CUDA_HOST_REGISTER_PORTABLE = 1                 # cudaHostRegisterPortable: pinned for every CUDA context

_lock = threading.Lock()
_registered_bytes = 0


def host_alloc_bytes(nbytes: int, method: str) -> int:
    """Bytes of host RAM that a host allocation of `nbytes` really takes with pinning `method`.

    none      a plain allocation: whole pages (large allocations are mmapped by the allocator)
    register  the same pages, page-locked in place with cudaHostRegister (what this engine does)
    caching   torch's pinned CachingHostAllocator (pin_memory=True): the next power of two
    """
    if method not in PIN_METHODS:
        raise ValueError(f"pinning method must be one of {PIN_METHODS}, got {method!r}")
    if nbytes <= 0:
        return 0
    if method == "caching":
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // PAGE) * PAGE


def registered_bytes() -> int:
    """Host bytes page-locked by `host_empty(pin=True)` that are still alive."""
    return _registered_bytes


class _Mapping(mmap.mmap):
    """An anonymous page-aligned mapping (a subclass only so a finalizer can be attached)."""


def _cuda_register(ptr: int, nbytes: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed with cudaError {err} "
                           "(out of lockable memory? check `ulimit -l` and free host RAM)")


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)   # at teardown an error has nowhere useful to go


def _release(ptr: int, nbytes: int, unregister: Callable[[int], None]) -> None:
    global _registered_bytes
    unregister(ptr)
    with _lock:
        _registered_bytes -= nbytes


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
               register: Callable[[int, int], None] = _cuda_register,
               unregister: Callable[[int], None] = _cuda_unregister) -> torch.Tensor:
    """An uninitialised host tensor of `shape`; with `pin`, page-locked for exactly its lifetime.

    Pinned: whole pages of an anonymous mapping (host_alloc_bytes(n, "register") bytes),
    registered through `register(ptr, nbytes)` and unregistered through `unregister(ptr)` once
    no tensor or view of it is left (the defaults call the CUDA runtime; tests pass fakes).
    """
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if not pin or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    global _registered_bytes
    size = host_alloc_bytes(nbytes, "register")
    mapping = _Mapping(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # plain process memory
    flat = torch.frombuffer(mapping, dtype=torch.uint8)            # holds `mapping` while any view lives
    ptr = flat.data_ptr()
    register(ptr, size)
    with _lock:
        _registered_bytes += size
    fin = weakref.finalize(mapping, _release, ptr, size, unregister)   # runs before the pages are unmapped
    fin.atexit = False                  # at interpreter exit the CUDA runtime may already be gone
    return flat[:nbytes].view(dtype).view(shape)
