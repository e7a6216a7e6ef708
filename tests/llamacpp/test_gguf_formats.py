"""engine.formats' byte arithmetic against the pinned llama.cpp: every GGUF type's block size
and bytes as its gguf-py declares them, and a real GGUF file's header (converted, then
quantised by the pinned llama-quantize) read back as the plan counts it."""
from __future__ import annotations

import subprocess

import pytest

from engine.config import ModelConfig, preset
from engine.formats import GGUF_TYPES, WeightFormat, weight_bytes
from harness.llamacpp.memory import gguf_weight_bytes
from harness.llamacpp.source import gguf_module


def test_every_type_has_gguf_py_sizes(bins):
    gguf = gguf_module()
    for name, (block, nbytes) in GGUF_TYPES.items():
        kind = gguf.GGMLQuantizationType[name.upper()]
        assert gguf.GGML_QUANT_SIZES[kind] == (block, nbytes), name


def test_an_f32_header_is_the_dense_weights(gguf_f32, mixtral):
    cfg = ModelConfig.from_hf_dir(mixtral[1])
    got = gguf_weight_bytes(gguf_f32.path, cfg)
    want = weight_bytes(cfg, WeightFormat("f32"))
    assert (got.non_expert, got.expert_slot, got.expert_mean) == (want.non_expert, want.expert_slot,
                                                                 want.expert_mean)
    assert got.source == "gguf header" and "f32 100%" in got.label
    assert got.expert_type == want.expert_type == "f32"


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_a_quantised_file_has_the_bytes_the_recipe_counts(bins, gguf_f32, mixtral, tmp_path, ftype):
    """One plain type and one mixed recipe (Q4_K_M: some tensors one step up, rows a 256-block
    cannot split fall back), each read back from the file the pinned llama-quantize wrote."""
    if bins.quantize is None:
        pytest.skip("this llama.cpp build has no llama-quantize")
    out = tmp_path / f"{ftype}.gguf"
    proc = subprocess.run([str(bins.quantize), str(gguf_f32.path), str(out), ftype], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = ModelConfig.from_hf_dir(mixtral[1])
    got = gguf_weight_bytes(out, cfg)
    want = weight_bytes(cfg, WeightFormat(ftype.lower()))
    assert (got.non_expert, got.expert_slot, got.expert_mean) == (want.non_expert, want.expert_slot,
                                                                 want.expert_mean)
    assert got.expert_type == want.expert_type          # the rates a profile gives that type apply
    assert got.expert_slot < weight_bytes(cfg, WeightFormat("f32")).expert_slot / 3
    if ftype == "Q8_0":
        assert got.expert_slot == cfg.expert_params * 34 // 32


def test_a_header_for_another_model_is_refused(gguf_f32, mixtral):
    cfg = ModelConfig.from_hf_dir(mixtral[1])
    with pytest.raises(ValueError, match="give the model the file was made from"):
        gguf_weight_bytes(gguf_f32.path, preset("tiny-mixtral"))            # 4 layers, the file's 3
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf_weight_bytes(mixtral[1] / "config.json", cfg)
