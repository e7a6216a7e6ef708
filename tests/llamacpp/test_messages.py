"""A failed GGUF conversion says why in one line -- the converter's own error, the source line that
raised it, and the file holding its whole output -- and blames the supplied tokenizer only when the converter's traceback shows the
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
def test_a_bare_assertion_in_the_converter_is_quoted_through_the_cli(bins, mixtral, tmp_path):
    """An expert tensor with no layer index trips the converter's bare `assert bid is not None`:
    the job's failed row says so in one line -- the exception, where it was raised and the source
    line itself, quoted from the converter's log -- not a lone `AssertionError`."""
    from safetensors.torch import load_file, save_file

    from harness import results
    from tests.harness.test_trust import cli

    ckpt = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.block_sparse_moe.experts.w1.weight"] = tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, ckpt / "model.safetensors",
              metadata={"format": "pt"})
    proc = cli(["engine=llamacpp", f"model.path={ckpt}", "workload=chat", "workload.tokens=random",
                "workload.context_tokens=64", "workload.gen_tokens=2", "run.repeats=1", "run.quiet=true"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    df = results.load(tmp_path / "results" / "runs")
    assert set(df.status) == {"failed"} and len(df) == 1
    error = df.error.iloc[0]
    assert "\n" not in error and "Traceback" not in proc.stderr
    assert ("convert_hf_to_gguf.py failed (exit 1) converting" in error
            and "AssertionError at conversion/llama.py:" in error
            and "in modify_tensors: `assert bid is not None`" in error), error
    assert TOKENIZER_HINT not in error
    saved = re.search(r"its whole output is in (\S+/convert-f32\.log)", error)
    assert saved and "assert bid is not None" in Path(saved.group(1)).read_text()


@pytest.mark.slow
def test_a_tokenizer_the_converter_cannot_read_gets_the_hint(bins, hf_checkpoints, tmp_path):
    """DeepSeek-V3's converter reads a BPE tokenizer through transformers, never the SentencePiece
    model moebench supplies to a checkpoint without one: the failure is in its set_vocab."""
    ckpt = shutil.copytree(hf_checkpoints["deepseek_v3"][1], tmp_path / "ckpt")
    err = failed_conversion(ckpt, tmp_path / "gguf")
    assert f"{ckpt} {TOKENIZER_HINT}" in str(err) and "in set_vocab" in err.output
