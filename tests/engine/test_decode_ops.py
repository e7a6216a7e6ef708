"""engine.kernels.cpu's decode-step ops (decode_ops.cpp) against torch's ops in engine.layers, the
reference path (the kernels off): RMSNorm and SiLU-gating up to fp32 rounding, the rotary
embedding bit for bit, decode attention against float64 at both vector widths the CPU has, a
SwiGLU expert bitwise the ops it fuses; each the same bits at any batch and thread count, and NaN
stays NaN. The engine-level tests (tests/engine/test_invariant*.py, test_hf_match.py) run them
inside every model."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu
from engine.layers import (apply_rope, decode_attention, expert_ffn, gated, rms_norm, rms_norm_fp32, rope_attention,
                           rope_cos_sin, route,
                           swiglu_matrices)

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"the CPU kernels cannot run here: {cpu.reason()}")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def torch_path(f, *args, **kwargs):
    with cpu.enabled(False):
        return f(*args, **kwargs)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to the dtype's rounding (one ulp of the larger values; bf16 results are rounded once)."""
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    return bool((got.float() - want.float()).abs().max() <= tol * want.float().abs().max().clamp_min(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 77, 2048])
def test_rms_norm_is_torchs_up_to_rounding_in_every_form(dtype, D):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(3, 2, D, generator=g) * 3).to(dtype)
    w = torch.randn(D, generator=g).to(dtype)
    for got, want in ((rms_norm(x, w, 1e-6), torch_path(rms_norm, x, w, 1e-6)),
                      (rms_norm_fp32(x, w, 1e-6), torch_path(rms_norm_fp32, x, w, 1e-6)),
                      (rms_norm_fp32(x, w, 1e-6, 1.0), torch_path(rms_norm_fp32, x, w, 1e-6, 1.0)),
                      (rms_norm_fp32(x, None, 1e-6), torch_path(rms_norm_fp32, x, None, 1e-6))):
        assert got.dtype == dtype and got.shape == x.shape
        assert close(got, want, dtype)


def test_rms_norm_keeps_torchs_path_for_a_weight_of_another_dtype():
    x, w = torch.randn(2, 64), torch.randn(64, dtype=torch.float64)
    assert torch.equal(rms_norm(x, w, 1e-6), torch_path(rms_norm, x, w, 1e-6))   # promotion: torch's ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,r,T", [(128, 128, 1), (64, 32, 1), (80, 80, 5)])
def test_rope_is_torchs_bit_for_bit(dtype, h, r, T):
    g = torch.Generator().manual_seed(h + r + T)
    x = torch.randn(2, 3, T, h, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(40, 40 + T), r, 1e6, 1.0, dtype)
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, torch_path(apply_rope, x, cos, sin))
    assert torch.equal(apply_rope(x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin), got)   # torch's, strided


def reference_attention(q, k, v, scale):
    """The decode step's attention in float64: q [B, H, 1, h] over k/v [B, K, S, h] by key-head groups."""
    B, H, _, h = q.shape
    K = k.shape[1]
    s = torch.einsum("bkgh,bksh->bkgs", q.double().reshape(B, K, H // K, h), k.double()) * scale
    return torch.einsum("bkgs,bksh->bkgh", s.softmax(-1), v.double()).reshape(B, H, 1, v.shape[-1])


@pytest.mark.parametrize("H,K,h,S", [(16, 4, 128, 150), (8, 8, 64, 65), (12, 4, 72, 300), (32, 4, 96, 1),
                                     (6, 2, 16, 129), (16, 2, 32, 513)])
def test_decode_attention_matches_float64_and_torchs_ops(H, K, h, S):
    g = torch.Generator().manual_seed(H * h + S)
    q = torch.randn(2, H, 1, h, generator=g)
    kb, vb = torch.randn(2, K, S + 7, h, generator=g), torch.randn(2, K, S + 7, h, generator=g)
    k, v = kb[:, :, :S], vb[:, :, :S]                                  # views of a longer cache, as a step reads it
    got = decode_attention(q, k, v, h ** -0.5)
    want = reference_attention(q, k, v, h ** -0.5)
    assert got.shape == (2, H, 1, h) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5
    torchs = torch_path(decode_attention, q, k, v, h ** -0.5)
    assert close(got, torchs, torch.float32)
    if H // K > 4 and S > 512:                                       # MKL's GEMM there: torch's ops themselves
        assert torch.equal(got, torchs)


def test_decode_attention_is_the_same_bits_at_any_batch_and_thread_count(threads):
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(3, 16, 1, 128, generator=g), torch.randn(3, 4, 500, 128, generator=g), \
        torch.randn(3, 4, 500, 128, generator=g)
    torch.set_num_threads(1)
    one = decode_attention(q, k, v, 0.1)
    torch.set_num_threads(2)
    assert torch.equal(decode_attention(q, k, v, 0.1), one)
    assert torch.equal(decode_attention(q[1:2], k[1:2], v[1:2], 0.1), one[1:2])


def test_decode_attention_passes_nan_on():
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64)
    k[0, 0, 3, 5] = math.nan
    out = decode_attention(q, k, v, 0.125)
    assert out[0, :2].isnan().all() and out[0, 2:].isfinite().all()   # the key head that read it, and only it


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_gating_is_torchs_up_to_rounding(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(5, 2 * 100, generator=g) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)                              # row-strided halves, as an expert makes them
    got = gated(gate, up, "silu")
    assert got.dtype == dtype and close(got, torch_path(gated, gate, up, "silu"), dtype)
    extreme = torch.tensor([[-200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 89.0, 200.0, math.nan]])
    out = gated(extreme, torch.ones_like(extreme), "silu")
    assert torch.allclose(out[:, :-1], F.silu(extreme[:, :-1]), rtol=1e-6, atol=1e-30) and out[0, -1].isnan()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, cpu.MAX_ROWS + 2])
def test_swiglu_expert_is_the_ops_it_fuses_bit_for_bit(dtype, n):
    D, I = 96, 40
    g = torch.Generator().manual_seed(n)
    packed = (torch.randn(3 * I * D, generator=g) * 0.1).to(dtype)
    x = torch.randn(n, D, generator=g).to(dtype)
    want = expert_ffn(x, packed, D, I, "silu", cpu.small_linear)
    assert torch.equal(cpu.swiglu(x, *swiglu_matrices(packed, D, I)), want)
    assert close(want, torch_path(expert_ffn, x, packed, D, I, "silu"), dtype)


def test_swiglu_add_is_the_add_it_replaces_bit_for_bit():
    D, I = 64, 48
    g = torch.Generator().manual_seed(11)
    for dtype in DTYPES:
        packed = (torch.randn(3 * I * D, generator=g) * 0.1).to(dtype)
        x, gate = torch.randn(1, D, generator=g).to(dtype), torch.rand(1, 1, generator=g).to(dtype)
        start = torch.randn(1, D, generator=g).to(dtype)
        want = start.clone().add_(cpu.swiglu(x, *swiglu_matrices(packed, D, I)) * gate)
        got = start.clone()
        cpu.swiglu_add_(got, x, *swiglu_matrices(packed, D, I), gate)
        assert torch.equal(got, want), dtype


@pytest.mark.parametrize("E,k,norm", [(16, 2, True), (64, 8, False), (8, 8, True)])
def test_softmax_topk_routes_as_torchs_ops(E, k, norm):
    g = torch.Generator().manual_seed(E + k)
    h, w = torch.randn(cpu.MAX_ROWS, 96, generator=g), torch.randn(E, 96, generator=g)
    ids, wts = route(h, w, k, norm, True)
    ref_ids, ref_wts = torch_path(route, h, w, k, norm, True)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    assert (wts - ref_wts).abs().max() <= 1e-5 * ref_wts.abs().max()          # the logits: another sum order
    tie = torch.zeros(1, 96)                                         # every logit 0: ties, taken by id
    assert cpu.softmax_topk(tie, w, k, norm)[0].tolist() == [list(range(k))]


def test_rope_attention_is_the_unfused_steps(threads):
    """rope, the KV write and attention in one op: the rotation and the written cache bit for bit,
    the output as `attention` computes it from them, and the cache's other positions untouched."""
    B, H, K, h, cap, start = 2, 12, 4, 64, 40, 29
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(B, H, 1, h, generator=g), torch.randn(B, K, 1, h, generator=g), \
        torch.randn(B, K, 1, h, generator=g)
    cos, sin = rope_cos_sin(torch.tensor([start]), h, 1e4, 1.0, torch.float32)
    k_buf, v_buf = torch.randn(B, K, cap, h, generator=g), torch.randn(B, K, cap, h, generator=g)
    kb, vb = k_buf.clone(), v_buf.clone()
    kb[:, :, start:start + 1], vb[:, :, start:start + 1] = apply_rope(k, cos, sin), v
    want = decode_attention(apply_rope(q, cos, sin), kb[:, :, :start + 1], vb[:, :, :start + 1], 0.2)
    for th in (1, 2):
        torch.set_num_threads(th)
        kt, vt = k_buf.clone(), v_buf.clone()
        got = rope_attention(q, k, v, cos, sin, kt, vt, start, 0.2)
        assert torch.equal(kt, kb) and torch.equal(vt, vb)
        assert torch.equal(got, want.reshape(B, 1, H * h))


def test_silu_through_the_kernels_exp_is_within_3_ulp_of_float64():
    x = torch.linspace(-87, 88, 200_001).reshape(1, -1)
    got = gated(x, torch.ones_like(x), "silu").double()
    exact = x.double() / (1 + torch.exp(-x.double()))
    ulp = (torch.nextafter(exact.float().abs(), torch.tensor(math.inf)) - exact.float().abs()).double()
    keep = exact.abs() > 1e-30                                       # normal results
    assert ((got - exact).abs() / ulp)[keep].max() <= 3
