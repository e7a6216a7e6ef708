"""Bad input gets a clear error, before anything is allocated, and nothing half-built stays."""
from __future__ import annotations

import gc
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.checkpoint import MissingTensorError
from engine.model import MoEModel
from engine.planner import PlanError, plan_memory
from engine.config import UnsupportedModelError, preset
from engine.registry import UnknownPluginError


def live_models() -> int:
    gc.collect()
    # type(o), not isinstance: isinstance reads o.__class__, which on some lazy module proxies
    # among gc's objects (torch.distributed.reduce_op) raises a FutureWarning
    return sum(issubclass(type(o), MoEModel) for o in gc.get_objects())


def test_unknown_architecture_names_supported(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*MixtralForCausalLM.*OlmoeForCausalLM"):
        Engine.from_pretrained(d, device="cpu")


def test_missing_tensor_is_named_and_nothing_left(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "missing")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.2.block_sparse_moe.experts.5.w2.weight"]
    save_file(sd, d / "model.safetensors")
    before = live_models()
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.5\.w2\.weight"):
        Engine.from_pretrained(d, device="cpu", placement="fetch", cache_capacity=4)
    assert live_models() == before


def test_missing_attention_tensor(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "missing_attn")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(MissingTensorError, match="model.layers.1.self_attn.k_proj.weight"):
        Engine.from_pretrained(d, device="cpu")


@pytest.mark.parametrize("capacity", [0, 1, 9])
def test_capacity_out_of_range(capacity):
    with pytest.raises(ValueError, match=r"cache_capacity must be in \[top_k=2, n_experts=8\].*got " + str(capacity)):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=capacity)


def test_fetch_without_capacity():
    with pytest.raises(ValueError, match="needs cache_capacity"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch")


def test_unknown_placement_lists_known():
    with pytest.raises(UnknownPluginError, match="unknown placement 'fetcher'; known: cpu, fetch, hybrid, resident, resident_grouped, stream"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetcher")


def test_unknown_policy_lists_known():
    with pytest.raises(UnknownPluginError, match="unknown cache policy 'mru'.*belady, fifo, lfu, lru, static"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=2, cache_policy="mru")


def test_unknown_placement_option():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['n_cpu_layer'\]; allowed: \['n_cpu_layers'\]"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="hybrid", n_cpu_layer=2)


def test_unknown_source_lists_presets():
    with pytest.raises(ValueError, match="neither a checkpoint directory.*tiny-mixtral"):
        Engine.from_pretrained("tiny-mixtrel", device="cpu")


def test_plan_over_budget_shows_arithmetic():
    before = live_models()
    with pytest.raises(PlanError) as err:
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="resident", device_memory="6MiB")
    msg = str(err.value)
    for part in ("non-expert weights", "KV cache (4 layers, 1 x 4096 tokens)", "experts [resident]", "= total", "budget",
                 "6.00 MiB"):
        assert part in msg
    assert live_models() == before


def test_auto_capacity_shrinks_with_context():
    """A longer context leaves fewer expert slots: KV (and the attention workspace over it)
    versus residency."""
    caps = []
    for ctx in (512, 2048, 4096):
        eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity="auto",
                                     device_memory="20MiB", max_context=ctx)
        caps.append(eng.plan.capacity)
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1] >= 2
    with pytest.raises(PlanError, match="fewer than top_k=2"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity="auto",
                               device_memory="20MiB", max_context=6144)


def test_presets_plan_at_real_shapes():
    plan = plan_memory(preset("mixtral-8x7b"), "fetch", "auto", 40 << 30, 4096, 1, 512, 2)
    assert 2 <= plan.capacity < 8
    assert plan.non_expert < plan.total <= 40 << 30
    for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"):
        assert plan_memory(preset(name), "resident", None, None, 4096, 1, 512, 2).experts > 0


def test_prompt_validation():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu")
    with pytest.raises(ValueError, match="equal lengths"):
        eng.generate([[1, 2], [3]], 2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        eng.generate([[1, 600]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1]], 0)
