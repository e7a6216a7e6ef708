"""GPT-OSS's MXFP4 experts: the format against known values and transformers' own dequantisation,
a tiny MXFP4 checkpoint (blocks and scales written here) loaded exactly -- kept packed or
dequantised at load -- against transformers' `Mxfp4Config(dequantize=True)` reference, and the
stored bytes as the bytes every counter and plan counts."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.blocks.clamped_experts import MXFP4Experts
from engine.blocks.mxfp4 import FP4, dequantize, quantize
from engine.checkpoint import MissingTensorError
from engine.families.gpt_oss import MXFP4_QUANTIZATION
from tests.conftest import hf_model, save
from tests.engine.test_hf_match import PROMPT, check_against_hf


def test_known_values_decode_as_transformers_decodes_them():
    """Byte 0x21: low nibble 1 (+0.5), high nibble 2 (+1.0); 0xF9: -0.5, -6; scale 127 = 2^0."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)                       # [E, rows, G, 16]
    blocks[0, 0, 0, :2] = torch.tensor([0x21, 0xF9], dtype=torch.uint8)
    blocks[0, 1, 0, 0] = 0x7E                                                   # low nibble 0xE (-4), high 0x7 (+6)
    scales = torch.tensor([[[127], [130]]], dtype=torch.uint8)                  # 2^0, 2^3
    got = dequantize(blocks, scales)                                            # [1, 2, 32]
    assert got[0, 0, :4].tolist() == [0.5, 1.0, -0.5, -6.0] and got[0, 0, 4:].abs().sum() == 0
    assert got[0, 1, :2].tolist() == [FP4[0xE] * 8, FP4[0x7] * 8] == [-32.0, 48.0]
    assert torch.equal(got.transpose(1, 2), convert_moe_packed_tensors(blocks, scales).float())


def test_representable_values_round_trip_and_random_ones_match_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 8, 64), generator=g)                      # [E, rows, values]
    exact = torch.tensor(FP4)[codes] * 2.0 ** torch.randint(-8, 8, (3, 8, 2, 1), generator=g).repeat_interleave(32, 2).view(3, 8, 64)
    blocks, scales = quantize(exact)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    assert torch.equal(dequantize(blocks, scales), exact)
    w = torch.randn(3, 8, 64, generator=g) * 0.02
    blocks, scales = quantize(w)
    back = dequantize(blocks, scales)
    assert torch.equal(back.transpose(1, 2), convert_moe_packed_tensors(blocks, scales).float())
    block_max = w.abs().view(3, 8, 2, 32).amax(-1, keepdim=True)
    assert ((back - w).abs().view(3, 8, 2, 32) <= block_max / 3).all()       # half of 4..6 at scale < max/3


def mxfp4_checkpoint(model, path):
    """Save `model` and rewrite its experts as MXFP4 blocks/scales with a quantization_config, as
    the published GPT-OSS checkpoints are; return the path."""
    save(model, path)
    tensors = {}
    for name, t in load_file(path / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):      # [E, in, out] -> rows of out
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(t.transpose(1, 2))
        else:
            tensors[name] = t
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": MXFP4_QUANTIZATION}))
    return path


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(transformers' dequantised reference in fp32, the MXFP4 checkpoint)."""
    import transformers as tf

    path = mxfp4_checkpoint(hf_model("gpt_oss", seed=6), tmp_path_factory.mktemp("mxfp4"))
    ref = tf.GptOssForCausalLM.from_pretrained(path, quantization_config=tf.Mxfp4Config(dequantize=True),
                                               dtype=torch.float32)
    assert ref.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16   # its dequantisation: bf16, exact
    return ref.float().eval(), path


def test_mxfp4_checkpoint_matches_transformers_dequantised_reference(mxfp4):
    ref, path = mxfp4
    check_against_hf(ref, path)
    assert Engine.from_pretrained(path, device="cpu").cfg.expert_format == "mxfp4"


def test_kept_packed_equals_dequantised_at_load_and_the_weights_are_transformers(mxfp4):
    ref, path = mxfp4
    packed = Engine.from_pretrained(path, device="cpu")
    dense = Engine.from_pretrained(path, device="cpu", model_overrides={"expert_format": "dense"})
    assert packed.model.store.dtype == torch.uint8 and dense.model.store.dtype == torch.float32
    a, b = packed.generate(PROMPT, 6), dense.generate(PROMPT, 6)
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    hub = dense.model.arch.experts.hub_layer(1, dense.model.store.rows[1])
    experts = ref.model.layers[1].mlp.experts
    assert torch.equal(hub["model.layers.1.mlp.experts.gate_up_proj"], experts.gate_up_proj.data)
    assert torch.equal(hub["model.layers.1.mlp.experts.down_proj"], experts.down_proj.data)


def test_counters_and_plan_count_the_stored_bytes(mxfp4):
    """One expert moves as its packed uint8 buffer: biases (fp32), FP4 blocks, E8M0 scales."""
    _, path = mxfp4
    eng = Engine.from_pretrained(path, device="cpu", placement="fetch", cache_capacity=2)
    D = I = 64
    stored = 4 * (2 * I + D) + 3 * D * I // 2 + 3 * D * I // 32
    layout = eng.model.arch.experts
    assert isinstance(layout, MXFP4Experts)
    assert eng.model.store.expert_bytes == layout.nbytes(4) == layout.nbytes(2) == eng.plan.expert_bytes == stored
    assert layout.params == 3 * D * I + 2 * I + D == eng.cfg.expert_params
    eng.generate(PROMPT, 4)
    c = eng.counters
    assert c["expert_misses"] > 0 and c["expert_miss_bytes"] == c["h2d_expert_bytes"] == c["expert_misses"] * stored
    dense = Engine.from_pretrained(path, device="cpu", placement="fetch", cache_capacity=2,
                                   model_overrides={"expert_format": "dense"})
    assert dense.model.store.expert_bytes == layout.params * 4


def test_mxfp4_layout_refuses_a_dense_checkpoint(tmp_path):
    path = save(hf_model("gpt_oss", seed=7), tmp_path / "dense")
    with pytest.raises(MissingTensorError, match="gate_up_proj_blocks.*expert_format='dense'"):
        Engine.from_pretrained(path, device="cpu", model_overrides={"expert_format": "mxfp4"})
