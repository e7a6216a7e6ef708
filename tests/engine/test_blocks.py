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


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},                  # DeepSeek-V3's published values
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},                  # GPT-OSS's published values
])
def test_yarn_equals_transformers(params):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.blocks.rope import Yarn
    cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=131072,
                         rope_parameters=dict(params))
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    rope = Yarn(dim=32, theta=params["rope_theta"], factor=params["factor"],
                original_max_position_embeddings=params["original_max_position_embeddings"],
                beta_fast=params["beta_fast"], beta_slow=params["beta_slow"], mscale=params.get("mscale"),
                mscale_all_dim=params.get("mscale_all_dim"), truncate=params.get("truncate", True))
    assert torch.equal(rope.inv_freq(), inv_ref) and rope.attention_scaling == pytest.approx(scale_ref, rel=0, abs=0)
    cos, sin = rope.cos_sin(torch.arange(0, 9000, 997), torch.float32)
    freqs = torch.arange(0, 9000, 997).float()[:, None] * inv_ref[None, :]
    emb = torch.cat((freqs, freqs), -1)
    assert torch.equal(cos, emb.cos() * scale_ref) and torch.equal(sin, emb.sin() * scale_ref)
