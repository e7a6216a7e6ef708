"""No code shipped in a checkpoint runs unless model.trust_remote_code=true: real checkpoints written
by transformers, with real .py files an auto_map names whose import writes a marker file; the real
`moebench` CLI in subprocesses, asserting on the marker, the one-line message and the loaded table.
(llama.cpp's converter: tests/llamacpp/test_remote_code.py.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import results
from harness.remote_code import FLAG, RemoteCodeRefused, checkpoint_code, refuse_checkpoint_code, stage_files
from tests.checkpoint_code import with_mixtral_model_code, with_tokenizer_code
from tests.harness.test_trust import cli
from tests.plugins import engine_params

SMALL = ["workload=chat", "workload.tokens=random", "workload.context_tokens=256", "workload.gen_tokens=4",
         "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false", "run.quiet=true"]


def job_dir_of(proc) -> Path:
    """The single run's dir, from the `results: <dir>/rows.parquet` line it prints."""
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("results: "))
    return Path(line.removeprefix("results: ")).parent


def lines_naming(proc, text: str) -> list[str]:
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if text in ln]


@pytest.fixture
def coded(tmp_path, tiny_mixtral_dir, monkeypatch) -> tuple[Path, Path]:
    """(a tiny Mixtral whose config.json auto_map names its own .py classes, the marker they write)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))     # transformers' copy of the modules goes here
    marker = tmp_path / "MARKER"
    return with_mixtral_model_code(tiny_mixtral_dir, tmp_path / "ckpt", marker), marker


@pytest.mark.slow
@pytest.mark.parametrize("engine", engine_params("hf", "llamacpp"))
def test_an_engine_that_would_run_it_is_refused_before_anything_runs(coded, tmp_path, engine):
    ckpt, marker = coded
    proc = cli([f"engine={engine}", f"model.path={ckpt}", *SMALL], tmp_path)
    assert proc.returncode == 1
    assert not marker.exists()
    said = lines_naming(proc, f"{FLAG}=true")
    assert len(said) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert f"{ckpt / 'config.json'}: its auto_map names code to import" in said[0]
    assert "(given: false)" in said[0] and "modeling_marker.py" in said[0]
    df = results.load(job_dir_of(proc))
    assert set(df.status) == {"failed"} and len(df) == 1
    assert str(ckpt / "config.json") in df.error.iloc[0] and f"{FLAG}=true" in df.error.iloc[0]
    manifest = json.loads((job_dir_of(proc) / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["config"]["model"]["trust_remote_code"] is False


@pytest.mark.slow
def test_with_the_flag_transformers_runs_it_and_the_run_says_so(coded, tmp_path):
    ckpt, marker = coded
    proc = cli(["engine=hf", f"model.path={ckpt}", f"{FLAG}=true", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists()                          # the checkpoint's own classes were imported: allowed
    df = results.load(job_dir_of(proc))
    assert set(df.status) == {"ok"} and "decode" in set(df.phase)
    manifest = json.loads((job_dir_of(proc) / "manifest.json").read_text())
    assert manifest["config"]["model"]["trust_remote_code"] is True


@pytest.mark.slow
def test_our_engine_never_runs_it(coded, tmp_path):
    """engine=moebench reads config.json and the safetensors itself: the checkpoint's code is never
    imported, so nothing is refused and nothing runs."""
    ckpt, marker = coded
    proc = cli(["engine=moebench", f"model.path={ckpt}", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()
    assert set(results.load(job_dir_of(proc)).status) == {"ok"}


def test_what_counts_as_code_and_what_a_loader_is_shown(tmp_path, tiny_mixtral_dir):
    ckpt = with_tokenizer_code(tiny_mixtral_dir, tmp_path / "ckpt", tmp_path / "MARKER")
    (ckpt / "extra").mkdir()
    (ckpt / "extra" / "helper.py").write_text("raise SystemExit('never imported')\n")
    found = checkpoint_code(ckpt)
    assert [c.file.name for c in found] == ["tokenizer_config.json", "helper.py", "tokenization_marker.py"]
    with pytest.raises(RemoteCodeRefused) as err:
        refuse_checkpoint_code(ckpt, False, "a loader")
    assert "\n" not in str(err.value) and str(ckpt / "tokenizer_config.json") in str(err.value)
    assert refuse_checkpoint_code(ckpt, True, "a loader") == found             # trusted: allowed, logged
    assert refuse_checkpoint_code(tiny_mixtral_dir, False, "a loader") == []   # no code: nothing to refuse

    stage = tmp_path / "stage"
    stage_files(ckpt, stage, trusted=False)
    assert sorted(p.name for p in stage.iterdir()) == sorted(
        p.name for p in ckpt.iterdir() if p.is_file() and p.suffix != ".py")
    staged = json.loads((stage / "tokenizer_config.json").read_text())
    assert "auto_map" not in staged and staged["tokenizer_class"] == "MarkerTokenizer"
    assert not (stage / "tokenizer_config.json").is_symlink()
    assert (stage / "model.safetensors").resolve() == (ckpt / "model.safetensors").resolve()
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["auto_map"]      # the original is untouched

    trusted = tmp_path / "trusted"
    stage_files(ckpt, trusted, trusted=True)
    assert sorted(os.listdir(trusted)) == sorted(os.listdir(ckpt))
