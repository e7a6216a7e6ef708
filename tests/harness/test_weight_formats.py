"""Weight formats and the one memory rule through the CLI: `moebench plan` on a hardware profile
plans for its card, a preset's published format and a `model.weight_format` override size the plan,
an engine refuses a format it does not hold in one line, and `moebench fit` answers for the engine
it is asked about. The formats' byte arithmetic is checked against the published sizes here; the
GGUF types against the pinned gguf-py in tests/llamacpp/test_gguf_formats.py."""
from __future__ import annotations

import pytest

from engine.config import preset
from engine.formats import GGUF_TYPES, WeightFormat, published, tensor_bytes, use_more_bits, weight_bytes
from tests.harness.test_trust import cli
from tests.plugins import needs_engine

QWEN = ["model=qwen3-30b-a3b", "model.dtype=bfloat16", "cache.capacity=auto"]


def test_a_block_type_counts_its_blocks():
    assert tensor_bytes("q4_k", 3, 512) == 3 * 2 * 144
    assert tensor_bytes("iq2_xxs", 1, 256) == 66
    assert tensor_bytes("mxfp4", 2, 64) == 2 * 2 * 17
    # DeepSeek-V3's FP8: a byte a weight and one fp32 scale per started 128 x 128 block
    assert tensor_bytes("fp8", 200, 300) == 200 * 300 + 4 * 2 * 3
    with pytest.raises(ValueError, match="does not split"):
        tensor_bytes("q4_k", 1, 100)


def test_published_formats_of_presets():
    assert published(preset("deepseek-v3")) == WeightFormat("fp8")
    assert published(preset("gpt-oss-120b")) == WeightFormat("bf16", "mxfp4")
    assert published(preset("qwen3-30b-a3b")) == WeightFormat("bf16")


def test_q8_0_experts_are_34_bytes_per_32_weights():
    cfg = preset("qwen3-30b-a3b")
    wb = weight_bytes(cfg, WeightFormat("q8_0"))
    assert wb.expert_slot == wb.expert_mean == cfg.expert_params * 34 // 32


def test_q4_k_m_raises_ffn_down_in_the_layers_llama_cpp_picks():
    cfg = preset("qwen3-30b-a3b")
    D, I, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers
    wb = weight_bytes(cfg, WeightFormat("q4_k_m"))
    q4k, q6k = (GGUF_TYPES[t][1] / 256 for t in ("q4_k", "q6_k"))
    more = sum(use_more_bits(i, L) for i in range(L))
    want = (2 * I * D * q4k) + D * I * (more * q6k + (L - more) * q4k) / L
    assert wb.expert_mean == pytest.approx(want)
    assert wb.expert_slot == 2 * I * D * q4k + D * I * q6k
    # the published Qwen3-30B-A3B Q4_K_M file is about 18.6 GB: the recipe lands there
    total = wb.non_expert + wb.expert_mean * cfg.n_experts * cfg.n_moe_layers
    assert 17.5e9 < total < 19.0e9


def test_plan_on_a_profile_plans_for_its_card(tmp_path):
    r = cli(["plan", *QWEN, "hardware=rtx4090-pcie4-x16"], tmp_path)
    assert r.returncode in (0, 1), r.stderr
    assert "budget 24.00 GiB (hardware=rtx4090-pcie4-x16's 24 GiB card)" in r.stdout
    assert "device cuda" in r.stdout
    r = cli(["plan", *QWEN, "hardware=rtx4090-pcie4-x16", "hardware.device_memory=8GiB"], tmp_path)
    assert r.stdout.splitlines()[0].endswith("budget 8.00 GiB")       # an explicit budget wins


@needs_engine("llamacpp")
def test_weight_format_sizes_the_plan(tmp_path):
    base = ["plan", *QWEN, "hardware=rtx4090-pcie4-x16", "engine=llamacpp", "placement=fetch"]
    q4 = cli([*base, "model.weight_format=Q4_K_M"], tmp_path)
    bf = cli([*base], tmp_path)
    assert q4.returncode == bf.returncode == 0, q4.stderr + bf.stderr
    assert "engine=llamacpp: weights q4_k_m (model.weight_format)" in q4.stdout
    assert "non-expert weights [q4_k_m]" in q4.stdout
    slots = [int(line.split()[-1]) for r in (q4, bf) for line in r.stdout.splitlines()
             if line.startswith("cache.capacity=auto ->") for line in [line.split(" expert slots")[0]]]
    assert slots[0] > 2 * slots[1]          # a Q4_K_M expert is under half a bf16 one: more slots fit


def test_published_fp8_is_dequantised_by_our_engine(tmp_path):
    r = cli(["plan", "model=deepseek-v3", "model.dtype=bfloat16", "placement=cpu", "hardware=h200-sxm-141gb"],
            tmp_path)
    assert "engine=moebench: weights published fp8, held in bf16 (dequantised at load)" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["model.weight_format=q4_k_m"], "engine=moebench holds the weights in model.dtype (bfloat16); allowed: bf16"),
    pytest.param(["engine=llamacpp", "model.weight_format=fp8"], "engine=llamacpp holds GGUF types; allowed:",
                 marks=needs_engine("llamacpp")),
    (["model.weight_format=q9_k"], "model.weight_format: allowed types f32"),
    pytest.param(["engine=llamacpp", "model.weight_format=q8_0", "engine.weights=q4_k_m"], "disagree",
                 marks=needs_engine("llamacpp")),
])
def test_a_format_the_engine_does_not_hold_is_one_line(tmp_path, args, words):
    r = cli(["plan", *QWEN, *args], tmp_path)
    assert r.returncode == 2
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@needs_engine("llamacpp")
def test_fit_answers_for_the_engine_asked(tmp_path):
    """gpt-oss-120b at 32k on a 24 GB card: llama.cpp with flash attention needs no score matrix, so
    fewer layers' experts go to the CPU than for ours, whose math attention materialises it."""
    args = ["fit", "--search", "n_cpu_layers", "model=gpt-oss-120b", "model.dtype=bfloat16",
            "hardware=rtx4090-pcie4-x16", "workload.context_tokens=32768"]
    ours, llama = cli(args, tmp_path), cli([*args, "engine=llamacpp", "engine.config=defaults"], tmp_path)
    assert ours.returncode == llama.returncode == 0, ours.stderr + llama.stderr
    n = [int(r.stdout.split("): ")[1].split(" of")[0]) for r in (ours, llama)]
    assert "for engine=moebench (its own forward pass" in ours.stdout
    assert "for engine=llamacpp (llama.cpp -fa auto, its default: no score matrix" in llama.stdout
    assert n[1] < n[0]
    assert "attention workspace (llama.cpp -fa auto, its default: no score matrix)" in llama.stdout
    # workspace is zero under llama.cpp's rule, O(context^2) under ours
    ws = [line for line in llama.stdout.splitlines() if "attention workspace" in line][0]
    assert ws.split()[-2:] == ["0", "B"]
