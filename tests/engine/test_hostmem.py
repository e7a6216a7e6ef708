"""Host RAM: what an allocation really takes per pinning method, registration lifetime of the
exact-size pinned buffers (with fake register/unregister, so it runs without CUDA), which
placements pin, and the host-RAM check's arithmetic."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from engine import Engine
from engine.config import preset
from engine.engine import _check_host_ram, host_ram_needed
from engine.hostmem import PAGE, host_alloc_bytes, host_empty, registered_bytes
from engine.planner import plan_memory
from engine.registry import PLACEMENTS

GiB = 1 << 30


def test_alloc_bytes_per_method():
    assert host_alloc_bytes(0, "register") == host_alloc_bytes(0, "caching") == 0
    assert host_alloc_bytes(1, "none") == host_alloc_bytes(1, "register") == PAGE
    assert host_alloc_bytes(PAGE + 1, "register") == 2 * PAGE
    assert host_alloc_bytes(5 * GiB, "caching") == 8 * GiB
    assert host_alloc_bytes(4 * GiB, "caching") == 4 * GiB
    with pytest.raises(ValueError, match=r"one of \('none', 'register', 'caching'\), got 'cuda'"):
        host_alloc_bytes(1, "cuda")


def test_mixtral_store_pinned_by_torch_would_need_128_gib():
    """The reason for registering in place: Mixtral-8x7B's bf16 expert store is 84 GiB, but each
    2.6 GiB layer rounded up to a power of two would pin 4 GiB -- 128 GiB in all."""
    cfg = preset("mixtral-8x7b")
    layer = cfg.n_experts * cfg.expert_params * 2
    store = cfg.n_moe_layers * layer
    assert 84 * GiB <= store < 85 * GiB
    assert cfg.n_moe_layers * host_alloc_bytes(layer, "caching") == 128 * GiB
    assert store <= cfg.n_moe_layers * host_alloc_bytes(layer, "register") < store + cfg.n_moe_layers * PAGE


def test_registration_lives_exactly_as_long_as_the_memory():
    calls: list[tuple] = []
    before = registered_bytes()
    t = host_empty((3, 1000), torch.float32, pin=True,
                   register=lambda ptr, n: calls.append(("register", ptr, n)),
                   unregister=lambda ptr: calls.append(("unregister", ptr)))
    assert t.shape == (3, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    (_, ptr, n), = calls
    assert ptr == t.data_ptr() and ptr % PAGE == 0 and n == host_alloc_bytes(12000, "register")
    assert registered_bytes() == before + n
    row = t[2]                                      # a view keeps the registration alive
    row.fill_(7.0)
    del t
    gc.collect()
    assert calls == [("register", ptr, n)] and row.sum().item() == 7000.0
    del row
    gc.collect()
    assert calls == [("register", ptr, n), ("unregister", ptr)] and registered_bytes() == before


def test_unpinned_is_a_plain_tensor():
    t = host_empty((4, 5), torch.bfloat16, pin=False,
                   register=lambda *a: pytest.fail("must not register"), unregister=lambda p: None)
    assert t.shape == (4, 5) and t.dtype == torch.bfloat16


@pytest.mark.parametrize("placement,copies", [("resident", False), ("cpu", False), ("hybrid", False),
                                              ("fetch", True), ("stream", True)])
def test_only_placements_that_copy_experts_pin(placement, copies):
    assert PLACEMENTS.get(placement).copies_experts is copies


def _fake_cuda_device() -> SimpleNamespace:
    return SimpleNamespace(emulated=False, pin_method=lambda pin: "register" if pin else "none")


def test_host_ram_needed_counts_real_allocation_sizes():
    cfg = preset("mixtral-8x7b")
    layer = cfg.n_experts * cfg.expert_params * 2
    plan = plan_memory(cfg, "fetch", 2, None, 4096, 1, 512, 2)
    fetch = PLACEMENTS.get("fetch")(SimpleNamespace())
    rows = dict(host_ram_needed(cfg, torch.bfloat16, fetch, _fake_cuda_device(), plan))
    store = rows[f"host expert store (32 layers x 2.62 GiB, register)"]
    assert store == 32 * host_alloc_bytes(layer, "register")
    assert rows["non-expert weights"] == cfg.non_expert_params() * 2
    resident = PLACEMENTS.get("resident")(SimpleNamespace())
    rows = dict(host_ram_needed(cfg, torch.bfloat16, resident, _fake_cuda_device(), plan))
    assert rows["host expert store (0 layers x 2.62 GiB, none)"] == 0
    with pytest.raises(MemoryError, match=r"needs 86\.99 GiB of host RAM at bfloat16, but only 64\.00 GiB is "
                                          r"available:\n  non-expert weights .*\n  host expert store \(32 layers"):
        _check_host_ram(cfg, torch.bfloat16, None, host_ram_needed(cfg, torch.bfloat16, fetch,
                                                                      _fake_cuda_device(), plan), available=64 * GiB)


def test_emulated_device_counts_device_experts_in_host_ram():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=3)
    rows = dict(host_ram_needed(eng.cfg, torch.float32, eng.placement, eng.device, eng.plan))
    assert rows["device experts (emulated: in host RAM)"] == eng.plan.experts == 4 * 3 * eng.model.store.expert_bytes
    assert not any(r.is_pinned() for r in eng.model.store.rows.values())   # no pinning without CUDA
