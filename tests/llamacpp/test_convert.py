"""HF checkpoint -> GGUF with the pinned converter: types, the pass-through vocabulary, the cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness.llamacpp import build
from harness.llamacpp.convert import GGUF_TYPES, checkpoint_identity, convert


def gguf_fields(path) -> dict:
    """Metadata of a GGUF, read with the pinned tree's gguf-py (in a subprocess, like the converter)."""
    code = ("import json,sys,gguf; r=gguf.GGUFReader(sys.argv[1]); "
            "print(json.dumps({f.name: (len(f.data) if f.types and f.types[0]==gguf.GGUFValueType.ARRAY "
            "else f.contents()) for f in r.fields.values() if not f.name.startswith('GGUF.')}, default=str))")
    env = {**os.environ, "PYTHONPATH": str(build.source_dir() / "gguf-py")}
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_tiny_mixtral_to_f32_gguf(gguf_f32, mixtral):
    model, path = mixtral
    assert gguf_f32.path.is_file() and gguf_f32.outtype == "f32"
    assert gguf_f32.vocab_size == model.config.vocab_size and gguf_f32.passthrough_vocab
    f = gguf_fields(gguf_f32.path)
    assert f["general.architecture"] == "llama" and f["llama.expert_count"] == 8
    assert f["llama.expert_used_count"] == 2 and f["llama.block_count"] == 3
    assert f["general.file_type"] == 0                                  # all f32
    # the pass-through vocabulary: one plain token per id, no special or end-of-generation ids
    assert f["tokenizer.ggml.model"] == "test" and f["tokenizer.ggml.tokens"] == model.config.vocab_size
    assert not [k for k in f if k.endswith("_token_id")]


@pytest.mark.slow
def test_cache_reuses_a_conversion_and_redoes_a_changed_checkpoint(gguf_f32, mixtral, gguf_root, tmp_path):
    again = convert(mixtral[1], "f32", root=gguf_root)
    assert again == gguf_f32 and again.path.stat().st_mtime_ns == gguf_f32.path.stat().st_mtime_ns
    copy = shutil.copytree(mixtral[1], tmp_path / "copy")
    before = checkpoint_identity(copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    assert checkpoint_identity(copy) != before


def test_unknown_type_and_non_checkpoint_are_refused(tmp_path):
    with pytest.raises(ValueError) as e:
        convert(tmp_path, "q4_k_xl")
    assert "q4_k_xl" in str(e.value) and "q8_0" in str(e.value) and "q4_k_m" in str(e.value)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert(tmp_path, "f32")
    assert "f32" in GGUF_TYPES
