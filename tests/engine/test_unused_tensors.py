"""Checkpoint tensors the model never reads are named in one warning (transformers' "Some weights
of the model checkpoint were not used"): none for any family's `save_pretrained` checkpoint --
each family reads every tensor transformers saves -- nor for the tensors consumed in
dequantisation (FP8 scales, MXFP4 blocks and scales) or skipped on purpose (MTP layers, the
rotary buffers of older checkpoints); an extra tensor is named, sorted, on one line."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from tests.conftest import FAMILIES, hf_model
from tests.engine.test_mxfp4 import mxfp4_checkpoint
from tests.engine.test_sigmoid_families import fp8_checkpoint

UNUSED = "not used by the"      # "<path>: N checkpoint tensors are not used by the <family> model ..."


def unused_warnings(path: Path, caplog, **options) -> list[str]:
    """The unused-tensor warnings of loading `path`."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint"):
        Engine.from_pretrained(path, device="cpu", **options)
    return [r.getMessage() for r in caplog.records if UNUSED in r.getMessage()]


def with_extra(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint `src` whose safetensors file also holds `extra`."""
    shutil.copytree(src, dst)
    save_file({**load_file(src / "model.safetensors"), **extra}, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_reads_every_tensor_transformers_saves(family, hf_checkpoints, caplog):
    assert unused_warnings(hf_checkpoints[family][1], caplog) == []


def test_quantised_checkpoints_consume_their_scales(tmp_path, hf_checkpoints, caplog):
    """FP8 `weight_scale_inv`s and MXFP4 `_blocks` / `_scales`, kept packed or dequantised at load."""
    fp8_checkpoint(hf_checkpoints["deepseek_v3"][1], tmp_path / "fp8")
    assert unused_warnings(tmp_path / "fp8", caplog) == []
    path = mxfp4_checkpoint(hf_model("gpt_oss", seed=6), tmp_path / "mxfp4")
    for fmt in ("mxfp4", "dense"):
        assert unused_warnings(path, caplog, model_overrides={"expert_format": fmt}) == []


@pytest.mark.parametrize("family,extra", [
    ("deepseek_v3", {"model.layers.3.eh_proj.weight": (64, 128), "model.layers.3.mlp.experts.0.gate_proj.weight": (32, 64)}),
    ("qwen3_next", {"mtp.fc.weight": (64, 128), "mtp.layers.0.mlp.gate.weight": (8, 64)}),
    ("mixtral", {"model.layers.0.self_attn.rotary_emb.inv_freq": (8,)}),
], ids=["mtp-layer", "mtp-module", "inv-freq"])
def test_tensors_skipped_on_purpose_do_not_warn(family, extra, tmp_path, hf_checkpoints, caplog):
    """DeepSeek-V3's MTP layer (model.layers.<num_hidden_layers>.*), Qwen3-Next's `mtp.*` module
    and the per-layer rotary `inv_freq` buffers older checkpoints store."""
    path = with_extra(hf_checkpoints[family][1], tmp_path / "skipped",
                      {name: torch.randn(shape) for name, shape in extra.items()})
    assert unused_warnings(path, caplog) == []


def test_an_extra_tensor_is_named(tmp_path, hf_checkpoints, caplog):
    path = with_extra(hf_checkpoints["mixtral"][1], tmp_path / "extra",
                      {"model.layers.0.self_attn.q_proj.bias": torch.randn(64)})
    assert unused_warnings(path, caplog) == [
        f"{path}: 1 checkpoint tensor is not used by the mixtral model and was not loaded: "
        "model.layers.0.self_attn.q_proj.bias (a family that should read it would compute something else)"]


def test_many_extra_tensors_are_counted_and_the_first_named_sorted_on_one_line(tmp_path, hf_checkpoints, caplog):
    names = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in (2, 1, 0) for p in "qkv"]
    path = with_extra(hf_checkpoints["qwen3_moe"][1], tmp_path / "extra", {n: torch.randn(4) for n in names})
    [warning] = unused_warnings(path, caplog)
    assert "\n" not in warning
    assert warning.startswith(f"{path}: 9 checkpoint tensors are not used by the qwen3_moe model and were not loaded: "
                              f"{', '.join(sorted(names)[:5])}, ... (4 more) (")


def test_layers_a_num_layers_override_leaves_out_are_skipped_not_warned(tmp_path, hf_checkpoints, caplog):
    """Fewer layers than the checkpoint holds is asked for, not a family's miss; a tensor of a
    built layer that nothing reads still warns."""
    src = hf_checkpoints["mixtral"][1]
    assert unused_warnings(src, caplog, model_overrides={"num_layers": 1, "moe_layers": (0,)}) == []
    path = with_extra(src, tmp_path / "extra", {"model.layers.0.self_attn.q_proj.bias": torch.randn(64)})
    [warning] = unused_warnings(path, caplog, model_overrides={"num_layers": 1, "moe_layers": (0,)})
    assert "1 checkpoint tensor is not used" in warning and "model.layers.0.self_attn.q_proj.bias" in warning
