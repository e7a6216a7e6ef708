"""Shared blocks against the transformers modules the next families use: the fp32-scaled norms
(GPT-OSS; Qwen3-Next's zero-centred 1 + w) and partial rotary (GLM-4.5), bitwise."""
from __future__ import annotations

import pytest
import torch

from engine.blocks.norms import RMSNorm
from engine.blocks.rope import Rope
from engine.layers import rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_scaled_norms_match_transformers(dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 32, generator=g) * 3).to(dtype)
    w = torch.randn(32, generator=g).to(dtype)
    for ref, ours in ((GptOssRMSNorm(32, eps=1e-5), RMSNorm("n", 32, 1e-5, weight_in_fp32=True)),
                      (Qwen3NextRMSNorm(32, eps=1e-6), RMSNorm("n", 32, 1e-6, offset=1.0))):
        ref.weight.data = w.clone()
        ref = ref.to(dtype)
        ours.w["weight"] = w
        with torch.no_grad():
            assert torch.equal(ours(x), ref(x))
    assert RMSNorm("n", 32, 1e-6, offset=1.0).tensors()["weight"].init == "zeros"   # 1 + 0: identity at init


def test_partial_rotary_matches_glm():
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    rope = Rope(dim=8, theta=10000.0)
    cos, sin = rope_cos_sin(torch.arange(3, 10), 8, 10000.0, 1.0, torch.float32)     # [T, 8]
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert torch.equal(rope.apply(q, cos, sin), ref_q) and torch.equal(rope.apply(k, cos, sin), ref_k)
