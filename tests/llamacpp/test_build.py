"""The pinned build: what it records, when it is trusted, how binaries are found."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from harness.llamacpp import build
from harness.llamacpp.build import (MARKER, BuildConfig, LlamaCppBuildError, cached_builds, find_binaries,
                                    finished_build, server_backend)


def test_flags_hash_follows_the_flags_not_the_jobs():
    assert BuildConfig(jobs=1).flags_hash("abc") == BuildConfig(jobs=8).flags_hash("abc")
    assert BuildConfig().flags_hash("abc") != BuildConfig(cuda=True).flags_hash("abc")
    assert BuildConfig().flags_hash("abc") != BuildConfig().flags_hash("def")
    flags = BuildConfig(no_amx=True).cmake_flags("abc")
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in flags and "-DLLAMA_OPENSSL=OFF" in flags
    assert "-DLLAMA_BUILD_COMMIT=abc" in flags and any("-mno-amx-int8" in f for f in flags)


def test_a_build_without_its_marker_is_not_trusted(tmp_path):
    """A build killed half-way has binaries but no marker (written last): it is rebuilt."""
    (tmp_path / "build" / "bin").mkdir(parents=True)
    for t in build.REQUIRED:
        (tmp_path / "build" / "bin" / t).write_text("")
    assert finished_build(tmp_path) is None
    (tmp_path / MARKER).write_text("{not json")
    assert finished_build(tmp_path) is None


def test_missing_binaries_say_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    with pytest.raises(LlamaCppBuildError) as e:
        find_binaries()
    assert "make llamacpp" in str(e.value) and "LLAMA_CPP_BIN" in str(e.value)
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    with pytest.raises(LlamaCppBuildError, match="lacks"):
        find_binaries()


def test_the_cached_build_records_the_pin(bins):
    if bins.origin != "cache":
        pytest.skip(f"binaries come from {bins.origin}, not the moebench cache")
    info = bins.info
    assert info.llama_cpp_python == build.LLAMA_CPP_PYTHON_VERSION and info.elapsed_s > 0
    assert info in cached_builds()
    marker = json.loads((bins.server.parents[2] / MARKER).read_text())
    assert marker["llama_cpp_commit"] == info.llama_cpp_commit != "unknown"
    version = subprocess.run([str(bins.server), "--version"], capture_output=True, text=True)
    assert f"commit {info.llama_cpp_commit}" in version.stdout + version.stderr
    assert (bins.server.parents[2] / "build.log").is_file()


def test_llama_cpp_bin_points_at_a_directory(bins, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_BIN", str(bins.server.parent))
    found = find_binaries()
    assert found.origin == "LLAMA_CPP_BIN" and found.server == bins.server and found.info is None
    assert os.access(found.bench, os.X_OK)
    # with no build record, the server itself says where it runs: this machine has no GPU
    assert server_backend(found.server) == "cpu"


@pytest.mark.parametrize("lines, backend", [
    (["Available devices:", "  (none)"], "cpu"),
    (["ggml_cuda_init: found 1 CUDA devices:", "Available devices:",
      "  CUDA0: NVIDIA H200 (143771 MiB, 143158 MiB free)"], "cuda"),     # arg.cpp's format on a GPU machine
    (["error: invalid argument: --list-devices"], "unknown")])           # a server too old to say
def test_a_server_without_a_build_record_says_where_it_runs(tmp_path, lines, backend):
    """LLAMA_CPP_BIN's or PATH's llama-server, as a real executable printing what llama.cpp's
    --list-devices prints (a CUDA card cannot be had here): labelled by what it lists."""
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{ln}'" for ln in lines) + "\n")
    exe.chmod(0o755)
    assert server_backend(exe) == backend
