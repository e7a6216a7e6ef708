"""The cost model per architecture: each attention kind's kernel arithmetic, the stored expert
bytes and the session state, by hand at the real presets' shapes."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import preset
from harness.costmodel import WorkloadShape, predict
from harness.costmodel.passcost import attention_cost, dense_weights, expert_bytes, kv_bytes, pass_flops
from harness.costmodel.work import PassWork


def decode_pass(cfg, past: int) -> PassWork:
    M = cfg.n_moe_layers
    return PassWork("decode", 1, 1, past, np.full(M, float(cfg.top_k)), np.zeros(M), np.zeros(M), np.zeros(M),
                    np.zeros(M, dtype=bool))


def test_mla_reads_the_latent_not_expanded_keys_and_values():
    """DeepSeek-V3 decode of one token at 32K, bf16, the absorbed kernel: per layer the latent
    (512 + 64) x 2 B per position is read once; 128 heads score over 512 + 64 dims and sum the
    same rows, the whole [latent | rope] row being the value; the absorbed query [128, 576] and the
    latent output [128, 512] are the kernel's own reads and writes."""
    cfg = preset("deepseek-v3")
    S, L, H, r, d = 32768, 61, 128, 512, 64
    a = attention_cost(cfg, 1, 1, S - 1, 2)
    assert a.bytes == L * ((r + d) * 2 * S + H * (2 * r + d) * 2)
    assert a.flops == L * 4 * H * S * (r + d)
    # expanded K/V would be 128 heads x (192 + 128) x 2 B per position: 71x the latent
    assert a.bytes < L * H * (128 + 64 + 128) * 2 * S / 50


def test_expanded_mla_pays_for_re_expanding_the_latent():
    cfg = preset("deepseek-v3")
    expanded = cfg.replace(mla_kernel="expanded")
    absorbed, exp = attention_cost(cfg, 1, 1, 4095, 2), attention_cost(expanded, 1, 1, 4095, 2)
    # every pass turns 4096 latents into 128 heads of keys (128 nope) and values (128): 2 r H (n + v) per position
    assert exp.flops > 2 * 61 * 4096 * 512 * 128 * 256
    assert exp.bytes > 10 * absorbed.bytes


def test_a_fresh_causal_pass_counts_the_triangle_a_masked_one_the_rectangle():
    """A fresh prefill chunk runs is_causal (the kernel skips the keys above the diagonal):
    T(T+1)/2 pairs per head; a chunk after a prefix runs under its mask: T x S. Mixtral-8x7B:
    32 layers, 32 query heads of 128."""
    cfg = preset("mixtral-8x7b")
    L, H, h, T = 32, 32, 128, 2048
    assert attention_cost(cfg, 1, T, 0, 2).flops == L * 4 * H * h * T * (T + 1) // 2
    assert attention_cost(cfg, 1, T, 512, 2).flops == L * 4 * H * h * T * (T + 512)
    assert attention_cost(cfg, 1, 1, 4095, 2).flops == L * 4 * H * h * 4096                  # decode: one row
    # GPT-OSS's sinks pad the mask with their column: an explicit mask, its whole rectangle, fresh or not
    oss = preset("gpt-oss-20b")
    full = [layer.attention for layer in oss.architecture().layers if layer.attention.window is None]
    assert full and all(a.kernel_cost(1, T, 0, 2).scores == a.H * T * T for a in full)


def test_expanded_mla_expands_each_row_once():
    """The new rows' kv_b up-projection is a per-token weight (dense_weights); the kernel adds only
    the held rows', so a fresh pass adds none and a pass after P held rows adds P."""
    cfg = preset("deepseek-v3").replace(mla_kernel="expanded")
    H, r, n, v, d, T = 128, 512, 128, 128, 64, 512
    L = cfg.num_layers
    fresh, after = attention_cost(cfg, 1, T, 0, 2), attention_cost(cfg, 1, T, 1024, 2)
    assert fresh.flops == L * 2 * H * (T * (T + 1) // 2) * (n + d + v)
    assert after.flops == L * (2 * 1024 * r * H * (n + v) + 2 * H * T * (T + 1024) * (n + d + v))


def test_sliding_layers_read_only_their_window():
    """GPT-OSS-20B: 12 sliding layers (window 128: 127 held keys + the new one) and 12 full
    ones; 8 KV heads of 64, bf16. Decode at 32K reads 2 x 8 x 64 x 2 B per key."""
    cfg = preset("gpt-oss-20b")
    S, per_key, io = 32768, 2 * 8 * 64 * 2, 2 * 64 * 64 * 2
    a = attention_cost(cfg, 1, 1, S - 1, 2)
    assert a.bytes == 12 * (per_key * S + io) + 12 * (per_key * 128 + io)
    assert a.flops == 12 * 4 * 64 * 64 * S + 12 * 4 * 64 * 64 * 128
    # the window caps the growth: 1K more context adds only the full layers' keys
    more = attention_cost(cfg, 1, 1, S + 1023, 2)
    assert more.bytes - a.bytes == 12 * per_key * 1024


def test_recurrent_layers_cost_the_same_at_any_context():
    """Qwen3-Next-80B-A3B: 36 gated-DeltaNet layers keep a fixed state (read and written once a
    pass), 12 full layers keep 2 x 2 KV heads x 256 x 2 B per token: only those grow."""
    cfg = preset("qwen3-next-80b-a3b")
    short, long = attention_cost(cfg, 1, 1, 1023, 2), attention_cost(cfg, 1, 1, 33791, 2)
    assert long.bytes - short.bytes == 12 * 2 * 2 * 256 * 2 * 32768
    assert long.flops - short.flops == 12 * 4 * 16 * 256 * 32768
    state = cfg.architecture().layers[0].attention.state_term(2).fixed
    assert short.bytes > 36 * 2 * state                      # the fixed states are there at any length
    # and the session state a restore copies is the planner's: fixed terms + the full layers' KV
    assert kv_bytes(cfg, 4096, 2, 2) == 2 * (36 * state + 12 * 2 * 2 * 256 * 2 * 4096)


def test_mxfp4_experts_cost_their_packed_bytes():
    """GPT-OSS-20B experts as published: 4-bit values, one e8m0 scale per 32, fp32 biases:
    (2I x D + D x I) / 2 + (2I x D + D x I) / 32 + (2I + D) x 4 bytes, whatever the compute dtype;
    the FLOPs are the dequantised expert's."""
    cfg = preset("gpt-oss-20b")
    D = I = 2880
    weights = 2 * I * D + D * I
    packed = weights // 2 + weights // 32 + (2 * I + D) * 4
    assert expert_bytes(cfg, 2) == expert_bytes(cfg, 4) == packed == 13_253_760
    f = pass_flops(cfg, decode_pass(cfg, 100), 2)
    assert f.dev_expert_bytes[0] == 4 * packed
    assert f.dev_expert_flops[0] == 2 * 4 * (weights + 2 * I + D)


def test_dense_weights_are_the_architecture_s_non_expert_tensors():
    """Shared experts, dense first layers, routers and the MLA projections are all dense weights:
    DeepSeek-V3's per-token parameters are its non-expert parameters less the embedding table
    and the head (which runs at the last position only)."""
    cfg = preset("deepseek-v3")
    w = dense_weights(cfg, 2)
    head = emb = 129280 * 7168
    assert w.per_token_params == cfg.non_expert_params() - emb - head
    assert w.head_params == head
    assert w.bytes > 2 * w.per_token_params          # the fp32 router biases count 4 bytes
    # Gemma 4's per-layer inputs: its table [Vp, L*P] is looked up, its projection [L*P, D] and the
    # projection's norm [P] multiply every token
    ple = preset("tiny-gemma4").replace(hidden_size_per_layer_input=16, vocab_size_per_layer_input=512)
    arch = ple.architecture()
    layers = sum(spec.numel for layer in arch.layers for _, _, spec in layer.walk())
    head_norm = sum(spec.numel for _, _, spec in arch.head.norm.walk())
    assert dense_weights(ple, 4).per_token_params == layers + head_norm + ple.num_layers * 16 * ple.hidden_size + 16


@pytest.mark.parametrize("model", ["deepseek-v3", "glm-4.5-air", "gpt-oss-120b", "qwen3-next-80b-a3b",
                                   "gemma-4-26b-a4b"])
def test_every_new_family_predicts_every_phase(model):
    shape = WorkloadShape(context_tokens=512, gen_tokens=4)
    pred = predict(model, "fetch", shape, "h100-sxm-80gb", dtype="bfloat16", capacity=preset(model).top_k)
    for phase, p in pred.phases.items():
        assert math.isfinite(p.time_s) and p.time_s > 0, phase
