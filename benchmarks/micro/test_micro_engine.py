"""Micro-benchmarks of the engine's hot paths: expert FFN (dense and quantised), router, cache
lookup, host->device copy.

Shapes are real models' per-expert shapes (OLMoE-1B-7B: D=2048, I=1024, 64 experts, top-8;
Mixtral-8x7B: D=4096, I=14336 is too large for a 2-core CI box, so its router only) and the
tiny test model's; dtype fp32 as on the CPU. Each benchmark names its shape in its id.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.blocks.experts import SwiGLUExperts
from engine.blocks.quant_experts import QuantExperts
from engine.cache import ExpertCache, ExpertStore
from engine.config import preset
from engine.counters import Counters
from engine.devices import Device
from engine.layers import expert_ffn, route
from engine.policies import make_policy

SHAPES = {"tiny": preset("tiny-mixtral"), "olmoe": preset("olmoe-1b-7b")}


def _packed(cfg, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3 * cfg.hidden_size * cfg.moe_intermediate_size, generator=g) * 0.02   # [3*I*D]


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_expert_ffn(benchmark, shape: str, tokens: int) -> None:
    cfg = SHAPES[shape]
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.randn(tokens, D)                                        # [n, D]
    w = _packed(cfg)
    out = benchmark(expert_ffn, x, w, D, I, cfg.hidden_act)
    assert out.shape == (tokens, D)


@pytest.mark.parametrize("fmt,group,activations", [("int8", 32, "fp32"), ("int4", 32, "fp32"), ("int4", 8, "fp32"),
                                                   ("int8", 32, "int8"), ("int4", 32, "int8")])
def test_quant_expert_ffn(benchmark, fmt: str, group: int, activations: str) -> None:
    """A decode step's one row through a quantised expert (experts.quant, experts.activations) of the
    wide benchmark shape (benchmarks/bench_vs_llamacpp.py --shape wide: D = I = 2048), from its packed
    bytes: the CPU kernel where it is built, else the dequantising path."""
    D = I = 2048
    layout = QuantExperts(SwiGLUExperts(D, I, "silu", "m.{layer}"), fmt, group, activations)
    packed = torch.empty(layout.numel, dtype=torch.uint8)
    layout.pack(torch.randn(layout.base.numel, generator=torch.Generator().manual_seed(0)) * 0.02, packed)
    out = benchmark(layout.run, torch.randn(1, D), packed)
    assert out.shape == (1, D) and torch.isfinite(out).all()


@pytest.mark.parametrize("tokens", [1, 512])
@pytest.mark.parametrize("shape", ["tiny", "olmoe", "mixtral"])
def test_route(benchmark, shape: str, tokens: int) -> None:
    cfg = preset("mixtral-8x7b") if shape == "mixtral" else SHAPES[shape]
    h = torch.randn(tokens, cfg.hidden_size)                          # [N, D]
    router = torch.randn(cfg.n_experts, cfg.hidden_size) * 0.02       # [E, D]
    ids, weights = benchmark(route, h, router, cfg.top_k, cfg.norm_topk_prob, True)
    assert ids.shape == (tokens, cfg.top_k)


def _cache(capacity: int, n_experts: int = 8, numel: int = 3 * 64 * 96) -> tuple[ExpertCache, Device]:
    dev = Device("cpu")
    store = ExpertStore(n_experts, numel, torch.float32)
    store.allocate(0, dev, on_device=False).normal_()
    cache = ExpertCache(store, dev, Counters(1), capacity, [0],
                        lambda layer: make_policy("lru", capacity, n_experts, layer))
    return cache, dev


@pytest.mark.parametrize("capacity", [2, 4, 8])
def test_cache_acquire(benchmark, capacity: int) -> None:
    """256 lookups (acquire + release) of a skewed id sequence through an LRU cache of 8
    experts on the emulated device; capacity 8 never misses after warm-up (lookup cost only)."""
    cache, dev = _cache(capacity)
    rng = np.random.default_rng(0)
    ids = rng.choice(8, size=256, p=np.array([8, 6, 5, 4, 3, 2, 1, 1]) / 30).tolist()

    def lookups() -> None:
        for e in ids:
            cache.acquire(0, e)
            cache.release(0, e)
        dev.synchronize()

    benchmark(lookups)
    assert cache.counters.totals()["expert_hits"] + cache.counters.totals()["expert_misses"] >= 256


@pytest.mark.parametrize("mib", [1, 16])
def test_copy_h2d(benchmark, mib: int) -> None:
    """One host->device copy of an expert-sized buffer and the wait for it (emulated device:
    a memcpy on the copy worker thread)."""
    dev = Device("cpu")
    n = mib * 2**20 // 4
    src = dev.host_empty((n,), torch.float32, pin=True).normal_()
    dst = dev.empty((n,), torch.float32, "bench")

    def copy() -> None:
        dev.wait(dev.copy_h2d(dst, src))

    benchmark(copy)
    assert torch.equal(dst, src)
