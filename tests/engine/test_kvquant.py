"""KV storage formats: the fast quantisers equal the slow per-block reference, round-trip error
is bounded by each format's step, bytes are payload + scales, bad input is refused by name."""
from __future__ import annotations

import pytest
import torch

from engine.kvquant import (FORMATS, KV_DTYPES, KVFormatError, block_size, dequantise_reference, is_lossy,
                            kv_format, quantise_reference)

BLOCKED = ("q8", "q4", "fp8")


def _x(rows: int = 6, h: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)   # scales vary per row
    x[0, :32] = 0.0                                     # an all-zero block: scale 0, decodes to 0
    x[1, 5] = 40.0                                      # one outlier dominates its block
    return x


@pytest.mark.parametrize("name", BLOCKED)
def test_fast_quantise_equals_reference(name):
    fmt, x = kv_format(name), _x()
    fast, ref = fmt.quantise(x), quantise_reference(fmt, x)
    for f, r in zip(fast, ref):
        assert f.dtype == r.dtype and f.shape == r.shape
        assert torch.equal(f.view(torch.uint8) if f.element_size() == 1 else f, r.view(torch.uint8) if r.element_size() == 1 else r)
    assert torch.equal(fmt.dequantise(fast, torch.float32), dequantise_reference(fmt, ref, torch.float32))


@pytest.mark.parametrize("name,rel_step", [("q8", 1 / 127), ("q4", 1 / 8), ("fp8", 1 / 16)])
def test_round_trip_error_within_one_step(name, rel_step):
    fmt, x = kv_format(name), _x(h=32)
    y = fmt.dequantise(fmt.quantise(x), torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # half a step for the integer codes (q4's code range is asymmetric: one full step at the top),
    # fp8's relative precision of 2^-3 on the largest values
    assert ((y - x).abs() <= amax * rel_step * 1.01 + 1e-7).all()
    assert torch.equal(y[0, :32], torch.zeros(32))
    assert (y - x).abs().max() > 0                         # lossy: the test would catch a pass-through


def test_cast_formats_and_exactness():
    x = _x(h=16)
    assert torch.equal(kv_format("model").dequantise(kv_format("model").quantise(x), torch.float32), x)
    assert kv_format("f16").quantise(x)[0].dtype == torch.float16
    assert is_lossy("f16", "float32") and not is_lossy("f16", "float16") and not is_lossy("bf16", torch.bfloat16)
    assert not is_lossy("model", "bfloat16") and all(is_lossy(n, "float16") for n in BLOCKED)


def test_row_bytes_are_payload_plus_scales():
    # llama.cpp: q8_0 is 34 bytes per 32 values, q4_0 18
    assert kv_format("q8").row_bytes(128, 2) == 128 + 4 * 2
    assert kv_format("q4").row_bytes(128, 2) == 64 + 4 * 2
    assert kv_format("fp8").row_bytes(128, 4) == 128 + 4 * 2
    assert kv_format("f16").row_bytes(128, 4) == 256 and kv_format("model").row_bytes(128, 4) == 512
    assert kv_format("q8").row_bytes(16, 4) == 16 + 2                 # a short head is one block
    for name in KV_DTYPES:      # row_bytes is what quantise really stores
        fmt = kv_format(name)
        parts = fmt.quantise(torch.randn(3, 64))
        assert sum(p.numel() * p.element_size() for p in parts) == 3 * fmt.row_bytes(64, 4)


def test_bad_input_is_refused_by_name():
    with pytest.raises(KVFormatError, match=r"kv_dtype must be one of .*'q8'.*got 'int3'"):
        kv_format("int3")
    with pytest.raises(KVFormatError, match="head_dim=48"):
        block_size(48)
    with pytest.raises(KVFormatError, match="head_dim=40"):
        kv_format("q4").check(40)
    kv_format("f16").check(40)                             # a cast has no blocks
    assert set(FORMATS) == set(KV_DTYPES)


def test_fp8_refused_where_torch_cannot_store_it(monkeypatch):
    kv_format("fp8").check_device("cpu")                      # this torch stores float8_e4m3fn on the CPU

    def no_fp8(*args, **kwargs):
        raise RuntimeError("\"copy_\" not implemented for 'Float8_e4m3fn'")
    monkeypatch.setattr(torch, "ones", no_fp8)
    with pytest.raises(KVFormatError, match=r"kv_dtype=fp8: torch .* cannot store float8_e4m3fn on cuda.*"
                                            r"allowed: model, f16, bf16, q8, q4"):
        kv_format("fp8").check_device("cuda")
    kv_format("q8").check_device("cuda")                      # only fp8 needs the dtype
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(KVFormatError, match=r"needs torch.float8_e4m3fn"):
        kv_format("fp8").check_device("cpu")
