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
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed))
    for gate, t, s in zip(fast.gates(weights), ref.rows, ref.slots):
        assert torch.equal(gate, weights[t, s, None])              # [n, 1]: each row's weight for that expert
    assert tokens_per_expert(ids, n_experts).tolist() == torch.bincount(ids.flatten(), minlength=n_experts).tolist()


def test_one_row_with_a_repeated_expert_is_grouped_like_the_reference() -> None:
    """Decode at batch 1 takes a one-row path; a router that chose one expert twice falls back to the sort."""
    for ids in (torch.tensor([[5, 2, 5]]), torch.tensor([[3, 1, 0]])):
        fast, ref = group_by_expert(ids, 8), group_by_expert_reference(ids)
        assert fast.experts == ref.experts
        assert all(torch.equal(a, b) for a, b in zip(fast.rows + fast.slots, ref.rows + ref.slots))
        w = torch.tensor([[0.5, 0.3, 0.2]])
        assert [g.tolist() for g in fast.gates(w)] == [w[t, s, None].tolist() for t, s in zip(ref.rows, ref.slots)]


HOST_SYNCING_OPS = ("nonzero", "_local_scalar_dense", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                    "masked_select", "repeat_interleave")   # output size or value read by the host on CUDA


@pytest.mark.parametrize("placement,options", [("fetch", {"cache_capacity": 3}),
                                               ("fetch", {"cache_capacity": 3, "prefetch": "next_layer_gate"}),
                                               ("resident", {}), ("resident_grouped", {}),
                                               ("stream", {"cache_capacity": 2, "stream_threshold": 4})])
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
        layer_reads = 0 if placement == "resident_grouped" else 4    # tiny-mixtral: 4 MoE layers; grouped: none
        assert reads == ["tolist"] * (layer_reads + prefetch_reads), reads


@pytest.mark.parametrize("seed", range(6))
def test_grouped_kernel_equals_expert_loop_per_group(seed: int) -> None:
    """expert_ffn_grouped on rows sorted by expert (empty and one-row groups included) is bitwise
    expert_ffn on each group: what lets resident_grouped keep the invariant exactly."""
    from engine.layers import expert_ffn, expert_ffn_grouped

    g = torch.Generator().manual_seed(seed)
    E, D, I = 6, 32, 48
    rows = torch.randn(E, 3 * D * I, generator=g) * 0.1                          # [E, P]
    counts = torch.randint(0, 5 if seed % 2 else 40, (E,), generator=g)
    counts[seed % E] = 1
    x = torch.randn(int(counts.sum()), D, generator=g)                           # [M, D] grouped by expert
    y = expert_ffn_grouped(x, rows, counts.cumsum(0).to(torch.int32), D, I, "silu")
    ends = counts.cumsum(0).tolist()
    for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
        if b > a:
            assert torch.equal(y[a:b], expert_ffn(x[a:b], rows[e], D, I, "silu"))


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-deepseek", "tiny-qwen3-next"])
def test_resident_grouped_equals_resident(model: str) -> None:
    """resident_grouped -- device-side grouping, grouped GEMMs -- gives bitwise the tokens
    and logits of the one-sync expert loop, prefill and decode, batch 2."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3]]
    ref = Engine.from_pretrained(model, device="cpu").generate(prompts, 6)
    got = Engine.from_pretrained(model, device="cpu", placement="resident_grouped").generate(prompts, 6)
    assert got.tokens == ref.tokens and all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


def test_resident_grouped_refused_without_a_grouped_kernel() -> None:
    with pytest.raises(ValueError, match="'resident_grouped' needs a grouped expert kernel; MXFP4Experts"):
        Engine.from_pretrained("tiny-gpt-oss", device="cpu", placement="resident_grouped")
