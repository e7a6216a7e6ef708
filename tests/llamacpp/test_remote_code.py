"""llama.cpp's converter loads tokenizers with trust_remote_code=True: a tiny DeepSeek-V3 written
by transformers, whose tokenizer_config.json auto_map names a .py file that writes a marker when
imported, never gets that file run unless trust_remote_code is given -- refused up front, and
converted from a staged copy without code should the refusal be missed. The CLI's refusal:
tests/harness/test_remote_code.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import results
from harness.llamacpp import convert as convert_mod
from harness.llamacpp.convert import ConversionError, convert
from harness.remote_code import FLAG, RemoteCodeRefused
from tests.checkpoint_code import with_tokenizer_code
from tests.harness.test_remote_code import SMALL, job_dir_of, lines_naming
from tests.harness.test_trust import cli


@pytest.fixture
def coded(tmp_path, hf_checkpoints, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))   # the converter's transformers copies modules here
    marker = tmp_path / "MARKER"
    return with_tokenizer_code(hf_checkpoints["deepseek_v3"][1], tmp_path / "ckpt", marker), marker


def test_the_converter_refuses_it_naming_the_file_and_the_flag(bins, coded, tmp_path):
    ckpt, marker = coded
    with pytest.raises(RemoteCodeRefused) as err:
        convert(ckpt, "f32", root=tmp_path / "gguf")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{ckpt / 'tokenizer_config.json'}: its auto_map names code")
    assert f"{FLAG}=true" in msg and "tokenization_marker.py" in msg and "llama.cpp's converter" in msg
    assert not marker.exists() and not (tmp_path / "gguf").exists()       # refused before anything ran


@pytest.mark.slow
def test_the_cli_refuses_it_before_anything_runs(bins, coded, tmp_path):
    ckpt, marker = coded
    proc = cli(["engine=llamacpp", f"model.path={ckpt}", *SMALL], tmp_path)
    assert proc.returncode == 1 and not marker.exists()
    said = lines_naming(proc, f"{FLAG}=true")
    assert len(said) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert str(ckpt / "tokenizer_config.json") in said[0] and "llama.cpp's converter" in said[0]
    df = results.load(job_dir_of(proc))
    assert set(df.status) == {"failed"} and str(ckpt / "tokenizer_config.json") in df.error.iloc[0]


@pytest.mark.slow
def test_a_missed_refusal_still_runs_nothing(bins, coded, tmp_path, monkeypatch):
    """The refusal switched off: the converter runs on the staged copy (no .py, no auto_map), so
    AutoTokenizer(trust_remote_code=True) finds nothing to import."""
    ckpt, marker = coded
    monkeypatch.setattr(convert_mod, "refuse_checkpoint_code", lambda *a, **k: [])
    with pytest.raises(ConversionError):        # the tiny model has no tokenizer the converter reads
        convert(ckpt, "f32", root=tmp_path / "gguf")
    assert not marker.exists()


@pytest.mark.slow
def test_trusted_the_converter_runs_it(bins, coded, tmp_path):
    """The same checkpoint with trust_remote_code: the converter imports the file (the marker is live,
    so its absence above means something); the conversion then fails on the tiny model's tokenizer."""
    ckpt, marker = coded
    with pytest.raises(ConversionError):
        convert(ckpt, "f32", root=tmp_path / "gguf", trust_remote_code=True)
    assert marker.read_text() != ""


@pytest.mark.slow
def test_trusted_through_the_cli_it_runs_and_the_run_says_so(bins, mixtral, tmp_path, monkeypatch):
    """model.trust_remote_code=true reaches the converter (a Mixtral with tokenizer code converts and
    runs), and the job's manifest records it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "cache"))        # this GGUF is throwaway
    monkeypatch.setenv("LLAMA_CPP_BIN", str(bins.server.parent))
    ckpt = with_tokenizer_code(mixtral[1], tmp_path / "ckpt", tmp_path / "MARKER")
    proc = cli(["engine=llamacpp", f"model.path={ckpt}", f"{FLAG}=true", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    df = results.load(job_dir_of(proc))
    assert set(df.status) == {"ok"} and "decode" in set(df.phase)
    manifest = json.loads((job_dir_of(proc) / "manifest.json").read_text())
    assert manifest["config"]["model"]["trust_remote_code"] is True
    assert list((tmp_path / "cache" / "gguf").rglob("model-f32.gguf"))
