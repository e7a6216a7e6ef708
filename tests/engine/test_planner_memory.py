"""The planner's transient memory against what a forward pass really allocates on the emulated
device (torch.profiler's record of every CPU-allocator allocation and free, kernel
workspaces included): planned >= measured peak, and not absurdly larger (<= 3x)."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.config import preset
from engine.planner import allocator_slack, attention_workspace_bytes, plan_memory
from harness.measure import transient_peak

CASES = [  # tokens, batch, dtype, placement options, model overrides
    (1, 2, "float32", {}, None),                                  # a decode step
    (8, 1, "float32", {}, None),
    (64, 2, "float32", {"placement": "fetch", "cache_capacity": 2}, None),
    (256, 1, "float32", {}, None),
    (256, 1, "bfloat16", {}, None),
    (512, 2, "float32", {}, None),                                # the attention workspace matters here
    (128, 2, "float32", {}, {"family": "qwen2_moe", "shared_expert_intermediate_size": 96}),
    (200, 1, "float32", {}, {"family": "qwen3_moe", "qk_norm": "head"}),
    (256, 2, "float32", {}, {"sliding_window": 32}),              # bounded state: held + new keys concatenated
    (1, 2, "bfloat16", {"expert_quant": "int4"}, None),           # quantised experts: dequantised, then the kernel
    (64, 2, "float32", {"placement": "fetch", "cache_capacity": 2, "expert_quant": "int4"}, None),
    (8, 1, "bfloat16", {"expert_quant": "int8"}, None),
]


# the second wave: sinks and MXFP4 dequantised in the kernel, the delta rule's chunks, Gemma 4's layer
SECOND_WAVE_CASES = [(model, tokens, batch, dtype) for model in ("tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4")
                     for tokens, batch, dtype in ((1, 2, "float32"), (64, 2, "float32"), (200, 1, "float32"),
                                                  (256, 1, "bfloat16"))]


def measured_and_planned(device: str, tokens: int, batch: int, dtype: str, options: dict | None = None,
                         overrides: dict | None = None, model: str = "tiny-mixtral",
                         all_logits: bool = False) -> tuple[int, int]:
    """(measured transient peak, planned transient) of one prefill of `tokens` per sequence
    (keeping every position's logits with all_logits, on an engine planned for that)."""
    eng = Engine.from_pretrained(model, device=device, dtype=dtype, ubatch=tokens, max_context=tokens + 1,
                                 batch=batch, model_overrides=overrides, all_logits=all_logits, **(options or {}))
    sess = eng.new_session(batch)
    eng.prefill(sess, [[1]] * batch)          # allocates the whole planned KV: not part of the transient
    rows = torch.randint(0, 512, (batch, tokens), generator=torch.Generator().manual_seed(tokens)).tolist()
    return transient_peak(device, lambda: eng.prefill(sess, rows, all_logits=all_logits)), eng.plan.transient


@pytest.mark.parametrize("tokens,batch,dtype,options,overrides", CASES)
def test_planned_transient_bounds_the_measured_peak(tokens, batch, dtype, options, overrides):
    peak, planned = measured_and_planned("cpu", tokens, batch, dtype, options, overrides)
    assert 0 < peak <= planned <= 3 * peak, (peak, planned)


def test_the_packed_kernel_path_stays_within_the_dequantising_plan():
    """A few fp32 rows of int4 experts on the CPU run the kernel on the packed bytes (no dense copy):
    the plan still counts the dequantising path, which the same layer takes for more rows."""
    from engine.kernels import cpu as cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here: the dequantising path runs, covered above")
    peak, planned = measured_and_planned("cpu", 1, 2, "float32", {"expert_quant": "int4"})
    assert 0 < peak <= planned, (peak, planned)


@pytest.mark.parametrize("model,tokens,batch,dtype", SECOND_WAVE_CASES)
def test_second_wave_planned_transient_bounds_the_measured_peak(model, tokens, batch, dtype):
    peak, planned = measured_and_planned("cpu", tokens, batch, dtype, model=model)
    assert 0 < peak <= planned <= 3 * peak, (peak, planned)


@pytest.mark.parametrize("model,tokens,batch,dtype", [("tiny-mixtral", 256, 2, "float32"),
                                                      ("tiny-gemma4", 200, 1, "float32"),     # soft-capped logits
                                                      ("tiny-mixtral", 64, 1, "bfloat16")])
def test_planned_transient_bounds_a_prefill_keeping_every_positions_logits(model, tokens, batch, dtype):
    """The quality pass's prefill (harness.quality) on a vocabulary wide enough that its logits,
    [B, T, V], and not any layer, are the peak."""
    V = 8192
    peak, planned = measured_and_planned("cpu", tokens, batch, dtype, overrides={"vocab_size": V}, model=model,
                                         all_logits=True)
    assert peak > batch * tokens * V * torch.finfo(getattr(torch, dtype)).bits // 8      # the logits dominate
    assert peak <= planned <= 3 * peak, (peak, planned)


def test_cuda_plan_counts_materialised_scores_and_allocator_slack():
    cfg = preset("mixtral-8x7b")
    B, T, S = 1, 512, 4096
    cuda = attention_workspace_bytes(cfg, B, T, S, 2, "cuda")
    assert cuda >= 2 * B * cfg.num_heads * T * S * 4                     # scores + probabilities, fp32
    assert attention_workspace_bytes(cfg, B, T, S, 2, "cpu") < cuda
    assert allocator_slack(100, "cpu") == 0 and allocator_slack(100, "cuda") >= 22 << 20
    on_cuda = plan_memory(cfg, "fetch", 2, None, S, B, T, 2, device_kind="cuda")
    on_cpu = plan_memory(cfg, "fetch", 2, None, S, B, T, 2, device_kind="cpu")
    assert on_cuda.total - on_cpu.total == (on_cuda.attention - on_cpu.attention) + on_cuda.slack
    assert "attention workspace (worst case)" in str(on_cuda) and "allocator slack" in str(on_cuda)
    with pytest.raises(ValueError, match="device_kind must be 'cuda' or 'cpu', got 'tpu'"):
        attention_workspace_bytes(cfg, B, T, S, 2, "tpu")
