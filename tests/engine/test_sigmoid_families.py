"""DeepSeek-V3 (MLA) and GLM-4.5 against transformers beyond the default tiny configs (no q
bottleneck, half-split rope, biases, mscale != mscale_all_dim, no rope scaling, no groups, no
dense layer, no q/k norm, quarter rotary), both MLA kernels, fused expert tensors, the Hub's
older config.json form, DeepSeek-V3's block-wise FP8 checkpoints (dequantised at load: equal to
transformers on the dequantised weights) and every other quantisation refused, the MTP layers
ignored and said so, presets exported and run by transformers, and the non-expert parameters
(shared experts, dense layers) by hand."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.checkpoint import MissingTensorError
from engine.config import ModelConfig, UnsupportedModelError, preset
from engine.export import export_preset
from tests.conftest import hf_model, save
from tests.engine.test_hf_match import PROMPT, check_against_hf

YARN_MSCALES = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                "beta_fast": 16, "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.8}   # cos/sin scaled too


@pytest.mark.slow
@pytest.mark.parametrize("family,options", [
    ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, n_group=1, topk_group=1,
                         first_k_dense_replace=2, rope_parameters=YARN_MSCALES)),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, first_k_dense_replace=0,
                         norm_topk_prob=False, n_shared_experts=2, n_group=8, topk_group=3, num_experts_per_tok=3)),
    ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25, n_group=1, topk_group=1,
                      first_k_dense_replace=0, n_shared_experts=2, norm_topk_prob=False)),
], ids=["mla-plain-q-bias-mscales", "mla-no-rope-scaling-all-moe", "glm-no-qk-norm"])
def test_variants_match_transformers(family, options, tmp_path):
    model = hf_model(family, seed=4, **options)
    check_against_hf(model, save(model, tmp_path / "variant"))


def test_expanded_kernel_matches_transformers_and_the_absorbed_one(hf_checkpoints):
    """The slow obvious path (transformers' order) and the absorbed one, both from the latent."""
    model, path = hf_checkpoints["deepseek_v3"]
    check_against_hf(model, path, model_overrides={"mla_kernel": "expanded"})
    prompts = [[5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 120], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    runs = [Engine.from_pretrained(path, device="cpu", ubatch=5, model_overrides={"mla_kernel": k}).generate(prompts, 8)
            for k in ("absorbed", "expanded")]
    assert runs[0].tokens == runs[1].tokens
    assert max((a - b).abs().max().item() for a, b in zip(runs[0].logits, runs[1].logits)) <= 1e-5


def test_fused_expert_tensors(tmp_path, hf_checkpoints):
    """Experts stored fused ([E, 2I, D] gate_up_proj, [E, D, I] down_proj, transformers' in-memory form) load too."""
    model, src = hf_checkpoints["deepseek_v3"]
    dst = shutil.copytree(src, tmp_path / "fused")
    sd = load_file(src / "model.safetensors")
    for layer in range(1, 3):
        p = f"model.layers.{layer}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(f"{p}{e}.gate_proj.weight"), sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(16)])
        sd[p + "down_proj"] = torch.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(16)])
    save_file(sd, dst / "model.safetensors")
    check_against_hf(model, dst)


def test_older_hub_config_form(tmp_path, hf_checkpoints):
    """DeepSeek-V3's published config.json form: rope_theta + rope_scaling {type: yarn}, torch_dtype,
    scoring_func/topk_method, no rope_interleave (transformers' default: interleaved)."""
    model, src = hf_checkpoints["deepseek_v3"]
    dst = shutil.copytree(src, tmp_path / "old")
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": {"type": rope.pop("rope_type"), **rope},
            "torch_dtype": cfg.pop("dtype"), "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    del cfg["rope_interleave"]
    (dst / "config.json").write_text(json.dumps(cfg))
    check_against_hf(model, dst)


def test_options_it_cannot_run_are_refused():
    base = {**preset("tiny-deepseek").family_class.hf_config(preset("tiny-deepseek"))}
    for change, match in (({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
                          ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
                          ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
                          ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope scaling type 'linear'"),
                          ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'")):
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_hf_dict({**base, **change})


def test_mtp_layers_are_ignored_and_said_so(tmp_path, hf_checkpoints, caplog):
    """num_nextn_predict_layers=1: its layer (model.layers.<num_hidden_layers>.*, as DeepSeek-V3 and
    GLM-4.5 publish it) is never read; the logits are those without it."""
    model, src = hf_checkpoints["deepseek_v3"]
    dst = shutil.copytree(src, tmp_path / "mtp")
    sd = load_file(src / "model.safetensors")
    sd["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    sd["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.randn(32, 64)
    save_file(sd, dst / "model.safetensors")
    assert json.loads((dst / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.INFO, logger="engine.families.sigmoid_moe"):
        got = Engine.from_pretrained(dst, device="cpu").generate(PROMPT, 4)
    assert "1 multi-token-prediction layer(s) (num_nextn_predict_layers; model.layers.3.*) are not used" in caplog.text
    ref = Engine.from_pretrained(src, device="cpu").generate(PROMPT, 4)
    assert got.tokens == ref.tokens and all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


# --- FP8 ---------------------------------------------------------------------------------------
FP8_MAX = 448.0          # float8_e4m3fn


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's format: per block amax / 448 as the scale, codes w / scale in float8_e4m3fn."""
    bo, bi = block
    O, I = w.shape
    po, pi = -(-O // bo) * bo, -(-I // bi) * bi
    padded = torch.zeros(po, pi).index_put_((torch.arange(O)[:, None], torch.arange(I)[None, :]), w)
    blocks = padded.view(po // bo, bo, pi // bi, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)                  # [O/bo, I/bi]
    codes = (blocks / scale[:, None, :, None]).view(po, pi)[:O, :I].to(torch.float8_e4m3fn)
    return codes, scale


def fp8_checkpoint(src, dst, block=(16, 16)) -> dict[str, torch.Tensor]:
    """Quantise every linear weight but the embedding, head and router as DeepSeek-V3 publishes them;
    returns the dequantised weights (what the engine must run)."""
    dst.mkdir()
    sd, out, dequantised = load_file(src / "model.safetensors"), {}, {}
    for name, t in sd.items():
        if t.ndim == 2 and "embed" not in name and "lm_head" not in name and not name.endswith("mlp.gate.weight"):
            codes, scale = quantize_block_fp8(t, block)
            out[name], out[name + "_scale_inv"] = codes, scale
            s = scale.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
            dequantised[name] = codes.float() * s
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantised


def test_block_fp8_checkpoint_is_dequantised_at_load(tmp_path, hf_checkpoints, caplog):
    """Equal to transformers running the dequantised weights (so never a bare cast of FP8 codes),
    with a warning saying so; partial edge blocks included (24 rows in blocks of 16)."""
    model, src = hf_checkpoints["deepseek_v3"]
    dequantised = fp8_checkpoint(src, tmp_path / "fp8")
    assert load_file(tmp_path / "fp8" / "model.safetensors")["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype \
        == torch.float8_e4m3fn
    plain = shutil.copytree(src, tmp_path / "dequantised")              # the same weights, dequantised, in fp32
    save_file({**load_file(src / "model.safetensors"), **dequantised}, plain / "model.safetensors")
    reference = type(model).from_pretrained(plain, dtype=torch.float32).eval()
    assert not torch.equal(reference.model.layers[0].self_attn.q_a_proj.weight, model.model.layers[0].self_attn.q_a_proj.weight)
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint"):
        check_against_hf(reference, tmp_path / "fp8")
    assert "block-wise FP8 checkpoint (quant_method fp8, weight_block_size [16, 16])" in caplog.text
    assert "dequantised at load" in caplog.text


def test_fp8_without_its_scales_or_format_is_refused(tmp_path, hf_checkpoints):
    _, src = hf_checkpoints["deepseek_v3"]
    fp8_checkpoint(src, tmp_path / "fp8")
    missing = shutil.copytree(tmp_path / "fp8", tmp_path / "missing")
    sd = load_file(missing / "model.safetensors")
    del sd["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(sd, missing / "model.safetensors")
    with pytest.raises(MissingTensorError, match="FP8 tensor 'model.layers.0.self_attn.o_proj.weight' has no "
                                                 "'model.layers.0.self_attn.o_proj.weight_scale_inv'"):
        Engine.from_pretrained(missing, device="cpu")
    undeclared = shutil.copytree(tmp_path / "fp8", tmp_path / "undeclared")
    cfg = json.loads((undeclared / "config.json").read_text())
    del cfg["quantization_config"]
    (undeclared / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="stored as torch.float8_e4m3fn, but config.json declares no block-wise FP8"):
        Engine.from_pretrained(undeclared, device="cpu")
    for q, match in (({"quant_method": "fp8"}, "without weight_block_size"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
                     ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported")):
        (undeclared / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
        with pytest.raises(UnsupportedModelError, match=match):
            Engine.from_pretrained(undeclared, device="cpu")
    glm = {**preset("tiny-glm").family_class.hf_config(preset("tiny-glm")),
           "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(UnsupportedModelError, match="glm4_moe: quantization_config quant_method 'bitsandbytes'"):
        ModelConfig.from_hf_dict(glm)


# --- presets through transformers; sizes by hand --------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-deepseek", "tiny-moonlight", "tiny-glm"])
def test_exported_preset_runs_in_transformers(name, tmp_path):
    """engine.export writes what transformers builds and runs to the same logits (what engine=hf
    compares against), and our engine on the export equals our engine on the preset bitwise."""
    import transformers

    path = export_preset(name, 0, preset(name), tmp_path)
    check_against_hf(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path)
    ours = Engine.from_pretrained(name, device="cpu").generate(PROMPT, 4)
    back = Engine.from_pretrained(path, device="cpu").generate(PROMPT, 4)
    assert ours.tokens == back.tokens and all(torch.equal(a, b) for a, b in zip(ours.logits, back.logits))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "moonlight-16b-a3b", "glm-4.5", "glm-4.5-air"])
def test_real_presets_are_what_transformers_builds(name):
    """transformers builds (on the meta device) exactly the parameters we plan from hf_config:
    non-expert + MoE layers x experts x expert_params."""
    import transformers

    cfg = preset(name)
    hf = transformers.AutoConfig.for_model(**cfg.family_class.hf_config(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    total = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert total == cfg.non_expert_params() + cfg.n_moe_layers * cfg.n_experts * cfg.expert_params


def test_non_expert_params_by_hand():
    """tiny-deepseek: V=512, D=64, 4 layers (1 dense), 4 heads, q_lora 32, kv_lora 16, nope 16, rope 8,
    v 16, 8 experts of 64, one shared expert, dense MLP 128. Shared experts and the dense layer are
    non-expert weights; the router bias is kept fp32 (2 more bytes each at bf16)."""
    cfg = preset("tiny-deepseek")
    embed_head = 2 * 512 * 64 + 64
    attention = 32 * 64 + 32 + (4 * 24) * 32 + (16 + 8) * 64 + 16 + 4 * (16 + 16) * 16 + 64 * (4 * 16)
    norms = 2 * 64
    dense = 3 * 64 * 128
    moe_beside = 8 * 64 + 8 + 3 * 64 * 64                        # router, bias, shared expert
    assert attention == 12_848
    assert cfg.non_expert_params() == embed_head + 4 * (attention + norms) + dense + 3 * moe_beside == 180_504
    assert cfg.architecture().non_expert_bytes(2) == 2 * 180_504 + 3 * 8 * 2
    assert cfg.expert_params == 3 * 64 * 64
