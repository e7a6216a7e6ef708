"""The engine against Hugging Face transformers, family by family: prefill logits, 16 greedy
decode steps and the router's top-k expert sets, from real `save_pretrained` checkpoints
(single file, sharded, bf16, older Hub config form, fused expert tensors)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.hooks import RouteCallback
from tests.conftest import FAMILIES, hf_model, rewrite_config_old_hub_form, save

PROMPT = [[5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 120]]
STEPS = 16
TOL = 1e-4


def hf_router(layer):
    """The transformers module whose output[2] is a decoder layer's top-k ids (None: a dense layer):
    `mlp.gate` (Mixtral, Qwen), `mlp.router` (GPT-OSS), the layer's own `router` (Gemma 4)."""
    for owner, attr in ((layer.mlp, "gate"), (layer.mlp, "router"), (layer, "router")):
        mod = getattr(owner, attr, None)
        if isinstance(mod, torch.nn.Module) and not isinstance(mod, torch.nn.Linear):
            return mod
    return None


def hf_reference(model, prompt: list[list[int]], steps: int):
    """(prefill logits [T, V], decode logits per step [V], tokens, top-k sets per layer [T, k])."""
    routes: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = hf_router(layer)
        if gate is not None:
            def keep_first(mod, inp, out, i=i):  # must return None: a returned value replaces the output
                routes.setdefault(i, out[2].detach().clone())
            hooks.append(gate.register_forward_hook(keep_first))
    ids = torch.tensor(prompt)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for h in hooks:
            h.remove()
        prefill = out.logits[0]
        past, tok = out.past_key_values, out.logits[0, -1].argmax()
        logits, toks = [out.logits[0, -1]], [int(tok)]
        for _ in range(steps - 1):
            out = model(tok.view(1, 1), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
            logits.append(out.logits[0, -1])
            toks.append(int(tok))
    return prefill, logits, toks, routes


def check_against_hf(model, path, dtype="float32", ubatch=512, prompt=PROMPT, **options):
    ref_prefill, ref_logits, ref_toks, ref_routes = hf_reference(model, prompt, STEPS)
    eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, ubatch=ubatch, **options)
    ours_routes: dict[int, list[torch.Tensor]] = {}      # per layer, each prefill chunk's routing
    hook = RouteCallback(lambda layer, ids, w: ours_routes.setdefault(layer, []).append(ids.clone()))
    eng.model.add_routing_hook(hook)
    sess = eng.new_session(1)
    prefill = eng.prefill(sess, prompt, all_logits=True)[0]
    eng.model.remove_routing_hook(hook)
    sess.close()
    assert (prefill - ref_prefill).abs().max().item() <= TOL
    res = eng.generate(prompt, max_new_tokens=STEPS)
    assert res.tokens[0] == ref_toks
    diffs = [(a[0] - b).abs().max().item() for a, b in zip(res.logits, ref_logits)]
    assert max(diffs) <= TOL, diffs
    assert set(ours_routes) == set(ref_routes) and ref_routes
    for layer, ref in ref_routes.items():
        ours = torch.cat(ours_routes[layer])
        assert [set(r) for r in ours.tolist()] == [set(r) for r in ref.tolist()], f"layer {layer}"


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(family, hf_checkpoints):
    model, path = hf_checkpoints[family]
    check_against_hf(model, path)


@pytest.mark.parametrize("ubatch", [512, 5])
def test_sliding_window_matches_transformers(tmp_path, ubatch):
    """A window shorter than the prompt: our bounded state (the last window - 1 tokens) against
    transformers' sliding-window cache, prefill in one chunk or in chunks longer than the window."""
    model = hf_model("mixtral", seed=3, sliding_window=4)
    check_against_hf(model, save(model, tmp_path / "window"), ubatch=ubatch)


def test_per_expert_names_on_disk(hf_checkpoints):
    """transformers saves experts under their Hub per-expert names; that is what we load."""
    names = load_file(hf_checkpoints["mixtral"][1] / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    names = load_file(hf_checkpoints["qwen3_moe"][1] / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sharded_checkpoint(family, tmp_path):
    model = hf_model(family, seed=1)
    path = save(model, tmp_path / "sharded", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    check_against_hf(model, path)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_bf16_checkpoint(family, tmp_path):
    """A bf16 save is loaded (upcast to fp32) and matches transformers running the same bf16 weights in fp32
    (loaded afresh: `.float()` of the bf16 model would keep its rope frequencies rounded to bf16)."""
    model = hf_model(family, seed=2).to(torch.bfloat16)
    path = save(model, tmp_path / "bf16")
    assert json.loads((path / "config.json").read_text()).get("dtype") == "bfloat16"
    check_against_hf(type(model).from_pretrained(path, dtype=torch.float32).eval(), path)
    eng = Engine.from_pretrained(path, device="cpu", dtype="auto")
    assert eng.model.dtype == torch.bfloat16
    assert len(eng.generate(PROMPT, 4).tokens[0]) == 4


def test_older_hub_config_form(tmp_path, hf_checkpoints):
    model, src = hf_checkpoints["olmoe"]
    dst = shutil.copytree(src, tmp_path / "old")
    rewrite_config_old_hub_form(dst)
    cfg = json.loads((dst / "config.json").read_text())
    assert "rope_parameters" not in cfg and "torch_dtype" in cfg and "rope_theta" in cfg
    check_against_hf(model, dst)


def test_fused_expert_tensors(tmp_path, hf_checkpoints):
    """Checkpoints that store experts fused ([E, 2I, D] gate_up_proj, [E, D, I] down_proj) load too."""
    model, src = hf_checkpoints["qwen3_moe"]
    dst = shutil.copytree(src, tmp_path / "fused")
    sd = load_file(src / "model.safetensors")
    fused = {}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(f"{p}{e}.gate_proj.weight"), sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)])
        fused[p + "down_proj"] = torch.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file({**sd, **fused}, dst / "model.safetensors")
    check_against_hf(model, dst)


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4"])
def test_exported_second_wave_presets_are_what_transformers_runs(name, tmp_path):
    """export_preset writes what transformers loads -- GPT-OSS's experts stacked in MXFP4 with its
    quantization_config, Gemma 4's stacked experts, Qwen3-Next's per expert -- and it runs to our
    logits and routing on the preset's seeded weights."""
    import transformers as tf

    from engine.config import preset
    from engine.export import export_preset

    path = export_preset(name, 0, preset(name), tmp_path)
    mxfp4 = "quantization_config" in json.loads((path / "config.json").read_text())
    kw = {"quantization_config": tf.Mxfp4Config(dequantize=True)} if mxfp4 else {}
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).float().eval()
    check_against_hf(model, path)
