"""Model families: a new family is one module plus its registration (a toy family through a
real entry point, with no edit elsewhere), every preset round-trips through its family's
config.json, configs split into common and family fields, and families never import each
other."""
from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch

from engine import Engine
from engine.config import PRESETS, ModelConfig, UnsupportedModelError, preset
from engine.export import export_preset
from engine.registry import FAMILIES
from tests.conftest import install_entry_point
from tests.test_architecture import REPO, files, imports

TOY = '''
"""A third-party family: Mixtral under another name, its top-k weights not renormalised."""
from engine.families.mixtral import Mixtral


class ToyMixtral(Mixtral):
    name = "toy_mixtral"
    architectures = ("ToyMixtralForCausalLM",)
    model_types = ("toy_mixtral",)
    fixed = {"norm_topk_prob": False}

    @classmethod
    def presets(cls):
        tiny = Mixtral.presets()["tiny-mixtral"]
        return {"tiny-toy": tiny.replace(family=cls.name, name="tiny-toy", norm_topk_prob=False)}
'''
PROMPT = [[5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 120]]


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """An installed-looking distribution declaring a family in `moebench.families`."""
    install_entry_point(tmp_path, monkeypatch, "toy_family", TOY, "moebench.families", "toy_mixtral",
                        "toy_family:ToyMixtral")
    monkeypatch.setattr(FAMILIES, "_targets", dict(FAMILIES._targets))
    monkeypatch.setattr(FAMILIES, "_loaded", dict(FAMILIES._loaded))
    monkeypatch.setattr(FAMILIES, "_scanned", False)
    yield
    sys.modules.pop("toy_family", None)


def run(eng: Engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    r = eng.generate(PROMPT, 6)
    return r.tokens, r.logits


def test_toy_family_through_an_entry_point_loads_and_runs(toy_family, tmp_path):
    assert "toy_mixtral" in FAMILIES.names() and "tiny-toy" in PRESETS
    toy = Engine.from_pretrained("tiny-toy", device="cpu")
    # the same seeded weights (same tensor names) as tiny-mixtral, with the one option changed
    mixtral = Engine.from_pretrained("tiny-mixtral", device="cpu")
    unnormed = Engine.from_pretrained("tiny-mixtral", device="cpu", model_overrides={"norm_topk_prob": False})
    toks, logits = run(toy)
    same = run(unnormed)
    assert same[0] == toks and all(torch.equal(a, b) for a, b in zip(same[1], logits))
    assert max((a - b).abs().max().item() for a, b in zip(logits, run(mixtral)[1])) > 1e-3
    # through its own config.json: export, read back by architecture name, same numbers
    path = export_preset("tiny-toy", 0, preset("tiny-toy"), tmp_path)
    assert ModelConfig.from_hf_dir(path).family == "toy_mixtral"
    from_dir = run(Engine.from_pretrained(path, device="cpu"))
    assert from_dir[0] == toks and all(torch.equal(a, b) for a, b in zip(from_dir[1], logits))
    # and the invariant holds for it as for any family: fetch at the smallest cache is bitwise resident
    fetched = run(Engine.from_pretrained("tiny-toy", device="cpu", placement="fetch", cache_capacity=2))
    assert fetched[0] == toks and all(torch.equal(a, b) for a, b in zip(fetched[1], logits))


def test_unregistered_architecture_lists_the_registered_ones():
    with pytest.raises(UnsupportedModelError, match=r"'ToyMixtralForCausalLM'.*registered: \[") as exc:
        ModelConfig.from_hf_dict({"architectures": ["ToyMixtralForCausalLM"], "model_type": "toy_mixtral"})
    registered = [a for name in FAMILIES.names() for a in FAMILIES.get(name).architectures]
    assert "MixtralForCausalLM" in registered and all(repr(a) in str(exc.value) for a in registered)
    with pytest.raises(UnsupportedModelError, match="unknown model family 'llama'; known: .*mixtral, olmoe"):
        ModelConfig.of("llama", vocab_size=1)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_its_config_json(name):
    cfg = preset(name)
    fam = cfg.family_class
    back = fam.parse(fam.hf_config(cfg), cfg.name)
    assert back == cfg.replace(torch_dtype="float32", weight_format="")    # exported weights are fp32, no FP8 blocks


def test_config_fields_split_into_common_and_family():
    cfg = preset("tiny-mixtral")
    assert cfg.num_kv_heads == cfg.arch.num_kv_heads == 2            # family fields read through
    small = cfg.replace(num_layers=2, moe_layers=(0, 1), num_heads=8)
    assert (small.num_layers, small.num_heads, small.arch.head_dim) == (2, 8, 16)
    with pytest.raises(TypeError, match=r"unknown model field\(s\) \['num_head'\].*mixtral fields: num_heads"):
        cfg.replace(num_head=8)
    with pytest.raises(AttributeError, match="mixtral model config has no field 'kv_lora_rank'"):
        cfg.kv_lora_rank
    qwen = cfg.replace(family="qwen2_moe", shared_expert_intermediate_size=96)   # the same shape in another family
    assert qwen.family == "qwen2_moe" and qwen.arch == dataclasses.replace(cfg.arch, shared_expert_intermediate_size=96)
    with pytest.raises(TypeError, match="family 'olmoe' takes arch=GQAConfig"):
        dataclasses.replace(cfg, family="olmoe", arch=object())


def test_sizes_come_from_the_blocks():
    """The derived sizes the cost model reads are sums over the tensors the blocks declare."""
    cfg = preset("qwen1.5-moe-a2.7b")
    arch = cfg.architecture()
    assert cfg.non_expert_params() == sum(s.numel for _, _, s in arch.walk())
    assert cfg.expert_params == 3 * cfg.hidden_size * cfg.moe_intermediate_size == arch.experts.params
    assert cfg.kv_bytes_per_token(2) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def test_families_never_import_each_other():
    """A family module imports the blocks, the family bases (base, gqa, sigmoid_moe) and engine helpers, never
    another family: what two families share moves into a base or a block."""
    members = {f.stem for f in files("engine/families")} - {"__init__", "base", "gqa", "sigmoid_moe"}
    bad = [f"{f.relative_to(REPO)} imports {mod}" for f in files("engine/families") for mod in imports(f)
           for other in members - {f.stem} if mod == f"engine.families.{other}"]
    assert not bad
