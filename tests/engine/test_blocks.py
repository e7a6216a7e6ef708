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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary", [8, 16])
def test_rope_matches_transformers_bitwise(dtype: torch.dtype, rotary: int):
    """Partial (GLM's) and full rotary, against transformers' rotate_half form, to the bit: ours
    rolls x against a sin with its first half negated."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, h, 7, 16, generator=g).to(dtype) for h in (4, 2))
    rope = Rope(dim=rotary, theta=10000.0)
    cos, sin = rope_cos_sin(torch.arange(3, 10), rotary, 10000.0, 1.0, dtype)        # [T, r]
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    bits = torch.int32 if dtype == torch.float32 else torch.int16                   # compared as raw bits
    for ours, ref in ((rope.apply(q, cos, sin), ref_q), (rope.apply(k, cos, sin), ref_k)):
        assert ours.dtype == dtype and torch.equal(ours.view(bits), ref.view(bits))


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


# --- the second wave's blocks against the transformers modules they mirror -------------------------
def test_attention_with_sinks_matches_gpt_oss_eager():
    """The sink as one extra key inside SDPA against transformers' eager softmax over [scores, sink],
    with a causal window mask (prefill) and without a mask (decode)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from engine.blocks.sinks import attention_with_sinks
    from engine.layers import causal_mask

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), \
        torch.randn(2, 2, 9, 16, generator=g)
    sinks = torch.randn(4, generator=g) * 2
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    for mask in (causal_mask(7, 2, 4, torch.device("cpu")), None):
        additive = None if mask is None else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]
        ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=16 ** -0.5)
        ours = attention_with_sinks(q, k, v, mask, sinks)
        assert (ours - ref.reshape(2, 7, 64)).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pow_norm_matches_gemma4(dtype):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from engine.blocks.norms import PowRMSNorm

    g = torch.Generator().manual_seed(4)
    x, w = (torch.randn(5, 32, generator=g) * 3).to(dtype), torch.randn(32, generator=g).to(dtype)
    for with_scale in (True, False):
        ref = Gemma4RMSNorm(32, eps=1e-6, with_scale=with_scale).to(dtype)
        ours = PowRMSNorm("n" if with_scale else None, 32, 1e-6)
        if with_scale:
            ref.weight.data, ours.w["weight"] = w.clone(), w
        with torch.no_grad():
            assert torch.equal(ours(x), ref(x))


def test_proportional_rope_matches_transformers():
    """Gemma 4's global layers: a quarter of the 512-dim head's pairs rotate at the full head's
    frequencies, the rest pass through unchanged."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.blocks.rope import Proportional

    cfg = tf.Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              global_head_dim=512)
    inv, scale = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type="full_attention")
    rope = Proportional(512, 1_000_000.0, fraction=0.25)
    pos = torch.arange(0, 9000, 997)
    cos, sin = rope.cos_sin(pos, torch.float32)
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    assert scale == 1.0 and torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())
    x = torch.randn(1, 1, len(pos), 512)
    y = rope.apply(x, cos, sin)
    still = torch.cat((torch.arange(64, 256), torch.arange(320, 512)))
    assert torch.equal(y[..., still], x[..., still]) and not torch.equal(y[..., :64], x[..., :64])


def test_second_wave_routers_match_transformers():
    import transformers as tf
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from engine.blocks.norms import PowRMSNorm
    from engine.blocks.topk_routers import ScaledInputRouter, TopKThenSoftmax

    g = torch.Generator().manual_seed(5)
    h = torch.randn(11, 32, generator=g)
    ref = GptOssTopKRouter(tf.GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3))
    ref.weight.data, ref.bias.data = torch.randn(8, 32, generator=g), torch.randn(8, generator=g)
    ours = TopKThenSoftmax("r.", 32, 8, 3)
    ours.w = {"weight": ref.weight.data, "bias": ref.bias.data}
    _, ref_w, ref_i = ref(h)
    ids, weights = ours.route(h)
    assert torch.equal(ids, ref_i) and torch.equal(weights, ref_w)
    ref = Gemma4TextRouter(tf.Gemma4TextConfig(hidden_size=32, num_experts=8, top_k_experts=3, rms_norm_eps=1e-6))
    ref.proj.weight.data, ref.scale.data = torch.randn(8, 32, generator=g), torch.rand(32, generator=g) + 0.5
    ref.per_expert_scale.data = torch.rand(8, generator=g) + 0.5
    ours = ScaledInputRouter("r.", 32, 8, 3, PowRMSNorm(None, 32, 1e-6))
    ours.w = {"proj": ref.proj.weight.data, "scale": ref.scale.data, "per_expert_scale": ref.per_expert_scale.data}
    _, ref_w, ref_i = ref(h)
    ids, weights = ours.route(h)
    assert torch.equal(ids, ref_i) and torch.equal(weights, ref_w) and weights.dtype == torch.float32


def test_clamped_swiglu_expert_matches_gpt_oss(tmp_path):
    """One expert through our packed layout (gate and up de-interleaved at load, from a real
    safetensors file) against GptOssExperts on the same weights (interleaved, transposed), with
    the clamps active."""
    import transformers as tf
    from safetensors.torch import save_file
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from engine.blocks.clamped_experts import ClampedSwiGLUExperts
    from engine.checkpoint import Checkpoint

    g = torch.Generator().manual_seed(6)
    ref = GptOssExperts(tf.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=2))
    for p in (ref.gate_up_proj, ref.gate_up_proj_bias, ref.down_proj, ref.down_proj_bias):
        p.data = torch.randn(p.shape, generator=g)
    layout = ClampedSwiGLUExperts(32, 16)
    hub = {"model.layers.0.mlp.experts." + n: getattr(ref, n).data
           for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    save_file({n: t.contiguous() for n, t in hub.items()}, tmp_path / "model.safetensors")
    ckpt = Checkpoint(tmp_path)
    packed = torch.empty(layout.numel)
    layout.read_into(ckpt, 0, 1, packed)
    assert all(torch.equal(t, hub[n][1]) for n, t in layout.hub_tensors(0, 1, packed).items())   # written back as read
    x = torch.randn(5, 32, generator=g) * 3                                      # large enough to clamp
    with torch.no_grad():
        want = ref(x, torch.ones(5, 1, dtype=torch.long), torch.ones(5, 1))
    assert (layout.run(x, packed) - want).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,past,kv_start,window,plain", [(100, 0, 0, None, True), (700, 0, 0, 1024, True),
                                                          (64, 0, 0, 16, False), (8, 40, 0, None, False),
                                                          (8, 40, 40, None, True)])
def test_plain_causal_mask_runs_as_is_causal_bitwise(dtype, T, past, kv_start, window, plain):
    """`sdpa` passes a plain lower-triangular mask as is_causal: the same bits as the masked kernel
    (what keeps a fresh prefill's output unchanged), and only that mask -- a window cut or keys held
    before the queries keep the explicit mask."""
    from engine.layers import causal_mask, sdpa

    mask = causal_mask(T, past, window, torch.device("cpu"), kv_start)
    assert mask.plain_causal is plain
    g = torch.Generator().manual_seed(T)
    S = past + T - kv_start
    q = torch.randn(2, 8, T, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 4, S, 64, generator=g).to(dtype) for _ in range(2))
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    assert torch.equal(sdpa(q, k, v, mask, 0.125, enable_gqa=True), masked)


def test_a_packed_experts_views_are_made_once_and_follow_its_buffer():
    """expert_ffn keeps a packed buffer's matrix views on it (`memo`): a second call slices
    nothing, and a cache slot refilled with another expert runs that expert."""
    from engine.cache import row_views
    from engine.layers import expert_ffn
    from tests.engine.test_static_decode import OpTrace

    D, I = 8, 4
    g = torch.Generator().manual_seed(0)
    a, b, x = torch.randn(3 * D * I, generator=g), torch.randn(3 * D * I, generator=g), torch.randn(3, D, generator=g)
    slots = torch.empty(2, 3 * D * I)                                         # [slots, P]
    slot = row_views(slots)[1]
    assert row_views(slots)[1] is slot                                        # the same view object each time
    slot.copy_(a)
    y_a = expert_ffn(x, slot, D, I, "silu")
    with OpTrace() as trace:
        expert_ffn(x, slot, D, I, "silu")
    names = [op[0] for op in trace.ops]
    assert names and not {"slice", "view"} & {n.split(".")[0] for n in names}, names
    slot.copy_(b)                                                             # refilled: the kept views see it
    assert torch.equal(y_a, expert_ffn(x, a.clone(), D, I, "silu"))
    assert torch.equal(expert_ffn(x, slot, D, I, "silu"), expert_ffn(x, b.clone(), D, I, "silu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
def test_heads_first_and_attention_of_one_token_are_the_transposed_form(dtype, T):
    """One token's heads are a view, not a transpose (one op less per tensor): the same elements at
    the same addresses, and attention over them gives the transposed form's bits."""
    from engine.layers import attention, decode_on_cpu, heads_first

    B, H, K, hd, S = 2, 8, 4, 16, 9
    g = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, H * hd, generator=g).to(dtype)
    want = x.view(B, T, H, hd).transpose(1, 2)
    got = heads_first(x, hd)
    assert got.shape == want.shape and torch.equal(got, want) and got.data_ptr() == want.data_ptr()
    k, v = (torch.randn(B, K, S, hd, generator=g).to(dtype) for _ in range(2))
    mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool).tril(S - T)
    ref = torch.nn.functional.scaled_dot_product_attention(want, k, v, attn_mask=mask, enable_gqa=True)
    ref = ref.transpose(1, 2).reshape(B, T, H * hd)
    out = attention(got, k, v, mask)
    assert torch.equal(out, attention(want, k, v, mask))
    if decode_on_cpu(got, mask):                  # decode_attention's sums, not the flash kernel's
        assert torch.allclose(out, ref, rtol=0, atol=1e-6)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("hv", [16, 12])
def test_decode_attention_is_sdpa_in_float64_and_each_sequence_alone(hv):
    """The CPU's decode attention (three ops over query heads grouped by key head) against its slow
    reference, SDPA in float64 with K/V repeated to every query head; key heads of their own width
    for V (MLA); each sequence of a batch the same bits as alone."""
    from engine.layers import decode_attention

    B, H, K, hd, S = 3, 8, 2, 16, 37
    g = torch.Generator().manual_seed(hv)
    q = torch.randn(B, H, 1, hd, generator=g)
    k, v = torch.randn(B, K, S, hd, generator=g), torch.randn(B, K, S, hv, generator=g)
    got = decode_attention(q, k, v, 0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(H // K, 1), v.double().repeat_interleave(H // K, 1), scale=0.3)
    assert got.shape == (B, H, 1, hv) and (got.double() - ref).abs().max() < 1e-6
    for b in range(B):
        assert torch.equal(got[b:b + 1], decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], 0.3))
