"""Token -> expert dispatch: the one-sync grouping equals the nonzero reference exactly, and a
forward pass reads routing back to the host once per MoE layer, never per expert."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.dispatch import group_by_expert, group_by_expert_reference, tokens_per_expert


def random_ids(seed: int, rows: int, n_experts: int, top_k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(rows)])   # [N, k] distinct


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 70), st.integers(2, 16), st.integers(1, 4))
def test_grouping_equals_nonzero_reference(seed: int, rows: int, n_experts: int, top_k: int) -> None:
    ids = random_ids(seed, rows, n_experts, min(top_k, n_experts))
    fast, ref = group_by_expert(ids, n_experts), group_by_expert_reference(ids)
    assert fast.experts == ref.experts
    for a, b in zip(fast.rows + fast.slots, ref.rows + ref.slots):
        assert a.dtype == b.dtype and torch.equal(a, b)            # same rows, same order: bitwise outputs
    assert tokens_per_expert(ids, n_experts).tolist() == torch.bincount(ids.flatten(), minlength=n_experts).tolist()


HOST_SYNCING_OPS = ("nonzero", "_local_scalar_dense", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                    "masked_select", "repeat_interleave")   # output size or value read by the host on CUDA


@pytest.mark.parametrize("placement,options", [("fetch", {"cache_capacity": 3}),
                                               ("fetch", {"cache_capacity": 3, "prefetch": "next_layer_gate"}),
                                               ("resident", {}), ("stream", {"cache_capacity": 2, "stream_threshold": 4})])
def test_one_host_read_per_moe_layer(placement, options, monkeypatch):
    """Counted on the emulated device: every `.tolist()` inside a forward pass (a device->host
    transfer on CUDA) and every op whose output size the host must read (a hidden sync)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, **options)
    sess = eng.new_session(2)
    eng.prefill(sess, [[1, 2, 3, 4, 5, 6, 7, 8]] * 2)                 # warm: cache state is not the point
    reads: list[str] = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append("tolist")
        return real_tolist(self)

    class SyncOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in HOST_SYNCING_OPS:
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    for rows in ([[9, 8, 7, 6, 5, 4]] * 2, [[3], [1]]):             # a streamed prefill (> 4 tokens), a decode step
        reads.clear()
        with torch.inference_mode(), SyncOps():
            eng.model.forward(torch.tensor(rows), sess)
        prefetch_reads = 3 if "prefetch" in options else 0           # next_layer_gate: one per layer it predicts for
        assert reads == ["tolist"] * (4 + prefetch_reads), reads      # tiny-mixtral: 4 MoE layers
