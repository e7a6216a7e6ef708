"""A failed GGUF conversion says why in one line -- the converter's own error and the file holding its
whole output -- and blames the supplied tokenizer only when the converter's traceback shows the
tokenizer failed: real checkpoints written by transformers, broken for real, the pinned converter."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from harness.llamacpp.convert import ConversionError, convert

TOKENIZER_HINT = "has no tokenizer, and moebench supplies one only"


def failed_conversion(path, root) -> ConversionError:
    with pytest.raises(ConversionError) as err:
        convert(path, "f32", root=root)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"convert_hf_to_gguf.py failed (exit 1) converting {path} to GGUF f32: ")
    saved = re.search(r"its whole output is in ([^\s;]+/convert-f32\.log)(;|$)", msg)
    assert saved, msg
    text = Path(saved.group(1)).read_text()                 # the command, then everything it printed
    assert text.startswith("$ ") and ("Traceback" in text or "ERROR:" in text)
    return err.value


@pytest.mark.slow
def test_an_unsupported_architecture_is_not_blamed_on_the_tokenizer(bins, mixtral, tmp_path):
    ckpt = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooBarForCausalLM"]}))
    msg = str(failed_conversion(ckpt, tmp_path / "gguf"))
    assert "Model FooBarForCausalLM is not supported" in msg and TOKENIZER_HINT not in msg


@pytest.mark.slow
def test_a_truncated_safetensors_is_not_blamed_on_the_tokenizer(bins, mixtral, tmp_path):
    ckpt = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    msg = str(failed_conversion(ckpt, tmp_path / "gguf"))
    assert "ValueError: Could not read complete metadata" in msg and TOKENIZER_HINT not in msg


@pytest.mark.slow
def test_a_tokenizer_the_converter_cannot_read_gets_the_hint(bins, hf_checkpoints, tmp_path):
    """DeepSeek-V3's converter reads a BPE tokenizer through transformers, never the SentencePiece
    model moebench supplies to a checkpoint without one: the failure is in its set_vocab."""
    ckpt = shutil.copytree(hf_checkpoints["deepseek_v3"][1], tmp_path / "ckpt")
    err = failed_conversion(ckpt, tmp_path / "gguf")
    assert f"{ckpt} {TOKENIZER_HINT}" in str(err) and "in set_vocab" in err.output
