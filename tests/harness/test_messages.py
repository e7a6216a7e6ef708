"""Faults end in one line naming the key or file, the value and what is allowed -- never a bare
exception, never another fault's message: real checkpoints with a broken config.json, a real
llama-server that exits 1, real trace files, the CLIs in subprocesses. (A failed GGUF conversion:
tests/llamacpp/test_messages.py; Ctrl-C of a single run, which promises no resume:
tests/harness/test_trust.py.)"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.config import ModelConfig
from harness import results
from tests.cli_runner import run_module
from tests.harness.test_remote_code import job_dir_of, lines_naming
from tests.harness.test_trust import REPO, cli
from tests.plugins import needs_engine

SMALL = ["workload=chat", "workload.tokens=random", "workload.context_tokens=256", "workload.gen_tokens=4",
         "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false", "run.quiet=true"]


def one_line(proc, text: str) -> str:
    """The one output line holding `text`; no traceback anywhere."""
    said = lines_naming(proc, text)
    assert len(said) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return said[0]


# ------------------------------------------------------------------------- numbers in config.json

@pytest.mark.slow
@pytest.mark.parametrize("key, value, says", [
    ("hidden_size", "sixty-four", 'hidden_size must be an integer >= 1, got "sixty-four"'),
    ("num_local_experts", -8, "num_local_experts must be an integer >= 1, got -8"),
    ("rope_parameters", "x", 'rope_parameters must be a JSON object or null, got "x"'),
])
def test_a_bad_number_in_config_json_names_the_key(tmp_path, tiny_mixtral_dir, key, value, says):
    ckpt = shutil.copytree(tiny_mixtral_dir, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, key: value}))
    proc = cli([f"model.path={ckpt}", *SMALL], tmp_path)
    assert proc.returncode == 1
    line = one_line(proc, says)
    assert f"{ckpt / 'config.json'}: {says}" in line and "top_k" not in line
    df = results.load(job_dir_of(proc))
    assert set(df.status) == {"failed"} and says in df.error.iloc[0]


@pytest.mark.parametrize("change, says", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number >= 0 or null, got NaN"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer >= 1, got true"),
    ({"num_hidden_layers": None}, "num_hidden_layers must be an integer >= 1, got null"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}},
     'rope_parameters.rope_theta must be a finite number >= 0 or null, got "1e6"'),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in [1, num_local_experts=8], got 9"),
    ({"rope_parameters": 3}, "rope_parameters must be a JSON object or null, got 3"),
    ({"rope_parameters": {"rope_type": "default", "full_attention": "y"}},
     'rope_parameters.full_attention must be a JSON object or null, got "y"'),
    ({"rope_scaling": "linear"}, 'rope_scaling must be a JSON object or null, got "linear"'),
])
def test_every_number_key_is_checked_the_same_way(tiny_mixtral_dir, change, says):
    cfg = json.loads((tiny_mixtral_dir / "config.json").read_text())
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_dict({**cfg, **change})
    assert says in str(err.value)
    assert ModelConfig.from_hf_dict(cfg).n_experts == 8       # the checkpoint as saved passes


# ------------------------------------------------------------------------- overrides Hydra rejects

@pytest.mark.parametrize("args, says", [
    (["-m", "placement=[resident"], "cannot parse the override 'placement=[resident': no viable alternative"),
    (["placement=[resident"], "cannot parse the override 'placement=[resident': no viable alternative"),
    (["placement=hybrid", "placement.n_cpu_layers=abc"], "placement.n_cpu_layers: allowed an integer, got 'abc'"),
    (["-m", "placement=hybrid", "placement.n_cpu_layers=abc"],
     "placement.n_cpu_layers: allowed an integer, got 'abc'"),
    (["hardware.h2d_gbps=abc"], "hardware.h2d_gbps: allowed a number (float) or null, got 'abc'"),
    (["run.repeats=two"], "run.repeats: allowed an integer, got 'two'"),
    (["engine=nope"], "engine=nope: no such option; allowed: hf, "),
    (["-m", "engine=hf,nope"], "engine=nope: no such option; allowed: hf, "),
], ids=["sweep-parse", "run-parse", "run-type", "sweep-type", "float-type", "int-type", "run-option",
        "sweep-option"])
def test_an_override_hydra_rejects_is_one_line(tmp_path, args, says):
    """A malformed override, or one whose value is not its key's type: one line naming the override
    or key, what is allowed and what was given; no traceback, no run."""
    proc = cli([*args, "run.quiet=true"], tmp_path)
    assert proc.returncode == 1
    assert (proc.stdout + proc.stderr).strip() == f"moebench: {one_line(proc, says).removeprefix('moebench: ')}"
    assert not list(tmp_path.rglob("rows.parquet"))


# ------------------------------------------------------------------------- a llama-server that fails

@pytest.mark.slow
@needs_engine("llamacpp")
def test_a_server_that_exits_1_is_reported_as_failing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("llama-server", "llama-bench"):
        exe = bin_dir / name
        exe.write_text(f"#!/bin/sh\necho 'load_backend: loading'\n"
                       f"echo '{name}: error while loading shared libraries: libggml-base.so: cannot open' >&2\n"
                       "exit 1\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    proc = cli(["engine=llamacpp", *SMALL], tmp_path, env={"LLAMA_CPP_BIN": str(bin_dir)})
    assert proc.returncode == 1
    line = one_line(proc, "--help failed")
    assert f"{bin_dir / 'llama-server'} --help failed (exit 1): " in line and "libggml-base.so" in line
    assert "LLAMA_CPP_BIN" in line and "no -t option" not in proc.stdout + proc.stderr
    df = results.load(job_dir_of(proc))
    assert set(df.status) == {"failed"} and df.error.iloc[0].startswith("BinaryFailed: ")


# ------------------------------------------------------------------------- moebench-sim

def sim(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return run_module("harness.sim.cli", args, cwd, env, timeout=300)


@pytest.mark.slow
def test_sim_refuses_an_object_array_naming_the_file(tmp_path):
    path = tmp_path / "objects.npz"
    meta = json.dumps({"n_experts": 8, "expert_bytes": 64})
    np.savez(path, experts=np.array([[1, 2], [3]], dtype=object), meta=np.array(meta))
    proc = sim([str(path)], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{path}: array 'experts' holds Python objects (dtype object)" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("content, says", [
    (os.urandom(4096), "this file is not a zip archive (its first bytes are b"),
    (b"\x93NUMPY" + bytes(120), "this file is not a zip archive (a single .npy array)"),
], ids=["random-bytes", "npy"])
def test_sim_says_a_garbage_file_is_not_a_routing_trace(tmp_path, content, says):
    """Bytes that are no zip archive: not numpy's talk of pickled data, but what a trace is and why
    this is none."""
    path = tmp_path / "garbage.npz"
    path.write_bytes(content)
    proc = sim([str(path)], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "pickle" not in proc.stderr
    assert f"{path}: not a routing trace: a trace is an .npz (zip) archive of experts and meta" in proc.stderr
    assert says in proc.stderr


@pytest.mark.slow
def test_sim_refuses_an_out_it_cannot_write_before_any_work(tmp_path):
    out = tmp_path / "nonexistent" / "x.csv"
    proc = sim(["--synthetic", "mixtral-like", "--tokens", "16", "--out", str(out)], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "" and not out.parent.exists()
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert (f"--out {out}: its directory {out.parent} does not exist; allowed: a file in an existing directory"
            in proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--synthetic", "mixtral-like", "--tokens", "0"],
     "--tokens must be >= 1 (the length of the synthetic trace), got 0"),
    (["EMPTY"], "the trace holds 0 tokens, so nothing can be replayed; allowed: a trace of >= 1 token"),
])
def test_sim_refuses_a_trace_of_no_tokens_instead_of_a_nan_row(tmp_path, args, says):
    from engine.trace import RoutingTrace, save_trace
    empty = save_trace(tmp_path / "empty.npz", RoutingTrace(experts=np.zeros((0, 4, 2), np.int32),
                                                           meta={"n_experts": 8, "expert_bytes": 64}))
    out = tmp_path / "rows.csv"
    proc = sim([str(empty) if a == "EMPTY" else a for a in args] + ["--out", str(out)], tmp_path)
    assert proc.returncode == 2 and not out.exists() and "NaN" not in proc.stdout
    assert proc.stderr.count("\n") == 1 and says in proc.stderr and "Traceback" not in proc.stderr

