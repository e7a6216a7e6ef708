"""Tests for harness.manifest: required keys, JSON safety, no crash without git/CUDA/NVML."""
from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

import pandas as pd
import pytest

from harness import manifest as M
from harness import results as R


class Policy(Enum):
    LRU = "lru"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> dict:
    not_a_repo = tmp_path_factory.mktemp("not_a_repo")
    config = {"model": {"name": "tiny-mixtral", "path": Path("/models/x")},
              "cache": {"capacity": "auto", "policy": Policy.LRU}, "sizes": (1, 2),
              "bad_float": float("nan")}
    return M.collect_manifest(config, extra={"sweep_id": "s1", "job_id": "0"},
                              repo_dir=not_a_repo)


def test_required_keys_and_json(manifest: dict) -> None:
    for key in M.MANIFEST_KEYS:
        assert key in manifest, key
    assert manifest["schema_version"] == R.SCHEMA_VERSION
    assert manifest["created"].endswith("+00:00")  # UTC ISO 8601
    assert manifest["sweep_id"] == "s1" and manifest["job_id"] == "0"
    text = json.dumps(manifest, allow_nan=False)
    assert json.loads(text)["config"] == {
        "model": {"name": "tiny-mixtral", "path": "/models/x"},
        "cache": {"capacity": "auto", "policy": "lru"}, "sizes": [1, 2], "bad_float": None}


def test_packages_python_host(manifest: dict) -> None:
    packages = manifest["packages"]
    assert set(M.PACKAGES) <= set(packages)
    assert packages["pandas"] == pd.__version__
    assert packages["moebench"] is not None  # installed or read from pyproject.toml
    assert manifest["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    host = manifest["host"]
    assert host["hostname"] and host["cpu_cores_logical"] >= 1
    assert isinstance(host["ram_bytes"], int) and host["ram_bytes"] > 0
    assert host["cpu_model"] is None or isinstance(host["cpu_model"], str)


def test_not_a_repo_gives_null_git(manifest: dict) -> None:
    assert manifest["git"] == {"commit": None, "dirty": None, "root": None}


def test_gpu_fields_null_without_cuda(manifest: dict) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: GPU fields are filled")
    gpu = manifest["gpu"]
    assert set(gpu) == set(M.GPU_FIELDS)
    assert gpu["count"] == 0
    assert all(gpu[k] is None for k in M.GPU_FIELDS if k != "count")


@pytest.mark.gpu
def test_gpu_fields_filled_with_cuda(manifest: dict) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gpu = manifest["gpu"]
    assert gpu["count"] >= 1 and gpu["name"] and gpu["memory_bytes"] > 0


def test_git_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {("rev-parse", "HEAD"): "0123abcd\n", ("status", "--porcelain"): " M harness/x.py\n",
               ("rev-parse", "--show-toplevel"): "/repo\n"}
    monkeypatch.setattr(M, "_git", lambda repo_dir, *args: answers[args])
    assert M.git_info(Path("/repo")) == {"commit": "0123abcd", "dirty": True, "root": "/repo"}
    answers[("status", "--porcelain")] = ""
    assert M.git_info(Path("/repo"))["dirty"] is False


def test_missing_git_binary_is_not_fatal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    assert M.git_info(tmp_path) == {"commit": None, "dirty": None, "root": None}


def test_missing_nvml_is_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    out = M.nvml_info("GPU-0000", 0)
    assert out and all(v is None for v in out.values())


def test_cpu_model_parsing(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor \n")
    assert M.cpu_model(cpuinfo) == "AMD EPYC 9654 96-Core Processor"
    assert M._driver_from_proc(tmp_path / "absent") is None
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 2024\n")
    assert M._driver_from_proc(version) == "550.54.15"


def test_extra_may_not_overwrite_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'git'"):
        M.collect_manifest({}, extra={"git": "x"}, repo_dir=tmp_path)
    with pytest.raises(TypeError, match="mapping"):
        M.collect_manifest(["not", "a", "dict"], repo_dir=tmp_path)  # type: ignore[arg-type]


def test_manifest_round_trips_through_write_job(manifest: dict, tmp_path: Path) -> None:
    rows = R.make_rows({"placement": "fetch"}, {"device_kind": "cpu", "emulated": True},
                       "s1", "0", 0, "load", {"time_s": 1.0}, "client")
    R.write_job(tmp_path / "job", rows, manifest)
    assert json.loads((tmp_path / "job" / R.MANIFEST_FILE).read_text()) == manifest
